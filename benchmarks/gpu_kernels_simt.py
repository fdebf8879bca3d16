"""One-shot H200 run for the SIMT ladder and `kernels inspect` (needs a CUDA GPU and numba-cuda).

    python benchmarks/gpu_kernels_simt.py          # files under $OUT, or ./out

1. correctness: the SIMT and inspect test files on the real GPU, including the
   `gpu`-marked full-size ragged SGEMMs vs torch float64 (junit XML);
2. the ladder: vector add vs torch add, every SGEMM rung vs cuBLAS at 1024^3 and
   4096^3 (table, simt_ladder.json, simt_ladder.png);
3. inspect: PTX/SASS/registers/occupancy of three SIMT kernels and of a small
   Triton kernel, each cross-checked against what the CUDA driver reports for
   the loaded kernel (registers, local memory, active blocks per SM).

Each step records its error and the script carries on, so one failure does not
waste the GPU session; the exit code is non-zero if any step failed.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nanoforge.kernels import inspect as ki  # noqa: E402
from nanoforge.kernels.simt import bench, ladder  # noqa: E402


def run_tests(out: Path) -> dict:
    tests = [str(REPO / "tests" / f) for f in ("test_kernels_simt.py", "test_kernels_inspect.py")]
    code = pytest.main(["-q", "-rs", *tests, f"--junitxml={out / 'simt_gpu_tests.xml'}"])
    return {"pytest_exit_code": int(code)}


def driver_view_numba(fn, signature: str, threads: int) -> dict:
    """What the CUDA driver says about the loaded Numba kernel (to compare with inspect's cubin reading)."""
    cuda = ladder.numba_cuda()
    kernel = cuda.jit(signature)(fn)
    (compiled,) = kernel.overloads.values()
    view = {
        "registers_per_thread": kernel.get_regs_per_thread(),
        "shared_bytes_per_block": kernel.get_shared_mem_per_block(),
        "local_bytes_per_thread": kernel.get_local_mem_per_thread(),
    }
    # cuOccupancyMaxActiveBlocksPerMultiprocessor, via the cooperative-grid helper (blocks/SM x SMs)
    try:
        sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
        view["active_blocks_per_sm"] = compiled.max_cooperative_grid_blocks(threads) // sms
    except Exception as e:  # a cross-check only: keep the rest of the report
        view["active_blocks_per_sm"] = f"unavailable: {type(e).__name__}: {e}"
    return view


def inspect_simt(out: Path) -> dict:
    results = {}
    for name in ("vector_add", "sgemm_smem_tiled", "sgemm_regtile_2d"):
        report = ki.inspect_kernel(name, out)
        fn, signature, threads = ki.simt_kernels()[name]
        driver = driver_view_numba(fn, signature, threads)
        print(f"  driver: {driver}\n")
        results[name] = {"inspect": report, "driver": driver}
    return results


def inspect_triton_launch(out: Path) -> dict:
    """A warm-up launch's CompiledKernel through `compiled_triton`, vs its own n_regs / n_spills."""
    import triton
    import triton.language as tl

    @triton.jit
    def scale_kernel(x, y, n, alpha, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(y + offs, tl.load(x + offs, mask=mask) * alpha, mask=mask)

    x = torch.randn(1 << 20, device="cuda")
    y = torch.empty_like(x)
    compiled = scale_kernel[(x.numel() // 1024,)](x, y, x.numel(), 2.0, BLOCK=1024, num_warps=8)
    torch.testing.assert_close(y, 2 * x)
    report = ki.report(ki.compiled_triton("triton_scale", compiled), out)
    driver = {"n_regs": compiled.n_regs, "n_spills": compiled.n_spills}
    print(f"  driver: {driver}\n")
    return {"inspect": report, "driver": driver}


def main() -> int:
    if not torch.cuda.is_available():  # one line, not a traceback from the first CUDA call
        print("gpu_kernels_simt.py needs a CUDA GPU", file=sys.stderr)
        return 2
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    cuda = ladder.numba_cuda()
    numba_impl = getattr(cuda, "implementation", "?")  # "NVIDIA" for numba-cuda, "Built-in" for numba's own
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}; numba.cuda: {numba_impl}")
    summary, failed = {}, []
    steps = [
        ("tests", lambda: run_tests(out)),
        ("ladder", lambda: bench.run_ladder([1024, 4096], out)),
        ("inspect_simt", lambda: inspect_simt(out / "inspect")),
        ("inspect_triton", lambda: inspect_triton_launch(out / "inspect")),
    ]
    for name, step in steps:
        print(f"\n===== {name} =====", flush=True)
        try:
            summary[name] = step()
        except Exception:
            summary[name] = {"error": traceback.format_exc()}
            failed.append(name)
            print(summary[name]["error"], flush=True)
    if summary.get("tests", {}).get("pytest_exit_code", 0) != 0:
        failed.append("tests")
    (out / "gpu_kernels_simt.json").write_text(json.dumps(summary, indent=2, default=str))
    print(f"\nwrote {out / 'gpu_kernels_simt.json'}; failed steps: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
