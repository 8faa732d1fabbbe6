"""Every two-GPU expert-parallelism target in one call: the training step and the transport.

    tools/from_source.sh python3 tools/bench_ep_2gpu.py --out $OUT/ep_2gpu.json

It runs, one after the other on the GPUs of this host (``torch.distributed.run``,
``--nproc-per-node`` = ``--gpus``; the parts inherit ``tools/from_source.sh``'s path):

1. ``tools/bench_train_step.py --config bench-2gpu --methods ddp ep`` with the
   model's own, forced balanced and forced Zipf routing, run twice: both methods
   replaying CUDA graphs, then both eager (``--graphs both``, the default; ``on`` or
   ``off`` runs one of them; a failure of the graphed run leaves the eager one): EP
   tokens/s per GPU over DP's on the same commit and in the same mode (target >= 1.05x
   for every routing) and both MFUs (target >= 42%);
   EP2 again with each MoE layer's transport pipelined under its expert GEMMs
   (``parallel.ep_overlap_chunks`` of ``--overlap-chunks``, 2 and 4 by default; with
   ``--comm-sms`` the communication stream bounded to that many SMs): its tokens/s per
   GPU over DP2's and over the unsplit EP2's, in the same mode;
   EP2 with two microbatches interleaved at the transport
   (``parallel.ep_overlap_microbatches``, one run per ``--interleave`` item: an SM bound of
   the communication stream, optionally with the transport's blocks moved by the copy
   engines, ``parallel.ep_copy_engine``, and with SMs every persistent GEMM leaves free,
   ``parallel.sm_carveout``; by default every SM, 16, every SM with the copy engines, and
   that with 16 SMs carved out of the GEMMs) at ``--interleave-micro-batch`` sequences per microbatch (default
   1: at bench-2gpu's 2, two microbatches' activations take 129 GiB by ``pretrain plan``),
   with an unsplit EP2 run at that microbatch size as its baseline: tokens/s per GPU
   over DP2's (the target) and over that unsplit EP2's (what the interleave gains).
   Every run also profiles one more, untimed step (``--profile``): the share of its
   communication's device time (the EP transport's kernels and copies, NCCL's) that ran
   while compute ran too ("communication N% hidden"), what the step-time model's SM share
   guesses;
2. ``tools/bench_ep_transport.py --graphs`` from 512 to 64k tokens per rank,
   balanced and Zipf routing: the rowwise transport over a bare NCCL
   ``all_to_all_single`` (targets: >= 1.0x at every size, >= 1.5x at 16-64 MiB of
   payload) and the share of the put ceiling measured in the same run at the largest
   size (target >= 80%);
3. with ``--tests``: the two-GPU tests of steps replayed from CUDA graphs (DP2 and EP2
   equal eager steps bit for bit, no host synchronisation in a replayed step), of
   interleaved microbatches (equal to one at a time, on the communication stream) and of the
   rowwise transport (equal to all_to_all bit for bit, no host sync, graph replay: with the
   put kernel's stores, the fused barrier and the copy engines' blocks), pass or fail recorded; several minutes (every case starts its own processes), so on their own:
   ``tools/from_source.sh python3 tools/bench_ep_2gpu.py --tests --skip train --skip
   transport --part-timeout 580 --out $OUT/ep_2gpu_tests.json``.

Each part writes its own JSON next to ``--out``; ``--out`` gets all of them plus the
target checks (rewritten after every part), and a short table is printed. A part that
fails is recorded with its exit status and the rest still runs; one that runs past
``--part-timeout`` (a hang: a spinning barrier never times out) is killed with its
processes and recorded as timed out.

Duration with the defaults (estimated from bench-2gpu's 2.7-2.8 s steps on two H200s,
``docs/performance.md``): 2 modes x 9 runs (DP2, EP2, EP2 in 2 and in 4 chunks, EP2 at
the interleave's microbatch size, interleaved with every SM and with 16, each with SM
puts and with the copy engines) x 3 routings x 6 steps plus their model builds and
captures for part 1, about a minute for part 2: 23 to 28 minutes. Within ten minutes a
call: ``--graphs on --overlap-chunks none`` (seven runs, 8 to 9 minutes), ``--graphs
off`` likewise, or the chunked overlap alone against DP2 and EP2 in one mode:

    tools/from_source.sh python3 tools/bench_ep_2gpu.py --skip transport --graphs off --interleave none --out $OUT/ep_2gpu_overlap.json
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_testing import run_process_tree

TOOLS = Path(__file__).resolve().parent
ROUTINGS = ("model", "balanced", "zipf")
GRAPH_MODES = {"on": ("graphs",), "off": ("eager",), "both": ("graphs", "eager")}
# the app's steps replayed from CUDA graphs, and the transport's interleaved microbatches
GRAPH_TESTS = (("apps/pretrain/tests/test_gpu.py", "packages/moe-ep-transport/tests/test_gpu.py"),
               ("-m", "multigpu", "-k", "cuda_graphs_on_two_ranks or interleaved or rowwise"))
EP_OVER_DP = 1.05
MFU = 0.42
X_NCCL_ALL, X_NCCL_MID, MID_MIB = 1.0, 1.5, (16, 64)
PUT_SHARE = 80.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="JSON file of every part and the checks")
    p.add_argument("--gpus", type=int, default=2, help="GPUs of this host (processes per part)")
    p.add_argument("--config", default="bench-2gpu", help="bench_train_step preset")
    p.add_argument("--steps", type=int, default=4, help="timed training steps per (method, routing)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed steps per (method, routing); the first captures the graphs")
    p.add_argument("--graphs", choices=sorted(GRAPH_MODES), default="both",
                   help="training steps replayed from CUDA graphs, eager, or both (two runs)")
    p.add_argument("--tests", action="store_true",
                   help="also run the two-GPU tests of CUDA-graph steps (several minutes: on their "
                        "own, with --skip train --skip transport --part-timeout 580)")
    p.add_argument("--overlap-chunks", default="2,4",
                   help="EP2 runs with parallel.ep_overlap_chunks of each, comma-separated "
                        "('none': no overlap runs)")
    p.add_argument("--comm-sms", type=int, default=None,
                   help="parallel.ep_comm_sms of the overlap runs (default: every SM)")
    p.add_argument("--interleave", default="all,16,all+ce,all+ce+carve16",
                   help="EP2 runs with parallel.ep_overlap_microbatches, one per communication-stream "
                        "SM bound, comma-separated ('all': every SM; '+ce': with parallel.ep_copy_engine; "
                        "'+carveN': with parallel.sm_carveout=N; 'none': no interleaved runs)")
    p.add_argument("--interleave-micro-batch", type=int, default=1,
                   help="train.micro_batch of the interleaved runs and of their unsplit EP2 baseline")
    p.add_argument("--tokens", default="512,1024,2048,4096,8192,16384,32768,65536",
                   help="transport sizes, tokens per rank, comma-separated")
    p.add_argument("--transport-routing", default="balanced,zipf")
    p.add_argument("--iters", type=int, default=20, help="transport iterations per size")
    p.add_argument("--skip", choices=["train", "transport"], action="append", default=[],
                   help="leave a part out (repeatable)")
    p.add_argument("--part-timeout", type=float, default=300.0,
                   help="seconds a part may run before it and its processes are killed")
    a = p.parse_args(argv)
    if a.gpus < 2:
        p.error(f"--gpus {a.gpus}: expert parallelism needs at least 2")
    if a.part_timeout <= 0:
        p.error(f"--part-timeout {a.part_timeout}: positive seconds expected")
    if a.steps < 1 or a.warmup < 0 or a.iters < 1:
        p.error("--steps and --iters must be positive, --warmup not negative")
    if a.graphs != "off" and a.warmup < 1:
        p.error(f"--warmup {a.warmup} with --graphs {a.graphs}: the first step captures the graphs")
    try:
        sizes = [int(t) for t in a.tokens.split(",")]
    except ValueError:
        p.error(f"--tokens {a.tokens!r}: comma-separated integers expected")
    if not sizes or min(sizes) < 1:
        p.error(f"--tokens {a.tokens!r}: positive sizes expected")
    try:
        a.overlap = [] if a.overlap_chunks == "none" else [int(c) for c in a.overlap_chunks.split(",")]
    except ValueError:
        p.error(f"--overlap-chunks {a.overlap_chunks!r}: comma-separated integers or 'none' expected")
    if any(c < 2 for c in a.overlap):
        p.error(f"--overlap-chunks {a.overlap_chunks!r}: 2 or more chunks (1 is the EP2 run itself)")
    if a.comm_sms is not None and (a.comm_sms < 1 or not a.overlap):
        p.error(f"--comm-sms {a.comm_sms}: a positive SM count, for the --overlap-chunks runs")
    try:
        a.interleave_runs = [] if a.interleave == "none" else [
            interleave_run(v) for v in a.interleave.split(",")]
    except ValueError:
        p.error(f"--interleave {a.interleave!r}: comma-separated SM counts or 'all', each with an optional "
                "'+ce' and '+carveN', or 'none'")
    if any(run.comm_sms is not None and run.comm_sms < 1 or run.carveout == 0 for run in a.interleave_runs):
        p.error(f"--interleave {a.interleave!r}: positive SM counts expected")
    if any(run.comm_sms is not None and run.carveout for run in a.interleave_runs):
        p.error(f"--interleave {a.interleave!r}: a carveout goes with 'all' (parallel.sm_carveout refuses "
                "parallel.ep_comm_sms)")
    if a.interleave_micro_batch < 1:
        p.error(f"--interleave-micro-batch {a.interleave_micro_batch}: a positive sequence count expected")
    bad = set(a.transport_routing.split(",")) - {"balanced", "random", "zipf"}
    if bad:
        p.error(f"--transport-routing: unknown routing {sorted(bad)} (balanced, random, zipf)")
    if len(set(a.skip)) == 2 and not a.tests:
        p.error("--skip train and transport without --tests leaves nothing to run")
    return a


def commands(a: argparse.Namespace) -> dict[str, tuple[list[str], Path]]:
    """Each part's command line and the JSON it writes (``train_graphs``, ``train_eager``,
    ``transport``, ``tests``: a pytest JUnit XML)."""
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.gpus)]
    parts = {}
    if "train" not in a.skip:
        for mode in GRAPH_MODES[a.graphs]:
            path = a.out.with_name(f"{a.out.stem}_train_step_{mode}.json")
            graphs = f"train.cuda_graphs={'true' if mode == 'graphs' else 'false'}"
            parts[f"train_{mode}"] = (
                [*run, str(TOOLS / "bench_train_step.py"), graphs, "--config", a.config,
                 "--methods", "ddp", "ep", "--routing", *ROUTINGS, "--steps", str(a.steps),
                 "--warmup", str(a.warmup), "--out", str(path),
                 "--profile", str(path.with_suffix(".profile.txt"))], path)
            for chunks in a.overlap:
                path = a.out.with_name(f"{a.out.stem}_train_step_{mode}_overlap{chunks}.json")
                sms = [] if a.comm_sms is None else [f"parallel.ep_comm_sms={a.comm_sms}"]
                parts[f"train_{mode}_overlap{chunks}"] = (
                    [*run, str(TOOLS / "bench_train_step.py"), graphs, f"parallel.ep_overlap_chunks={chunks}",
                     *sms, "--config", a.config, "--methods", "ep", "--routing", *ROUTINGS,
                     "--steps", str(a.steps), "--warmup", str(a.warmup), "--out", str(path),
                 "--profile", str(path.with_suffix(".profile.txt"))], path)
            if a.interleave_runs:
                mb = f"train.micro_batch={a.interleave_micro_batch}"
                ep_runs = {f"mb{a.interleave_micro_batch}": [mb]}
                for item in a.interleave_runs:
                    ep_runs[item.part] = [mb, "parallel.ep_overlap_microbatches=true", *item.overrides]
                for variant, overrides in ep_runs.items():
                    path = a.out.with_name(f"{a.out.stem}_train_step_{mode}_{variant}.json")
                    parts[f"train_{mode}_{variant}"] = (
                        [*run, str(TOOLS / "bench_train_step.py"), graphs, *overrides, "--config", a.config,
                         "--methods", "ep", "--routing", *ROUTINGS, "--steps", str(a.steps),
                         "--warmup", str(a.warmup), "--out", str(path),
                 "--profile", str(path.with_suffix(".profile.txt"))], path)
    if "transport" not in a.skip:
        path = a.out.with_name(a.out.stem + "_transport.json")
        parts["transport"] = ([*run, str(TOOLS / "bench_ep_transport.py"), "--graphs", "--tokens", a.tokens,
                               "--routing", a.transport_routing, "--iters", str(a.iters),
                               "--out", str(path)], path)
    if a.tests:
        path = a.out.with_name(a.out.stem + "_tests.xml")
        parts["tests"] = ([sys.executable, "-m", "pytest", "-p", "moe_testing.pytest_plugin", "-q",
                           *(str(TOOLS.parent / f) for f in GRAPH_TESTS[0]), *GRAPH_TESTS[1],
                           f"--junitxml={path}"], path)
    return parts


def hidden_share(run: dict[str, Any] | None) -> float | None:
    """The share of the communication's device time (the EP transport, NCCL) that ran while
    compute ran too in the run's profiled step (``bench_train_step.py --profile``:
    ``comm_overlap``); ``None`` without a profile or communication."""
    overlap = ((run or {}).get("profile") or {}).get("overlap") or {}
    busy = overlap.get("comm_ms", 0.0)
    return overlap["comm_under_compute_ms"] / busy if busy else None


def train_checks(report: dict[str, Any], mode: str) -> list[dict[str, Any]]:
    """EP over DP tokens/s per GPU and both MFUs, per routing (``mode``: graphs or eager;
    a method the layout kept eager says so in ``cuda_graphs_off``)."""
    by = {(r["method"], r["routing"]): r for r in report["runs"]}
    checks = []
    for routing in ROUTINGS:
        dp, ep = by.get(("ddp", routing)), by.get(("ep", routing))
        if dp is None or ep is None:
            continue
        ratio = ep["tokens_per_s_per_gpu"] / dp["tokens_per_s_per_gpu"]
        checks.append(dict(mode=mode, routing=routing,
                           dp_cuda_graphs=dp.get("cuda_graphs"), ep_cuda_graphs=ep.get("cuda_graphs"),
                           dp_tokens_per_s_per_gpu=dp["tokens_per_s_per_gpu"],
                           ep_tokens_per_s_per_gpu=ep["tokens_per_s_per_gpu"], ep_over_dp=ratio,
                           dp_mfu=dp["mfu"], ep_mfu=ep["mfu"], dp_hidden=hidden_share(dp),
                           ep_hidden=hidden_share(ep),
                           met=ratio >= EP_OVER_DP and min(dp["mfu"] or 0, ep["mfu"] or 0) >= MFU))
    return checks


def _against_dp(runs: list[dict[str, Any]], base: dict[str, Any] | None, baseline: dict[str, Any] | None,
                baseline_key: str, **fields: Any) -> list[dict[str, Any]]:
    """Per routing of an overlapped EP2 run: its tokens/s per GPU over DP2's of ``base`` (the
    same mode's DP/EP report) and over its EP2 ``baseline`` run's (``baseline_key``), the
    communication's hidden share, and the target (>= 1.05x DP2, both MFUs >= 42%); ``fields``
    say which run it was. ``None`` where a report left no run to compare with."""
    dps = {r["routing"]: r for r in (base or {}).get("runs", []) if r["method"] == "ddp"}
    eps = {r["routing"]: r for r in (baseline or {}).get("runs", []) if r["method"] == "ep"}
    checks = []
    for r in runs:
        dp, ep = dps.get(r["routing"]), eps.get(r["routing"])
        over_dp = r["tokens_per_s_per_gpu"] / dp["tokens_per_s_per_gpu"] if dp else None
        checks.append(dict(routing=r["routing"], **fields,
                           cuda_graphs=r.get("cuda_graphs"), tokens_per_s_per_gpu=r["tokens_per_s_per_gpu"],
                           mfu=r["mfu"], over_dp=over_dp, hidden=hidden_share(r),
                           **{baseline_key: r["tokens_per_s_per_gpu"] / ep["tokens_per_s_per_gpu"] if ep else None},
                           met=over_dp is not None and over_dp >= EP_OVER_DP
                           and min(dp["mfu"] or 0, r["mfu"] or 0) >= MFU))
    return checks


def overlap_checks(report: dict[str, Any], base: dict[str, Any] | None, mode: str,
                   chunks: int) -> list[dict[str, Any]]:
    """EP2 in ``chunks`` pipelined chunks over DP2 and over the unsplit EP2 of ``base`` (the
    same mode's DP/EP report; ``None`` where that part left none), per routing."""
    return _against_dp(report["runs"], base, base, "over_ep", mode=mode, chunks=chunks)


@dataclass(frozen=True)
class InterleaveRun:
    """One ``--interleave`` item: the communication stream's SM bound, the copy engines, the
    GEMMs' SM carveout."""

    comm_sms: int | None
    copy_engine: bool
    carveout: int | None

    @property
    def part(self) -> str:
        """The part's name after ``train_{mode}_``."""
        return (f"interleave{self.comm_sms or ''}{'_ce' if self.copy_engine else ''}"
                f"{f'_carve{self.carveout}' if self.carveout is not None else ''}")

    @property
    def overrides(self) -> list[str]:
        return [*([] if self.comm_sms is None else [f"parallel.ep_comm_sms={self.comm_sms}"]),
                *(["parallel.ep_copy_engine=true"] if self.copy_engine else []),
                *([] if self.carveout is None else [f"parallel.sm_carveout={self.carveout}"])]

    @property
    def label(self) -> str:
        words = ["every SM" if self.comm_sms is None else f"{self.comm_sms} SMs"]
        words += ["copy engines"] if self.copy_engine else []
        words += [f"GEMMs leave {self.carveout} SMs"] if self.carveout is not None else []
        return ", ".join(words)


def interleave_run(item: str) -> InterleaveRun:
    """``all`` or an SM count, then optional ``+ce`` and ``+carveN`` (ValueError otherwise)."""
    bound, *extras = item.split("+")
    carve = [e.removeprefix("carve") for e in extras if e.startswith("carve")]
    if len(carve) > 1 or any(e != "ce" and not e.startswith("carve") for e in extras) or extras.count("ce") > 1:
        raise ValueError(item)
    return InterleaveRun(None if bound == "all" else int(bound), "ce" in extras,
                         int(carve[0]) if carve else None)


def interleave_checks(report: dict[str, Any], base: dict[str, Any] | None, unsplit: dict[str, Any] | None,
                      mode: str, run: InterleaveRun) -> list[dict[str, Any]]:
    """EP2 with interleaved microbatches over DP2 of ``base`` (the same mode's DP/EP report)
    and over ``unsplit`` (EP2 at the same microbatch size, not interleaved), per routing."""
    return _against_dp(report["runs"], base, unsplit, "over_unsplit", mode=mode, comm_sms=run.comm_sms,
                       copy_engine=run.copy_engine, sm_carveout=run.carveout, label=run.label)


def transport_checks(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Rowwise (``combine="auto"``, from CUDA graphs where replayed) over NCCL per size and routing."""
    rows = report["rows"]
    largest = max(r["tokens"] for r in rows)
    checks = []
    for r in rows:
        if r["backend"] not in ("rowwise:graph", "rowwise"):
            continue
        graphed = any(o["backend"] == "rowwise:graph" and o["tokens"] == r["tokens"]
                      and o["routing"] == r["routing"] for o in rows)
        if graphed and r["backend"] == "rowwise":
            continue  # the graph replay is the device time the targets are about
        want = X_NCCL_MID if MID_MIB[0] <= r["payload_mib"] <= MID_MIB[1] else X_NCCL_ALL
        met = r["x_nccl"] >= want
        if r["tokens"] == largest and r["routing"] == "balanced":
            met = met and r["pct_put_ceiling"] >= PUT_SHARE
        checks.append(dict(tokens=r["tokens"], routing=r["routing"], backend=r["backend"],
                           payload_mib=r["payload_mib"], x_nccl=r["x_nccl"], want_x_nccl=want,
                           pct_put_ceiling=r["pct_put_ceiling"], met=met))
    return checks


def run_part(cmd: list[str], timeout_s: float) -> tuple[int, bool]:
    """``(exit status, timed out)`` of ``cmd``; a part past ``timeout_s`` is killed with
    every process it started, torchrun's ranks included (``moe_testing.run_process_tree``)."""
    try:
        return run_process_tree(cmd, timeout=timeout_s).returncode, False
    except subprocess.TimeoutExpired:
        return -signal.SIGKILL, True


def _hidden(share: float | None) -> str:
    return "" if share is None else f", communication {share:.0%} hidden"


def print_summary(result: dict[str, Any]) -> None:
    for name, part in result["parts"].items():
        if part["timed_out"]:
            print(f"{name}: killed after --part-timeout (its output is above)")
        elif part["returncode"] != 0:
            print(f"{name}: exited {part['returncode']} (its output is above)")
        elif name == "tests":
            print("tests: passed")
    for c in [c for name in GRAPH_MODES["both"] for c in result.get(f"train_{name}_checks", [])]:
        print(f"train {c['mode']:>6} {c['routing']:>8}: EP {c['ep_tokens_per_s_per_gpu']:,.0f} / DP "
              f"{c['dp_tokens_per_s_per_gpu']:,.0f} tok/s/GPU = {c['ep_over_dp']:.3f}x (>= {EP_OVER_DP}), "
              f"MFU EP {c['ep_mfu'] or 0:.1%} DP {c['dp_mfu'] or 0:.1%} (>= {MFU:.0%}){_hidden(c.get('ep_hidden'))}: "
              f"{'met' if c['met'] else 'NOT met'}")
    for kind, baseline_key, baseline in (("overlap", "over_ep", "EP unsplit"), ("interleave", "over_unsplit", "unsplit")):
        for c in [c for name in GRAPH_MODES["both"] for c in result.get(f"{kind}_{name}_checks", [])]:
            what = f"in {c['chunks']} chunks" if kind == "overlap" else f"interleaved ({c['label']})"
            vs_dp = f"{c['over_dp']:.3f}x DP" if c["over_dp"] is not None else "no DP run"
            vs_base = (f"{c[baseline_key]:.3f}x {baseline}" if c[baseline_key] is not None
                       else f"no {baseline.split()[0]} run")
            print(f"train {c['mode']:>6} {c['routing']:>8}: EP {what} "
                  f"{c['tokens_per_s_per_gpu']:,.0f} tok/s/GPU = {vs_dp}, {vs_base}, MFU {c['mfu'] or 0:.1%}"
                  f"{_hidden(c.get('hidden'))}: {'met' if c['met'] else 'NOT met'}")
    for c in result.get("transport_checks", []):
        print(f"transport {c['tokens']:>6} {c['routing']:>8} {c['payload_mib']:>7.1f} MiB: "
              f"{c['x_nccl']:.2f}x NCCL (>= {c['want_x_nccl']}), {c['pct_put_ceiling']:.0f}% put: "
              f"{'met' if c['met'] else 'NOT met'}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"parts": {}}
    for name, (cmd, json_path) in commands(a).items():
        print("+", " ".join(cmd), flush=True)
        code, timed_out = run_part(cmd, a.part_timeout)
        report = None
        if json_path.exists() and json_path.suffix == ".json":
            report = json.loads(json_path.read_text())
        result["parts"][name] = {"command": cmd, "returncode": code, "timed_out": timed_out,
                                 "report": report, "file": str(json_path)}
        if report is not None and "_interleave" in name:
            mode, variant = name.removeprefix("train_").split("_", 1)
            unsplit = result["parts"].get(f"train_{mode}_mb{a.interleave_micro_batch}", {}).get("report")
            base = result["parts"].get(f"train_{mode}", {}).get("report")
            runs = {item.part: item for item in a.interleave_runs}
            result.setdefault(f"interleave_{mode}_checks", []).extend(
                interleave_checks(report, base, unsplit, mode, runs[variant]))
        elif report is not None and "_mb" in name:
            pass  # the interleaved runs' baseline, checked with them
        elif report is not None and "_overlap" in name:
            mode, chunks = name.removeprefix("train_").split("_overlap")
            base = result["parts"].get(f"train_{mode}", {}).get("report")
            result.setdefault(f"overlap_{mode}_checks", []).extend(
                overlap_checks(report, base, mode, int(chunks)))
        elif report is not None and name.startswith("train_"):
            result[f"{name}_checks"] = train_checks(report, name.removeprefix("train_"))
        elif report is not None and name == "transport":
            result["transport_checks"] = transport_checks(report)
        a.out.write_text(json.dumps(result, indent=1))  # after every part: a later failure keeps it
    print_summary(result)
    return result


if __name__ == "__main__":
    main()
