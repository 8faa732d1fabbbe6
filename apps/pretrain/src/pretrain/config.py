"""The composed run configuration, its built-in presets and layout validation.

Each package owns the config dataclass of what it implements (``model`` is
``moe_model.MoEConfig``, ``mxfp8`` is ``moe_mxfp8.MXFP8Config``); the app composes
them with its own sections. ``parallel``, ``optim`` and ``checkpoint`` are the
app's: they hold the keys users type and the app translates them into the
libraries' configs (``moe_ddp.DDPConfig``, ``moe_optim.OptimConfig``,
``moe_pp.PipelineConfig``, ``moe_ckpt.CheckpointerConfig``), which carry knobs a
run must not change (the DDP reduction must stay a sum, see ``pretrain.trainer``).

A run's config comes from a preset name or a TOML file, then dotted ``KEY=VALUE``
overrides; see :mod:`pretrain.config_tree` for the typing rules. Everything that
can be checked without knowing the world size is checked by ``validate``;
``validate_layout`` adds the checks that need it and runs at startup.
"""

from __future__ import annotations

import copy
import math
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

from moe_model import MoEConfig
from moe_model.experts import MAX_WGRAD_SOURCES
from moe_mxfp8 import FP8RowCodec, MXFP8Config, MXFP8RowCodec, name_matches

from pretrain.config_reference import annotated_toml
from pretrain.config_tree import ConfigError, apply_tree, set_key
from pretrain.data.mixture import block_quotas
from pretrain.data.sources import STDLIB
from pretrain.presets import PRESETS

__all__ = [
    "EP_PAYLOAD_CODECS",
    "PRESETS",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DataSource",
    "EvalConfig",
    "Layout",
    "MetricsConfig",
    "OptimConfig",
    "ParallelConfig",
    "PretrainConfig",
    "TrainConfig",
    "config_toml",
    "load_config",
    "validate_layout",
]


# parallel.ep_payload -> the moe_ep_transport RowCodec that encodes it ("compute": none)
EP_PAYLOAD_CODECS: dict[str, type[MXFP8RowCodec] | type[FP8RowCodec]] = {
    "mxfp8": MXFP8RowCodec, "fp8_rowwise": FP8RowCodec}


