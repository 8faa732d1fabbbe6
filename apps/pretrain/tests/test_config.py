"""Config composition: typed overrides, presets, TOML round trips, layout validation."""

from __future__ import annotations

import dataclasses
import enum
import tomllib
from dataclasses import dataclass, field
from typing import Literal

import pytest
import torch
from moe_model import MoEConfig
from pretrain.config import PRESETS, PretrainConfig, config_toml, load_config, validate_layout
from pretrain.config_reference import annotated_toml
from pretrain.config_tree import ConfigError, apply_tree, coerce, set_key


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass
class Inner:
    width: int = 4
    ratio: float | None = 0.5
    mode: Literal["fast", "exact"] = "fast"


@dataclass
class Outer:
    inner: Inner = field(default_factory=Inner)
    name: str = "x"
    flag: bool = False
    limit: int | None = None
    color: Color = Color.RED
    layers: list[int] = field(default_factory=list)
    pair: tuple[int, float] = (1, 2.0)


def test_overrides_follow_the_declared_types():
    cfg = Outer()
    for key, value in [("inner.width", "8"), ("inner.ratio", "none"), ("inner.mode", "exact"),
                       ("name", "run"), ("flag", "true"), ("limit", "1_000"), ("color", "BLUE"),
                       ("layers", "[1, 2,3]"), ("pair", "3,0.25")]:
        set_key(cfg, key, value)
    assert cfg == Outer(Inner(8, None, "exact"), "run", True, 1000, Color.BLUE, [1, 2, 3], (3, 0.25))
    set_key(cfg, "inner.ratio", 2)  # TOML ints are fine for floats
    set_key(cfg, "limit", "null")
    assert cfg.inner.ratio == 2.0 and isinstance(cfg.inner.ratio, float) and cfg.limit is None


@pytest.mark.parametrize("key, value, message", [
    ("inner.width", "4.5", "inner.width expects an integer, got '4.5'"),
    ("inner.width", True, "inner.width expects an integer, got True"),
    ("inner.ratio", "half", "inner.ratio expects a number or none, got 'half'"),
    ("inner.mode", "slow", "inner.mode expects one of fast, exact, got 'slow'"),
    ("flag", "maybe", "flag expects true or false, got 'maybe'"),
    ("name", 3, "name expects a string, got 3"),
    ("color", "green", "color expects one of RED, BLUE, got 'green'"),
    ("pair", "1", "pair expects 2 values, got 1"),
    ("layers", "1,x", "layers[1] expects an integer, got 'x'"),
    ("inner", "3", "inner is a section; set one of its keys, e.g. inner.width"),
    ("inner.widht", "3", "unknown config key 'inner.widht'; did you mean 'inner.width'?"),
    ("innr.width", "3", "unknown config key 'innr.width'; did you mean 'inner.width'?"),
    ("nothing_like_it", "3", "unknown config key 'nothing_like_it'"),
])
def test_bad_overrides_fail_with_one_line(key, value, message):
    with pytest.raises(ConfigError) as e:
        set_key(Outer(), key, value)
    assert str(e.value) == message
    assert "\n" not in str(e.value)


def test_every_model_field_is_settable_from_a_string():
    """Generic over MoEConfig: fields another package adds work without app changes."""
    cfg = PretrainConfig()
    for f in dataclasses.fields(MoEConfig):
        value = getattr(cfg.model, f.name)
        text = "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        set_key(cfg, f"model.{f.name}", text)
        assert getattr(cfg.model, f.name) == value, f.name
    assert coerce("model.d_model", "512", int) == 512


def test_presets_are_valid_and_round_trip_through_toml(tmp_path):
    for name in PRESETS:
        cfg = load_config(name, ["run_dir=runs/x", "data.seed=7"])
        validate_layout(cfg, 1)
        path = tmp_path / f"{name}.toml"
        path.write_text(config_toml(cfg))
        assert load_config(str(path)) == cfg, name
    bench = load_config("bench-1gpu")
    m = bench.model
    assert (m.d_model, m.n_layers, m.n_heads, m.head_dim, m.n_kv_heads) == (2048, 8, 16, 128, 4)
    assert (m.n_experts, m.top_k, m.expert_hidden, m.vocab_size) == (64, 8, 1024, 100352)
    assert (bench.train.seq_len, bench.train.micro_batch, bench.train.global_batch) == (4096, 2, 64)
    assert bench.data.path == "synthetic"
    assert bench.parallel.merge_expert_grad_microbatches == 4
    assert load_config("bench-2gpu").model.n_layers == 16


