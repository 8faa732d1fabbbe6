"""CUTLASS sm90 grouped GEMMs vs torch._grouped_mm vs moe-model's Triton kernel (one GPU).

    tools/from_source.sh python3 tools/bench_cutlass_grouped_mm.py --out $OUT/cutlass_gmm.json
    # or with a library built elsewhere (same nvcc line as build()):
    tools/from_source.sh python3 tools/bench_cutlass_grouped_mm.py --lib libcutlass_gmm.so

Answers one question: would a CUTLASS Hopper grouped GEMM (warp-specialised,
ping-pong or cooperative consumers, TMA epilogue overlapping the next tile's
mainloop) beat the Triton kernel on the MoE layer's shapes? It builds
``tools/cutlass_grouped_mm.cu`` against the headers of the ``nvidia-cutlass`` wheel
(``cutlass_library/source/include``) with ``nvcc -arch=sm_90a`` (about 90 s), then
times the forward/dgrad shapes of bench-1gpu's MoE layer (16k tokens, top-8, 64
experts, d_model 2048, expert hidden 1024: 131072 rows), balanced and Zipf-skewed,
in the TN layout every backend takes (weights K-major). Every output is checked
against torch._grouped_mm (bit-identical in the runs so far). Prints TFLOP/s per
backend and writes JSON.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import tempfile
from pathlib import Path

import torch
from moe_model.triton_grouped_mm import triton_grouped_mm

SOURCE = Path(__file__).with_name("cutlass_grouped_mm.cu")
# Kernel schedule (pp: ping-pong, co: cooperative), tile M x N (K 64), cluster: the order of gg_run's switch.
VARIANTS = ["pp128x128_c2x1", "co256x128_c2x1", "pp128x128_c1x1", "pp128x128_c1x2",
            "co128x256_c2x1", "co256x128_c1x1"]
SHAPES = [(2048, 2048), (2048, 1024), (1024, 2048)]  # (N, K): x@w1 (gate+up), h@w2, dy@w2 (dgrad)


def build(nvcc: str, out_dir: Path) -> Path:
    import cutlass_library

    root = Path(cutlass_library.__file__).parent / "source"
    lib = out_dir / "libcutlass_gmm.so"
    cmd = [nvcc, "-O3", "-std=c++17", "-arch=sm_90a", "--expt-relaxed-constexpr", "-DNDEBUG",
           f"-I{root / 'include'}", f"-I{root / 'tools' / 'util' / 'include'}", "-Xcompiler", "-fPIC",
           "-shared", "-o", str(lib), str(SOURCE)]
    subprocess.run(cmd, check=True)
    return lib


def load(lib_path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(lib_path))
    lib.gg_run.restype = ctypes.c_int
    lib.gg_run.argtypes = [ctypes.c_int, *[ctypes.c_void_p] * 4, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                           ctypes.c_void_p]
    return lib


def group_sizes(kind: str, rows: int, groups: int) -> torch.Tensor:
    if kind == "balanced":
        return torch.full((groups,), rows // groups, dtype=torch.int64)
    gen = torch.Generator().manual_seed(0)
    p = 1.0 / torch.arange(1, groups + 1, dtype=torch.float64) ** 0.8
    return torch.bincount(torch.multinomial(p, rows, replacement=True, generator=gen), minlength=groups)


def timed_ms(fn, iters: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def backends(lib: ctypes.CDLL, a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, stream: int
             ) -> dict[str, object]:
    """name -> callable, or (callable returning a status, its output) for the CUTLASS variants."""
    (G, N, K), bt = b.shape, b.transpose(1, 2)
    runs: dict[str, object] = {"torch": lambda: torch._grouped_mm(a, bt, offs=offsets),
                               "triton": lambda: triton_grouped_mm(a, bt, offsets)}
    for v, name in enumerate(VARIANTS):
        d = torch.empty(a.shape[0], N, device=a.device, dtype=torch.bfloat16)
        runs[name] = (lambda v=v, d=d: lib.gg_run(v, a.data_ptr(), b.data_ptr(), d.data_ptr(),
                                                  offsets.data_ptr(), G, N, K, stream), d)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lib", type=Path, default=None, help="a built libcutlass_gmm.so (else build it)")
    ap.add_argument("--nvcc", default="nvcc")
    ap.add_argument("--rows", type=int, default=131072)
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("cutlass_grouped_mm.json"))
    args = ap.parse_args()
    lib = load(args.lib if args.lib is not None else build(args.nvcc, Path(tempfile.mkdtemp())))
    dev, R, G = torch.device("cuda"), args.rows, args.groups
    stream = torch.cuda.current_stream().cuda_stream
    results = []
    for routing in ("balanced", "skewed"):
        offsets = torch.cumsum(group_sizes(routing, R, G), 0).to(torch.int32).to(dev)
        for N, K in SHAPES:
            a = torch.randn(R, K, device=dev).to(torch.bfloat16)
            b = (torch.randn(G, N, K, device=dev) / K**0.5).to(torch.bfloat16)
            want = torch._grouped_mm(a, b.transpose(1, 2), offs=offsets)
            runs = backends(lib, a, b, offsets, stream)
            row = {"routing": routing, "N": N, "K": K}
            for name, run in runs.items():
                fn, out = run if isinstance(run, tuple) else (run, None)
                got = fn()
                torch.cuda.synchronize()
                if out is not None:
                    if got != 0:
                        raise RuntimeError(f"CUTLASS variant {name} failed with status {got}")
                    got = out
                row[f"{name}_max_abs_err"] = float((got.float() - want.float()).abs().max())
                ms = timed_ms(fn, args.iters)
                row[f"{name}_tflops"] = 2 * R * N * K / (ms * 1e-3) / 1e12
            results.append(row)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": R, "groups": G,
                                    "results": results}, indent=1))
    names = ["torch", "triton", *VARIANTS]
    print(f"{'routing':>8} {'N':>5} {'K':>5} " + " ".join(f"{n:>15}" for n in names) + "  max err")
    for r in results:
        err = max(r[f"{n}_max_abs_err"] for n in names)
        print(f"{r['routing']:>8} {r['N']:>5} {r['K']:>5} "
              + " ".join(f"{r[n + '_tflops']:>15.0f}" for n in names) + f"  {err:.3g}")


if __name__ == "__main__":
    main()
