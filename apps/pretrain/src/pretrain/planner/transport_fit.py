"""The EP transport's share of its link, fitted to a two-GPU transport benchmark.

``Profile.ep_transport_efficiency`` is the one figure of the step-time model that
only a run on two GPUs can measure: how much of a link's bandwidth (the profile's
``links``) the expert-parallel dispatch and combine reach. ``tools/bench_ep_transport.py``
measures the rowwise transport's dispatch + combine at several sizes and records, per
row, the bytes that cross the link (``moved_mib``: a token once per other rank holding
one of its experts, one FP32 partial per such token and rank back) and the time
(``ms``). Those are the bytes the model's ``_ep_calls`` counts for the same call, so
the share is their rate over the link's, once each call's latency is taken off.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pretrain.planner.profile import Link

# Rows the fit reads, best first: device time alone from CUDA graph replays (the model
# counts the host's launches separately), else the eager timing.
_BACKENDS = ("rowwise:graph", "rowwise")


def transport_rows(report: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """The report's rowwise rows of forced balanced routing (the model takes routing skew
    apart, as ``routing_skew``), CUDA-graph rows where it has them; ``ValueError`` naming
    ``where`` when it has none or they lack a field."""
    rows = report.get("rows") if isinstance(report, dict) else None
    if not isinstance(rows, list):
        raise ValueError(f"{where}: not a tools/bench_ep_transport.py report (no 'rows' list)")
    for backend in _BACKENDS:
        picked = [r for r in rows if isinstance(r, dict) and r.get("backend") == backend
                  and r.get("routing") == "balanced"]
        if picked:
            break
    else:
        raise ValueError(f"{where}: no rowwise rows of balanced routing "
                         f"(run tools/bench_ep_transport.py with --routing balanced)")
    for r in picked:
        for key in ("moved_mib", "ms"):
            if not (isinstance(r.get(key), (int, float)) and r[key] > 0):
                raise ValueError(f"{where}: row of {r.get('tokens')} tokens: {key} must be a "
                                 f"positive number, got {r.get(key)!r}")
    return picked


def ep_transport_efficiency(report: dict[str, Any], link: Link, where: str = "report") -> float:
    """The share of ``link``'s bandwidth the transport of ``report`` (a
    ``tools/bench_ep_transport.py`` JSON) reaches: the bytes moved over the time spent
    moving them at the link's rate, summed over the sizes (so the large, bandwidth-bound
    ones weigh most). A row's time less its two calls' latency (``alpha_us`` per other
    rank each) is its moving time; rows that leave none are latency-bound and skipped."""
    rows = transport_rows(report, where)
    peers = int(report.get("ranks", 2)) - 1
    if peers < 1:
        raise ValueError(f"{where}: ranks {report.get('ranks')!r}: the transport needs two or more")
    moved = moving = 0.0
    for r in rows:
        seconds = r["ms"] * 1e-3 - 2 * peers * link.alpha_us * 1e-6
        if seconds > 0:
            moved += r["moved_mib"] * 2**20
            moving += seconds
    if moving == 0:
        raise ValueError(f"{where}: every row is within the link's latency; no bandwidth to fit")
    return moved / moving / (link.gb_per_s * 1e9)


def load_transport_report(path: Path) -> dict[str, Any]:
    """A ``tools/bench_ep_transport.py`` JSON, checked (``ValueError`` naming the file)."""
    try:
        report = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
    transport_rows(report, str(path))
    return report