def test_optional_field_with_a_non_none_default_round_trips():
    @dataclass
    class Tree:
        cap: float | None = 1.25

    tree = Tree(cap=None)
    back = Tree()
    apply_tree(back, tomllib.loads(annotated_toml(tree)))
    assert back == tree


def test_toml_file_errors_name_the_key(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[train]\nstpes = 3\n')
    with pytest.raises(ConfigError, match="run.toml: unknown config key 'train.stpes'; did you mean 'train.steps'"):
        load_config(str(path))
    path.write_text('[train]\nsteps = 3.0\n')
    with pytest.raises(ConfigError, match="run.toml: train.steps expects an integer"):
        load_config(str(path))
    path.write_text("[train\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(str(path))
    with pytest.raises(ConfigError, match="neither a built-in preset"):
        load_config(str(tmp_path / "missing.toml"))
    with pytest.raises(ConfigError, match="must look like KEY=VALUE"):
        load_config("tiny", ["train.steps"])


@pytest.mark.parametrize("overrides, message", [
    (["train.steps=0"], "train.steps must be positive, got 0"),
    (["model.n_kv_heads=3"], "invalid model config"),
    (["parallel.ep=2", "parallel.ep_backend=local"], "parallel.ep_backend=local"),
    (["data.seed=-1"], "data.seed must be >= 0"),
    (["optim.lr=nan"], "optim.lr must be a finite number, got nan"),
    (["optim.lr=inf"], "optim.lr must be a finite number, got inf"),
    (["optim.grad_clip=nan"], "optim.grad_clip must be a finite number"),
    (["parallel.bucket_cap_mb=nan"], "parallel.bucket_cap_mb must be a finite number"),
    ([f"seed={2**64}"], r"seed must be below 2\*\*64"),
    (["train.stop_after=0"], "train.stop_after must be positive or none, got 0"),
    (["optim.warmup_steps=4"], "train.steps=4 must exceed optim.warmup_steps=4"),
    (["parallel.ep_payload=mxfp8"], "parallel.ep_payload=mxfp8 needs expert parallelism"),
    (["parallel.ep_payload=fp8_rowwise", "parallel.ep_backend=local"],
     "parallel.ep_payload=fp8_rowwise needs expert parallelism: parallel.ep > 1 or an "
     "all_to_all or rowwise parallel.ep_backend"),
    (["parallel.ep_overlap_chunks=0"], "parallel.ep_overlap_chunks must be positive, got 0"),
    (["parallel.ep_overlap_chunks=2"], "parallel.ep_overlap_chunks=2 overlaps the EP transport with "
     "the experts: it needs parallel.ep > 1 or an all_to_all or rowwise parallel.ep_backend"),
    (["parallel.ep=2", "parallel.ep_overlap_chunks=1025", "train.micro_batch=4", "train.seq_len=256"],
     "parallel.ep_overlap_chunks=1025 exceeds the 1024 tokens of a microbatch"),
    (["parallel.ep=2", "parallel.ep_comm_sms=16"], "parallel.ep_comm_sms=16 bounds the SMs of the EP "
     "communication stream: a positive count, with parallel.ep_overlap_chunks > 1 or "
     "parallel.ep_overlap_microbatches"),
    (["parallel.ep=2", "parallel.ep_overlap_chunks=2", "parallel.ep_comm_sms=0"], "parallel.ep_comm_sms=0"),
    (["parallel.ep=2", "parallel.ep_overlap_chunks=2", "parallel.ep_comm_sms=16", "train.device=cpu"],
     "parallel.ep_comm_sms=16 bounds a CUDA stream's SMs: train.device=cpu has none"),
    (["parallel.ep=2", "parallel.ep_copy_engine=true"], "parallel.ep_copy_engine moves the rowwise EP "
     r"transport's blocks: it needs parallel.ep_backend=rowwise \(got all_to_all\)"),
    (["parallel.ep=2", "parallel.ep_backend=rowwise", "parallel.ep_copy_engine=true", "model.top_k=1",
      "model.capacity_factor=1.0"], "parallel.ep_copy_engine moves the token inbox sends and the partial sums "
     "summed at the destination, and parallel.ep=2 uses neither"),
    (["parallel.sm_carveout=0", "train.device=cuda"], "parallel.sm_carveout=0: a positive SM count expected"),
    (["parallel.sm_carveout=8", "train.device=cpu"], "parallel.sm_carveout=8: it bounds a CUDA GPU's SMs: "
     "train.device=cpu has none"),
    (["parallel.sm_carveout=8", "train.device=cuda", "parallel.ep=2", "parallel.ep_overlap_chunks=2",
      "parallel.ep_comm_sms=16"], "parallel.sm_carveout=8: parallel.ep_comm_sms=16 confines the communication "
     "stream to SMs of its own"),
    (["parallel.ep_overlap_microbatches=true"], "parallel.ep_overlap_microbatches interleaves two "
     "microbatches at the EP transport: it needs parallel.ep > 1 or an all_to_all or rowwise "
     "parallel.ep_backend"),
    (["parallel.ep=2", "parallel.ep_overlap_microbatches=true", "parallel.ep_overlap_chunks=2"],
     "parallel.ep_overlap_chunks=2 pipelines one microbatch's chunks instead; use one of the two"),
    (["parallel.ep=2", "parallel.ep_overlap_microbatches=true", "model.recompute=block"],
     "model.recompute=block holds its state across the transport calls"),
    (["parallel.ep_backend=all_to_all", "parallel.ep_overlap_microbatches=true", "parallel.pp=2"],
     "parallel.pp=2 runs its own microbatch schedule"),
    (["mxfp8.gemm=fast"], "invalid mxfp8 config: MXFP8Config.gemm must be one of"),
    (["parallel.pp=2", "model.tie_embeddings=true"], "model.tie_embeddings with parallel.pp > 1"),
    (["parallel.pp=2", "parallel.pp_schedule=zero_bubble", "model.recompute=block"],
     "parallel.pp_schedule=zero_bubble with model.recompute=block is not supported"),
    (["parallel.pp=2", "parallel.pp_schedule=zero_bubble", "model.recompute=selective"],
     "parallel.pp_schedule=zero_bubble with model.recompute=selective is not supported"),
    (["train.cuda_graphs=true", "parallel.pp=2"], "train.cuda_graphs is not supported with parallel.pp=2"),
    (["train.cuda_graphs=true", "parallel.ep=2", "parallel.ep_backend=all_to_all"],
     "train.cuda_graphs is not supported with parallel.ep=2 / ep_backend=all_to_all: the "
     "all_to_all transport reads its split sizes on the host"),
    (["train.cuda_graphs=true", "mxfp8.targets=experts", "mxfp8.recipe=fp8_rowwise"],
     "train.cuda_graphs is not supported with mxfp8.recipe=fp8_rowwise and mxfp8.gemm=emulated"),
    (["train.cuda_graphs=true", "train.device=cpu"],
     "train.cuda_graphs is not supported with train.device=cpu"),
    (["train.cuda_graphs=true", "train.reference_kernels=true"],
     "train.cuda_graphs is not supported with train.reference_kernels"),
])
def test_validate_names_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", overrides)


@pytest.mark.parametrize("overrides", [
    ["parallel.pp=2", "parallel.pp_schedule=1f1b", "model.recompute=selective"],
    ["parallel.pp=2", "parallel.pp_schedule=zero_bubble", "model.recompute=none"],
    ["parallel.pp_schedule=zero_bubble", "model.recompute=block"],  # no pipeline: no schedule runs
])
def test_recompute_is_refused_only_under_a_zero_bubble_pipeline(overrides):
    load_config("tiny", overrides)


EP_TRANSPORT = ["parallel.ep_backend=all_to_all"]  # an EP transport on one rank: a payload applies


@pytest.mark.parametrize("payload, targets, recipe, refused", [
    ("fp8_rowwise", "experts", "fp8_rowwise", False),
    ("fp8_rowwise", "experts", "fp8_rowwise_gw_hp", False),
    ("fp8_rowwise", "experts", "mxfp8", True),
    ("fp8_rowwise", "blocks.1.mlp.experts", "fp8_blockwise", True),
    ("fp8_rowwise", "attn.w?", "mxfp8", False),  # the experts stay in the compute dtype
    ("fp8_rowwise", "", "mxfp8", False),
    ("mxfp8", "experts", "mxfp8", False),
    ("mxfp8", "experts", "fp8_rowwise", True),
    ("mxfp8", "experts", "fp8_blockwise", True),
    ("compute", "experts", "fp8_blockwise", False),
])
def test_quantized_payload_needs_experts_that_compute_on_its_values(payload, targets, recipe, refused):
    overrides = [*EP_TRANSPORT, f"parallel.ep_payload={payload}", f"mxfp8.targets={targets}",
                 f"mxfp8.recipe={recipe}"]
    if not refused:
        assert load_config("tiny", overrides).parallel.ep_payload == payload
        return
    with pytest.raises(ConfigError) as e:
        load_config("tiny", overrides)
    assert str(e.value) == (
        f"parallel.ep_payload={payload} into experts of mxfp8.recipe={recipe} would round the "
        f"dispatched rows twice; with that payload use mxfp8.recipe "
        f"{'mxfp8' if payload == 'mxfp8' else 'fp8_rowwise or fp8_rowwise_gw_hp'}, or "
        "parallel.ep_payload=compute")


def test_the_quantized_experts_of_dense_leading_layers_do_not_count():
    """Only MoE layers have routed experts: a glob naming a dense block's index matches none."""
    load_config("tiny", [*EP_TRANSPORT, "parallel.ep_payload=fp8_rowwise", "model.n_dense_layers=1",
                         "mxfp8.targets=blocks.0.*"])


@pytest.mark.parametrize("world, overrides, message", [
    (3, ["parallel.pp=2"], "world size 3 is not divisible by parallel.pp=2"),
    (4, ["parallel.pp=2", "parallel.ep=4"],
     "parallel.ep=4 does not divide the data-parallel size 2 (world size 4 / parallel.pp=2)"),
    (6, ["parallel.ep=3", "train.global_batch=12", "train.micro_batch=1"],
     "model.n_experts=4 is not divisible by parallel.ep=3"),
    (2, ["train.global_batch=6", "train.micro_batch=2"],
     "train.global_batch=6 is not divisible by data-parallel size 2 x train.micro_batch=2"),
    (4, ["parallel.pp=4"], "model.n_layers=2 is fewer than the 4 pipeline stages"),
    (2, ["parallel.pp=2", "parallel.pp_virtual_stages=2", "model.n_layers=4",
         "train.global_batch=6"],
     "parallel.pp_virtual_stages=2 needs the microbatches per rank (3 = train.global_batch"),
])
def test_impossible_layouts(world, overrides, message):
    cfg = load_config("tiny", overrides)
    with pytest.raises(ConfigError) as e:
        validate_layout(cfg, world)
    assert message in str(e.value)


@pytest.mark.parametrize("ddp_mode", ["all_reduce", "reduce_scatter"])
def test_cuda_graphs_take_several_data_parallel_ranks(ddp_mode):
    # The gradient reductions (and the balancing counts' all-reduce) run inside the graphs.
    cfg = load_config("tiny", ["train.cuda_graphs=true", f"parallel.ddp_mode={ddp_mode}",
                               "train.global_batch=8"])
    assert validate_layout(cfg, 4).dp == 4


def test_cuda_graphs_take_expert_parallelism_on_the_rowwise_transport():
    cfg = load_config("tiny", ["train.cuda_graphs=true", "parallel.ep=2", "parallel.ep_backend=rowwise"])
    assert validate_layout(cfg, 4).ep_dp == 2


@pytest.mark.parametrize("recipe, gemm", [("mxfp8", "emulated"), ("fp8_rowwise", "native"),
                                          ("fp8_rowwise_gw_hp", "native"), ("fp8_rowwise", "triton"),
                                          ("fp8_blockwise", "triton")])
def test_cuda_graphs_take_low_precision_experts_without_host_reads(recipe, gemm):
    # The weight caches refresh in place; emulated MXFP8 runs torch._grouped_mm on CUDA.
    cfg = load_config("tiny", ["train.cuda_graphs=true", "mxfp8.targets=experts",
                               f"mxfp8.recipe={recipe}", f"mxfp8.gemm={gemm}"])
    assert cfg.train.cuda_graphs and cfg.mxfp8.recipe == recipe


@pytest.mark.parametrize("recipe, gemm, needs", [("fp8_rowwise", "native", "9.x"),
                                                 ("fp8_blockwise", "triton", "8.9 or up"),
                                                 ("mxfp8", "native", "10.x")])
def test_a_gpu_gemm_on_a_cpu_run_is_refused_in_one_line(recipe, gemm, needs):
    from pretrain.build import refuse_unavailable_native_gemm

    cfg = load_config("tiny", ["train.device=cpu", "mxfp8.targets=experts", f"mxfp8.recipe={recipe}",
                               f"mxfp8.gemm={gemm}"])
    with pytest.raises(ConfigError, match=f"mxfp8.gemm={gemm} with mxfp8.recipe={recipe} needs a "
                                          f"GPU of compute capability {needs}.*train.device=cpu"):
        refuse_unavailable_native_gemm(cfg, torch.device("cpu"))
    refuse_unavailable_native_gemm(load_config("tiny", ["train.device=cpu", "mxfp8.targets=experts",
                                                        f"mxfp8.recipe={recipe}"]),
                                   torch.device("cpu"))  # emulated: runs anywhere


def test_a_gpu_dense_gemm_on_a_cpu_run_is_refused_naming_dense_gemm():
    from pretrain.build import refuse_unavailable_native_gemm

    cfg = load_config("tiny", ["train.device=cpu", "mxfp8.targets=[experts,head]",
                               "mxfp8.recipe=fp8_rowwise_gw_hp", "mxfp8.dense_gemm=native"])
    with pytest.raises(ConfigError, match="^mxfp8.dense_gemm=native with mxfp8.recipe=fp8_rowwise_gw_hp "
                                          "needs a GPU of compute capability 9.x.*train.device=cpu"):
        refuse_unavailable_native_gemm(cfg, torch.device("cpu"))


def test_emulated_dense_gemms_are_refused_under_cuda_graphs():
    with pytest.raises(ConfigError, match="train.cuda_graphs is not supported with mxfp8.recipe="
                                          "fp8_rowwise_gw_hp and mxfp8.dense_gemm=emulated: the "
                                          "emulated FP8 GEMMs read"):
        load_config("tiny", ["train.cuda_graphs=true", "mxfp8.targets=[experts,head]",
                             "mxfp8.recipe=fp8_rowwise_gw_hp", "mxfp8.gemm=triton",
                             "mxfp8.dense_gemm=emulated"])
    cfg = load_config("tiny", ["train.cuda_graphs=true", "mxfp8.targets=[experts,head]",
                               "mxfp8.recipe=fp8_rowwise_gw_hp", "mxfp8.gemm=triton",
                               "mxfp8.dense_gemm=native"])
    assert cfg.mxfp8.resolved_dense_gemm == "native"


def test_fp8_weight_gradients_without_their_native_gemm_are_refused_under_cuda_graphs(monkeypatch):
    """fp8_rowwise on the Triton GEMM still runs its FP8 weight gradients natively, else
    emulated (host reads): on a GPU without the native GEMM, graphs are refused in one line."""
    import moe_mxfp8
    from pretrain.build import refuse_unavailable_native_gemm

    monkeypatch.setattr(moe_mxfp8, "fp8_triton_available", lambda device: True)
    monkeypatch.setattr(moe_mxfp8, "fp8_native_available", lambda device: False)
    cuda = torch.device("cuda", 0)
    common = ["mxfp8.targets=experts", "mxfp8.gemm=triton"]
    with pytest.raises(ConfigError, match="mxfp8.recipe=fp8_rowwise with mxfp8.gemm=triton runs its "
                                          "FP8 weight gradients natively.*train.cuda_graphs"):
        refuse_unavailable_native_gemm(
            load_config("tiny", [*common, "mxfp8.recipe=fp8_rowwise", "train.cuda_graphs=true"]), cuda)
    for ok in (["mxfp8.recipe=fp8_rowwise"], ["mxfp8.recipe=fp8_rowwise_gw_hp", "train.cuda_graphs=true"],
               ["mxfp8.recipe=fp8_blockwise", "train.cuda_graphs=true"]):
        refuse_unavailable_native_gemm(load_config("tiny", [*common, *ok]), cuda)


def test_layout_derives_dp_and_ep_dp():
    cfg = load_config("tiny", ["parallel.pp=2", "parallel.ep=2", "train.global_batch=8",
                               "train.micro_batch=1"])
    layout = validate_layout(cfg, 8)
    assert (layout.pp, layout.dp, layout.ep, layout.ep_dp, layout.microbatches) == (2, 4, 2, 2, 2)
    assert cfg.parallel.resolved_ep_backend(cfg.train.cuda_graphs) == "all_to_all"


def test_auto_ep_backend_is_the_transport_cuda_graphs_can_hold():
    """EP with train.cuda_graphs (bench-1gpu has it on) takes the rowwise transport; a run
    that asks for all_to_all with graphs is refused naming rowwise."""
    cfg = load_config("bench-1gpu", ["parallel.ep=2"])
    assert cfg.train.cuda_graphs
    assert validate_layout(cfg, 2).ep == 2
    assert cfg.parallel.resolved_ep_backend(cfg.train.cuda_graphs) == "rowwise"
    assert load_config("bench-1gpu").parallel.resolved_ep_backend(True) == "local"  # ep 1
    with pytest.raises(ConfigError, match="use parallel.ep_backend=rowwise"):
        load_config("bench-1gpu", ["parallel.ep=2", "parallel.ep_backend=all_to_all"])


def test_mxfp8_targets_round_trip(tmp_path):
    cfg = load_config("tiny", ["mxfp8.targets=experts,attn.w?"])
    assert cfg.mxfp8.targets == ("experts", "attn.w?")
    assert load_config("tiny").mxfp8.targets == ()  # off by default
    path = tmp_path / "run.toml"
    path.write_text(config_toml(cfg))
    assert load_config(str(path)) == cfg


@pytest.mark.parametrize(("overrides", "message"), [
    (["parallel.merge_expert_grad_microbatches=5"], "must be 1 to 4"),
    (["parallel.merge_expert_grad_microbatches=0"], "must be 1 to 4 or auto"),
    (["parallel.merge_expert_grad_microbatches=2", "parallel.fuse_grad_accumulation=false"],
     "needs parallel.fuse_grad_accumulation"),
])
def test_merged_expert_grads_need_the_fused_path_and_at_most_four(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", overrides).validate()


def test_merged_expert_grads_auto_parses_and_round_trips(tmp_path):
    cfg = load_config("tiny", ["parallel.merge_expert_grad_microbatches=auto"])
    assert cfg.parallel.merge_expert_grad_microbatches == "auto"
    # auto with the fused path off is not refused: it resolves to 1
    load_config("tiny", ["parallel.merge_expert_grad_microbatches=auto",
                         "parallel.fuse_grad_accumulation=false"]).validate()
    path = tmp_path / "run.toml"
    path.write_text(config_toml(cfg))
    assert load_config(str(path)) == cfg
    with pytest.raises(ConfigError, match="expects an integer or one of auto, got 'most'"):
        load_config("tiny", ["parallel.merge_expert_grad_microbatches=most"])


@pytest.mark.parametrize(("key", "choices"), [
    ("model.router_score", "softmax, sigmoid"),
    ("model.lb_loss_granularity", "microbatch, global_batch"),
    ("model.recompute", "none, block, selective"),
    ("model.grouped_mm_backend", "auto, grouped_mm, triton, loop"),
    ("model.attention_backend", "auto, cudnn, flash"),
])
def test_a_package_literal_field_refuses_a_bad_value_listing_its_choices(key, choices):
    """Package-owned enum-like fields are typed Literal: the app's coercion names the
    choices (one line, before the package's own validation) and the reference lists them."""
    with pytest.raises(ConfigError, match=f"^{key} expects one of {choices}, got 'bogus'$"):
        load_config("tiny", [f"{key}=bogus"])
    line = next(ln for ln in config_toml(load_config("tiny")).splitlines()
                if ln.startswith(key.split(".")[1] + " = "))
    assert choices.replace(", ", " | ") in line


def test_a_renamed_key_is_refused_naming_its_new_key(tmp_path):
    message = ("config key 'parallel.fuse_expert_grad_accumulation' was renamed "
               "'parallel.fuse_grad_accumulation'; set that instead")
    with pytest.raises(ConfigError, match=f"^{message}$"):
        load_config("tiny", ["parallel.fuse_expert_grad_accumulation=false"])
    path = tmp_path / "run.toml"
    path.write_text("[parallel]\nfuse_expert_grad_accumulation = false\n")
    with pytest.raises(ConfigError, match=f"run.toml: {message}$"):
        load_config(str(path))
    assert not load_config("tiny", ["parallel.fuse_grad_accumulation=false"]).parallel.fuse_grad_accumulation


@pytest.mark.parametrize("text", ["runs/\U0001F680-launch", 'a "quoted" \\ path', "tab\tnew\nline\x7f\x01 caf\u00e9"])
def test_strings_round_trip_through_the_written_toml(text):
    """Characters past U+FFFF (JSON would write surrogate pairs, which TOML refuses), quotes,
    backslashes and control characters."""
    @dataclass
    class Tree:
        name: str = ""

    back = Tree()
    apply_tree(back, tomllib.loads(annotated_toml(Tree(text))))
    assert back.name == text