@dataclass
class ParallelConfig:
    pp: int = 1  # pipeline stages; data parallelism is derived: DP = world size / pp
    pp_schedule: Literal["gpipe", "1f1b", "zero_bubble"] = "1f1b"  # schedule when pp > 1
    pp_virtual_stages: int = 1  # model chunks per pipeline rank (1f1b with > 1: interleaved 1F1B)
    pp_split: Literal["params", "flops"] = "params"  # balance pipeline stages by memory or compute
    ep: int = 1  # expert parallelism (EP-MP): ranks splitting each MoE layer's experts; divides DP
    # EP token transport: local (no EP) | all_to_all (gloo/NCCL) | rowwise (NVSHMEM puts on GPU,
    # emulated peer memory on CPU); auto: local when ep == 1, else rowwise with
    # train.cuda_graphs (the transport whose calls a graph can hold), else all_to_all
    ep_backend: Literal["auto", "local", "all_to_all", "rowwise"] = "auto"
    # the forward dispatch's rows, encoded once per token at its source: the compute dtype |
    # E4M3 with a power-of-two scale per 32 values | E4M3 with one power-of-two FP32 scale per
    # row (d_model + 4 bytes); gradients and the combine travel in the compute dtype (straight
    # through); quantized experts (mxfp8.targets) need the payload their mxfp8.recipe computes
    # on exactly (mxfp8 for mxfp8; fp8_rowwise for fp8_rowwise and fp8_rowwise_gw_hp)
    ep_payload: Literal["compute", "mxfp8", "fp8_rowwise"] = "compute"
    # where the EP combine sums a token's top-k contributions (moe_ep_transport.EPConfig.combine):
    # auto | source | destination
    ep_combine: Literal["auto", "source", "destination"] = "auto"
    # token chunks each MoE layer's EP dispatch -> experts -> combine is split into, pipelined
    # on two CUDA streams so that chunks' transfers run under other chunks' expert GEMMs
    # (moe_ep_transport.EPConfig.overlap_chunks; each chunk its own transport call and, with
    # model.capacity_factor, its own capacity); 1: one dispatch and one combine per layer.
    # Two H200s, bench-2gpu replayed from CUDA graphs: 2 chunks 1.01x the unsplit step, 4
    # chunks 0.97x; eager steps stalled for seconds where ep_comm_sms was unset
    # (docs/performance.md, bench-2gpu): 1 until the stall is understood
    ep_overlap_chunks: int = 1
    # SMs the EP communication stream may use with ep_overlap_chunks > 1 or
    # ep_overlap_microbatches (a CUDA green context; moe_ep_transport.EPConfig.comm_sms,
    # MicrobatchInterleave's comm_sms); none: every SM, at the highest priority, the fastest
    # measured with chunks (2 chunks on bench-2gpu: 0.90x at 32 SMs, 0.72x at 16)
    ep_comm_sms: int | None = None
    # the rowwise EP transport's bulk moves (token inbox sends; partial sums of a combine
    # summing at the destination) by the GPU's copy engines instead of the put kernel's SM
    # stores, so that a transfer under the expert GEMMs (ep_overlap_microbatches,
    # ep_overlap_chunks) takes no SMs from them (moe_ep_transport.EPConfig.copy_engine).
    # Needs ep_backend=rowwise. false until measured against the SM puts on GPUs
    ep_copy_engine: bool = False
    # SMs every persistent GEMM leaves free (torch's SM carveout: cuBLAS, torch._grouped_mm, and
    # moe_model's and moe_mxfp8's persistent Triton GEMMs; pretrain.sm_carveout), so that
    # kernels of other streams (the EP communication stream's while microbatches or chunks
    # overlap, NCCL's) run beside them instead of between them; the GEMMs run on the rest.
    # CUDA only, not with ep_comm_sms (its green context's SMs are not the ones left free);
    # none: every SM
    sm_carveout: int | None = None
    # two microbatches' forwards interleaved at the EP transport: one's dispatch and combine
    # run on a communication stream under the other's attention and expert GEMMs, and the
    # backward of the pair interleaves the same way (moe_ep_transport.MicrobatchInterleave).
    # Every microbatch but the step's last goes in a pair (the last runs alone, so that the
    # gradient sync still overlaps its backward); two microbatches' activations are alive at
    # once. Needs EP, model.recompute=none, parallel.pp=1 and ep_overlap_chunks=1.
    ep_overlap_microbatches: bool = False
    ddp_mode: Literal["reduce_scatter", "all_reduce"] = "reduce_scatter"  # gradient sync collective
    # routed experts' weight gradients added to the FP32 main grads inside the grouped GEMM's
    # epilogue, the untied embedding's rows of the tokens seen, and the dense linear layers'
    # by cuBLAS with FP32 output (CUDA), all through moe_model's gradient sink; false: BF16
    # gradients through autograd and the DDP hook
    fuse_grad_accumulation: bool = True
    # with it, n (2 to 4): n microbatches' expert weight gradients in one GEMM launch (the
    # earlier ones held until the n-th's backward): 1/n of the FP32 main-grad
    # read-modify-writes, for the memory of n - 1 microbatches' expert GEMM inputs and output
    # gradients (`pretrain plan` counts it); 1: each microbatch's at once; auto: the largest
    # n that the memory planner fits on this run's GPUs (1 on a CPU)
    merge_expert_grad_microbatches: int | Literal["auto"] = 1
    bucket_cap_mb: float = 64.0  # gradient bucket size (MiB of FP32)

    def resolved_ep_backend(self, cuda_graphs: bool) -> str:
        """The transport ``ep_backend`` names (``cuda_graphs``: ``train.cuda_graphs``)."""
        if self.ep_backend == "auto":
            return "local" if self.ep == 1 else "rowwise" if cuda_graphs else "all_to_all"
        return self.ep_backend


