"""One-shot H200 run for the Triton GEMM (tiled / persistent / Stream-K / hybrid) and RMSNorm.

    python benchmarks/gpu_kernels_gemm.py [--quick] [--steps tests,correctness,schedules,bench]
                                                        # files under $OUT, or ./out

1. tests: the `gpu`-marked tests of tests/test_kernels_matmul.py and
   tests/test_kernels_rmsnorm.py (full-size ragged shapes, every schedule,
   bias + GELU epilogue, linear, RMSNorm forward/backward; junit XML);
2. correctness table: relative Frobenius error vs a float64 reference of every
   schedule on full-size shapes (TMA and pointer paths), NaN-poisoned outputs;
3. schedules: tiled / persistent / hybrid vs cuBLAS on three model shapes
   (which data-parallel variant "auto" should prefer);
4. the bench: `nanoforge.kernels.bench.run(["gemm", "streamk", "rmsnorm"])`
   (table, kernels_bench.json, roofline.png).

TRITON_PRINT_AUTOTUNING=1 logs every autotuning decision (the chosen block
shapes). Each step records its error and the script carries on; the exit code
is non-zero if any step failed. Results: gemm_gpu_report_<steps>.json (one per run;
name the steps to split the work over several runs: the first compiles and
autotunes many kernel variants, minutes; Triton's disk cache keeps them for
later runs on the same machine).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("TRITON_PRINT_AUTOTUNING", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nanoforge.kernels import bench  # noqa: E402
from nanoforge.kernels import matmul as mm  # noqa: E402
from nanoforge.kernels import rmsnorm as rn  # noqa: E402

# (label, M, N, K): TMA-aligned square, model shapes, ragged (pointer path), wave-quantized
CORRECTNESS_SHAPES = [
    ("square", 4096, 4096, 4096),
    ("llama3-8b k/v", 16384, 1024, 4096),
    ("gpt2 lm-head (N % 8 != 0)", 16384, 50257, 768),
    ("ragged", 3001, 5003, 1037),
    ("wave-quantized", 1024, 4352, 8192),
]


def run_tests(out: Path) -> dict:
    tests = [str(REPO / "tests" / f) for f in ("test_kernels_matmul.py", "test_kernels_rmsnorm.py")]
    code = pytest.main(["-q", "-rs", "-m", "gpu", *tests, f"--junitxml={out / 'gemm_gpu_tests.xml'}"])
    return {"pytest_exit_code": int(code), "ok": int(code) == 0}


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def correctness() -> dict:
    results, ok = [], True
    for label, M, N, K in CORRECTNESS_SHAPES:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        ref = a.double() @ b.double()
        for schedule in mm.SCHEDULES:
            out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            t0 = time.time()
            mm.matmul(a, b, schedule=schedule, out=out)
            torch.cuda.synchronize()
            err = rel_error(out, ref)
            passed = err < 4e-3  # bf16 output rounding alone gives ~2e-3
            ok &= passed
            results.append({"shape": f"{label} {M}x{N}x{K}", "schedule": schedule, "tma": mm._tma_ok(a, b, out),
                            "rel_error": err, "passed": passed, "first_call_s": time.time() - t0})
            print(f"  {label:<28} {M}x{N}x{K} {schedule:<10} rel err {err:.2e} {'ok' if passed else 'FAIL'}",
                  flush=True)
    for shape in [(16384, 4096), (4096, 4100)]:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(shape[-1], device="cuda", dtype=torch.bfloat16)
        err = rel_error(rn.rms_norm(x, w, 1e-5), rn.rms_norm_ref(x.double(), w.double(), 1e-5))
        passed = err < 4e-3
        ok &= passed
        results.append({"shape": f"rmsnorm {shape}", "rel_error": err, "passed": passed})
        print(f"  rmsnorm {shape} rel err {err:.2e} {'ok' if passed else 'FAIL'}", flush=True)
    return {"results": results, "ok": ok}


def schedules(quick: bool) -> dict:
    rows = []
    for name, M, N, K in [s for s in bench.gemm_shapes() if s[0] in ("square", "llama3-8b gate/up", "gpt2 mlp-up")]:
        if quick and M * N * K > 4096**3:
            continue
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        base = bench.time_ms(lambda: torch.matmul(a, b), quick)
        for schedule in ("tiled", "persistent", "hybrid"):
            print(f"[schedules] {name} {M}x{N}x{K} {schedule}", flush=True)
            ms = bench.time_ms(lambda: mm.matmul(a, b, schedule=schedule), quick)
            rows.append(bench.make_row(f"gemm-{schedule}", f"{name} {M}x{N}x{K}", ms, base, "cuBLAS (torch.matmul)",
                                       2.0 * M * N * K, 2.0 * (M * K + K * N + M * N)))
    print(bench.format_table(rows))
    return {"rows": rows, "ok": True}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes, shorter timing")
    parser.add_argument("--steps", default="tests,correctness,schedules,bench",
                        help="comma-separated subset of: tests, correctness, schedules, bench")
    args = parser.parse_args()
    if not torch.cuda.is_available():  # one line, not a traceback from the first CUDA call
        print("gpu_kernels_gemm.py needs a CUDA GPU", file=sys.stderr)
        return 2
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}", flush=True)

    steps = {
        "tests": lambda: run_tests(out),
        "correctness": correctness,
        "schedules": lambda: schedules(args.quick),
        "bench": lambda: {"summary": bench.run(["gemm", "streamk", "rmsnorm"], out, quick=args.quick)["summary"],
                          "ok": True},
    }
    chosen = args.steps.split(",")
    unknown = set(chosen) - set(steps)
    if unknown:
        parser.error(f"unknown steps {sorted(unknown)}; choose from {list(steps)}")
    report, failed = {}, []
    for name in chosen:
        step = steps[name]
        print(f"\n===== {name} =====", flush=True)
        t0 = time.time()
        try:
            report[name] = step()
        except Exception as e:  # keep going: one broken step must not waste the GPU session
            traceback.print_exc()
            report[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        report[name]["seconds"] = round(time.time() - t0, 1)
        if not report[name]["ok"]:
            failed.append(name)
        (out / f"gemm_gpu_report_{'_'.join(chosen)}.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"\nsteps failed: {failed or 'none'}; report in {out}/gemm_gpu_report_{'_'.join(chosen)}.json")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
