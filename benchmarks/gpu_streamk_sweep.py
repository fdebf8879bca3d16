"""H200 study of the wave-quantization sweep: Stream-K and the hybrid against the data-parallel tiled
kernel on `bench.streamk_shapes`, one block of lines per shape as it is measured (a device call that is
cut off still reports what it finished).

Each schedule is timed two ways, several times: launched from Python (`do_bench`, L2 flushed before
each call: the host's launch cost shows wherever it exceeds the flush's) and replayed from a CUDA graph
(`do_bench_cudagraph`: the GPU's time alone). The host's cost of one `matmul` call is measured apart.
Then every candidate config of the hybrid is timed on its own (graph), so that the autotuner's choice can
be told apart from run-to-run noise.

    python benchmarks/gpu_streamk_sweep.py [--repeats 3] [--no-configs]   # JSON: $OUT/streamk_sweep.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from nanoforge.kernels import bench  # noqa: E402
from nanoforge.kernels import matmul as mm  # noqa: E402


def host_us(fn, calls: int = 200) -> float:
    """Host microseconds per call: `calls` calls queued back to back, timed without waiting for the GPU."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def cfg_dict(cfg) -> dict:
    return {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def cfg_name(cfg) -> str:
    k = cfg.kwargs
    return (f"{k['BLOCK_M']}x{k['BLOCK_N']}x{k['BLOCK_K']} s{cfg.num_stages} w{cfg.num_warps} {k['FIXUP']} "
            f"sk{k['SK_ITERS']}")


def each_config(fn, tuner) -> list[dict]:
    """Graph time of fn with the tuner held to one config at a time (its pruned candidates)."""
    configs, cache = tuner.configs, dict(tuner.cache)
    rows = []
    try:
        for cfg in configs:
            tuner.configs, tuner.cache = [cfg], {}
            try:
                ms = bench.time_ms(fn, graph=True)
            except Exception as e:  # out of resources etc.: the autotuner would have skipped it too
                rows.append({"config": cfg_dict(cfg), "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            rows.append({"config": cfg_dict(cfg), "name": cfg_name(cfg), "graph_ms": ms})
    finally:
        tuner.configs, tuner.cache = configs, cache
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-configs", action="store_true", help="skip timing each hybrid config")
    args = parser.parse_args()
    if not torch.cuda.is_available():  # one line, not a traceback from the first CUDA call
        print("gpu_streamk_sweep.py needs a CUDA GPU", file=sys.stderr)
        return 2
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    num_sms = mm._num_sms(torch.device("cuda"))
    rows = []
    for M, N, K in bench.streamk_shapes(num_sms):
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        ref = mm.matmul(a, b, schedule="tiled")
        row = {"shape": f"{M}x{N}x{K}"}
        print(f"== {row['shape']}", flush=True)
        for schedule in ("tiled", "streamk", "hybrid"):
            fn = (lambda s=schedule: mm.matmul(a, b, schedule=s))
            out_t = fn()
            row[f"{schedule}_rel_err"] = ((out_t.double() - ref.double()).norm() / ref.double().norm()).item()
            tuner = mm._tiled_tuned if schedule == "tiled" else mm._persistent_tuned
            row[f"{schedule}_config"] = cfg_dict(tuner.best_config)
            timings = getattr(tuner, "configs_timings", None) or {}
            row[f"{schedule}_autotune_ms"] = sorted(
                [(cfg_name(c) if "FIXUP" in c.kwargs else str(c), float(t if not isinstance(t, list) else t[0]))
                 for c, t in timings.items()], key=lambda x: x[1])
            row[f"{schedule}_eager_ms"] = [bench.time_ms(fn) for _ in range(args.repeats)]
            row[f"{schedule}_graph_ms"] = [bench.time_ms(fn, graph=True) for _ in range(args.repeats)]
            row[f"{schedule}_host_us"] = host_us(fn)
            print(f"  {schedule:<8} eager {[round(x, 4) for x in row[f'{schedule}_eager_ms']]} graph "
                  f"{[round(x, 4) for x in row[f'{schedule}_graph_ms']]} host {row[f'{schedule}_host_us']:.0f} us/call "
                  f"config {row[f'{schedule}_config']}", flush=True)
        for way in ("eager", "graph"):
            dp = statistics.median(row[f"tiled_{way}_ms"])
            for schedule in ("streamk", "hybrid"):
                row[f"{schedule}_vs_dp_{way}"] = dp / statistics.median(row[f"{schedule}_{way}_ms"])
        print(f"  hybrid vs DP: eager {row['hybrid_vs_dp_eager']:.3f}x, graph {row['hybrid_vs_dp_graph']:.3f}x; "
              f"streamk graph {row['streamk_vs_dp_graph']:.3f}x", flush=True)
        if not args.no_configs:
            hyb = lambda: mm.matmul(a, b, schedule="hybrid")  # noqa: E731
            row["hybrid_each_config"] = each_config(hyb, mm._persistent_tuned)
            ok = sorted([r for r in row["hybrid_each_config"] if "graph_ms" in r], key=lambda r: r["graph_ms"])
            dp = statistics.median(row["tiled_graph_ms"])
            for r in ok[:6]:
                print(f"    {r['name']:<40} {r['graph_ms']:.4f} ms = {dp / r['graph_ms']:.3f}x DP", flush=True)
        rows.append(row)
        (out / "streamk_sweep.json").write_text(json.dumps(rows, indent=2))
    for way in ("eager", "graph"):
        best = [max(r[f"streamk_vs_dp_{way}"], r[f"hybrid_vs_dp_{way}"]) for r in rows]
        print(f"min over the sweep ({way}) {min(best):.3f}x (target >= 1.15)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
