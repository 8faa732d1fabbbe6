"""The step-time tools' CPU side: validate_step_time's dry run (every shape planned and
predicted, within an H200) and step_time_table's Markdown (marked as predictions)."""

from __future__ import annotations

from pathlib import Path

import pytest
from moe_testing import load_script

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def test_validate_step_time_dry_run_predicts_every_shape(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))  # the tool imports bench_train_step beside it
    tool = load_script(TOOLS / "validate_step_time.py")
    report = tool.main(["--dry-run", "--out", str(tmp_path / "v.json")])
    rows = report["rows"]
    assert {(r["case"], r["graphs"]) for r in rows} == {
        (s, g) for s in tool.SHAPES for g in ("on", "off")}
    for r in rows:
        assert r["predicted"]["fits"] and r["predicted"]["tokens_per_s"] > 0
        assert "measured" not in r
    by = {(r["case"], r["graphs"]): r["predicted"]["step_ms"] for r in rows}
    for shape in tool.SHAPES:  # graphs never slower than eager launches
        assert by[shape, "on"] <= by[shape, "off"]
    assert (tmp_path / "v.json").exists()


def test_validate_step_time_dry_run_predicts_the_two_gpu_layouts(monkeypatch):
    """On two GPUs the cases are bench-2gpu's DP2, EP2 and PP2, each planned as the
    benchmark builds it: EP2 exchanges tokens, PP2 has a bubble, DP2 neither."""
    monkeypatch.syspath_prepend(str(TOOLS))
    tool = load_script(TOOLS / "validate_step_time.py")
    rows = {r["case"]: r["predicted"] for r in tool.main(["--dry-run", "--world", "2"])["rows"]}
    assert set(rows) == {"dp2", "ep2", "pp2"}
    assert all(p["fits"] and p["tokens_per_s"] > 0 and not p["cuda_graphs"] for p in rows.values())
    assert rows["ep2"]["exposed_comm_ms"] > rows["dp2"]["exposed_comm_ms"]
    assert rows["pp2"]["bubble_ms"] > 0 == rows["dp2"]["bubble_ms"] == rows["ep2"]["bubble_ms"]


def test_validate_step_time_dry_run_predicts_ep2_pipelined(monkeypatch):
    """--ep-overlap-chunks adds EP2 with its transport pipelined: more EP time in all (a
    latency per chunk call), less of it exposed."""
    monkeypatch.syspath_prepend(str(TOOLS))
    tool = load_script(TOOLS / "validate_step_time.py")
    rows = {r["case"]: r for r in tool.main(["--dry-run", "--world", "2", "--ep-overlap-chunks",
                                             "2", "--ep-comm-sms", "16"])["rows"]}
    assert set(rows) == {"dp2", "ep2", "pp2", "ep2-overlap2"}
    assert rows["ep2-overlap2"]["overrides"] == ["parallel.ep_overlap_chunks=2",
                                                 "parallel.ep_comm_sms=16"]
    one, two = rows["ep2"]["predicted"], rows["ep2-overlap2"]["predicted"]
    assert one["ep_exposed_ms"] == one["ep_comm_ms"]
    assert two["ep_exposed_ms"] < one["ep_exposed_ms"] <= one["ep_comm_ms"] < two["ep_comm_ms"]
    with pytest.raises(SystemExit):
        tool.parse_args(["--ep-overlap-chunks", "1"])


def test_validate_step_time_scores_a_recorded_run_against_new_predictions(tmp_path, monkeypatch, capsys):
    """--measured: each case is scored against the recorded row of the same case, graphs
    and overrides (the two-H200 run in tools/results); a row measured otherwise is not."""
    import json

    monkeypatch.syspath_prepend(str(TOOLS))
    tool = load_script(TOOLS / "validate_step_time.py")
    recorded = TOOLS / "results" / "validate_step_time_2gpu.json"
    rows = {r["case"]: r for r in tool.main(["--dry-run", "--world", "2", "--measured", str(recorded)])["rows"]}
    measured = {r["case"]: r["measured"] for r in json.loads(recorded.read_text())["rows"]}
    assert set(rows) == {"dp2", "ep2", "pp2"}
    for case, row in rows.items():
        assert row["measured"] == measured[case]
        assert row["error"] == pytest.approx(row["predicted"]["tokens_per_s"]
                                             / measured[case]["tokens_per_s"] - 1, rel=1e-12)
    other = json.loads(recorded.read_text())
    other["rows"][0]["overrides"] = ["parallel.pp=4"]  # dp2 measured in another configuration
    (tmp_path / "other.json").write_text(json.dumps(other))
    rows = {r["case"]: r for r in tool.main(["--dry-run", "--world", "2", "--measured",
                                             str(tmp_path / "other.json")])["rows"]}
    assert "measured" not in rows["dp2"] and "measured" in rows["ep2"]
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(SystemExit, match="bad.json: not a validate_step_time report"):
        tool.main(["--dry-run", "--world", "2", "--measured", str(tmp_path / "bad.json")])
    with pytest.raises(SystemExit):
        tool.parse_args(["--measured", str(recorded)])  # scores a dry run only


@pytest.mark.slow
def test_step_time_table_marks_its_figures_as_predictions(tmp_path, monkeypatch):
    tool = load_script(TOOLS / "step_time_table.py")
    from pretrain.planner import FAMILY

    monkeypatch.setattr(tool, "FAMILY", FAMILY[:1])
    monkeypatch.setattr(tool, "GPU_COUNTS", (16,))
    tool.main(["--profiles", "h200", "--markdown", str(tmp_path / "t.md")])
    text = (tmp_path / "t.md").read_text()
    assert "not measurements" in text and "profile `h200-recorded`" in text
    assert "| tiny | 16 |" in text
