"""The step-time model: textbook collective volumes, moe_pp's bubbles, FLOPs against
moe_model's MFU convention, the bundled profile against a recorded step, the ranking,
and ``pretrain plan --time`` / ``pretrain calibrate`` on the command line (CPU)."""

from __future__ import annotations

import importlib
import json
from dataclasses import replace
from pathlib import Path

import pytest
from moe_ddp import sent_bytes
from moe_model import MoEConfig, flops_per_token
from moe_pp import Costs, make_schedule, simulate
from pretrain import planner
from pretrain.cli import main
from pretrain.config import load_config
from pretrain.planner import PlanRequest, load_profile, predict_step
from pretrain.planner.comm import (
    Fabric,
    Group,
    all_gather_bytes,
    all_to_all_bytes,
    reduce_scatter_bytes,
    ring_all_reduce_bytes,
)
from pretrain.planner.profile import Link, Profile, parse_link
from pretrain.planner.step_time import pipeline_bubble, remote_reach
from pretrain.planner.sweep import FamilyMember, sweep_time

NBYTES = 3 * 2**20


@pytest.mark.parametrize("group", [2, 3, 4, 8, 64])
def test_collective_volumes_are_the_textbook_ring_volumes(group):
    assert ring_all_reduce_bytes(NBYTES, group) == pytest.approx(2 * (group - 1) / group * NBYTES)
    assert reduce_scatter_bytes(NBYTES, group) == pytest.approx((group - 1) / group * NBYTES)
    assert all_gather_bytes(NBYTES, group) == pytest.approx((group - 1) / group * NBYTES)
    assert all_to_all_bytes(NBYTES, group) == pytest.approx((group - 1) / group * NBYTES)
    # moe_ddp's own byte counter (what it compares its modes with) agrees
    assert ring_all_reduce_bytes(NBYTES, group) == pytest.approx(
        sent_bytes("all_reduce", NBYTES, group), abs=1)
    assert reduce_scatter_bytes(NBYTES, group) == pytest.approx(
        sent_bytes("reduce_scatter", NBYTES, group), abs=1)
    assert ring_all_reduce_bytes(NBYTES, 1) == reduce_scatter_bytes(NBYTES, 1) == 0


NV, NET = Link(alpha_us=3.0, gb_per_s=300.0), Link(alpha_us=11.0, gb_per_s=40.0)


def test_collective_times_are_alpha_beta_on_the_link_the_group_uses():
    fabric = Fabric(NV, NET, gpus_per_node=8)
    inside, across = Group(8, 1), Group(4, 8)  # ranks 0..7; ranks 0, 8, 16, 24
    assert fabric.all_reduce(NBYTES, inside) == pytest.approx(
        14 * 3e-6 + 2 * 7 / 8 * NBYTES / 300e9)
    assert fabric.reduce_scatter(NBYTES, across) == pytest.approx(
        3 * 11e-6 + 3 / 4 * NBYTES / 40e9)
    assert fabric.all_gather(NBYTES, Group(16, 1)) == pytest.approx(
        15 * 11e-6 + 15 / 16 * NBYTES / 40e9)  # two nodes: the ring is paced by the network
    # all-to-all over two nodes of 8: 7 peers on NVLink, 8 on the network, at once
    share = NBYTES / 16
    assert fabric.all_to_all(NBYTES, Group(16, 1)) == pytest.approx(
        max(7 * 3e-6 + 7 * share / 300e9, 8 * 11e-6 + 8 * share / 40e9))
    assert fabric.all_to_all(NBYTES, inside) == pytest.approx(
        7 * 3e-6 + 7 / 8 * NBYTES / 300e9)
    assert fabric.all_to_all(NBYTES, inside, efficiency=0.5) == pytest.approx(
        7 * 3e-6 + 7 / 8 * NBYTES / 150e9)


