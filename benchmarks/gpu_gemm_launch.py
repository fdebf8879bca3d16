"""Our GEMM launched from Python vs cuBLAS, and what one `matmul` call costs the host (issue #14).

    python benchmarks/gpu_gemm_launch.py [--quick]     # on the H200: < 3 minutes; files under $OUT, or ./out
    python benchmarks/gpu_gemm_launch.py --smoke       # on a CPU, under TRITON_INTERPRET=1 (a test runs it)

1. launched: the 12 shapes of `nanoforge kernels bench --kinds gemm`, our matmul and torch.matmul each
   called in a Python loop with CUDA events around the loop (`bench.time_launched_ms`, rotating input
   copies so that L2 holds none), as a user calls them: where a call's host side is slower than its
   kernel, the GPU waits and the time shows it. Geometric mean of cuBLAS time / ours (target >= 0.95).
2. host: per-call host time on GPT-2's attn-out shape (16,384 x 768 x 768) and a small one: N calls
   timed on the wall clock with no synchronization in between (the queue never fills at these N), for
   our matmul, for our matmul with the launch stubbed out (our Python path alone: the plan lookup,
   output allocation, TMA descriptors) and for torch.matmul; beside the kernel's GPU time (a CUDA-graph
   replay) and the launched loop's time per call.

Prints both tables and the README's GEMM row from this run; writes gemm_launch.json.
"""

# ruff: noqa: B023 (each timing lambda is called before its loop variables move on)
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # before triton is imported: the CPU interpreter, our kernels on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("NANOFORGE_KERNELS", "triton")

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nanoforge.kernels import bench
from nanoforge.kernels import matmul as mm

SMOKE_SHAPES = [("smoke tma", 64, 48, 64), ("smoke ragged", 37, 45, 70)]
HOST_SHAPES = [("gpt2 attn-out", bench.TOKENS, 768, 768), ("small", 256, 768, 768)]


class _NoLaunch:
    """Takes a launch and does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def stubbed_launch():
    """Within: every launch plan made so far launches nothing, so a call costs our Python path alone."""
    saved = {key: (plan.compiled, plan.kernel) for key, plan in mm._PLANS.items()}
    for plan in mm._PLANS.values():
        if plan.compiled is not None:
            plan.compiled = _NoLaunch()
        else:
            plan.kernel = _NoLaunch()
    try:
        yield
    finally:
        for key, (compiled, kernel) in saved.items():
            mm._PLANS[key].compiled, mm._PLANS[key].kernel = compiled, kernel


def host_us(fn, calls: int, device: torch.device) -> float:
    """Host microseconds per call: `calls` calls on the wall clock, no synchronization between them;
    median of 5 rounds (the device drained before each)."""
    fn()
    times = []
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) * 1e6 / calls)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return statistics.median(times)


def host_rows(shapes, device: torch.device, calls: int, quick: bool) -> list[dict]:
    rows = []
    for name, M, N, K in shapes:
        a = torch.randn(M, K, device=device, dtype=torch.bfloat16)
        b = torch.randn(K, N, device=device, dtype=torch.bfloat16)
        ours = host_us(lambda: mm.matmul(a, b), calls, device)
        with stubbed_launch():
            python = host_us(lambda: mm.matmul(a, b), calls, device)
        cublas = host_us(lambda: torch.matmul(a, b), calls, device)
        row = {"shape": f"{name} {M}x{N}x{K}", "calls": calls, "ours_host_us": ours, "ours_python_us": python,
               "cublas_host_us": cublas,
               "ours_launched_us": 1e3 * bench.time_launched_ms([lambda: mm.matmul(a, b)], device, quick),
               "ours_gpu_us": None, "cublas_gpu_us": None}
        if device.type == "cuda":  # GPU time alone: CUDA-graph replays
            row["ours_gpu_us"] = 1e3 * bench.time_ms(lambda: mm.matmul(a, b), quick, graph=True)
            row["cublas_gpu_us"] = 1e3 * bench.time_ms(lambda: torch.matmul(a, b), quick, graph=True)
        rows.append(row)
    return rows


def format_host(rows: list[dict]) -> str:
    head = (f"{'shape':<28} {'ours host':>10} {'ours python':>12} {'cuBLAS host':>12} {'ours launched':>14} "
            f"{'ours GPU':>9} {'cuBLAS GPU':>11}   (us per call)")
    lines = [head, "-" * len(head)]
    fmt = lambda x: "-" if x is None else f"{x:.1f}"
    for r in rows:
        lines.append(f"{r['shape']:<28} {fmt(r['ours_host_us']):>10} {fmt(r['ours_python_us']):>12} "
                     f"{fmt(r['cublas_host_us']):>12} {fmt(r['ours_launched_us']):>14} {fmt(r['ours_gpu_us']):>9} "
                     f"{fmt(r['cublas_gpu_us']):>11}")
    return "\n".join(lines)


def readme_row(rows: list[dict], geomean: float) -> str:
    """The README's GEMM row, from this run's numbers."""
    tflops = [r["ours_tflops"] for r in rows]
    weakest = sorted(rows, key=lambda r: r["ratio"])[:2]
    strongest = max(rows, key=lambda r: r["ratio"])
    name = lambda r: r["shape"].rsplit(" ", 1)[0]
    return (f"| GEMM over square 4096 and 8192 and the GPT-2 and Llama-3-8B linear layers at 16,384 tokens "
            f"({len(rows)} shapes), launched from Python | {min(tflops):.0f}-{max(tflops):.0f} TFLOP/s; geometric "
            f"mean **{geomean:.3f}x**; weakest {name(weakest[0])} {weakest[0]['ratio']:.2f}x and "
            f"{name(weakest[1])} {weakest[1]['ratio']:.2f}x; {name(strongest)} {strongest['ratio']:.2f}x "
            f"| cuBLAS (`torch.matmul`) |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 of the 12 shapes, shorter timing loops")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    args = parser.parse_args(argv)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        device, shapes, calls = torch.device("cpu"), SMOKE_SHAPES, 3
        host_shapes = SMOKE_SHAPES[:1]
    else:
        if not torch.cuda.is_available():
            parser.error("needs a CUDA GPU (or --smoke on a CPU)")
        device, shapes, calls, host_shapes = torch.device("cuda"), None, 200, HOST_SHAPES
    import triton

    t0 = time.time()
    print(f"device: {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu (interpreter)'}; "
          f"torch {torch.__version__}; triton {triton.__version__}", flush=True)
    rows = bench._gemm_rows(args.quick, shapes, str(device))
    geomean = bench.summarize(rows)["gemm_vs_cublas_geomean"]
    print("\n" + bench.format_table(rows))
    print(f"GEMM vs cuBLAS, launched from Python: geometric mean {geomean:.3f} over {len(rows)} shapes "
          f"(target >= 0.95)")
    print("\nREADME row from this run:\n" + readme_row(rows, geomean), flush=True)

    host = host_rows(host_shapes, device, calls, args.quick)
    print("\n" + format_host(host))
    report = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "triton": triton.__version__, "smoke": args.smoke, "quick": args.quick,
              "launched": {"rows": rows, "geomean_vs_cublas": geomean, "shapes": len(rows)}, "host": host,
              "readme_row": readme_row(rows, geomean), "seconds": round(time.time() - t0, 1)}
    (out / "gemm_launch.json").write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out / 'gemm_launch.json'} in {report['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