@dataclass
class TrainConfig:
    steps: int = 300  # optimizer steps (the LR schedule spans them)
    stop_after: int | None = None  # end this process after that step, checkpointing as on SIGTERM
    seq_len: int = 128  # tokens per sequence
    global_batch: int = 16  # sequences per optimizer step (all ranks, all microbatches)
    micro_batch: int = 16  # sequences per rank per microbatch
    max_consecutive_skips: int = 5  # abort after this many steps in a row with a non-finite loss/grad
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when present
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    # replay the microbatches' forward + backward from CUDA graphs captured after the first
    # step (pretrain.graphs); CUDA only, not with pipeline parallelism, the all_to_all EP
    # transport, emulated FP8 GEMMs or reference kernels (validate says why)
    cuda_graphs: bool = False
    # restart a run that aborted for non-finite steps on the same learning rates (it would
    # return to the same checkpoint; pretrain.divergence)
    allow_resume_after_divergence: bool = False
    # seconds a collective waits for a peer before the process group fails it (a hung or
    # dead rank); generous because a checkpoint load or the first step's compile can be slow
    collective_timeout_s: float = 600.0
    # every package's eager reference instead of its fused kernels, on every device, from
    # trainer build to close (bisecting a numerical problem; pretrain.reference_kernels);
    # not with train.cuda_graphs
    reference_kernels: bool = False


@dataclass
class OptimConfig:
    name: Literal["adamw", "muon"] = "adamw"  # update rule (muon: hidden matrices; AdamW the rest)
    lr: float = 3e-3  # peak learning rate (AdamW)
    muon_lr: float = 0.02  # peak learning rate of the Muon matrices (optim.name=muon)
    muon_momentum: float = 0.95  # Muon momentum decay
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"  # shape after warmup
    warmup_steps: int = 20  # linear warmup steps from 0 to lr
    min_lr_ratio: float = 0.1  # final LR of the decay, as a fraction of lr (cosine, wsd)
    decay_fraction: float = 0.2  # wsd: share of the steps spent decaying at the end
    weight_decay: float = 0.1  # decoupled weight decay (none on norms, embeddings and biases)
    beta1: float = 0.9  # first-moment decay
    beta2: float = 0.95  # second-moment decay
    eps: float = 1e-8  # Adam epsilon
    grad_clip: float = 1.0  # max global gradient norm (0 disables clipping)
    expert_lr_mult: float = 1.0  # routed experts' LR = lr * expert_lr_mult


@dataclass
class DataSource:
    path: str = ""  # a token directory (or one of its .bin files)
    weight: float = 1.0  # share of the samples, relative to the other sources' weights


@dataclass
class DataConfig:
    path: str = STDLIB  # stdlib (this interpreter's sources as bytes) | synthetic | a token dir or file
    seed: int | None = None  # seed of the global sequence order; None: the run seed
    # a mixture of token directories, each sampled by its weight (TOML: [[data.sources]] tables;
    # command line: '[{path="a", weight=3}, {path="b", weight=1}]'); empty: data.path alone
    sources: list[DataSource] = field(default_factory=list)
    # compare token files with the SHA-256 tokens.json records when opening them; none: when the
    # files total under 10 GB
    verify: bool | None = None
    # attention stays inside each document of a window (documents end with the data's eos_id);
    # needs token data with an end-of-text id; not with parallel.pp > 1 or train.cuda_graphs
    document_mask: bool = False
    val_path: str = ""  # held-out token directory (or .bin) for evaluation; empty: none

    def validate(self, where: str = "") -> None:
        """The mixture's settings (``where``: the origin of data.sources, for the message)."""
        if not self.sources:
            return
        if self.path != STDLIB:
            raise ConfigError(f"data.path={self.path!r} and data.sources are both set{where}; "
                              "use data.sources alone for several directories")
        for i, source in enumerate(self.sources):
            if not source.path or source.path in (STDLIB, "synthetic"):
                raise ConfigError(f"data.sources[{i}].path must name a token directory, got "
                                  f"{source.path!r}{where}")
            if not (math.isfinite(source.weight) and source.weight >= 0):
                raise ConfigError(f"data.sources[{i}].weight must be a finite number >= 0, got "
                                  f"{source.weight}{where}")
        if not any(source.weight > 0 for source in self.sources):
            raise ConfigError(f"data.sources: every weight is 0{where}; at least one must be positive")
        try:
            block_quotas([source.weight for source in self.sources])
        except ValueError as e:
            raise ConfigError(f"data.sources: {e}{where}") from None


