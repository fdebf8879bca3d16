"""Skinny matmul for decode: y = act(f(x) @ W^T + bias) for a handful of rows x, bound by reading W.

A decode step multiplies a few token rows (batch 1-16) by every weight matrix once: the work is reading W from
HBM. cuBLAS picks general GEMM tiles for these shapes (on the H200, Llama-3.2-1B's attention-out, 2,048 x 2,048,
took 5.8 us, ~1.4 TB/s, and MLP-down a split-K GEMM plus a reduce kernel). Here each program owns BLOCK_N rows
of W and streams them along K in BLOCK_K tiles (the loads software-pipelined under `tl.dot` on the x rows, padded
to 16), so every SM reads its own contiguous rows; the output needs no reduction across programs. (Cutting K into
ranges for the matrices with fewer rows than SMs x BLOCK_N, the tile's last range adding the sums up, was no
faster on the H200 and was taken out in session 52; see GEMV_CONFIGS.)

What a decode layer does around its projections rides along, so that a layer is fewer launches:

- `norm_gemv(a, x, g, eps, W)`: the residual add and RMSNorm before Q/K/V and before gate-and-up in the
  prologue. Every program computes the row's statistics itself (a first pass over x + a, a few KB that stay in
  L1/L2 for the second), normalises each K tile as `rmsnorm.add_rms_norm` rounds it, and programs take turns
  storing the sum x + a, the residual stream the next layer adds to.
- `swiglu=True`: silu(gate) * up in the epilogue: W is the fused (2F, K) gate-and-up matrix, each program
  computes gate rows [n, n + BLOCK_N) and the matching up rows, and writes F outputs, rounded as
  `F.linear` then `swiglu.silu_mul` round them.
- every kernel launches with programmatic dependent launch where the device has it (`kernels/pdl.py`), and,
  launched early, asks L2 for its first W tiles (`prefetch_k` of them, up to 16 MiB a matrix) before it waits
  for its predecessor: W is no kernel's output, so the stream from HBM starts while the kernel before it ends.

References: `gemv_ref` (`F.linear`, then `silu_mul_ref` with swiglu) and `norm_gemv_ref` (`add_rms_norm_ref`
first). The fast path runs outside autograd, for at most MAX_ROWS rows of a 16/32-bit float dtype; anything
else takes the reference.

Neither this kernel nor cuBLAS wins every decode shape (one H200 run of `kernels bench --kinds gemv`, in CUDA
graphs, session 10: Qwen3-0.6B's attention-out at one row 4.2 us against cuBLAS's 12.3; Llama-3.2-1B's QKV 5.3
against 5.1). So the model's decode-sized projections go through `skinny_linear` and `norm_linear`, which take,
per shape, the faster of cuBLAS (after the separate norm kernel, before the separate SwiGLU kernel) and this
kernel with them fused, timed once on the device in CUDA graphs the first time the shape is seen outside a
graph capture (the engine's warm-up before it captures). NANOFORGE_GEMV picks the mode: `auto` (that choice;
the default), `1` (this kernel wherever it fits), `0` (cuBLAS only). The choices and the autotuner's picks are
kept on disk for the next process on the same GPU model and software (`kernels/tuning_cache.py`).
"""

from __future__ import annotations

import functools
import os
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanoforge.kernels import pdl, tuning_cache
from nanoforge.kernels.dispatch import (
    capturing, compile_in_parallel, env_choice, env_mib, interpreting, replays_us, use_fast,
)
from nanoforge.kernels.matmul import (
    _dot,  # tl.dot that also works on bfloat16 under the CPU interpreter
)
from nanoforge.kernels.rmsnorm import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref
from nanoforge.kernels.swiglu import silu_mul, silu_mul_ref, swiglu_round

MAX_ROWS = 16  # rows of x the kernel takes (one tl.dot tile); more is a GEMM's work
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
             swiglu: bool = False) -> torch.Tensor:
    y = F.linear(x, weight, bias)
    return silu_mul_ref(y) if swiglu else y


