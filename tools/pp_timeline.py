"""Print each rank's pipeline schedule tick by tick, and its bubble fraction.

    uv run python tools/pp_timeline.py --schedule zero_bubble --pp 4 --microbatches 8
    uv run python tools/pp_timeline.py --schedule 1f1b --pp 4 --virtual 2 --microbatches 8 --png 1f1b.png
    tools/from_source.sh python3 tools/pp_timeline.py --schedule gpipe --pp 2 --microbatches 4

Cells read ``<kind><microbatch><chunk>``: ``F`` forward, ``B`` backward (input
gradient only in zero-bubble schedules, which also have ``W``, the weight
gradient), and with virtual stages a letter for the rank's chunk (``a`` first).
The timeline is the schedule's own simulation (the one the runtime orders its
messages by): zero-latency links, integer costs per action, ``F = B = W = 1`` by
default, a full backward ``B + W``. The bubble fraction is idle ticks over
ranks x makespan; "held" is the most microbatch-chunks whose activations a rank
keeps at once.
"""

from __future__ import annotations

import argparse
import string

from moe_pp import SCHEDULES, Costs, Timeline, make_schedule, simulate


def _label(kind: str, microbatch: int, stage: int, pp: int, virtual: int) -> str:
    chunk = string.ascii_lowercase[stage // pp] if virtual > 1 else ""
    return f"{kind}{microbatch}{chunk}"


def render(timeline: Timeline) -> str:
    """The per-rank tick rows and the per-rank summary table, as text."""
    schedule = timeline.schedule
    pp, virtual = schedule.pp, schedule.virtual
    rows: list[list[str]] = [["."] * timeline.makespan for _ in range(pp)]
    for rank, actions in enumerate(timeline.ranks):
        for t in actions:
            label = _label(t.action.kind, t.action.microbatch, t.action.stage, pp, virtual)
            for tick in range(t.start, t.end):
                rows[rank][tick] = label
    width = max(len(c) for row in rows for c in row) + 1
    lines = [
        f"schedule {schedule.name}  pp {pp}  virtual {virtual}  microbatches "
        f"{schedule.n_microbatches}  costs F={timeline.costs.F} B={timeline.costs.B} "
        f"W={timeline.costs.W}  makespan {timeline.makespan} ticks",
        "tick    " + "".join(str(t % 100).rjust(width) for t in range(timeline.makespan)),
    ]
    lines += [f"rank {r:<3}" + "".join(c.rjust(width) for c in row) for r, row in enumerate(rows)]
    lines += ["", f"{'rank':>4} {'busy':>6} {'idle':>6} {'bubble':>8} {'held':>5}"]
    for r in range(pp):
        busy = timeline.busy(r)
        lines.append(
            f"{r:>4} {busy:>6} {timeline.makespan - busy:>6} "
            f"{timeline.bubble_fraction(r):>7.1%} {timeline.peak_in_flight(r):>5}"
        )
    lines.append(f" all {'':>6} {'':>6} {timeline.bubble_fraction():>7.1%}")
    return "\n".join(lines)


def save_png(timeline: Timeline, path: str) -> None:
    """A Gantt chart of the timeline (matplotlib is imported only here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    schedule = timeline.schedule
    colours = {"F": (0.25, 0.5, 0.85), "B": (0.9, 0.5, 0.2), "W": (0.35, 0.7, 0.35)}
    fig, ax = plt.subplots(figsize=(max(6.0, timeline.makespan * 0.32), 0.6 * schedule.pp + 1.2))
    for rank, actions in enumerate(timeline.ranks):
        for t in actions:
            shade = 1.0 - 0.35 * (t.action.stage // schedule.pp) / max(1, schedule.virtual - 1)
            colour = tuple(c * shade for c in colours[t.action.kind])
            ax.barh(rank, t.end - t.start, left=t.start, color=colour, edgecolor="white")
            label = _label(t.action.kind, t.action.microbatch, t.action.stage, schedule.pp,
                           schedule.virtual)
            ax.text((t.start + t.end) / 2, rank, label, ha="center", va="center", fontsize=7,
                    color="white")
    ax.set_yticks(range(schedule.pp), [f"rank {r}" for r in range(schedule.pp)])
    ax.invert_yaxis()
    ax.set_xlabel("tick")
    ax.set_title(f"{schedule.name}: pp {schedule.pp}, virtual {schedule.virtual}, "
                 f"{schedule.n_microbatches} microbatches, bubble {timeline.bubble_fraction():.1%}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks")
    parser.add_argument("--virtual", type=int, default=1, help="stages per rank")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--costs", default="1,1,1", help="ticks of F,B,W (full backward: B+W)")
    parser.add_argument("--png", help="also write a Gantt chart to this file")
    args = parser.parse_args(argv)
    try:
        f, b, w = (int(c) for c in args.costs.split(","))
    except ValueError:
        parser.error(f"--costs expects three integers F,B,W, got {args.costs!r}")
    schedule = make_schedule(args.schedule, args.pp, args.virtual, args.microbatches)
    timeline = simulate(schedule, Costs(f, b, w))
    print(render(timeline))
    if args.png:
        save_png(timeline, args.png)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
