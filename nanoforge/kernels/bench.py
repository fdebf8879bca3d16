"""`nanoforge kernels bench`: each kernel beside its library baseline, timed in the same process.

`run(kinds, out_dir, quick)` prints one table, writes `kernels_bench.json` and
`roofline.png` into out_dir, and returns what it wrote. Kinds:

- "gemm": our matmul (schedule "auto") vs cuBLAS (torch.matmul) on square 4096
  and 8192 and on the linear layers of GPT-2 (768 hidden, 3072 MLP, 50257
  vocab) and Llama-3-8B (4096 hidden, 14336 MLP, 1024 kv projection, 128256
  vocab) at M = 16384 tokens, both *launched* the way a user calls them: a
  Python loop of calls with CUDA events around the loop (`time_launched_ms`),
  so a call whose host side is slower than its kernel shows. The summary gives
  the geometric-mean ratio. Then gate-and-up with SwiGLU in the GEMM's epilogue
  (`activation="swiglu"`) vs cuBLAS + the SwiGLU kernel, at Llama-3.2-1B's and
  Qwen3-0.6B's shapes and a prefill step of 16,384 tokens, in CUDA graphs.
- "streamk": shapes whose tile count lands just past a multiple of the SM
  count; Stream-K and the hybrid vs our data-parallel tiled kernel.
- "rmsnorm": rms_norm vs F.rms_norm, add_rms_norm vs torch add + F.rms_norm.
- "flash", "paged", "gemv": rows from `bench_rows(quick)` in
  nanoforge/kernels/flash_attention.py, paged_attention.py and gemv.py, when present.

A row: {"kernel", "shape", "ours_ms", "base_ms", "baseline", "ratio" (base_ms /
ours_ms, > 1 means ours is faster), "flops", "bytes" (compulsory traffic),
"ours_tflops", "ours_gbps"}. Other times are medians of triton.testing.do_bench,
which clears the L2 cache before every call, so inputs small enough to stay
in L2 are not flattered; the launched GEMM loops rotate over copies of their
inputs instead.

The roofline's two ceilings are measured at start: a 1 GiB device-to-device
copy (bandwidth) and an 8192^3 bf16 torch.matmul (compute).
"""

# ruff: noqa: B023 (each timing lambda is called before its loop variables move on)
from __future__ import annotations

import importlib
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from nanoforge.errors import NanoforgeError

KINDS = ("gemm", "streamk", "rmsnorm", "flash", "paged", "gemv")
TOKENS = 16384  # M of the model-shaped GEMMs
_EXTERNAL = {"flash": "flash_attention", "paged": "paged_attention", "gemv": "gemv"}


# --------------------------------------------------------------------------- measuring


def time_ms(fn: Callable[[], object], quick: bool = False, grad_to_none: list | None = None,
            graph: bool = False) -> float:
    """Median milliseconds of fn() on the GPU. One untimed call first (compilation, autotuning), then
    triton.testing.do_bench, which clears L2 before every call; with `graph`, do_bench_cudagraph: the calls
    replayed from a CUDA graph, so the time is the GPU's alone, without the host's launch overhead (how the
    training step runs them). `grad_to_none`: tensors whose .grad is reset between calls (timing a backward)."""
    from triton.testing import do_bench, do_bench_cudagraph

    fn()
    torch.cuda.synchronize()
    if graph:
        return do_bench_cudagraph(fn, rep=40 if quick else 100, grad_to_none=grad_to_none, return_mode="median")
    return do_bench(fn, warmup=10 if quick else 25, rep=40 if quick else 100, grad_to_none=grad_to_none,
                    return_mode="median")