@dataclass
class CheckpointConfig:
    every: int = 0  # also save every N optimizer steps (0: only at the end and when stopped early)
    final: bool = True  # save after the last step (train.steps); a stop always saves
    # auto: the latest complete checkpoint under run_dir/checkpoints, if any | none | a step directory
    resume: str = "auto"
    # a checkpoint step directory (any layout) whose weights the run starts from, with a fresh
    # optimizer, LR schedule and data stream (step 1); None: model.init_from's or random weights
    init_from: str | None = None
    keep_last: int = 2  # complete checkpoints kept (0: all)
    async_save: bool = True  # write in the background while training continues


@dataclass
class EvalConfig:
    # evaluate data.val_path every N steps and at the run's end (0: never); none: every 10% of
    # train.steps
    every: int | None = None
    tokens: int = 1 << 20  # held-out tokens per evaluation (the first ones; at most data.val_path's)
    # prompts the model completes greedily at each evaluation, appended to run_dir/samples.jsonl
    # and printed (needs data.val_path and the whole model on each rank: parallel.pp=1)
    prompts: tuple[str, ...] = ()
    max_new_tokens: int = 32  # tokens each eval.prompts completion adds


@dataclass
class MetricsConfig:
    expert_load_every: int = 10  # record tokens per expert per layer every N steps (0: never)
    tensorboard: bool = False  # also write TensorBoard events to run_dir/tensorboard (the tensorboard extra)
    wandb: bool = False  # also log to Weights & Biases (the wandb extra)
    wandb_project: str | None = None  # W&B project; None: wandb's default
    wandb_name: str | None = None  # W&B run name; None: wandb's default
    # online | offline (run_dir/wandb, no network; `wandb sync` uploads it) | auto: wandb's own
    # settings (WANDB_MODE, wandb login)
    wandb_mode: Literal["auto", "online", "offline"] = "auto"


