"""tools/sweep_figure8.py: which methods of a failed point failed and which never ran."""

from __future__ import annotations

from pathlib import Path

from moe_testing import load_script

TOOL = Path(__file__).resolve().parents[1] / "tools" / "sweep_figure8.py"


def test_after_a_failure_only_the_first_unmeasured_method_failed():
    sweep = load_script(TOOL)
    rows = sweep.unmeasured_rows("experts", 128, ["ddp", "ep", "fsdp2"], {"ddp"}, "OOM", "tail")
    assert [(r["method"], r["status"]) for r in rows] == [("ep", "OOM"), ("fsdp2", "not run")]
    assert rows[0]["error_tail"] == "tail" and rows[1]["after"] == "ep OOM"
    # the process failed in its first method: the rest never started
    rows = sweep.unmeasured_rows("experts", 8, ["ddp", "ep"], set(), "timeout", "")
    assert [r["status"] for r in rows] == ["timeout", "not run"]
    # no failure, yet no result: missing, not a failure
    rows = sweep.unmeasured_rows("experts", 8, ["ddp", "ep"], {"ddp"}, None, "")
    assert [(r["method"], r["status"]) for r in rows] == [("ep", "missing")]
    assert sweep.unmeasured_rows("experts", 8, ["ddp"], {"ddp"}, "error", "") == []