@pytest.mark.parametrize("schedule,pp,virtual,m,f,b,w", [
    ("1f1b", 4, 1, 8, 2, 2, 2), ("gpipe", 4, 1, 8, 2, 3, 1), ("1f1b", 2, 1, 16, 3, 2, 4),
    ("1f1b", 4, 2, 8, 2, 2, 2), ("zero_bubble", 4, 1, 8, 2, 2, 2),
    ("zero_bubble", 3, 1, 6, 4, 3, 3),
])
def test_bubble_is_moe_pp_simulators(schedule, pp, virtual, m, f, b, w):
    sim = simulate(make_schedule(schedule, pp, virtual, m), Costs(F=f, B=b, W=w))
    expected = max(sim.bubble_fraction(r) for r in range(pp))
    share = pipeline_bubble(schedule, pp, virtual, m, f * 0.001, b * 0.001, w * 0.001)
    if schedule == "zero_bubble":
        assert share == pytest.approx(expected)
    else:  # a full backward costs B + W; the ticks split it evenly (same sum)
        half = (b + w) // 2
        even = simulate(make_schedule(schedule, pp, virtual, m), Costs(F=f, B=half, W=b + w - half))
        assert share == pytest.approx(max(even.bubble_fraction(r) for r in range(pp)))
    if schedule in ("1f1b", "gpipe") and virtual == 1:  # the textbook (pp-1) / (m+pp-1)
        assert share == pytest.approx((pp - 1) / (m + pp - 1))


def _flat_profile(rate: float = 500.0) -> Profile:
    """Every GEMM and attention at one FLOP rate (the backward's 2.5x FLOPs at 2.5/2 of it),
    nothing else costing time."""
    return Profile(name="flat", source="test", device="none", peak_tflops=rate,
                   dense_gemm_tflops=rate, expert_gemm_tflops=rate, expert_gemm_half_rows=0.0,
                   attention_fwd_tflops=rate, attention_bwd_tflops=1.25 * rate,
                   memory_gb_per_s=1e12, kernel_gap_us_graphs=0.0, kernel_gap_us_eager=0.0,
                   host_launch_us=0.0, gpu_gib=140.0,
                   links={"nvlink": Link(0.0, 1e9), "network": Link(0.0, 1e9)})


MODEL = MoEConfig(vocab_size=512, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32,
                  n_experts=8, top_k=2, expert_hidden=64, n_shared_experts=1, n_dense_layers=1)


def test_gemm_and_attention_time_is_moe_models_mfu_flops():
    """With every rate equal, GEMMs and attention take flops_per_token x tokens / rate
    (less the norms' weights, which flops_per_token counts as multiply-adds)."""
    req = PlanRequest(model=MODEL, world=1, micro_batch=2, seq_len=64, global_batch=6)
    st = predict_step(req, _flat_profile(), cuda_graphs=True)
    tokens = 6 * 64
    norms = MODEL.n_layers * (2 * MODEL.d_model + 2 * MODEL.head_dim) + MODEL.d_model
    expected = (flops_per_token(MODEL, 64) - 6 * norms) * tokens / 500e12
    got = sum(st.compute[k] for k in ("expert_gemm", "dense_gemm", "attention"))
    assert got == pytest.approx(expected, rel=1e-9)
    assert st.step_s == pytest.approx(st.compute_s + st.exposed_comm_s + st.bubble_s)
    assert st.tokens_per_s == pytest.approx(tokens / st.step_s)


def test_recompute_and_graphs_and_skew_move_the_step_the_right_way():
    profile = load_profile("h200")
    base = PlanRequest(model=MODEL, world=2, ep=2, ep_backend="all_to_all", micro_batch=2,
                       seq_len=64, global_batch=8)
    st = predict_step(base, profile)
    assert predict_step(replace(base, model=replace(MODEL, recompute="block")),
                        profile).step_s > st.step_s
    assert predict_step(base, profile, cuda_graphs=True).step_s < st.step_s
    assert predict_step(base, profile, routing_skew=1.5).step_s > st.step_s
    assert st.exposed["ep_all_to_all"] > 0 and st.exposed["dp_grad_sync"] >= 0


def test_an_eager_step_takes_the_longer_of_host_and_device_per_microbatch():
    """Eager, a microbatch lasts max(its kernels x host_launch_us, its device time): the
    host runs ahead through the forward and the backward together; replayed from graphs,
    the host costs nothing."""
    from pretrain.planner.step_time import KERNELS_PER_BLOCK, KERNELS_PER_EDGE

    req = PlanRequest(model=MODEL, world=1, micro_batch=2, seq_len=64, global_batch=6)
    flat = _flat_profile()
    graphs = predict_step(req, flat, cuda_graphs=True)
    kernels = MODEL.n_layers * KERNELS_PER_BLOCK + KERNELS_PER_EDGE
    device_mb = (graphs.step_s - graphs.compute["optimizer"]
                 - graphs.compute["weight_rebuild"]) / req.microbatches
    for host_us in (0.5 * device_mb / kernels * 1e6, 3 * device_mb / kernels * 1e6):
        profile = replace(flat, host_launch_us=host_us)
        eager = predict_step(req, profile)
        assert predict_step(req, profile, cuda_graphs=True).step_s == graphs.step_s
        waited = max(0.0, kernels * host_us * 1e-6 - device_mb)
        assert eager.compute["launch_gaps"] == pytest.approx(req.microbatches * waited, rel=1e-6,
                                                             abs=1e-12)
        assert eager.step_s == pytest.approx(graphs.step_s + req.microbatches * waited, rel=1e-6)


