"""This rank's part of the model: built on meta, cut to the layout, materialised, converted.

Order (each step needs the ones before it):

1. the whole model, on the ``meta`` device when large (structure only, no
   memory: a model far larger than one device is never allocated whole), else
   directly on the device (a meta build imports PyTorch's reference kernels,
   seconds of start-up a small run should not pay);
2. pipeline (``parallel.pp > 1``): moe_pp splits it and keeps this PP rank's
   stages (views sharing the model's submodules, under the model's names);
3. expert parallelism: every MoE layer keeps only this EP-MP rank's experts;
4. materialise on the device and initialise; values depend only on (seed,
   parameter name, global expert id), so every layout starts from the same weights;
5. cast the parameters to the compute dtype; buffers (the routers' selection
   bias) stay FP32. The distributed optimizer keeps the FP32 main weights, taken
   from these values (BF16-rounded initial values on GPU, the same on every layout).
   Low-precision experts whose main weight this rank holds whole stay FP32, rounded
   to the compute dtype's values, as their own main weights
   (``pretrain.optimizer.expert_weight_in_fp32``);
6. MXFP8 (``mxfp8.targets``): swap the target layers, same parameters and names;
7. EP dispatch: one transport per EP group, shared by all MoE layers, one
   dispatcher per layer (seeded by the layer, for fair overflow drops), which the
   trainer wires into the model with the rest of its attachments
   (``moe_model.wire_model``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from moe_ep_transport import EPConfig, EPDispatcher, MicrobatchInterleave, Transport, make_transport
from moe_model import (
    MoELayer,
    MoETransformer,
    TokenDispatcher,
    init_weights,
    lm_loss_sum,
    total_params,
)
from moe_mxfp8 import apply_mxfp8, unmatched_targets
from moe_pp import Pipeline, PipelineConfig, build_pipeline
from torch import nn

from pretrain.config import EP_PAYLOAD_CODECS, ConfigError, PretrainConfig, ep_call_tokens
from pretrain.mesh import ParallelMesh
from pretrain.optimizer import expert_weight_in_fp32

_ROOT_CHILDREN = ("embed", "norm", "head")
META_BUILD_BYTES = 1 << 30  # build on meta when the whole model's FP32 weights exceed this


@dataclass
class ModelPart:
    module: nn.Module  # this rank's parameters under the model's names
    pipeline: Pipeline | None  # this rank's stages and schedule (parallel.pp > 1)
    moe_layers: dict[int, MoELayer]  # MoE layer index in the model -> the layer held here
    dispatchers: dict[str, TokenDispatcher]  # MoE layer name in ``module`` -> its EP dispatcher
    transport: Transport | None  # the EP group's token transport (parallel.ep_backend != local)
    mxfp8_layers: list[str]  # modules swapped for MXFP8 ones
    nvshmem: bool  # the transport runs on NVSHMEM (finalised on close)
    # runs microbatch forwards interleaved at the dispatchers' calls (parallel.ep_overlap_microbatches)
    interleave: MicrobatchInterleave | None = None

    def close(self) -> None:
        """Release the EP transport (collective over the EP group)."""
        if self.transport is not None:
            self.transport.close()
            self.transport = None
            if self.nvshmem:
                from moe_ep_transport import nvshmem_memory

                nvshmem_memory.finalize()


def cast_parameters_(module: nn.Module, dtype: torch.dtype,
                     keep: Callable[[str, nn.Parameter], bool] | None = None) -> None:
    """Parameters to ``dtype`` in place (same ``Parameter`` objects); those ``keep`` names
    keep their dtype and take ``dtype``'s values (so the main weights start from the same
    values whichever parameters stay); buffers untouched."""
    for name, p in module.named_parameters():
        kept = keep is not None and keep(name, p)
        p.data = p.data.to(dtype).to(p.dtype) if kept else p.data.to(dtype)


def _moe_layer_index(name: str, n_dense_layers: int) -> int:
    """``blocks.{i}.mlp`` -> index among the model's MoE layers (dense blocks lead)."""
    return int(name.split(".")[1]) - n_dense_layers