def norm_gemv_ref(a: torch.Tensor | None, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    h, s = add_rms_norm_ref(a, x, norm_weight, eps) if a is not None else (rms_norm_ref(x, norm_weight, eps), x)
    return gemv_ref(h, weight, bias, swiglu=swiglu), s


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         swiglu: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K), weight (N, K), bias (N,) or None -> (..., N), or (..., N/2) with swiglu (W: gate rows, then
    up rows); written into `out` where given (contiguous, of that shape: a CUDA graph's buffer, no copy after)."""
    _check(x, weight, swiglu)
    if not fits(x, weight) or (out is not None and not out.is_contiguous()):
        y = gemv_ref(x, weight, bias, swiglu=swiglu)
        return y if out is None else out.copy_(y)
    y = _launch(x, None, None, 0.0, weight, bias, swiglu, out)[0]
    return y if out is None else out


def norm_gemv(a: torch.Tensor | None, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
              weight: torch.Tensor, bias: torch.Tensor | None = None, *,
              swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(gemv(rms_norm(x + a), W, bias), x + a), or with x alone where a is None: the residual add, the norm and
    the projection in one launch."""
    _check(x, weight, swiglu)
    if norm_weight.shape != x.shape[-1:] or (a is not None and (a.shape != x.shape or a.dtype != x.dtype)):
        raise ValueError(f"norm_gemv: x {tuple(x.shape)}, residual {None if a is None else tuple(a.shape)} and norm "
                         f"weight {tuple(norm_weight.shape)} do not match")
    if not (fits(x, weight) and use_fast(norm_weight) and (a is None or use_fast(a))):
        return norm_gemv_ref(a, x, norm_weight, eps, weight, bias, swiglu=swiglu)
    return _launch(x, a, norm_weight, eps, weight, bias, swiglu)


def _check(x: torch.Tensor, weight: torch.Tensor, swiglu: bool) -> None:
    if x.shape[-1] != weight.shape[1] or (swiglu and weight.shape[0] % 2):
        raise ValueError(f"gemv: x has {x.shape[-1]} features and weight is {tuple(weight.shape)}: weight must be "
                         f"(N, {x.shape[-1]}){' with N even (gate and up)' if swiglu else ''}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(x, a, norm_weight, eps, weight, bias, swiglu, out=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    rows = _rows(x)
    res = _rows(a) if a is not None else None
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m, k = rows.shape
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    out = _empty(m, n, like=rows) if out is None else out.view(m, n)
    summed = _empty(m, k, like=rows) if res is not None else None
    on = pdl.enabled(rows)
    interpret = interpreting()
    args = (rows, res if res is not None else rows, norm_weight.contiguous() if norm_weight is not None else rows,
            summed if summed is not None else out, weight, bias if bias is not None else out, out, m, n, k,
            rows.stride(0), res.stride(0) if res is not None else 0, k, weight.stride(0), out.stride(0), float(eps),
            prefetch_k(weight) if on else 0)
    meta = {"NORM": norm_weight is not None, "HAS_RES": res is not None, "SWIGLU": swiglu,
            "HAS_BIAS": bias is not None, "PDL": on, "LINE": 128 // weight.element_size(),
            "BLOCK_M": max(16, triton.next_power_of_2(m)), **_stats_tile(k)}
    if interpret:  # one small configuration: the autotuner would run every one of them on the CPU
        c = INTERPRET_CONFIG
        _gemv_kernel[(triton.cdiv(n, c["BLOCK_N"]),)](*args, **meta, **c, num_warps=1)
    else:
        candidates = configs()
        kernel = _TUNED[candidates]
        tuned, started = len(kernel.cache), time.perf_counter()
        # the autotuner's key, kept here: its own cache's key format differs between Triton versions
        key = (rows.dtype, candidates, n, k, meta["BLOCK_M"], swiglu, meta["NORM"], meta["HAS_RES"])
        first, known = key not in _COMPILED, None
        if first:  # a shape not launched yet: its pick read back from disk, else its candidates compiled at once
            _COMPILED.add(key)
            known = set(kernel.cache)
            if _restore_picks(kernel, key, rows.device):
                tuned = len(kernel.cache)  # read back, not tuned
            else:
                compile_in_parallel(_gemv_kernel, kernel.configs, args, {**meta, "launch_pdl": bool(on)})
        kernel[lambda c: (triton.cdiv(n, c["BLOCK_N"]),)](*args, **meta, launch_pdl=bool(on))
        if first and len(kernel.cache) != len(known):  # the autotuner timed this shape: its pick kept on disk
            _save_picks(kernel, key, known, rows.device)
        if len(kernel.cache) != tuned and not _TUNING["choosing"]:  # this call compiled and timed configurations
            _TUNING["s"] += time.perf_counter() - started
    s = None if norm_weight is None else (summed.view(x.shape) if summed is not None else x)
    return out.reshape(*x.shape[:-1], n), s


INTERPRET_CONFIG = {"BLOCK_N": 16, "BLOCK_K": 32}  # under TRITON_INTERPRET


STATS_ELEMENTS = 4096  # of x the norm's first pass loads at once (32 fp32 registers a thread at 4 warps)


def _stats_tile(k: int) -> dict:
    """The norm's first pass loads STATS_ROWS x STATS_K of x (+ the residual) at once: whole rows up to
    STATS_ELEMENTS columns, as many rows as fit in STATS_ELEMENTS (up to a tile's 16)."""
    cols = min(triton.next_power_of_2(k), STATS_ELEMENTS)
    return {"STATS_ROWS": max(1, min(16, STATS_ELEMENTS // cols)), "STATS_K": cols}


def prefetch_k(weight: torch.Tensor) -> int:
    """How many of W's K columns (every row's first ones) a program launched early asks L2 for before it waits:
    all of them for a matrix of at most NANOFORGE_GEMV_PREFETCH_MB (default 16, a third of the H200's L2; 0 turns
    the prefetch off), a matching share of a larger one (Llama-3.2-1B's gate-and-up, 64 MiB: its first 512)."""
    budget = env_mib("NANOFORGE_GEMV_PREFETCH_MB", "16") * (1 << 20)
    return max(0, min(weight.shape[1], int(budget // (weight.shape[0] * weight.element_size()))))


def mode() -> str:
    """NANOFORGE_GEMV: "auto" (per shape, the fastest way, measured), "1" (this kernel) or "0" (cuBLAS)."""
    return env_choice("NANOFORGE_GEMV", ("auto", "1", "0"))


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  swiglu: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """gemv_ref(x, weight, bias, swiglu=swiglu) for operands that `fits`, the way `choose` picks: "ours" (this
    kernel, SwiGLU in its epilogue) or "cublas" (F.linear, then the SwiGLU kernel); into `out` where given (the
    LM head into the engine's logits buffer: session 47's profile had a 1.6 us copy kernel a step after it)."""
    if choose(x, weight, bias, swiglu, norm=False) == "ours":
        return gemv(x, weight, bias, swiglu=swiglu, out=out)
    if out is not None and bias is None and not swiglu:
        return torch.matmul(x, weight.t(), out=out)
    y = _cublas(x, weight, bias, swiglu)
    return y if out is None else out.copy_(y)


def norm_linear(a: torch.Tensor | None, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """norm_gemv_ref's result for operands that `fits`, the way `choose` picks: "ours" (one launch) or "cublas"
    (the add + RMSNorm kernel, then `skinny_linear`'s own choice)."""
    if choose(x, weight, bias, swiglu, norm=True, residual=a is not None) == "ours":
        return norm_gemv(a, x, norm_weight, eps, weight, bias, swiglu=swiglu)
    return _apart(a, x, norm_weight, eps, weight, bias, swiglu)


_CHOICES: dict[tuple, str] = {}  # (device, dtype, rows, K, N, bias, swiglu, norm, residual, configs) -> the faster way
_TUNING = {"s": 0.0, "choosing": False}
_COMPILED: set[tuple] = set()  # the autotuner's keys whose candidates were compiled in parallel


def tuning_s() -> float:
    """Seconds this process has spent tuning the skinny matmul: autotuning (compiling and timing each
    configuration for a new shape) and timing the per-shape choice against cuBLAS. A fresh engine's start pays
    them in its warm-up; what the server's first line reports."""
    return _TUNING["s"]


def choose(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, swiglu: bool, *, norm: bool,
           residual: bool = False) -> str:
    m = mode()
    if m != "auto":
        return "cublas" if m == "0" else "ours"
    rows = x.numel() // x.shape[-1]
    key = (str(x.device), x.dtype, rows, *weight.shape[::-1], bias is not None, swiglu, norm, residual, configs())
    way = _CHOICES.get(key)
    if way is None:
        if not _can_time(x):
            return "cublas"  # nothing to time here (the interpreter; inside a capture): the library's
        saved, at = _saved(x.device), repr(key[1:])  # on disk: per GPU model, not per device index
        way = saved.get(at) if saved is not None else None
        if way in ("ours", "cublas"):
            _CHOICES[key] = way
            return way
        started, _TUNING["choosing"] = time.perf_counter(), True
        try:
            way = _CHOICES[key] = _fastest(x, weight, bias, swiglu, norm, residual)
        finally:
            _TUNING["s"] += time.perf_counter() - started
            _TUNING["choosing"] = False
        if saved is not None:
            saved.put(at, way)
    return way


def _saved(device: torch.device) -> tuning_cache.Decisions | None:
    """This module's decisions on disk for the device's GPU model (`kernels/tuning_cache.py`), or None."""
    return tuning_cache.decisions("gemv", device, _salt)


_SALT_FILES = ("rmsnorm.py", "swiglu.py", "pdl.py")  # beside this one: what the two ways run besides the kernel


@functools.cache
def _salt() -> str:
    """What else a decision depends on: the kernel's Triton hash (its source and the jit functions it calls) and
    the source of this module and of the kernels the cuBLAS way runs beside F.linear."""
    here = os.path.dirname(__file__)
    return tuning_cache.source_salt(_gemv_kernel.cache_key, __file__, *(os.path.join(here, f) for f in _SALT_FILES))


def _restore_picks(kernel, key: tuple, device: torch.device) -> bool:
    """The autotuner's picks for `key` read back from disk into its cache: whether there were any. Stored as
    the autotuner's own keys (whose format differs between Triton versions, which the file's name covers) and
    the index of the pick among its candidates; a pick whose key this Triton does not make is never looked up."""
    saved = _saved(device)
    picks = saved.get(repr(key)) if saved is not None else None
    if not isinstance(picks, list) or not picks:
        return False
    try:
        for tuning_key, index in picks:
            kernel.cache.setdefault(tuple(tuning_key), kernel.configs[index])
    except (TypeError, ValueError, IndexError):
        return False
    return True


def _save_picks(kernel, key: tuple, known: set, device: torch.device) -> None:
    """The autotuner's new picks (its cache's keys not in `known`) kept on disk under `key`."""
    saved = _saved(device)
    if saved is None:
        return
    try:
        picks = [[list(k), kernel.configs.index(c)] for k, c in kernel.cache.items() if k not in known]
    except ValueError:  # a pick that is none of the candidates: nothing this module could read back
        return
    saved.put(repr(key), picks)


def _can_time(x: torch.Tensor) -> bool:
    return x.device.type == "cuda" and not capturing(x.device)


def _fastest(x, weight, bias, swiglu, norm, residual) -> str:
    """Time both ways on copies of the operands (W rotated through `_weight_copies`) and return the faster."""
    ws = _weight_copies(weight)
    xs = _rows(x).clone()
    if norm:
        g, a = torch.ones(xs.shape[-1], device=xs.device, dtype=xs.dtype), xs.clone() if residual else None
        ways = {"ours": lambda w: norm_gemv(a, xs, g, 1e-6, w, bias, swiglu=swiglu),
                "cublas": lambda w: _apart(a, xs, g, 1e-6, w, bias, swiglu)}
    else:
        ways = {"ours": lambda w: gemv(xs, w, bias, swiglu=swiglu),
                "cublas": lambda w: _cublas(xs, w, bias, swiglu)}
    times = _graphs_us({name: lambda f=f: [f(w) for w in ws] for name, f in ways.items()})
    return min(times, key=times.get)


def _weight_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """Copies of W to time a way on, as many as make 96 MiB (up to 16): L2 (50 MB on an H200) holds none of them
    by the time it comes round again, as a model's layers stream theirs from HBM."""
    return [weight.clone() for _ in range(max(1, min(16, -(-(96 << 20) // (weight.numel() * weight.element_size())))))]


def _cublas(x, w, bias, swiglu):
    y = F.linear(x, w, bias)
    return silu_mul(y) if swiglu else y


def _apart(a, x, g, eps, w, bias, swiglu):
    """norm_linear's "cublas" way: the add + RMSNorm kernel, then skinny_linear (and its own choice)."""
    h, s = add_rms_norm(a, x, g, eps) if a is not None else (rms_norm(x, g, eps), x)
    return skinny_linear(h, w, bias, swiglu=swiglu), s


def _graphs_us(fns: dict, replays: int = 8) -> dict:
    """Microseconds of each fn() replayed from its CUDA graph (best of `replays`, in turns: `replays_us`; one
    eager call first: autotuning)."""
    graphs = {}
    for name, fn in fns.items():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name], capture_error_mode="thread_local"):  # a KV connector's thread may use CUDA
            fn()
    return replays_us({name: graph.replay for name, graph in graphs.items()}, replays)


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
def _residual_tile(X, R, k, mask, HAS_RES: tl.constexpr, ty: tl.constexpr):
    """A (rows, BLOCK_K) tile of x (+ the residual, rounded to ty as the stored sum is) in fp32."""
    h = tl.load(X + k[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        h = (h + tl.load(R + k[None, :], mask=mask, other=0.0).to(tl.float32)).to(ty).to(tl.float32)
    return h


@triton.jit
def _gemv_kernel(
    X, R, G, S, W, B, Y, M, N, K, stride_xm, stride_rm, stride_sm, stride_wn, stride_ym, eps, PREFETCH_K,
    NORM: tl.constexpr, HAS_RES: tl.constexpr, SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
    LINE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    STATS_ROWS: tl.constexpr, STATS_K: tl.constexpr,
):  # fmt: skip
    """Y[:, n] for this program's BLOCK_N outputs n. NORM: x is rms_norm(X + R) with weight G (HAS_RES: the sum
    stored to S, its K tiles shared out among the programs). SWIGLU: outputs silu(x W[n]) * (x W[n + N]).
    With PDL, the program first asks L2 for its rows' first PREFETCH_K columns of W (LINE elements a line)."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_rows = W + offs_n[None, :].to(tl.int64) * stride_wn
    if PDL:  # launched early: no kernel writes W, so it can stream in while the kernel before this one finishes
        lines = tl.arange(0, BLOCK_K // LINE) * LINE
        for k0 in range(0, PREFETCH_K, BLOCK_K):
            kk = k0 + lines
            at = tl.where((kk < PREFETCH_K)[:, None] & n_ok[None, :], w_rows + kk[:, None], W)
            pdl.prefetch_l2(at)
            if SWIGLU:
                pdl.prefetch_l2(at + N * stride_wn)
    pdl.enter(PDL)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    x_rows = X + offs_m[:, None].to(tl.int64) * stride_xm
    r_rows = R + offs_m[:, None].to(tl.int64) * stride_rm
    ty = Y.dtype.element_ty
    if NORM:  # first pass: each row's 1/rms (the rows are a few KB, read again from cache below)
        rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
        # STATS_ROWS rows of STATS_K columns at once (the whole row where K <= 4,096): one round trip to L2 for
        # a row, not one per BLOCK_K tile (compiled, such a loop waits for each load before the next: 8 for
        # K = 2,048, most of what fusing the norm cost Llama-3.2-1B's Q/K/V against the norm kernel + cuBLAS)
        offs_sr = tl.arange(0, STATS_ROWS)
        offs_sk = tl.arange(0, STATS_K)
        if HAS_RES:  # the sum's K tiles are shared out: tile t is stored by program t % programs
            programs = tl.num_programs(0)
        for m0 in range(0, M, STATS_ROWS):
            rows_s = m0 + offs_sr
            ssq = tl.zeros([STATS_ROWS], dtype=tl.float32)
            for k0 in range(0, K, STATS_K):
                k = k0 + offs_sk
                mask = (rows_s < M)[:, None] & (k < K)[None, :]
                h = _residual_tile(X + rows_s[:, None].to(tl.int64) * stride_xm,
                                   R + rows_s[:, None].to(tl.int64) * stride_rm, k, mask, HAS_RES, ty)
                if HAS_RES:
                    mine = ((k // BLOCK_K) % programs) == pid
                    tl.store(S + rows_s[:, None].to(tl.int64) * stride_sm + k[None, :], h.to(ty),
                             mask=mask & mine[None, :])
                ssq += tl.sum(h * h, axis=1)
            inv = tl.rsqrt(ssq / K + eps)
            for j in tl.static_range(STATS_ROWS):  # into the rows' vector of the main loop's layout
                rstd = tl.where(offs_m == m0 + j, tl.sum(tl.where(offs_sr == j, inv, 0.0)), rstd)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        x_mask = m_ok[:, None] & k_ok[None, :]
        if NORM:  # as rmsnorm's kernel rounds it: x * rstd * g in fp32, to the dtype
            g = tl.load(G + k, mask=k_ok, other=0.0).to(tl.float32)
            xt = (_residual_tile(x_rows, r_rows, k, x_mask, HAS_RES, ty) * rstd[:, None] * g[None, :]).to(ty)
        else:
            xt = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        acc = _dot(xt, tl.load(w_rows + k[:, None], mask=w_mask, other=0.0), acc)  # W tile (BLOCK_K, BLOCK_N)
        if SWIGLU:
            up = _dot(xt, tl.load(w_rows + N * stride_wn + k[:, None], mask=w_mask, other=0.0), up)
    _finish(acc, up, B, Y, offs_m, offs_n, m_ok, n_ok, N, stride_ym, SWIGLU, HAS_BIAS, ty)


@triton.jit
def _epilogue(acc, up, B, offs_n, n_ok, N, SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr, ty: tl.constexpr):
    """The tile's outputs in `ty` from its fp32 sums: the bias, SwiGLU."""
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if SWIGLU:
            up += tl.load(B + N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if SWIGLU:  # F.linear's outputs rounded, silu(gate) rounded, then the product (swiglu.silu_mul's rounding)
        return swiglu_round(acc, up, ty)
    return acc.to(ty)


@triton.jit
def _finish(acc, up, B, Y, offs_m, offs_n, m_ok, n_ok, N, stride_ym, SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr,
            ty: tl.constexpr):
    """The tile's epilogue from its fp32 sums: the bias, SwiGLU, the store."""
    out = _epilogue(acc, up, B, offs_n, n_ok, N, SWIGLU, HAS_BIAS, ty)
    tl.store(Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], out, mask=m_ok[:, None] & n_ok[None, :])


# Rows per program trade parallelism (N / BLOCK_N programs over 132 SMs) against the loads each one keeps in
# flight; the autotuner picks per (N, K, rows, fusion) on the first call, which the engine makes before it captures.
# PDL is not in the key: a configuration is timed as the kernel runs alone, whether or not it later launches early.
# Few candidates: each is a compile per constexpr variant at a fresh server's start (session 12's first run on the
# H200: the engine started in 6.8 s, 4.2 s of it tuning over three). Session 12's H200 picks were 32 x 256 wherever
# K <= 2,048 and 16 x 512 for MLP-down; session 11's tuner took 64 x 256 and 128 x 128 once each (Llama's
# gate-and-up, Qwen3's Q/K/V: 28.3 and 10.1 us a layer), which session 12 measured slower than 32 x 256 (26.4 and
# 7.0 us): noise in timing ~5 us kernels, which fewer candidates also cut down. 32 x 256 x 3 stages and 64 x 256 x 2
# hold fewer W tiles in flight: compiled as launched (`kernels inspect gemv_decode`), the fused gate-and-up at
# 32 x 256 with four stages takes 157 KB of shared memory, one program an SM, so Llama-3.2-1B's 256 programs run in
# two waves and a successor launched early finds no room beside it; three stages take 108 KB (two an SM).
# Cutting K into ranges for the matrices with fewer rows than SMs x BLOCK_N (attention-out, MLP-down, Llama's
# Q/K/V: 64-96 programs of 32 rows on 132 SMs), the tile's last range adding the fp32 sums up, was a candidate set
# of its own (`NANOFORGE_GEMV_CONFIGS=split`) until session 52: session 13's H200 run found it no faster at any of
# those shapes (Llama's attention-out 5.2 us a layer either way, MLP-down 16.7 against 17.1; batch-1 decode 936
# tok/s against 924 without, within the run's own spread, 909 for the same engine again) and the engine's start
# twice as long tuning: such a kernel is bound by its latency, not by how many SMs stream (the code at 65f653c).
# NANOFORGE_GEMV_CONFIGS=wide (session 10's eight) is a measurement lever, for what the default leaves out.
GEMV_CONFIGS = {"default": ((32, 256, 4, 4), (16, 512, 4, 3), (16, 256, 4, 4), (32, 256, 4, 3), (64, 256, 4, 2)),
                "wide": ((16, 256, 4, 4), (16, 512, 4, 3), (16, 128, 4, 6), (32, 256, 4, 4), (32, 128, 4, 5),
                         (64, 128, 4, 4), (64, 256, 8, 3), (128, 128, 8, 3))}  # BLOCK_N, BLOCK_K, warps, stages


_TUNED = {name: triton.autotune(
    configs=[triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s) for bn, bk, w, s in cfgs],
    key=["N", "K", "BLOCK_M", "SWIGLU", "NORM", "HAS_RES"],
)(_gemv_kernel) for name, cfgs in GEMV_CONFIGS.items()}


def configs() -> str:
    """NANOFORGE_GEMV_CONFIGS: the autotuner's candidates, "default" (five) or "wide" (session 10's eight)."""
    return env_choice("NANOFORGE_GEMV_CONFIGS", tuple(GEMV_CONFIGS))


def decisions() -> dict:
    """What this process has decided per shape: the autotuner's pick for each key (per candidate set) and the
    way `choose` took for each projection (benchmarks print them beside their numbers)."""
    return {"picks": {f"{name} {key}": str(cfg) for name, t in _TUNED.items() for key, cfg in t.cache.items()},
            "ways": {str(key): way for key, way in _CHOICES.items()}}


# ----------------------------------------------------------------------------------------------
# Benchmark (`nanoforge kernels bench --kinds gemv`)
# ----------------------------------------------------------------------------------------------

# (model, d_model, q/k/v features, attention-out K, d_ff, layers): the decode projections of Llama-3.2-1B and
# Qwen3-0.6B; each layer is Q/K/V (the norm and residual add fused), attention-out, gate-and-up (norm, residual
# and SwiGLU fused) and MLP-down
# (model, d_model, Q/K/V rows, attention-out columns, d_ff, layers, vocabulary)
BENCH_MODELS = [("llama3-1b", 2048, 3072, 2048, 8192, 16, 128256), ("qwen3-0.6b", 1024, 4096, 2048, 3072, 28, 151936)]

# the ways compared, as the engine's switches set them: cuBLAS with the separate norm and SwiGLU kernels, and
# ours fused without PDL, with it (W prefetched into L2 before the wait, and not)
BENCH_WAYS = {"cublas": {"NANOFORGE_GEMV": "0", "NANOFORGE_PDL": "0"}, "ours": {"NANOFORGE_GEMV": "1", "NANOFORGE_PDL": "0"},
              "ours+pdl": {"NANOFORGE_GEMV": "1", "NANOFORGE_PDL": "1"},
              "ours+pdl-no-prefetch": {"NANOFORGE_GEMV": "1", "NANOFORGE_PDL": "1", "NANOFORGE_GEMV_PREFETCH_MB": "0"}}


def _weight(n: int, k: int, gen) -> torch.Tensor:
    return (torch.randn(n, k, generator=gen, device="cuda") / k**0.5).bfloat16()


def _layer(d: int, qkv: int, ao: int, ff: int, rows: int, gen):
    """One decode layer's projections on fresh bf16 weights, through the model's own `norm_linear` and
    `skinny_linear`: (residual stream, pending MLP output) -> the next pair. Attention is left out (its output
    is a fixed tensor)."""
    w_qkv, w_o, w_in, w_out = _weight(qkv, d, gen), _weight(d, ao, gen), _weight(2 * ff, d, gen), _weight(d, ff, gen)
    g = torch.ones(d, device="cuda", dtype=torch.bfloat16)
    o = torch.randn(rows, ao, generator=gen, device="cuda").bfloat16()

    def layer(x, m):
        x = norm_linear(m, x, g, 1e-6, w_qkv)[1]
        a, x = norm_linear(skinny_linear(o, w_o), x, g, 1e-6, w_in, swiglu=True)
        return x, skinny_linear(a, w_out)

    return layer


def _projection(rows: int, k: int, n: int, swiglu: bool, norm: bool, gen):
    """One projection as a chain link (x, p) -> (x, p): with `norm`, of the residual x + p normalised (k is the
    model's width); else of a fixed (rows, k) input."""
    w, g = _weight(n, k, gen), torch.ones(k, device="cuda", dtype=torch.bfloat16)
    inp = torch.randn(rows, k, generator=gen, device="cuda").bfloat16()

    def link(x, p):
        if norm:
            return norm_linear(p, x, g, 1e-6, w, swiglu=swiglu)[1], p
        skinny_linear(inp, w, swiglu=swiglu)
        return x, p

    return link


def _chain_us(make, n_layers: int, x0: torch.Tensor, quick: bool) -> float:
    """Microseconds a layer of `n_layers` links from make() (each its own weights), replayed from a CUDA graph."""
    from nanoforge.kernels.bench import time_ms

    stack = [make() for _ in range(n_layers)]

    def step():
        x, p = x0, torch.zeros_like(x0)
        for link in stack:
            x, p = link(x, p)
        return x

    return 1000 * time_ms(step, quick, graph=True) / n_layers


def bench_rows(quick: bool) -> list[dict]:
    """Each model's decode layers' projections (with the norms, residual adds and SwiGLU between them; attention
    left out), every layer its own weights, at 1 (and, not quick, 8) rows, bf16, replayed from a CUDA graph as
    the engine replays its decode steps, each of BENCH_WAYS against cuBLAS, per layer; then each projection alone
    (a chain of it, one weight copy a layer), and the LM head. The autotuner's pick for each shape is printed."""
    from unittest import mock

    from nanoforge.errors import NanoforgeError
    from nanoforge.kernels.bench import make_row

    if not torch.cuda.is_available():
        raise NanoforgeError("gemv benchmarks need a CUDA GPU", param="kinds")
    rows = []
    for model, d, qkv, ao, ff, n_layers, vocab in BENCH_MODELS:
        for m in (1,) if quick else (1, 8):
            gen = torch.Generator(device="cuda").manual_seed(m)
            x0 = torch.randn(m, d, generator=gen, device="cuda").bfloat16()
            # (label, weight bytes a link, make, links): the whole layer, then each projection alone, then the LM
            # head (`Transformer.logits`; two copies of it, each several times L2)
            parts = [("layer", 2 * (qkv * d + d * ao + 2 * ff * d + d * ff), lambda: _layer(d, qkv, ao, ff, m, gen),
                      n_layers)]
            parts += [(label, 2 * n * k, lambda k=k, n=n, s=s, nm=nm: _projection(m, k, n, s, nm, gen), links)
                      for label, k, n, s, nm, links in (
                          ("qkv+norm", d, qkv, False, True, n_layers), ("attn-out", ao, d, False, False, n_layers),
                          ("gate-up+norm+swiglu", d, 2 * ff, True, True, n_layers),
                          ("down", ff, d, False, False, n_layers), ("lm-head", d, vocab, False, False, 2))]
            for label, b, make, links in parts:
                times = {}
                for name, env in BENCH_WAYS.items():
                    with mock.patch.dict(os.environ, env):
                        times[name] = _chain_us(make, links, x0, quick)
                rows += [make_row("gemv", f"{model} {label} {name} {m}x{d}", times[name] / 1000, times["cublas"] / 1000,
                                  "cuBLAS + norm, SwiGLU kernels", 2.0 * m * b / 2, b) for name in times if name != "cublas"]
    made = decisions()
    for key, cfg in made["picks"].items():
        print(f"  gemv autotune {key}: {cfg}")
    return rows