def time_launched_ms(fns: list[Callable[[], object]], device: torch.device, quick: bool = False) -> float:
    """Milliseconds per call of a user's loop: fns[0](), fns[1](), ... called back to back from Python with
    no synchronization between calls, timed around the whole loop (CUDA events on a GPU, the wall clock
    elsewhere), median of 5 loops. The host's launch path is included: where it is slower than the
    kernel, the GPU waits for it and the time shows it. `fns`: the same call on different copies of its
    inputs, so that the L2 cache keeps none of them from one call to the next. One untimed round first
    (compilation, autotuning)."""
    cuda = device.type == "cuda"

    def loop(n: int) -> float:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(n):
                fns[i % len(fns)]()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / n
        t0 = time.perf_counter()
        for i in range(n):
            fns[i % len(fns)]()
        return (time.perf_counter() - t0) * 1e3 / n

    for fn in fns:
        fn()
    if cuda:
        torch.cuda.synchronize()
    target_ms = (10.0 if quick else 30.0) if cuda else 0.0
    n = max(len(fns), 3 if cuda else 1, math.ceil(target_ms / loop(len(fns))))
    return statistics.median(loop(n) for _ in range(5))


def rotating_copies(nbytes: int, device: torch.device) -> int:
    """How many copies of a call's inputs (nbytes) to cycle through so that twice the L2 cache passes
    between two uses of one copy (at most 16); 1 off a GPU."""
    if device.type != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
    return max(1, min(16, math.ceil(2 * l2 / nbytes)))


def make_row(kernel: str, shape: str, ours_ms: float, base_ms: float, baseline: str, flops: float,
             nbytes: float) -> dict:
    """One table row in the format every kernel's bench_rows() returns."""
    return {"kernel": kernel, "shape": shape, "ours_ms": ours_ms, "base_ms": base_ms, "baseline": baseline,
            "ratio": base_ms / ours_ms, "flops": flops, "bytes": nbytes,
            "ours_tflops": flops / ours_ms / 1e9, "ours_gbps": nbytes / ours_ms / 1e6}


def measure_ceilings(quick: bool) -> dict:
    """Achievable HBM bandwidth (GB/s, big copy) and bf16 tensor-core throughput (TFLOP/s, big matmul)."""
    print("measuring ceilings: 1 GiB copy, 8192^3 bf16 matmul", flush=True)
    n = 1 << 29  # bf16 elements = 1 GiB
    src = torch.empty(n, device="cuda", dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), quick)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = time_ms(lambda: torch.matmul(a, b), quick)
    return {"copy_gbps": 2 * n * 2 / copy_ms / 1e6, "matmul_tflops": 2 * 8192**3 / mm_ms / 1e9}


# --------------------------------------------------------------------------- suites


def gemm_shapes() -> list[tuple[str, int, int, int]]:
    """(name, M, N, K) for C[M, N] = A[M, K] @ B[K, N]."""
    gpt2 = [("qkv", 768, 2304), ("attn-out", 768, 768), ("mlp-up", 768, 3072), ("mlp-down", 3072, 768),
            ("lm-head", 768, 50257)]
    llama = [("q/o", 4096, 4096), ("k/v", 4096, 1024), ("gate/up", 4096, 14336), ("down", 14336, 4096),
             ("lm-head", 4096, 128256)]
    return ([("square", 4096, 4096, 4096), ("square", 8192, 8192, 8192)]
            + [(f"gpt2 {name}", TOKENS, n, k) for name, k, n in gpt2]
            + [(f"llama3-8b {name}", TOKENS, n, k) for name, k, n in llama])


def streamk_shapes(num_sms: int) -> list[tuple[int, int, int]]:
    """(M, N, K) whose 128x256 tile count is just past a multiple of num_sms, so
    also with 256x128, 128x128 and 64x128 tiles (2x and 4x as many): the last
    data-parallel wave runs nearly empty. K = 8192 makes each tile long."""
    shapes = []
    for waves, tile_rows in [(1, 8), (1, 16), (1, 4), (2, 8)]:
        tile_cols = waves * num_sms // tile_rows + 1
        shapes.append((128 * tile_rows, 256 * tile_cols, 8192))
    return shapes