@pytest.mark.parametrize("payload", ["mxfp8", "fp8_rowwise"])
def test_a_quantised_dispatch_payload_sends_its_packed_rows(payload):
    """The forward dispatch moves the codec's packed rows (scales included); the combine
    and both backward calls stay in the compute dtype, so the step saves exactly the
    dispatch's difference in bytes, over the link's bandwidth."""
    from pretrain.config import EP_PAYLOAD_CODECS
    from pretrain.planner.step_time import remote_reach

    gb_per_s = 100.0
    profile = replace(_flat_profile(), links={"nvlink": Link(0.0, gb_per_s),
                                             "network": Link(0.0, gb_per_s)},
                      ep_transport_efficiency=1.0)
    base = PlanRequest(model=MODEL, world=2, ep=2, ep_backend="all_to_all", micro_batch=2,
                       seq_len=64, global_batch=8)
    ep = {p: predict_step(replace(base, ep_payload=p), profile).comm["ep_all_to_all"]
          for p in ("compute", payload)}
    tokens = base.micro_batch * base.seq_len
    rows = tokens * remote_reach(MODEL.n_experts, MODEL.top_k, base.ep)  # sent to the other rank
    saved_per_row = 2 * MODEL.d_model - EP_PAYLOAD_CODECS[payload]().packed_width(MODEL.d_model)
    moe_layers = MODEL.n_layers - MODEL.n_dense_layers
    saved = base.microbatches * moe_layers * rows * saved_per_row / (gb_per_s * 1e9)
    assert saved > 0 and ep["compute"] - ep[payload] == pytest.approx(saved, rel=1e-9)
    with pytest.raises(ValueError, match="needs an EP transport"):
        PlanRequest(model=MODEL, world=1, ep_payload=payload)


def test_remote_reach_is_the_hypergeometric_expectation():
    assert remote_reach(64, 8, 1) == 0
    # two ranks of 32 experts: the other rank holds none of 8 distinct experts w.p. C(32,8)/C(64,8)
    assert remote_reach(64, 8, 2) == pytest.approx(1 - 10518300 / 4426165368)
    assert remote_reach(8, 1, 8) == pytest.approx(7 / 8)


def test_pipeline_bubble_enters_the_step():
    req = PlanRequest(model=MODEL, world=2, pp=2, micro_batch=1, seq_len=64, global_batch=4)
    st = predict_step(req, load_profile("h200"))
    busy = st.step_s - st.bubble_s - st.exposed_comm_s - st.compute["optimizer"] \
        - st.compute["weight_rebuild"]
    assert st.bubble_s > 0
    # 1F1B with 4 microbatches on 2 ranks: about (pp-1)/(m+pp-1) = 1/5 idle (stages differ)
    assert 0.1 < st.bubble_s / (busy + st.bubble_s) < 0.3


def test_bundled_h200_profile_predicts_the_recorded_bench_step():
    """bench-1gpu replayed from graphs measured 106.1k-106.4k tok/s (docs/performance.md)."""
    cfg = load_config("bench-1gpu", [])
    st = predict_step(PlanRequest.from_config(cfg, 1), load_profile("h200"), cuda_graphs=True)
    assert st.tokens_per_s_per_gpu == pytest.approx(106.1e3, rel=0.10)


RESULTS = Path(__file__).resolve().parents[3] / "tools" / "results"


def _replayed_ep2_step_s(chunks: int, share: float) -> float:
    cfg = load_config("bench-2gpu", ["parallel.ep=2", "parallel.ep_backend=rowwise", "train.cuda_graphs=true",
                                     f"parallel.ep_overlap_chunks={chunks}"])
    profile = replace(load_profile("h200"), ep_comm_sm_share=share)
    return predict_step(PlanRequest.from_config(cfg, 2), profile, cuda_graphs=True).step_s