@dataclass
class PretrainConfig:
    # keys that were renamed: setting the old one is refused with a pointer to the new one
    # (``pretrain.config_tree.unknown_key``); not config fields
    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        "parallel.fuse_expert_grad_accumulation": "parallel.fuse_grad_accumulation",
    }

    model: MoEConfig = field(default_factory=MoEConfig)
    # MXFP8 layers; targets are module-name globs ("experts", "attn.w?"); empty: off
    mxfp8: MXFP8Config = field(default_factory=lambda: MXFP8Config(targets=()))
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run_dir: str | None = None  # output folder; None: a new folder under runs/
    seed: int = 0  # seeds initialisation (and the data order unless data.seed is set)

    def __post_init__(self) -> None:
        # dotted key -> where its value came from ("preset tiny", "file run.toml", "the
        # command line"), for the keys ``load_config`` set; a key absent here holds its
        # default. Not a config field: it is neither written nor read back.
        self.key_sources: dict[str, str] = {}

    def with_changes(self, table: str, **changes: Any) -> PretrainConfig:
        """A copy whose ``table`` (e.g. ``"parallel"``) has ``changes`` (the other tables
        shared); not validated."""
        derived = copy.copy(self)
        setattr(derived, table, replace(getattr(self, table), **changes))
        return derived

    def validate(self) -> None:
        """Every check that does not need the world size; raises ``ConfigError``."""
        try:
            self.model.validate()
        except ValueError as e:
            raise ConfigError(f"invalid model config: {e}") from None
        try:
            self.mxfp8.validate()
        except ValueError as e:
            raise ConfigError(f"invalid mxfp8 config: {e}") from None
        positive = ["train.steps", "train.seq_len", "train.global_batch", "train.micro_batch",
                    "train.max_consecutive_skips", "train.collective_timeout_s", "parallel.pp", "parallel.pp_virtual_stages",
                    "parallel.ep", "parallel.bucket_cap_mb", "parallel.ep_overlap_chunks",
                    "optim.lr", "optim.muon_lr", "eval.tokens", "eval.max_new_tokens"]
        non_negative = ["optim.warmup_steps", "optim.min_lr_ratio", "optim.weight_decay",
                        "optim.grad_clip", "optim.expert_lr_mult", "optim.eps",
                        "checkpoint.every", "checkpoint.keep_last", "metrics.expert_load_every",
                        "seed"]
        for key in positive + non_negative:
            value = self._get(key)
            if not math.isfinite(value):  # nan passes both comparisons below
                raise ConfigError(f"{key} must be a finite number, got {value}")
            if value < 0 or (value == 0 and key in positive):
                bound = "positive" if key in positive else ">= 0"
                raise ConfigError(f"{key} must be {bound}, got {value}")
        if self.seed >= 1 << 64:
            raise ConfigError(f"seed must be below 2**64 (torch's generator seed), got {self.seed}")
        if self.eval.every is not None and self.eval.every < 0:
            raise ConfigError(f"eval.every must be >= 0 or none, got {self.eval.every}")
        if self.eval.every and not self.data.val_path:
            raise ConfigError(f"eval.every={self.eval.every} needs data.val_path")
        if self.eval.prompts and (not self.data.val_path or self.eval.every == 0):
            raise ConfigError("eval.prompts are completed at each evaluation: set data.val_path "
                              "(and eval.every > 0)")
        if self.eval.prompts and self.parallel.pp > 1:
            raise ConfigError("eval.prompts needs the whole model on each rank: parallel.pp=1")
        if self.data.val_path and self.eval.tokens < self.train.seq_len:
            raise ConfigError(f"eval.tokens={self.eval.tokens} holds no window of "
                              f"train.seq_len={self.train.seq_len} tokens")
        for key in ("data.seed", "train.stop_after"):
            value = self._get(key)
            if value is not None and value < (0 if key == "data.seed" else 1):
                bound = ">= 0" if key == "data.seed" else "positive"
                raise ConfigError(f"{key} must be {bound} or none, got {value}")
        o = self.optim
        if not (0 <= o.beta1 < 1 and 0 <= o.beta2 < 1 and 0 <= o.muon_momentum < 1):
            raise ConfigError(f"optim.beta1/beta2/muon_momentum must be in [0, 1), got "
                              f"{o.beta1}, {o.beta2}, {o.muon_momentum}")
        if o.min_lr_ratio > 1 or not 0 < o.decay_fraction <= 1:
            raise ConfigError("optim.min_lr_ratio must be <= 1 and optim.decay_fraction in (0, 1]")
        if o.schedule != "constant" and self.train.steps <= o.warmup_steps:
            raise ConfigError(
                f"optim.schedule={o.schedule} decays after the warmup: train.steps={self.train.steps} "
                f"must exceed optim.warmup_steps={o.warmup_steps}"
            )
        p = self.parallel
        if p.ep_backend == "local" and p.ep > 1:
            raise ConfigError(
                f"parallel.ep_backend=local keeps every expert on its rank; parallel.ep={p.ep} "
                "needs all_to_all or rowwise"
            )
        if p.ep_payload != "compute":
            self._check_ep_payload()
        if p.ep_overlap_chunks > 1 or p.ep_comm_sms is not None:
            self._check_ep_overlap()
        if p.ep_overlap_microbatches:
            self._check_ep_microbatch_overlap()
        if p.ep_copy_engine:
            self._check_ep_copy_engine()
        if p.sm_carveout is not None:
            self._check_sm_carveout()
        if self.model.tie_embeddings and p.pp > 1:
            raise ConfigError(
                "model.tie_embeddings with parallel.pp > 1 is not supported: the embedding and the "
                "head would live on different pipeline stages"
            )
        if p.pp > 1 and p.pp_schedule == "zero_bubble" and self.model.recompute != "none":
            raise ConfigError(
                f"parallel.pp_schedule=zero_bubble with model.recompute={self.model.recompute} is "
                "not supported: its separate input- and weight-gradient passes would replay each "
                "recomputed block twice, which activation recompute does not allow; use "
                "parallel.pp_schedule=1f1b or gpipe, or model.recompute=none"
            )
        merge = p.merge_expert_grad_microbatches
        if merge != "auto" and not 1 <= merge <= MAX_WGRAD_SOURCES:
            raise ConfigError(
                f"parallel.merge_expert_grad_microbatches must be 1 to {MAX_WGRAD_SOURCES} or auto, "
                f"got {merge}: the expert weight-gradient kernel reduces at most "
                f"{MAX_WGRAD_SOURCES} microbatches per launch"
            )
        if merge != "auto" and merge > 1 and not p.fuse_grad_accumulation:
            raise ConfigError(
                "parallel.merge_expert_grad_microbatches > 1 merges the gradients the fused expert "
                "GEMMs deliver: it needs parallel.fuse_grad_accumulation=true"
            )
        if self.train.cuda_graphs:
            unsupported = [
                (p.pp > 1, f"parallel.pp={p.pp}: the pipeline schedule interleaves microbatches"),
                (p.resolved_ep_backend(self.train.cuda_graphs) == "all_to_all",
                 f"parallel.ep={p.ep} / ep_backend={p.ep_backend}: the all_to_all transport reads "
                 "its split sizes on the host every call; use parallel.ep_backend=rowwise"),
                (bool(self.mxfp8.targets) and self.mxfp8.recipe != "mxfp8"
                 and "emulated" in (self.mxfp8.gemm, self.mxfp8.resolved_dense_gemm),
                 f"mxfp8.recipe={self.mxfp8.recipe} and mxfp8."
                 f"{'gemm' if self.mxfp8.gemm == 'emulated' else 'dense_gemm'}=emulated: the "
                 "emulated FP8 GEMMs read the group offsets on the host; use native or triton"),
                (self.train.device == "cpu", "train.device=cpu: CUDA graphs need a GPU"),
                (self.train.reference_kernels, "train.reference_kernels: the reference expert "
                 "GEMMs read the expert offsets on the host"),
            ]
            for bad, why in unsupported:
                if bad:
                    raise ConfigError(f"train.cuda_graphs is not supported with {why}")
        if self.data.document_mask:
            if p.pp > 1:
                raise ConfigError("data.document_mask with parallel.pp > 1 is not supported: the "
                                  "pipeline passes no document boundaries between its stages")
            if self.train.cuda_graphs:
                raise ConfigError("data.document_mask with train.cuda_graphs is not supported: the "
                                  "document mask is built anew for every batch")
        if not self.checkpoint.resume:
            raise ConfigError("checkpoint.resume must be auto, none or a checkpoint path")
        origin = self.key_sources.get("data.sources")
        self.data.validate(f" ({origin})" if origin else "")

    def _check_ep_overlap(self) -> None:
        """Chunks need a transport to overlap and tokens to fill them; an SM bound, an overlap."""
        p, t = self.parallel, self.train
        tokens = t.micro_batch * t.seq_len
        if p.ep_overlap_chunks > 1 and p.resolved_ep_backend(self.train.cuda_graphs) == "local":
            raise ConfigError(
                f"parallel.ep_overlap_chunks={p.ep_overlap_chunks} overlaps the EP transport with "
                "the experts: it needs parallel.ep > 1 or an all_to_all or rowwise parallel.ep_backend"
            )
        if p.ep_overlap_chunks > tokens:
            raise ConfigError(
                f"parallel.ep_overlap_chunks={p.ep_overlap_chunks} exceeds the "
                f"{tokens} tokens of a microbatch (train.micro_batch x train.seq_len)"
            )
        overlapped = p.ep_overlap_chunks > 1 or p.ep_overlap_microbatches
        if p.ep_comm_sms is not None and (p.ep_comm_sms < 1 or not overlapped):
            raise ConfigError(
                f"parallel.ep_comm_sms={p.ep_comm_sms} bounds the SMs of the EP communication "
                "stream: a positive count, with parallel.ep_overlap_chunks > 1 or "
                "parallel.ep_overlap_microbatches"
            )
        if p.ep_comm_sms is not None and t.device == "cpu":
            raise ConfigError(f"parallel.ep_comm_sms={p.ep_comm_sms} bounds a CUDA stream's SMs: "
                              "train.device=cpu has none")

    def _check_ep_microbatch_overlap(self) -> None:
        """Interleaved microbatches need a transport to overlap and forwards that hold no
        thread-local state across its calls (moe_ep_transport.interleave)."""
        p, m = self.parallel, self.model
        why = None
        if p.resolved_ep_backend(self.train.cuda_graphs) == "local":
            why = "it needs parallel.ep > 1 or an all_to_all or rowwise parallel.ep_backend"
        elif p.ep_overlap_chunks > 1:
            why = (f"parallel.ep_overlap_chunks={p.ep_overlap_chunks} pipelines one microbatch's chunks "
                   "instead; use one of the two")
        elif m.recompute != "none":
            why = (f"model.recompute={m.recompute} holds its state across the transport calls where "
                   "the other microbatch runs; use model.recompute=none")
        elif p.pp > 1:
            why = f"parallel.pp={p.pp} runs its own microbatch schedule"
        if why is not None:
            raise ConfigError(f"parallel.ep_overlap_microbatches interleaves two microbatches at the EP "
                              f"transport: {why}")

    def _check_sm_carveout(self) -> None:
        """A positive count, on a GPU, with a torch that has the carveout, and no green context
        for the communication stream (it runs on SMs of its own, not the ones left free)."""
        import torch

        from pretrain.sm_carveout import carveout_supported

        p = self.parallel
        why = None
        if p.sm_carveout < 1:
            why = "a positive SM count expected"
        elif self.train.device == "cpu":
            why = "it bounds a CUDA GPU's SMs: train.device=cpu has none"
        elif p.ep_comm_sms is not None:
            why = (f"parallel.ep_comm_sms={p.ep_comm_sms} confines the communication stream to SMs of its own, "
                   "which the GEMMs may still hold; use one of the two")
        elif not carveout_supported():
            why = f"torch {torch.__version__} has no SM carveout (torch._C._set_sm_carveout_experimental)"
        if why is not None:
            raise ConfigError(f"parallel.sm_carveout={p.sm_carveout}: {why}")

    def _check_ep_copy_engine(self) -> None:
        """The copy engines move the rowwise transport's contiguous blocks, where it has any."""
        from moe_ep_transport import EPConfig

        p, m = self.parallel, self.model
        backend = p.resolved_ep_backend(self.train.cuda_graphs)
        if backend != "rowwise":
            raise ConfigError("parallel.ep_copy_engine moves the rowwise EP transport's blocks: it needs "
                              f"parallel.ep_backend=rowwise (got {backend})")
        tokens = ep_call_tokens(self.train.micro_batch * self.train.seq_len, p.ep_overlap_chunks)
        cfg = EPConfig(n_experts=m.n_experts, top_k=m.top_k, max_tokens=tokens, d_model=m.d_model,
                       capacity_factor=m.capacity_factor, combine=p.ep_combine)
        if not cfg.copy_engine_moves(p.ep, 4 * m.d_model):
            raise ConfigError(
                f"parallel.ep_copy_engine moves the token inbox sends and the partial sums summed at the "
                f"destination, and parallel.ep={p.ep} uses neither (one row per slot; the combine sums at "
                f"the source): leave it false or set parallel.ep_combine=destination"
            )

    def _check_ep_payload(self) -> None:
        """A quantized dispatch payload needs a transport that encodes it, and experts that
        compute on the values it carries (a recipe outside the codec's ``exact_recipes``
        would round every dispatched row a second time)."""
        p, m, x = self.parallel, self.model, self.mxfp8
        if p.resolved_ep_backend(self.train.cuda_graphs) == "local":
            raise ConfigError(
                f"parallel.ep_payload={p.ep_payload} needs expert parallelism: parallel.ep > 1 "
                "or an all_to_all or rowwise parallel.ep_backend"
            )
        exact = EP_PAYLOAD_CODECS[p.ep_payload].exact_recipes
        quantized_experts = any(name_matches(f"blocks.{i}.mlp.experts", t)
                                for i in range(m.n_dense_layers, m.n_layers) for t in x.targets)
        if quantized_experts and x.recipe not in exact:
            raise ConfigError(
                f"parallel.ep_payload={p.ep_payload} into experts of mxfp8.recipe={x.recipe} "
                f"would round the dispatched rows twice; with that payload use mxfp8.recipe "
                f"{' or '.join(exact)}, or parallel.ep_payload=compute"
            )

    def _get(self, key: str) -> Any:
        obj: Any = self
        for part in key.split("."):
            obj = getattr(obj, part)
        return obj