def _check_close(ours: torch.Tensor, base: torch.Tensor, what: str) -> None:
    """Refuse to report the speed of a wrong answer (sampled rows vs the baseline)."""
    rows = slice(None, None, max(1, ours.shape[0] // 64))
    o, b = ours[rows].double(), base[rows].double()
    err = (o - b).norm() / b.norm()
    if not err < 1e-2:
        raise RuntimeError(f"{what}: relative error vs the baseline is {err:.3g}; not benchmarking a wrong kernel")


def _gemm_rows(quick: bool, shapes: list[tuple[str, int, int, int]] | None = None,
               device: str = "cuda") -> list[dict]:
    """Our matmul vs torch.matmul, both launched in a loop (`time_launched_ms`), on rotating inputs."""
    from nanoforge.kernels.matmul import matmul

    device = torch.device(device)
    if shapes is None:
        shapes = gemm_shapes()
        if quick:
            shapes = [shapes[0], shapes[2], shapes[8]]
    rows = []
    for i, (name, M, N, K) in enumerate(shapes, 1):
        print(f"[gemm {i}/{len(shapes)}] {name} {M}x{N}x{K}: autotune + time", flush=True)
        copies = rotating_copies(2 * (M * K + K * N), device)
        inputs = [(torch.randn(M, K, device=device, dtype=torch.bfloat16),
                   torch.randn(K, N, device=device, dtype=torch.bfloat16)) for _ in range(copies)]
        a, b = inputs[0]
        _check_close(matmul(a, b), torch.matmul(a, b), f"gemm {name}")
        ours = time_launched_ms([lambda a=a, b=b: matmul(a, b) for a, b in inputs], device, quick)
        base = time_launched_ms([lambda a=a, b=b: torch.matmul(a, b) for a, b in inputs], device, quick)
        rows.append(make_row("gemm", f"{name} {M}x{N}x{K}", ours, base, "cuBLAS (torch.matmul)",
                             2.0 * M * N * K, 2.0 * (M * K + K * N + M * N)))
        del inputs, a, b
    return rows


def _swiglu_rows(quick: bool) -> list[dict]:
    """Gate-and-up + SwiGLU of a 16K-token prefill step: one GEMM with SwiGLU in its epilogue against cuBLAS's
    (tokens, 2F) product and the SwiGLU kernel, each replayed from a CUDA graph as the engine's prefill steps are.
    Bytes: the weight, the input and the (tokens, F) output; cuBLAS's way also moves the product (3 passes)."""
    from nanoforge.kernels.matmul import linear
    from nanoforge.kernels.swiglu import silu_mul

    rows = []
    for name, d, f in (("llama3-1b", 2048, 8192), ("qwen3-0.6b", 1024, 3072))[: 1 if quick else None]:
        print(f"[gemm-swiglu] {name} gate-and-up {TOKENS}x{2 * f}x{d}", flush=True)
        x = torch.randn(TOKENS, d, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(2 * f, d, device="cuda") / d**0.5).bfloat16()
        _check_close(linear(x, w, activation="swiglu"), silu_mul(x @ w.t()), f"swiglu {name}")
        ours = time_ms(lambda: linear(x, w, activation="swiglu"), quick, graph=True)
        base = time_ms(lambda: silu_mul(x @ w.t()), quick, graph=True)
        rows.append(make_row("gemm-swiglu", f"{name} {TOKENS}x{2 * f}x{d}", ours, base, "cuBLAS + SwiGLU kernel",
                             2.0 * TOKENS * 2 * f * d, 2.0 * (TOKENS * d + 2 * f * d + TOKENS * f)))
    return rows


def _gemm_suite(quick: bool) -> list[dict]:
    return _gemm_rows(quick) + _swiglu_rows(quick)


def _streamk_rows(quick: bool) -> list[dict]:
    from nanoforge.kernels.matmul import _num_sms, matmul

    num_sms = _num_sms(torch.device("cuda"))
    shapes = streamk_shapes(num_sms)[: 2 if quick else None]
    rows = []
    for i, (M, N, K) in enumerate(shapes, 1):
        tiles = (M // 128) * (N // 256)
        print(f"[streamk {i}/{len(shapes)}] {M}x{N}x{K}: {tiles} tiles of 128x256 = {tiles / num_sms:.2f} waves "
              f"on {num_sms} SMs", flush=True)
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        dp = matmul(a, b, schedule="tiled")
        # GPU time (CUDA-graph replay): the schedules' GPU work compared alone, as the training step runs it
        # (launched one at a time with do_bench's L2 flush, these ~0.12 ms kernels swung with the host).
        dp_ms = time_ms(lambda: matmul(a, b, schedule="tiled"), quick, graph=True)
        for schedule in ("streamk", "hybrid"):
            _check_close(matmul(a, b, schedule=schedule), dp, f"{schedule} {M}x{N}x{K}")
            ms = time_ms(lambda: matmul(a, b, schedule=schedule), quick, graph=True)
            rows.append(make_row(f"gemm-{schedule}", f"{M}x{N}x{K}", ms, dp_ms, "triton tiled (data-parallel)",
                                 2.0 * M * N * K, 2.0 * (M * K + K * N + M * N)))
    return rows


def _rmsnorm_rows(quick: bool) -> list[dict]:
    from nanoforge.kernels.rmsnorm import add_rms_norm, rms_norm

    shapes = [(TOKENS, 4096), (TOKENS, 768), (TOKENS, 8192)][: 1 if quick else None]
    rows = []
    for i, (T, H) in enumerate(shapes, 1):
        print(f"[rmsnorm {i}/{len(shapes)}] {T}x{H}", flush=True)
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        res = torch.randn_like(x)
        w = torch.randn(H, device="cuda", dtype=torch.bfloat16)
        _check_close(rms_norm(x, w, 1e-5), F.rms_norm(x, (H,), w, 1e-5), "rmsnorm")
        ours = time_ms(lambda: rms_norm(x, w, 1e-5), quick)
        base = time_ms(lambda: F.rms_norm(x, (H,), w, 1e-5), quick)
        rows.append(make_row("rmsnorm", f"{T}x{H}", ours, base, "torch F.rms_norm", 4.0 * T * H, 2.0 * (2 * T * H + H)))
        ours = time_ms(lambda: add_rms_norm(x, res, w, 1e-5), quick)
        base = time_ms(lambda: F.rms_norm(x + res, (H,), w, 1e-5), quick)
        rows.append(make_row("add-rmsnorm", f"{T}x{H}", ours, base, "torch add + F.rms_norm", 5.0 * T * H,
                             2.0 * (4 * T * H + H)))
    return rows


def _external_rows(kind: str, quick: bool) -> list[dict]:
    """Rows from another kernel module's bench_rows(quick); skipped (with a note) if it has none yet."""
    module = f"nanoforge.kernels.{_EXTERNAL[kind]}"
    try:
        bench_rows = importlib.import_module(module).bench_rows
    except (ImportError, AttributeError) as e:
        print(f"[{kind}] skipped: {module}.bench_rows is not available ({e})", flush=True)
        return []
    print(f"[{kind}] {module}.bench_rows(quick={quick})", flush=True)
    return bench_rows(quick)


_SUITES = {"gemm": _gemm_suite, "streamk": _streamk_rows, "rmsnorm": _rmsnorm_rows}


# --------------------------------------------------------------------------- report


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def summarize(rows: list[dict]) -> dict:
    gemm = [r["ratio"] for r in rows if r["kernel"] == "gemm"]
    # per wave-quantized shape, the better of Stream-K and the hybrid
    best: dict[str, float] = {}
    for r in rows:
        if r["kernel"] in ("gemm-streamk", "gemm-hybrid"):
            best[r["shape"]] = max(best.get(r["shape"], 0.0), r["ratio"])
    return {"gemm_vs_cublas_geomean": _geomean(gemm), "gemm_shapes": len(gemm),
            "streamk_vs_dp_geomean": _geomean(list(best.values())),
            "streamk_vs_dp_min": min(best.values()) if best else float("nan"), "streamk_shapes": len(best)}


def format_table(rows: list[dict]) -> str:
    head = (f"{'kernel':<16} {'shape':<38} {'ours ms':>9} {'base ms':>9} {'ratio':>6} {'TFLOP/s':>8} {'GB/s':>7}"
            "  baseline")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['kernel']:<16} {r['shape']:<38} {r['ours_ms']:>9.4f} {r['base_ms']:>9.4f} "
                     f"{r['ratio']:>6.3f} {r['ours_tflops']:>8.1f} {r['ours_gbps']:>7.0f}  {r['baseline']}")
    return "\n".join(lines)


def plot_roofline(rows: list[dict], ceilings: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peak, bw = ceilings["matmul_tflops"], ceilings["copy_gbps"] / 1e3  # TFLOP/s and TB/s
    intensity = [r["flops"] / r["bytes"] for r in rows] or [1.0]
    lo, hi = min(intensity + [peak / bw]) / 4, max(intensity + [peak / bw]) * 4
    fig, ax = plt.subplots(figsize=(9, 6))
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(xs, [min(peak, bw * x) for x in xs], "k-", lw=1.5,
            label=f"ceilings: {bw:.2f} TB/s copy, {peak:.0f} TFLOP/s bf16 matmul")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, kernel in enumerate(dict.fromkeys(r["kernel"] for r in rows)):
        mine = [r for r in rows if r["kernel"] == kernel]
        c = colors[i % len(colors)]
        x = [r["flops"] / r["bytes"] for r in mine]
        ax.scatter(x, [r["ours_tflops"] for r in mine], color=c, label=f"{kernel} (ours)", zorder=3)
        ax.scatter(x, [r["flops"] / r["base_ms"] / 1e9 for r in mine], facecolors="none", edgecolors=c,
                   marker="s", label=f"{kernel} baseline: {mine[0]['baseline']}", zorder=2)
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP/byte)", ylabel="achieved TFLOP/s",
           title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(kinds: list[str], out_dir: Path, quick: bool = False) -> dict:
    """Benchmark the chosen kinds on the current CUDA GPU; print, write JSON + PNG, return the report."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise NanoforgeError(f"unknown benchmark kind(s) {unknown}; choose from {list(KINDS)}", param="kinds")
    if not torch.cuda.is_available():
        raise NanoforgeError("kernels bench needs a CUDA GPU, and torch sees none (torch.cuda.is_available() is "
                             "False)")
    import triton

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    ceilings = measure_ceilings(quick)
    rows: list[dict] = []
    for kind in kinds:
        rows += _SUITES[kind](quick) if kind in _SUITES else _external_rows(kind, quick)
        # what is measured so far survives a run cut short (a time limit, a crash in a later suite)
        (out_dir / "kernels_bench.partial.json").write_text(json.dumps({"ceilings": ceilings, "rows": rows}))
    summary = summarize(rows)
    report = {"device": props.name, "sm_count": props.multi_processor_count, "torch": torch.__version__,
              "triton": triton.__version__, "quick": quick, "kinds": list(kinds), "ceilings": ceilings,
              "rows": rows, "summary": summary}

    print()
    print(format_table(rows))
    print(f"ceilings: {ceilings['copy_gbps']:.0f} GB/s copy, {ceilings['matmul_tflops']:.0f} TFLOP/s bf16 matmul")
    if summary["gemm_shapes"]:
        print(f"GEMM vs cuBLAS: geometric-mean ratio {summary['gemm_vs_cublas_geomean']:.3f} over "
              f"{summary['gemm_shapes']} shapes, launched from Python (target >= 0.95)")
    if summary["streamk_shapes"]:
        print(f"Stream-K/hybrid vs data-parallel on wave-quantized shapes: geometric mean "
              f"{summary['streamk_vs_dp_geomean']:.3f}, min {summary['streamk_vs_dp_min']:.3f} "
              f"(target >= 1.15)")
    (out_dir / "kernels_bench.json").write_text(json.dumps(report, indent=2))
    (out_dir / "kernels_bench.partial.json").unlink()
    plot_roofline(rows, ceilings, out_dir / "roofline.png", f"nanoforge kernels on {props.name}")
    print(f"wrote {out_dir / 'kernels_bench.json'} and {out_dir / 'roofline.png'}")
    return report