def refuse_unavailable_native_gemm(cfg: PretrainConfig, device: torch.device) -> None:
    """``mxfp8.gemm`` or ``mxfp8.dense_gemm`` native or triton where this device has no such
    tensor cores: one line before anything is built, rather than a traceback at the first
    forward. MXFP8's block-scaled GEMM needs compute capability 10.x, the FP8 recipes'
    native GEMMs 9.x, their Triton GEMM 8.9 or up (and ``fp8_rowwise``'s weight gradients,
    which have no Triton GEMM, 9.x to be replayed from CUDA graphs; ``fp8_blockwise_gw_fp8``'s
    have one); emulation (the
    default) runs anywhere."""
    x = cfg.mxfp8
    if not x.targets:
        return
    from moe_mxfp8 import (
        FP8_RECIPES,
        fp8_native_available,
        fp8_triton_available,
        native_mx_available,
    )

    choices = {"mxfp8.gemm": x.gemm}
    if x.recipe != "mxfp8" and x.dense_gemm is not None:
        choices["mxfp8.dense_gemm"] = x.dense_gemm
    for key, gemm in choices.items():
        if gemm == "emulated":
            continue
        if x.recipe == "mxfp8":
            available, needs = native_mx_available, "10.x"
        elif gemm == "native":
            available, needs = fp8_native_available, "9.x"
        else:
            available, needs = fp8_triton_available, "8.9 or up and Triton installed"
        if not (available(device) and device.type == "cuda"):
            here = (f"{torch.cuda.get_device_name(device)} (compute capability "
                    f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))})"
                    if device.type == "cuda" else f"train.device={device.type}")
            raise ConfigError(f"{key}={gemm} with mxfp8.recipe={x.recipe} needs a GPU of compute "
                              f"capability {needs}; this run has {here} ({key}=emulated runs "
                              "anywhere)")
        recipe = FP8_RECIPES.get(x.recipe)  # blockwise FP8 weight gradients run on Triton
        if (gemm == "triton" and cfg.train.cuda_graphs and recipe is not None and recipe.fp8_wgrad
                and not recipe.blockwise and not fp8_native_available(device)):
            raise ConfigError(f"mxfp8.recipe={x.recipe} with {key}=triton runs its FP8 weight "
                              "gradients natively (compute capability 9.x) or else emulated, which "
                              "reads the group offsets on the host: not with train.cuda_graphs "
                              "on this GPU (mxfp8.recipe=fp8_rowwise_gw_hp has no FP8 weight gradients)")


def build_model_part(cfg: PretrainConfig, mesh: ParallelMesh, device: torch.device,
                     dtype: torch.dtype) -> ModelPart:
    m, t, p = cfg.model, cfg.train, cfg.parallel
    refuse_unavailable_native_gemm(cfg, device)
    on_meta = 4 * total_params(m) > META_BUILD_BYTES
    with torch.device("meta" if on_meta else device):
        model = MoETransformer(m)
    unmatched = unmatched_targets(model, cfg.mxfp8.targets)  # the whole model: before the cut
    if unmatched:  # a misspelt glob would train without MXFP8 and say nothing
        raise ConfigError(
            f"mxfp8.targets {unmatched} match no linear layer or grouped experts of the model "
            "(module-name globs matched against every dotted suffix, e.g. 'experts', "
            "'attn.w?', 'blocks.1.*')")
    pipeline = None
    module: nn.Module = model
    if p.pp > 1:
        pipeline = build_pipeline(
            model, PipelineConfig(schedule=p.pp_schedule, virtual_stages=p.pp_virtual_stages,
                                  split=p.pp_split),
            n_microbatches=mesh.layout.microbatches, loss_fn=lm_loss_sum,
            activation_shape=(t.micro_batch, t.seq_len, m.d_model), activation_dtype=dtype,
            group=mesh.pp_group, seq_len=t.seq_len,
        )
        module = pipeline.module
    layer_names = {_moe_layer_index(name, m.n_dense_layers): name for name, _ in module.moe_layers()}
    layers = {index: module.get_submodule(name) for index, name in layer_names.items()}
    experts = mesh.expert_range(m.n_experts)
    for layer in layers.values():
        layer.experts.narrow_(experts.start, len(experts))
    if on_meta:
        module.to_empty(device=device)
    init_weights(module, m, cfg.seed)
    targets, ep_dp = cfg.mxfp8.targets, mesh.layout.ep_dp
    cast_parameters_(module, dtype, lambda name, p: expert_weight_in_fp32(name, p.numel(), targets, ep_dp))
    mxfp8_layers = apply_mxfp8(module, cfg.mxfp8) if cfg.mxfp8.targets else []
    if pipeline is not None:  # a swapped root child (the head) must reach the stage views too
        for stage in pipeline.stages.stages:
            for name in _ROOT_CHILDREN:
                if getattr(stage.module, name) is not None:
                    setattr(stage.module, name, getattr(module, name))
    backend = p.resolved_ep_backend(cfg.train.cuda_graphs)
    transport = None
    interleave = None
    dispatchers: dict[str, TokenDispatcher] = {}
    if backend != "local":
        ep_cfg = EPConfig(n_experts=m.n_experts, top_k=m.top_k,
                          max_tokens=ep_call_tokens(t.micro_batch * t.seq_len, p.ep_overlap_chunks),
                          d_model=m.d_model, capacity_factor=m.capacity_factor, combine=p.ep_combine,
                          overlap_chunks=p.ep_overlap_chunks,
                          comm_sms=p.ep_comm_sms if p.ep_overlap_chunks > 1 else None,
                          copy_engine=p.ep_copy_engine)
        codec = EP_PAYLOAD_CODECS[p.ep_payload]() if p.ep_payload != "compute" else None
        transport = make_transport(backend, ep_cfg, mesh.ep_mp_group, device=device, dtype=dtype,
                                   codec=codec)
        interleave = MicrobatchInterleave(p.ep_comm_sms) if p.ep_overlap_microbatches else None
        dispatchers = {name: EPDispatcher(ep_cfg, transport, codec=codec, seed=index, interleave=interleave)
                       for index, name in layer_names.items()}
    return ModelPart(module, pipeline, layers, dispatchers, transport, mxfp8_layers,
                     nvshmem=backend == "rowwise" and device.type == "cuda", interleave=interleave)
