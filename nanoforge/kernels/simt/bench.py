"""Time the SIMT ladder against cuBLAS (and vector add against torch) on one GPU.

`run_ladder(sizes, out_dir)` prints one table, writes simt_ladder.json and
simt_ladder.png, and returns the numbers. Every timing is the median of
`repeats` runs, each bracketed by CUDA events, after a warm-up launch that
also pays for JIT compilation. The baselines run in the same process on the
same inputs: cuBLAS SGEMM is torch.matmul in fp32 with TF32 off (so it does
the same fp32 FMAs as the ladder), and vector add's baseline is torch.add.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Callable

from nanoforge.errors import NanoforgeError
from nanoforge.kernels.simt import ladder


def _require_gpu():
    import torch

    if ladder.simulator_active():
        raise NanoforgeError(
            "the SIMT ladder needs a CUDA GPU; NUMBA_ENABLE_CUDASIM=1 selects the CPU simulator, which tests use"
        )
    if not (ladder.numba_cuda().is_available() and torch.cuda.is_available()):
        raise NanoforgeError("the SIMT ladder needs a CUDA GPU; tests run it under NUMBA_ENABLE_CUDASIM=1")


def _median_ms(fn: Callable[[], None], repeats: int) -> float:
    """Median time of `fn` in milliseconds by CUDA events, after one warm-up call.

    All runs are queued before the one synchronize, so the host stays ahead of
    the GPU and each event pair brackets the kernel, not the launch overhead.
    """
    import torch

    fn()  # warm-up: JIT compilation, caches, clocks
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def _row(kernel: str, shape: str, ms: float, work: float, unit: str) -> dict:
    """One table row; `work` is GB moved or GFLOP done, so rate is GB/s or GFLOP/s."""
    return {"kernel": kernel, "shape": shape, "ms": ms, "rate": work / (ms / 1e3), "unit": unit}


def _vector_add_rows(n: int, repeats: int) -> list[dict]:
    import torch

    cuda = ladder.numba_cuda()
    a, b, c = (torch.randn(n, device="cuda") for _ in range(3))
    # Numba views of the torch buffers: launches on the default stream, like torch's.
    a_d, b_d, c_d = (cuda.as_cuda_array(t) for t in (a, b, c))
    gbytes = 3 * n * 4 / 1e9  # read a and b, write c
    rows = []
    for name, fn in (
        ("torch add", lambda: torch.add(a, b, out=c)),
        ("vector_add", lambda: ladder.launch_vector_add(a_d, b_d, c_d)),
    ):
        rows.append(_row(name, f"n={n}", _median_ms(fn, repeats), gbytes, "GB/s"))
    return rows


def _sgemm_rows(size: int, repeats: int, naive_repeats: int) -> list[dict]:
    import torch

    cuda = ladder.numba_cuda()
    a, b = torch.randn(size, size, device="cuda"), torch.randn(size, size, device="cuda")
    c = torch.empty(size, size, device="cuda")
    a_d, b_d, c_d = (cuda.as_cuda_array(t) for t in (a, b, c))
    gflop = 2 * size**3 / 1e9
    rows = []

    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # true fp32 SGEMM, the same arithmetic as the ladder
    try:
        ms = _median_ms(lambda: torch.matmul(a, b, out=c), repeats)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    rows.append(_row("cuBLAS", f"{size}^3", ms, gflop, "GFLOP/s"))

    for rung in ladder.RUNGS.values():
        reps = naive_repeats if rung.name == "naive" else repeats
        ms = _median_ms(lambda rung=rung: ladder.launch_sgemm(rung, a_d, b_d, c_d), reps)
        rows.append(_row(rung.name, f"{size}^3", ms, gflop, "GFLOP/s"))
    return rows


def _add_ratios(rows: list[dict]) -> None:
    """% of the group's baseline and speed-up over the previous rung.

    A group is [baseline, first rung, second rung, ...]: cuBLAS then the SGEMM
    rungs in ladder order, or torch add then vector_add.
    """
    baseline = rows[0]["rate"]
    for i, row in enumerate(rows):
        row["pct_of_baseline"] = 100 * row["rate"] / baseline
        row["speedup_vs_prev"] = row["rate"] / rows[i - 1]["rate"] if i >= 2 else None


def _print_table(groups: list[list[dict]]) -> None:
    header = f"{'kernel':<12} {'shape':>14} {'ms':>10} {'rate':>18} {'% of baseline':>14} {'x prev rung':>12}"
    print(header)
    print("-" * len(header))
    for rows in groups:
        for r in rows:
            prev = f"{r['speedup_vs_prev']:.2f}x" if r["speedup_vs_prev"] else "-"
            rate = f"{r['rate']:,.0f} {r['unit']}"
            pct = f"{r['pct_of_baseline']:.1f}%"
            print(f"{r['kernel']:<12} {r['shape']:>14} {r['ms']:>10.3f} {rate:>18} {pct:>14} {prev:>12}")
        print()


def _plot(groups: list[list[dict]], path: Path, device: str) -> None:
    """One bar chart per SGEMM size: GFLOP/s of each rung, then cuBLAS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4), squeeze=False)
    for ax, rows in zip(axes[0], groups):
        rows = rows[1:] + rows[:1]  # the rungs in order, then cuBLAS
        bars = ax.bar([r["kernel"] for r in rows], [r["rate"] for r in rows], color=["C0"] * (len(rows) - 1) + ["C3"])
        ax.bar_label(bars, labels=[f"{r['pct_of_baseline']:.0f}%" for r in rows], fontsize=8)
        ax.set_title(f"SGEMM {rows[0]['shape']} on {device}")
        ax.set_ylabel("GFLOP/s (label: % of cuBLAS)")
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_ladder(
    sizes: list[int] | tuple[int, ...] = (4096,),
    out_dir: str | Path = "out",
    *,
    repeats: int = 10,
    naive_repeats: int = 3,
    vector_len: int = 1 << 27,
) -> dict:
    """Benchmark every rung at each square size; print the table, write JSON and PNG; return the numbers."""
    if not sizes or any(s <= 0 for s in sizes):
        raise NanoforgeError(f"sizes must be positive integers, got {list(sizes)}", param="sizes")
    _require_gpu()
    import torch

    groups = [_vector_add_rows(vector_len, repeats)] + [_sgemm_rows(s, repeats, naive_repeats) for s in sizes]
    meta = {"device": torch.cuda.get_device_name(), "repeats": repeats, "naive_repeats": naive_repeats}
    return _report(groups, sizes, out_dir, meta)


