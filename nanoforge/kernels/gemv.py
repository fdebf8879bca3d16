"""Skinny matmul for decode: y = f(x) @ W^T (+ bias) for a handful of rows x, bound by reading W.

A decode step multiplies a few token rows (batch 1-16) by every weight matrix once: the work is reading W from
HBM. cuBLAS picks general GEMM tiles for these shapes (on the H200, Llama-3.2-1B's attention-out, 2,048 x 2,048,
took 5.8 us, ~1.4 TB/s, and MLP-down a split-K GEMM plus a reduce kernel). Here each program owns BLOCK_N rows
of W and streams them along K in BLOCK_K tiles (the loads software-pipelined under `tl.dot` on the x rows, padded
to 16), so every SM reads its own contiguous rows; the output needs no reduction across programs.

`swiglu=True` takes x as the fused gate-and-up activations (..., 2K) and multiplies by silu(gate) * up,
computed in the prologue as `swiglu.silu_mul` does it (silu rounded to the dtype, then the product): MLP-down
without the separate SwiGLU launch.

The reference is `F.linear` (after `silu_mul_ref` for swiglu). The fast path runs outside autograd, for at most
MAX_ROWS rows of a 16/32-bit float dtype; anything else takes the reference.

Neither this kernel nor cuBLAS wins every decode shape (one H200 run of `kernels bench --kinds gemv`, in CUDA
graphs: Qwen3-0.6B's attention-out at one row 4.2 us against cuBLAS's 12.3; Llama-3.2-1B's QKV 5.3 against 5.1;
the fused SwiGLU prologue 0.17-0.26x, as every program recomputes the whole activation). So the model's
decode-sized projections go through `skinny_linear`, which takes, per shape, the fastest of cuBLAS, this kernel
and (MLP-down) the fused prologue, timed once on the device in CUDA graphs the first time the shape is seen
outside a graph capture (the engine's warm-up before it captures). NANOFORGE_GEMV picks the mode: `auto` (that
choice; the default), `1` (this kernel wherever it fits, the prologue fused), `0` (cuBLAS only).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanoforge.kernels.dispatch import interpreting, use_fast
from nanoforge.kernels.matmul import (
    _dot,  # tl.dot that also works on bfloat16 under the CPU interpreter
)
from nanoforge.kernels.swiglu import silu_mul_ref

MAX_ROWS = 16  # rows of x the kernel takes (one tl.dot tile); more is a GEMM's work
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
             swiglu: bool = False) -> torch.Tensor:
    return F.linear(silu_mul_ref(x) if swiglu else x, weight, bias)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         swiglu: bool = False) -> torch.Tensor:
    """x (..., K) (swiglu: (..., 2K)), weight (N, K), bias (N,) or None -> (..., N)."""
    k = weight.shape[1]
    if x.shape[-1] != (2 * k if swiglu else k):
        raise ValueError(f"gemv: x has {x.shape[-1]} features; weight {tuple(weight.shape)} needs "
                         f"{2 * k if swiglu else k}{' (gate and up)' if swiglu else ''}")
    if not fits(x, weight):
        return gemv_ref(x, weight, bias, swiglu=swiglu)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m, n = rows.shape[0], weight.shape[0]
    out = _empty(m, n, like=rows)
    block_m = max(16, triton.next_power_of_2(m))
    args = (rows, weight, bias if bias is not None else out, out, m, n, k, rows.stride(0), weight.stride(0),
            out.stride(0))
    meta = {"HAS_BIAS": bias is not None, "SWIGLU": swiglu, "BLOCK_M": block_m}
    if interpreting():  # one small configuration: the autotuner would run every one of them on the CPU
        _gemv_kernel[(triton.cdiv(n, 16),)](*args, **meta, BLOCK_N=16, BLOCK_K=32, num_warps=1)
    else:
        _gemv_tuned[lambda c: (triton.cdiv(n, c["BLOCK_N"]),)](*args, **meta)
    return out.reshape(*x.shape[:-1], n)


def mode() -> str:
    """NANOFORGE_GEMV: "auto" (per shape, the fastest way, measured), "1" (this kernel) or "0" (cuBLAS)."""
    m = os.environ.get("NANOFORGE_GEMV", "auto").lower()
    if m not in ("auto", "1", "0"):
        from nanoforge.errors import NanoforgeError

        raise NanoforgeError(f"NANOFORGE_GEMV must be auto, 1 or 0, not {m!r}", param="NANOFORGE_GEMV")
    return m


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  swiglu: bool = False) -> torch.Tensor:
    """F.linear(silu_mul(x) if swiglu else x, weight, bias) for operands that `fits`, by the way `mode` chooses:
    "cublas", "ours" (this kernel after silu_mul) or "fused" (SwiGLU in its prologue)."""
    from nanoforge.kernels.swiglu import silu_mul

    way = choose(x, weight, bias, swiglu)
    if way == "fused":
        return gemv(x, weight, bias, swiglu=True)
    h = silu_mul(x) if swiglu else x
    return gemv(h, weight, bias) if way == "ours" else F.linear(h, weight, bias)


_CHOICES: dict[tuple, str] = {}  # (device, dtype, rows, K, N, bias, swiglu) -> the fastest way, once timed


def choose(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, swiglu: bool) -> str:
    m = mode()
    if m != "auto":
        return "cublas" if m == "0" else ("fused" if swiglu else "ours")
    rows = x.numel() // x.shape[-1]
    key = (str(x.device), x.dtype, rows, *weight.shape[::-1], bias is not None, swiglu)
    way = _CHOICES.get(key)
    if way is None:
        if not _can_time(x):
            return "cublas"  # nothing to time here (the interpreter; inside a capture): the library's
        way = _CHOICES[key] = _fastest(x, weight, bias, swiglu)
    return way


def _can_time(x: torch.Tensor) -> bool:
    return x.device.type == "cuda" and not torch.cuda.is_current_stream_capturing()


def _fastest(x, weight, bias, swiglu) -> str:
    """Time each way on copies of the operands (W rotated through enough copies that L2 holds none of them, as a
    model's layers stream theirs from HBM) and return the fastest."""
    from nanoforge.kernels.swiglu import silu_mul

    copies = max(1, min(16, -(-(96 << 20) // (weight.numel() * weight.element_size()))))
    ws = [weight.clone() for _ in range(copies)]
    xs = x.reshape(-1, x.shape[-1]).clone()
    ways = {"cublas": lambda w: F.linear(silu_mul(xs) if swiglu else xs, w, bias),
            "ours": lambda w: gemv(silu_mul(xs) if swiglu else xs, w, bias)}
    if swiglu:
        ways["fused"] = lambda w: gemv(xs, w, bias, swiglu=True)
    times = {name: _graph_us(lambda f=f: [f(w) for w in ws]) / copies for name, f in ways.items()}
    return min(times, key=times.get)


def _graph_us(fn, replays: int = 5) -> float:
    """Microseconds of fn() replayed from a CUDA graph (best of `replays`); one eager call first (autotuning)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # a KV connector's thread may use CUDA meanwhile
        fn()
    best = float("inf")
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, 1000 * start.elapsed_time(end))
    return best


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `gemv` takes its fast path for these operands."""
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return False
    rows = x.numel() // max(1, x.shape[-1])
    return (use_fast(x, weight) and x.dtype == weight.dtype and x.dtype in _DTYPES and 0 < rows <= MAX_ROWS
            and weight.dim() == 2)


def _empty(*shape: int, like: torch.Tensor) -> torch.Tensor:
    """Every kernel output is allocated here (tests swap it for a NaN-filled one to catch unwritten elements)."""
    return torch.empty(shape, device=like.device, dtype=like.dtype)


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _gemv_kernel(
    X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    x_rows = X + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = W + offs_n[None, :].to(tl.int64) * stride_wn
    ty = Y.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        x_mask = m_ok[:, None] & k_ok[None, :]
        if SWIGLU:  # x holds [gate | up]: silu(gate) rounded to the dtype, times up (swiglu.silu_mul's rounding)
            g = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0).to(tl.float32)
            u = tl.load(x_rows + K + k[None, :], mask=x_mask, other=0.0).to(tl.float32)
            xt = ((g / (1.0 + tl.exp(-g))).to(ty).to(tl.float32) * u).to(ty)
        else:
            xt = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0)
        wt = tl.load(w_rows + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # (BLOCK_K, BLOCK_N)
        acc = _dot(xt, wt, acc)
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], acc.to(ty),
             mask=m_ok[:, None] & n_ok[None, :])


# Rows per program trade parallelism (N / BLOCK_N programs over 132 SMs) against the loads each one keeps in
# flight; the autotuner picks per (N, K, rows) on the first call, which the engine makes before it captures.
_gemv_tuned = triton.autotune(
    configs=[triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
             for bn, bk, w, s in ((16, 256, 4, 4), (16, 512, 4, 3), (16, 128, 4, 6), (32, 256, 4, 4),
                                  (32, 128, 4, 5), (64, 128, 4, 4), (64, 256, 8, 3), (128, 128, 8, 3))],
    key=["N", "K", "BLOCK_M", "SWIGLU"],
)(_gemv_kernel)


# ----------------------------------------------------------------------------------------------
# Benchmark (`nanoforge kernels bench --kinds gemv`)
# ----------------------------------------------------------------------------------------------

# (model, layer, K, N): every projection of a decode step of Llama-3.2-1B and Qwen3-0.6B
BENCH_SHAPES = [("llama3-1b", "qkv", 2048, 3072), ("llama3-1b", "attn-out", 2048, 2048),
                ("llama3-1b", "gate-up", 2048, 16384), ("llama3-1b", "down+swiglu", 8192, 2048),
                ("qwen3-0.6b", "qkv", 1024, 4096), ("qwen3-0.6b", "attn-out", 2048, 1024),
                ("qwen3-0.6b", "gate-up", 1024, 6144), ("qwen3-0.6b", "down+swiglu", 3072, 1024)]


def bench_rows(quick: bool) -> list[dict]:
    """Each decode projection at 1 (and, not quick, 8) rows, bf16, timed in CUDA graphs (as the engine replays
    them), against cuBLAS through F.linear (after the SwiGLU kernel where ours fuses it): the ratio is the time a
    decode step saves per projection."""
    from nanoforge.errors import NanoforgeError
    from nanoforge.kernels.bench import make_row, time_ms
    from nanoforge.kernels.swiglu import silu_mul

    if not torch.cuda.is_available():
        raise NanoforgeError("gemv benchmarks need a CUDA GPU", param="kinds")
    rows = []
    for model, layer, k, n in BENCH_SHAPES:
        swiglu = layer.endswith("swiglu")
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        for m in (1,) if quick else (1, 8):
            x = torch.randn(m, 2 * k if swiglu else k, device="cuda", dtype=torch.bfloat16)
            ours = time_ms(lambda x=x, w=w, s=swiglu: gemv(x, w, swiglu=s), quick, graph=True)
            base = time_ms(lambda x=x, w=w, s=swiglu: F.linear(silu_mul(x) if s else x, w), quick, graph=True)
            rows.append(make_row("gemv", f"{model} {layer} {m}x{k}x{n}", ours, base,
                                 "F.linear (cuBLAS)" + (" after silu_mul" if swiglu else ""), 2.0 * m * k * n,
                                 2.0 * (n * k + m * (2 * k if swiglu else k) + m * n)))
    return rows