@dataclass(frozen=True)
class Layout:
    """How the world is split: PP x DP, and inside DP, EP-MP (``ep``) x EP-DP."""

    world_size: int
    pp: int
    dp: int
    ep: int  # EP-MP: ranks holding different expert shards
    ep_dp: int  # ranks holding copies of the same expert shard; dp = ep * ep_dp
    microbatches: int  # microbatches per rank per optimizer step

    def describe(self) -> str:
        return (f"world {self.world_size} = pp {self.pp} x dp {self.dp} "
                f"(dp = ep {self.ep} x ep_dp {self.ep_dp}); "
                f"microbatches per rank: {self.microbatches}")


def ep_call_tokens(microbatch_tokens: int, overlap_chunks: int) -> int:
    """Tokens one EP transport call carries at most (``EPConfig.max_tokens``): a microbatch's,
    split into ``parallel.ep_overlap_chunks`` chunks (``tensor_split``: the first ones one
    token longer), so the transport's buffers are sized for one chunk."""
    return -(-microbatch_tokens // overlap_chunks)


def validate_layout(cfg: PretrainConfig, world_size: int) -> Layout:
    """The layout of ``cfg`` on ``world_size`` ranks, or a ``ConfigError`` saying why not."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    if world_size % p.pp:
        raise ConfigError(f"world size {world_size} is not divisible by parallel.pp={p.pp}")
    dp = world_size // p.pp
    if dp % p.ep:
        raise ConfigError(
            f"parallel.ep={p.ep} does not divide the data-parallel size {dp} "
            f"(world size {world_size} / parallel.pp={p.pp})"
        )
    if m.n_experts % p.ep:
        raise ConfigError(f"model.n_experts={m.n_experts} is not divisible by parallel.ep={p.ep}")
    if t.global_batch % (dp * t.micro_batch):
        raise ConfigError(
            f"train.global_batch={t.global_batch} is not divisible by data-parallel size {dp} "
            f"x train.micro_batch={t.micro_batch}"
        )
    stages = p.pp * p.pp_virtual_stages
    if m.n_layers < stages:
        raise ConfigError(
            f"model.n_layers={m.n_layers} is fewer than the {stages} pipeline stages "
            f"(parallel.pp={p.pp} x parallel.pp_virtual_stages={p.pp_virtual_stages})"
        )
    microbatches = t.global_batch // (dp * t.micro_batch)
    if p.pp > 1 and p.pp_virtual_stages > 1 and microbatches % p.pp:
        raise ConfigError(
            f"parallel.pp_virtual_stages={p.pp_virtual_stages} needs the microbatches per rank "
            f"({microbatches} = train.global_batch / (dp {dp} x train.micro_batch)) to be a "
            f"multiple of parallel.pp={p.pp}"
        )
    return Layout(world_size, p.pp, dp, p.ep, dp // p.ep, microbatches)


def load_config(source: str | None = None, overrides: list[str] | None = None) -> PretrainConfig:
    """The run config from a preset name or TOML path (default: ``default``), then overrides."""
    cfg = PretrainConfig()
    source = source or "default"
    if source in PRESETS:
        for key in apply_tree(cfg, PRESETS[source]):
            cfg.key_sources[key] = f"preset {source}"
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(
                f"--config {source!r} is neither a built-in preset ({', '.join(PRESETS)}) "
                "nor a TOML file"
            )
        try:
            tree = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
        try:
            for key in apply_tree(cfg, tree):
                cfg.key_sources[key] = f"file {path}"
        except ConfigError as e:  # an unknown key or a wrong type: say which file holds it
            raise ConfigError(f"{path}: {e}") from None
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like KEY=VALUE")
        set_key(cfg, key.strip(), value.strip())
        cfg.key_sources[key.strip()] = "the command line"
    cfg.validate()
    return cfg


def config_toml(cfg: PretrainConfig, layout: Layout | None = None) -> str:
    """The resolved config as TOML that ``load_config`` reads back to an equal config: every
    key with its type, default and description (``pretrain.config_reference``)."""
    header = "resolved pretrain config" + (f"; {layout.describe()}" if layout else "")
    header += "\nevery key: type, default: description (unset optional keys commented out)"
    return annotated_toml(cfg, header, cfg.key_sources)