def _report(groups: list[list[dict]], sizes, out_dir: str | Path, meta: dict) -> dict:
    """Ratios, the table, simt_ladder.json and simt_ladder.png from the timed rows."""
    for rows in groups:
        _add_ratios(rows)
    print(f"SIMT ladder on {meta['device']} (median of {meta['repeats']} runs; naive: {meta['naive_repeats']})")
    _print_table(groups)
    # The point of the ladder: what register tiling adds over shared-memory tiling alone.
    regtile_gain = {}
    for size, rows in zip(sizes, groups[1:]):
        rate = {r["kernel"]: r["rate"] for r in rows}
        regtile_gain[str(size)] = {k: rate[k] / rate["smem_tiled"] for k in ("regtile_1d", "regtile_2d")}
        print(
            f"register tiling over shared-memory tiling alone at {size}^3: "
            f"1-D {regtile_gain[str(size)]['regtile_1d']:.2f}x, 2-D {regtile_gain[str(size)]['regtile_2d']:.2f}x"
        )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        **meta,
        "baselines": {"vector_add": "torch.add", "sgemm": "cuBLAS via torch.matmul, fp32, TF32 off"},
        "vector_add": groups[0],
        "sgemm": {str(s): rows for s, rows in zip(sizes, groups[1:])},
        "register_tiling_over_smem_tiling": regtile_gain,
    }
    (out / "simt_ladder.json").write_text(json.dumps(result, indent=2))
    _plot(groups[1:], out / "simt_ladder.png", meta["device"])
    print(f"wrote {out / 'simt_ladder.json'} and {out / 'simt_ladder.png'}")
    return result
