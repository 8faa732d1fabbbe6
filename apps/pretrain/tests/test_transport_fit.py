"""The EP transport's share of NVLink fitted to a ``tools/bench_ep_transport.py`` report:
the fit against hand-made rows, its refusals, the recorded two-H200 run against the
step-time model's bytes and the bundled profiles, and ``pretrain calibrate --ep-transport``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pretrain.cli import main
from pretrain.planner import load_profile
from pretrain.planner.calibrate import EP_TRANSPORT_EFFICIENCY
from pretrain.planner.profile import Link
from pretrain.planner.step_time import remote_reach
from pretrain.planner.transport_fit import ep_transport_efficiency, load_transport_report

RECORDED = Path(__file__).resolve().parents[3] / "tools" / "results" / "ep_transport_2gpu.json"
LINK = Link(alpha_us=5.0, gb_per_s=100.0)


def _row(tokens: int, backend: str, moved_mib: float, share: float, routing: str = "balanced") -> dict:
    """A row whose time is two calls' latency plus ``moved_mib`` at ``share`` of LINK."""
    ms = 1e3 * (2 * LINK.alpha_us * 1e-6 + moved_mib * 2**20 / (share * LINK.gb_per_s * 1e9))
    return {"tokens": tokens, "routing": routing, "backend": backend, "moved_mib": moved_mib, "ms": ms}


def test_the_fit_recovers_the_share_of_graph_rows_of_balanced_routing():
    rows = [_row(t, "rowwise:graph", t / 64, 0.25) for t in (512, 8192, 65536)]
    noise = [_row(8192, "rowwise", 128.0, 0.9), _row(8192, "rowwise:graph", 100.0, 0.9, "zipf"),
             _row(8192, "nccl:graph", 256.0, 0.9), _row(8192, "rowwise:src:graph", 160.0, 0.9)]
    report = {"ranks": 2, "rows": noise[:2] + rows + noise[2:]}
    assert ep_transport_efficiency(report, LINK) == pytest.approx(0.25, rel=1e-12)
    # no graph rows: the eager ones
    eager = {"ranks": 2, "rows": [_row(t, "rowwise", t / 64, 0.4) for t in (512, 65536)]}
    assert ep_transport_efficiency(eager, LINK) == pytest.approx(0.4, rel=1e-12)
    # a row within the latency is skipped, not a negative time
    fast = {"ranks": 2, "rows": rows + [{**rows[0], "ms": 0.005}]}
    assert ep_transport_efficiency(fast, LINK) == pytest.approx(0.25, rel=1e-12)


@pytest.mark.parametrize(("report", "words"), [
    ({"rows": {}}, "no 'rows' list"),
    ({"rows": [_row(512, "rowwise:graph", 1.0, 0.5, "zipf")]}, "no rowwise rows of balanced"),
    ({"rows": [{**_row(512, "rowwise:graph", 1.0, 0.5), "ms": -1.0}]}, "ms must be a positive"),
    ({"rows": [{"tokens": 512, "routing": "balanced", "backend": "rowwise", "ms": 1.0}]},
     "moved_mib must be a positive"),
    ({"ranks": 2, "rows": [{**_row(512, "rowwise:graph", 1.0, 0.5), "ms": 0.001}]}, "within the link's latency"),
])
def test_the_fit_refuses_a_report_it_cannot_read_naming_it(report, words):
    with pytest.raises(ValueError, match=words) as e:
        ep_transport_efficiency(report, LINK, where="bench.json")
    assert str(e.value).startswith("bench.json: ")


def test_the_recorded_run_moves_the_bytes_the_step_time_model_counts():
    """moved = a token to the other rank once, one FP32 partial back (d_model 2048, BF16,
    top-8 of 64 on two ranks): the model's remote_reach x (2 + 4) x d_model per token; the
    bench's balanced routing reaches the other rank always, the model's uniform 99.6%."""
    report = load_transport_report(RECORDED)
    assert (report["d_model"], report["experts"], report["top_k"], report["ranks"]) == (2048, 64, 8, 2)
    reach = remote_reach(64, 8, 2)
    for r in report["rows"]:
        if r["backend"] == "rowwise:graph" and r["routing"] == "balanced":
            model_mib = r["tokens"] * reach * (2 + 4) * 2048 / 2**20
            assert r["moved_mib"] == pytest.approx(model_mib, rel=4e-3)


def test_the_bundled_share_is_the_fit_of_the_recorded_two_h200_run():
    share = ep_transport_efficiency(load_transport_report(RECORDED), load_profile("h200").links["nvlink"])
    assert share == pytest.approx(0.5008, abs=1e-4)
    assert EP_TRANSPORT_EFFICIENCY == load_profile("h200").ep_transport_efficiency == round(share, 2)


def test_calibrate_refuses_an_unreadable_transport_report_before_measuring(capsys, tmp_path):
    bad = tmp_path / "ep.json"
    bad.write_text("{not json")
    out = tmp_path / "p.json"
    assert main(["calibrate", "--device", "cpu", "--out", str(out), "--ep-transport", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(bad) in err[0] and "not JSON" in err[0]
    assert main(["calibrate", "--out", str(out), "--ep-transport", str(tmp_path / "none.json")]) == 2
    assert "none.json" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.slow
def test_calibrate_writes_the_share_fitted_to_the_given_run(capsys, tmp_path):
    ep = tmp_path / "ep.json"
    ep.write_text(json.dumps({"ranks": 2, "rows": [_row(65536, "rowwise:graph", 1024.0, 0.5)]}))
    out = tmp_path / "cpu.json"
    assert main(["calibrate", "--device", "cpu", "--out", str(out), "--link", "nvlink=5,100",
                 "--ep-transport", str(ep)]) == 0
    profile = load_profile(out)
    assert profile.ep_transport_efficiency == pytest.approx(0.5, rel=1e-9)
    assert "EP transport 0.5 of NVLink" in capsys.readouterr().out and "ep.json" in profile.source
