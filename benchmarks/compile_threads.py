"""How much a cold start gains from compiling an autotuner's candidates in threads (`dispatch.compile_in_parallel`).

The skinny matmul's candidates for one decode projection (Llama's gate-and-up at one row: the norm prologue,
SwiGLU, PDL) are compiled for sm_90 with Triton's own compiler, no GPU needed, each round into an empty cache:
one after another (what the autotuner does by itself), then in threads. Rounds alternate, so that a machine
warming up favours neither. Prints a table and writes compile_threads.json under $OUT (default ./out).

    python benchmarks/compile_threads.py [--threads N] [--rounds R]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from nanoforge.kernels import gemv
from nanoforge.kernels import inspect as kinspect
from nanoforge.errors import NanoforgeError
from nanoforge.kernels.dispatch import compile_threads


def candidates() -> list:
    base = kinspect.TRITON_KERNELS["gemv_decode"]
    return [dataclasses.replace(base, constexprs={**base.constexprs, **c.kwargs}, num_warps=c.num_warps,
                                num_stages=c.num_stages) for c in gemv._TUNED["default"].configs]


def compile_all(specs: list, threads: int) -> float:
    """Seconds to compile every spec into a fresh cache, in `threads` threads."""
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="nanoforge-compile-")
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda s: kinspect._compile_triton("gemv_decode", s), specs))
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=None, help="threads of the parallel rounds (default: "
                   "NANOFORGE_COMPILE_THREADS, else this process's CPUs up to 16)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of each way (default 2)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    a = p.parse_args(argv)
    if (a.threads is not None and a.threads < 1) or a.rounds < 1:
        print("--threads and --rounds must be positive", file=sys.stderr)
        return 2
    try:
        threads = a.threads or compile_threads()
    except NanoforgeError as e:
        print(e, file=sys.stderr)
        return 2
    specs = candidates()
    kinspect._compile_triton("gemv_decode", specs[0])  # imports and the first compile's setup, outside the rounds
    times: dict[str, list[float]] = {"serial": [], "threads": []}
    for r in range(a.rounds):
        for way, n in (("serial", 1), ("threads", threads)):
            times[way].append(compile_all(specs, n))
            print(f"round {r + 1}/{a.rounds}, {way:7s} ({n} thread{'s' if n > 1 else ''}): "
                  f"{times[way][-1]:.2f} s", flush=True)
    serial, parallel = statistics.median(times["serial"]), statistics.median(times["threads"])
    result = {"kernel": "gemv_decode", "target": "sm_%d%d" % kinspect._target_cc(), "candidates": len(specs),
              "threads": threads, "cpus": os.cpu_count(), "seconds": times, "serial_median_s": serial,
              "threads_median_s": parallel, "speedup": serial / parallel}
    print(f"\n{'way':24s} {'seconds (median)':>16s}\n{'one after another':24s} {serial:16.2f}\n"
          f"{f'{threads} threads':24s} {parallel:16.2f}\nspeedup {serial / parallel:.2f}x "
          f"({len(specs)} candidates, {os.cpu_count()} CPUs)")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "compile_threads.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out / 'compile_threads.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