def test_bundled_comm_sm_share_is_the_fit_of_the_recorded_overlapped_steps():
    """The h200 profile's SM share of the EP communication stream makes the model's 2-chunk
    step over its unsplit one what two H200s measured (replayed, forced balanced routing);
    the 4-chunk step, not fitted, is then predicted within 3% of its measured ratio."""
    unsplit = json.loads((RESULTS / "train_step_bench-2gpu_graphs.json").read_text())
    overlap = json.loads((RESULTS / "train_step_bench-2gpu_graphs_overlap.json").read_text())["settings"]
    base = next(r for r in unsplit["runs"] if (r["method"], r["routing"]) == ("ep", "balanced"))["step_ms"]
    measured = {n: overlap[f"chunks={n}"]["runs"][0]["step_ms"] / base for n in (2, 4)}
    lo, hi = 0.0, 1.0  # the pipelined step grows with the share: bisect
    for _ in range(30):
        mid = (lo + hi) / 2
        if _replayed_ep2_step_s(2, mid) / _replayed_ep2_step_s(1, mid) < measured[2]:
            lo = mid
        else:
            hi = mid
    share = load_profile("h200").ep_comm_sm_share
    assert share == pytest.approx(lo, abs=0.01)
    assert _replayed_ep2_step_s(4, share) / _replayed_ep2_step_s(1, share) == pytest.approx(measured[4], abs=0.03)


def test_profiles_load_and_bad_ones_are_named(tmp_path):
    h200 = load_profile("h200")
    assert h200.source and h200.device == "NVIDIA H200"  # says where its figures come from
    assert Profile.from_json(json.loads(json.dumps(h200.to_json()))) == h200
    assert load_profile("b200").links["nvlink"].gb_per_s > h200.links["nvlink"].gb_per_s
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({**h200.to_json(), "dense_gemm_tflop": 1}))
    with pytest.raises(ValueError, match=r"p\.json: unknown key 'dense_gemm_tflop'"):
        load_profile(bad)
    bad.write_text(json.dumps({**h200.to_json(), "memory_gb_per_s": -1}))
    with pytest.raises(ValueError, match="memory_gb_per_s"):
        load_profile(bad)
    bad.write_text(json.dumps({**h200.to_json(), "sm_count": 0}))
    with pytest.raises(ValueError, match="sm_count must be an integer >= 1"):
        load_profile(bad)
    bad.write_text(json.dumps({**h200.to_json(), "ep_comm_sm_share": 1.5}))
    with pytest.raises(ValueError, match=r"ep_comm_sm_share must be in \[0, 1\]"):
        load_profile(bad)
    with pytest.raises(ValueError, match="no profile 'h300'"):
        load_profile("h300")
    assert parse_link("network=ib-xdr-800")[1].gb_per_s == 90.0
    assert parse_link("nvlink=2,100") == ("nvlink", Link(2.0, 100.0))
    with pytest.raises(ValueError, match="CLASS"):
        parse_link("nvswitch=2,100")


SMALL_FAMILY = (FamilyMember("small-a", replace(MODEL, n_dense_layers=0), "-"),
                FamilyMember("small-b", replace(MODEL, n_experts=16, n_dense_layers=0), "-"))


def test_time_sweep_ranks_by_tokens_per_s_deterministically():
    profile = load_profile("h200")
    first = sweep_time(profile, SMALL_FAMILY, (16, 32), gpu_gib=4.0)
    again = sweep_time(profile, SMALL_FAMILY, (16, 32), gpu_gib=4.0)
    key = [[(t.plan.request.pp, t.plan.request.ep, t.plan.request.model.recompute)
            for t in r.ranked] for r in first]
    assert key == [[(t.plan.request.pp, t.plan.request.ep, t.plan.request.model.recompute)
                    for t in r.ranked] for r in again]
    for result in first:
        assert result.ranked and all(t.plan.fits for t in result.ranked)
        speeds = [t.time.tokens_per_s for t in result.ranked]
        assert speeds == sorted(speeds, reverse=True)


def test_time_sweep_breaks_ties_by_layout_preference(monkeypatch):
    sweep_module = importlib.import_module("pretrain.planner.sweep")
    real = sweep_module.predict_step
    monkeypatch.setattr(sweep_module, "predict_step", lambda req, *a, **k: replace(
        real(req, *a, **k), step_s=1.0))
    result = sweep_time(load_profile("h200"), SMALL_FAMILY[:1], (16,), gpu_gib=4.0)[0]
    assert [t.preference for t in result.ranked] == sorted(t.preference for t in result.ranked)


def test_plan_time_prints_the_prediction_next_to_memory(capsys):
    assert main(["plan", "--config", "tiny", "--time"]) == 0
    out = capsys.readouterr().out
    assert "torch.cuda.max_memory_allocated should read" in out
    assert "predicted step time (profile h200-recorded; 1 GPU on 1 node of 8" in out
    assert "tokens/s per GPU, MFU" in out and "pipeline bubble" in out
    assert main(["plan", "--config", "tiny", "--gpus", "2", "--gpus-per-node", "1", "--time",
                 "--json", "--link", "network=ib-xdr-800", "parallel.ep=2"]) == 0
    data = json.loads(capsys.readouterr().out)
    st = data["step_time"]
    assert st["gpus_per_node"] == 1 and st["step_s"] == pytest.approx(
        st["compute_s"] + st["exposed_comm_s"] + st["bubble_s"])
    assert st["exposed"]["ep_all_to_all"] > 0


def test_plan_time_rejects_a_bad_profile_in_one_line(capsys, tmp_path):
    assert main(["plan", "--config", "tiny", "--time", "--profile", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "x.json does not exist" in err[0]
    assert main(["plan", "--config", "tiny", "--time", "--link", "network=1"]) == 2
    assert "--link 'network=1'" in capsys.readouterr().err
    assert main(["plan", "--config", "tiny", "--time", "--gpus-per-node", "0"]) == 2


@pytest.mark.parametrize("recipe", [["mxfp8.recipe=mxfp8"], ["mxfp8.recipe=fp8_rowwise_gw_hp",
                                                              "mxfp8.gemm=native"]])
def test_plan_time_refuses_low_precision_experts_in_one_line(capsys, recipe):
    """Not timed as if the experts ran in BF16; the memory plan alone still runs."""
    overrides = ["mxfp8.targets=[experts]", *recipe]
    assert main(["plan", "--config", "tiny", "--time", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "mxfp8.targets=['experts']" in err[0] and "2 layers" in err[0]
    assert main(["plan", "--config", "tiny", *overrides]) == 0
    # attention-only targets leave the experts in BF16: timed
    assert main(["plan", "--config", "tiny", "--time", "mxfp8.targets=[attn.wq]"]) == 0


def test_plan_sweep_time_prints_ranked_layouts(capsys, monkeypatch):
    monkeypatch.setattr(planner, "FAMILY", SMALL_FAMILY)
    monkeypatch.setattr(planner, "GPU_COUNTS", (16,))
    assert main(["plan", "--sweep", "--time", "--gpu-gib", "4", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "predictions, not measurements" in out and "small-b" in out
    assert main(["plan", "--sweep", "--time", "--gpu-gib", "4", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["model"] for r in rows} == {"small-a", "small-b"}
    for model in ("small-a", "small-b"):
        speeds = [r["tokens_per_s_per_gpu"] for r in rows if r["model"] == model]
        assert speeds == sorted(speeds, reverse=True)


def test_expert_rate_fit_recovers_the_curve():
    from pretrain.planner.calibrate import fit_expert_rate

    rates = [(m, 640.0 * m / (m + 96.0)) for m in (128, 512, 2048)]
    peak, half = fit_expert_rate(rates)
    assert peak == pytest.approx(640.0) and half == pytest.approx(96.0)
    assert fit_expert_rate([(128, 500.0), (512, 480.0)]) == (500.0, 0.0)  # falling: flat fit


def test_calibrate_refuses_bad_input_in_one_line(capsys, tmp_path):
    assert main(["calibrate", "--out", str(tmp_path / "no" / "p.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0]
    assert main(["calibrate", "--out", str(tmp_path / "p.json"), "--link", "x=1,2"]) == 2
    assert not (tmp_path / "p.json").exists()


@pytest.mark.slow
def test_calibrate_on_cpu_writes_a_profile_plan_reads(capsys, tmp_path):
    out = tmp_path / "cpu.json"
    assert main(["calibrate", "--device", "cpu", "--out", str(out), "--link",
                 "network=ib-xdr-800"]) == 0
    profile = load_profile(out)
    assert profile.device == "cpu" and profile.links["network"].gb_per_s == 90.0
    assert main(["plan", "--config", "tiny", "--time", "--profile", str(out)]) == 0
    assert "cpu calibrated" in capsys.readouterr().out


def test_a_skewed_ep_rank_runs_at_most_its_capacity():
    """Capacity factor 1.25: the busiest rank's rows stop growing at 1.25x the mean."""
    model = replace(MODEL, capacity_factor=1.25, n_dense_layers=0)
    req = PlanRequest(model=model, world=2, ep=2, ep_backend="all_to_all", micro_batch=2,
                      seq_len=64, global_batch=8)
    profile = replace(_flat_profile(), expert_gemm_half_rows=0.0)
    mean, capped, over = (predict_step(req, profile, routing_skew=k).compute["expert_gemm"]
                          for k in (1.0, 1.25, 2.0))
    assert capped == pytest.approx(1.25 * mean) and over == pytest.approx(capped)


# EP overlap (parallel.ep_overlap_chunks): moe_ep_transport.pipeline's two-stream schedule


@pytest.mark.parametrize("first,work,last,share,makespan", [
    # D0 [0,1], D1 [1,2]; X0 [1,4], X1 [4,7]; C0 [4,5], C1 [7,8]
    (1.0, [3.0] * 2, 1.0, 0.0, 8.0),
    # D0 [0,3], D1 [3,6]; X0 [3,4], X1 [6,7]; C0 [6,8] (after D1), C1 [8,10]
    (3.0, [1.0] * 2, 2.0, 0.0, 10.0),
    # X0 at half rate under D1 ([1,2]: 0.5 done), alone to 4.5; X1 at half rate under
    # C0 ([4.5,5.5]: 0.5 done), alone to 8; C1 [8,9]
    (1.0, [3.0] * 2, 1.0, 0.5, 9.0),
    # D0 D1 D2 [0,3]; X0 [1,3]; C0 [3,4]; D3 [4,5]; X1 [3,5]; C1 [5,6]; X2 [5,7];
    # C2 [7,8]; X3 [7,9]; C3 [9,10]
    (1.0, [2.0] * 4, 1.0, 0.0, 10.0),
    # D0 D1 D2 [0,3]; X0 [1,3.5]; C0 [3.5,6.5]; D3 [6.5,7.5]; X1 [3.5,6]; C1 [7.5,10.5];
    # X2 [6,8.5]; C2 [10.5,13.5]; X3 [8.5,11]; C3 [13.5,16.5]
    (1.0, [2.5] * 4, 3.0, 0.0, 16.5),
    # every SM to the calls: the GEMMs run only while the stream waits for them (serial)
    (1.0, [2.0] * 4, 1.0, 1.0, 16.0),
    # a backward with the merged weight gradients in the last chunk: F0 [0,1], F1 [1,2];
    # X0 [1,2]; L0 [2,3]; X1 [2,5]; L1 [5,6]
    (1.0, [1.0, 3.0], 1.0, 0.0, 6.0),
])
def test_pipelined_layer_is_the_hand_computed_schedule(first, work, last, share, makespan):
    from pretrain.planner.step_time import pipelined_layer_s

    assert pipelined_layer_s(first, work, last, share) == pytest.approx(makespan, rel=1e-12)


@pytest.mark.parametrize("share", [0.0, 0.3, 1.0])
def test_one_chunk_is_the_serial_layer(share):
    from pretrain.planner.step_time import pipelined_layer_s

    assert pipelined_layer_s(0.7, [2.9], 1.3, share) == pytest.approx(0.7 + 2.9 + 1.3, rel=1e-15)


def _ep_request(**kw) -> PlanRequest:
    return PlanRequest(model=replace(MODEL, n_dense_layers=0), world=2, ep=2,
                       ep_backend="rowwise", micro_batch=2, seq_len=64, global_batch=8, **kw)


def test_one_chunk_keeps_every_ep_call_exposed():
    """ep_overlap_chunks=1 is today's prediction: the four calls, each ``alpha + bytes /
    bandwidth``, on the critical path, nothing hidden; the compute is the one an
    infinitely fast link gives."""
    gb_per_s = 100.0
    link = Link(0.0, gb_per_s)
    profile = replace(_flat_profile(), links={"nvlink": link, "network": link})
    fast = replace(profile, links={"nvlink": Link(0.0, 1e30), "network": Link(0.0, 1e30)})
    req = _ep_request(ep_combine="source")
    st = predict_step(req, profile, cuda_graphs=True)
    assert st.exposed["ep_all_to_all"] == st.comm["ep_all_to_all"]
    tokens, D = req.micro_batch * req.seq_len, MODEL.d_model
    slots = tokens * MODEL.top_k / 2  # routed to the other rank's experts (uniform)
    sent = tokens * remote_reach(MODEL.n_experts, MODEL.top_k, 2)  # a token once per rank
    calls = (sent + 3 * slots) * 2 * D / (gb_per_s * 1e9)  # dispatch, combine, 2 backward
    moe = req.microbatches * MODEL.n_layers * calls
    assert st.comm["ep_all_to_all"] == pytest.approx(moe, rel=1e-12)
    free = predict_step(req, fast, cuda_graphs=True)
    assert st.compute == pytest.approx(free.compute, rel=1e-12)
    assert st.exposed_comm_s - free.exposed_comm_s == pytest.approx(
        moe + sum(st.exposed[k] - free.exposed[k] for k in st.exposed if k != "ep_all_to_all"),
        rel=1e-12)


def test_chunks_without_communication_cost_only_their_launches():
    """Links that cost nothing, GEMMs at one rate whatever their rows: n chunks add
    (n - 1) chunks' launches per MoE layer and pass, at the profile's gap each."""
    from pretrain.planner.step_time import KERNELS_PER_CHUNK_BACKWARD, KERNELS_PER_CHUNK_FORWARD

    free = Link(0.0, 1e30)
    profile = replace(_flat_profile(), kernel_gap_us_graphs=1.0,
                      links={"nvlink": free, "network": free})
    one = predict_step(_ep_request(), profile, cuda_graphs=True)
    for n in (2, 4):
        st = predict_step(_ep_request(ep_overlap_chunks=n), profile, cuda_graphs=True)
        extra = (_ep_request().microbatches * MODEL.n_layers * (n - 1)
                 * (KERNELS_PER_CHUNK_FORWARD + KERNELS_PER_CHUNK_BACKWARD) * 1e-6)
        assert st.compute["expert_gemm"] == pytest.approx(one.compute["expert_gemm"], rel=1e-12)
        assert st.step_s - one.step_s == pytest.approx(extra, rel=1e-6)


def test_chunks_hide_the_calls_behind_the_gemms_unless_the_calls_take_every_sm():
    """bench-2gpu as EP2: its calls and GEMMs are long enough to hide one behind the other
    (the tiny model's are latency: there chunks only add)."""
    profile = load_profile("h200")
    cfg = load_config("bench-2gpu", ["parallel.ep=2", "parallel.ep_backend=rowwise"])
    base = PlanRequest.from_config(cfg, 2)

    def ep_request(**kw):
        return replace(base, **kw)

    one = predict_step(ep_request(), profile, cuda_graphs=True)
    two = predict_step(ep_request(ep_overlap_chunks=2), profile, cuda_graphs=True)
    assert two.step_s < one.step_s
    assert two.exposed["ep_all_to_all"] < one.exposed["ep_all_to_all"]
    # each chunk's call pays its latency again: more in all, less exposed
    assert two.comm["ep_all_to_all"] > one.comm["ep_all_to_all"]
    every = predict_step(ep_request(ep_overlap_chunks=2, ep_comm_sms=profile.sm_count),
                         profile, cuda_graphs=True)
    assert every.exposed["ep_all_to_all"] == pytest.approx(every.comm["ep_all_to_all"], rel=1e-9)
    bounded = [predict_step(ep_request(ep_overlap_chunks=2, ep_comm_sms=s), profile,
                            cuda_graphs=True).step_s for s in (8, 32, 96)]
    assert bounded == sorted(bounded)  # fewer SMs to the calls: faster GEMMs under them
    with pytest.raises(ValueError, match="ep_comm_sms must be >= 1"):
        _ep_request(ep_overlap_chunks=2, ep_comm_sms=0)


@pytest.mark.parametrize("share", [0.0, 0.25, 0.6, 1.0])
def test_the_sm_share_fit_recovers_the_share_of_a_pipelined_layer(share):
    from pretrain.planner.step_time import fit_comm_sm_share, pipelined_layer_s

    pipelined = pipelined_layer_s(0.5, [2.0] * 4, 0.5, share)
    assert fit_comm_sm_share(4.0, 8.0, pipelined, 4) == pytest.approx(share, abs=1e-9)
    assert fit_comm_sm_share(4.0, 8.0, 0.1, 4) == 0.0  # faster than any share: clamped


@pytest.mark.parametrize("calls, other, share, exposed", [
    (1.0, 3.0, 0.0, 0.0),  # under the other microbatch's compute, which keeps every SM
    (1.0, 3.0, 0.5, 0.5),  # the compute loses half its SMs while the calls run
    (4.0, 3.0, 0.0, 1.0),  # longer than the compute: the calls pace the pass
    (4.0, 3.0, 0.9, 3.6),
    (2.0, 5.0, 1.0, 2.0),  # every SM to the calls: nothing hidden
])
def test_interleaved_calls_hide_under_the_other_microbatch(calls, other, share, exposed):
    from pretrain.planner.step_time import interleaved_exposed_s

    assert interleaved_exposed_s(calls, other, share) == pytest.approx(exposed, rel=1e-12)


def test_microbatch_pairs_cover_all_but_the_last_and_an_odd_one_out():
    from pretrain.planner.step_time import paired_share

    assert [paired_share(n) for n in (1, 2, 3, 4, 5, 16)] == [0, 0, 2 / 3, 2 / 4, 4 / 5, 14 / 16]


def test_interleaved_pairs_hide_calls_unless_the_calls_take_every_sm():
    """bench-2gpu as EP2, 16 microbatches a rank: 14 interleaved. The calls cost what they
    cost unsplit; less of it is exposed, none hidden where the calls take every SM."""
    profile = load_profile("h200")
    base = PlanRequest.from_config(load_config("bench-2gpu", ["parallel.ep=2", "parallel.ep_backend=rowwise"]), 2)
    one = predict_step(base, profile, cuda_graphs=True)
    pairs = predict_step(replace(base, ep_overlap_microbatches=True), profile, cuda_graphs=True)
    assert pairs.comm["ep_all_to_all"] == pytest.approx(one.comm["ep_all_to_all"], rel=1e-12)
    assert pairs.exposed["ep_all_to_all"] < one.exposed["ep_all_to_all"]
    assert pairs.step_s == pytest.approx(
        one.step_s - (one.exposed["ep_all_to_all"] - pairs.exposed["ep_all_to_all"]), rel=1e-12)
    # the calls fit under the other microbatch's block, so each paired one exposes share x calls
    share = profile.ep_comm_sm_share
    assert pairs.exposed["ep_all_to_all"] == pytest.approx(
        one.exposed["ep_all_to_all"] * (14 / 16 * share + 2 / 16), rel=1e-9)
    every = predict_step(replace(base, ep_overlap_microbatches=True, ep_comm_sms=profile.sm_count),
                         profile, cuda_graphs=True)
    assert every.exposed["ep_all_to_all"] == pytest.approx(one.exposed["ep_all_to_all"], rel=1e-12)


def test_plan_time_reports_the_hidden_ep_time(capsys):
    assert main(["plan", "--config", "tiny", "--gpus", "2", "--time", "--json", "parallel.ep=2",
                 "parallel.ep_backend=rowwise", "parallel.ep_overlap_chunks=2"]) == 0
    st = json.loads(capsys.readouterr().out)["step_time"]
    assert 0 < st["exposed"]["ep_all_to_all"] < st["comm"]["ep_all_to_all"]
    assert main(["plan", "--config", "tiny", "--gpus", "2", "--time", "parallel.ep=2",
                 "parallel.ep_backend=rowwise", "parallel.ep_overlap_chunks=2"]) == 0
    assert "EP dispatch/combine, 2 chunks" in capsys.readouterr().out
    assert main(["plan", "--config", "tiny", "--gpus", "2", "--time", "parallel.ep=2",
                 "parallel.ep_backend=rowwise", "parallel.ep_overlap_microbatches=true",
                 "train.micro_batch=1"]) == 0
    assert "EP dispatch/combine, interleaved" in capsys.readouterr().out


@pytest.mark.parametrize("fused,ratio", [(False, 3 * 2 * 1.5 / 6), (True, (2 * 2 * 1.5 + 2) / 6)])
def test_chunked_expert_gemms_run_at_the_chunks_rate_but_merged_weight_gradients_do_not(
        fused, ratio):
    """64 rows per expert (128 tokens x top-2 over 4 local experts) at a half-rate size of
    64: the unsplit GEMMs run at 1/2 the peak, two chunks' at 1/3. Per layer, in units of
    the unsplit forward's FLOPs at the peak: one chunk 3 x 2 = 6; two chunks 3 x 2 x 1.5;
    with fused accumulation (moe_model's MergingSink) the weight gradients stay one launch
    over every chunk's rows: 2 x 2 x 1.5 + 2."""
    free = Link(0.0, 1e30)
    profile = replace(_flat_profile(), expert_gemm_half_rows=64.0,
                      links={"nvlink": free, "network": free})
    one = predict_step(_ep_request(fused_grad_accumulation=fused), profile, cuda_graphs=True)
    two = predict_step(_ep_request(ep_overlap_chunks=2, fused_grad_accumulation=fused), profile,
                       cuda_graphs=True)
    assert two.compute["expert_gemm"] == pytest.approx(ratio * one.compute["expert_gemm"],
                                                       rel=1e-12)
