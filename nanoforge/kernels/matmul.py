"""Matrix multiplication C = act(A @ B + bias) in Triton: bf16/fp16 in, fp32 accumulate.

One tile computation (`_mac`: a BLOCK_M x BLOCK_N tile of C over a range of
K-iterations) and one epilogue (`_epilogue_store`: bias, activation, cast,
store) are shared by four schedules, i.e. ways of handing tiles to programs:

- "tiled": one program per output tile, tiles visited in grouped ("swizzled")
  order so that consecutive programs share rows of A and columns of B in L2.
- "persistent": one program per SM, each looping over tiles SM-stride apart.
- "streamk": the K-iterations of *all* tiles, flattened into one list, are cut
  into one contiguous range per SM (Osama et al., "Stream-K", PPoPP 2023).
  Every SM gets the same amount of work whatever the tile count, at the cost
  of a fix-up where a tile's K-range is split between programs.
- "hybrid": full waves of tiles run data-parallel (as "persistent"); only the
  tiles of the last, partial wave are split Stream-K style, each into about
  K-iterations / SK_ITERS pieces (an owner reads its pieces one after another,
  so splitting a tile over every SM would cost more than it saves). This
  removes the wave-quantization tail without paying fix-ups on every tile.

"auto" picks "tiled" unless the tile count leaves the last wave mostly idle,
in which case it picks "hybrid" (see `_pick_schedule`).

Stream-K fix-up (design choice). A tile whose K-range is split between
programs is finished by its *owner*, the program that computes its last
K-iteration. Every other program touching the tile (a *contributor*) writes
its fp32 partial tile to a per-program slot of a workspace and raises a flag;
the owner waits for the flags, adds the partials, and runs the epilogue. The
iteration ranges are contiguous and handed out in program order, so a
program's range can end inside a tile (it is a contributor there, its only
one) and otherwise only contains tiles it owns. Each program first computes
and publishes its contributor segment, then its owned tiles. Hence an owner
only ever waits for programs with a smaller id that have nothing to wait for
before publishing: no wait chains on a GPU (all programs are resident, one per
SM), and no deadlock under TRITON_INTERPRET=1, which runs programs one after
another in id order. The owner resets each flag it consumes, so the workspace
needs no clearing between launches (it is cached per device; do not run two
Stream-K matmuls concurrently on different streams of one device).
Deterministic: partials are summed in a fixed order, no float atomics.

The hybrid's tail can instead use an atomic fix-up (FIXUP="atomic", one of the
autotuner's candidates for "hybrid"): every piece of a split tail tile adds its
partial into a zeroed fp32 tile of the workspace and counts itself in; the
piece that arrives last reads the sum, zeroes the tile and runs the epilogue.
Nobody waits and nobody reads more than one partial, where the owner otherwise
reads its contributors' partials one after another. The price: the summation
order, hence the last bits of the result, can vary from run to run.

Dispatch: `nanoforge.kernels.dispatch.use_fast` decides between Triton and
the torch reference. The Triton path covers float16/bfloat16 inputs without
autograd; anything else (float32/float64, tensors that need gradients, empty
shapes) goes to `matmul_ref`, i.e. cuBLAS on a GPU.

On a CUDA GPU, block shapes are autotuned per (M rounded up to a power of two,
N, K); M <= 64 takes its one BLOCK_M=64 config untuned. On Hopper
and newer, A, B and C are addressed through TMA tensor descriptors when their
strides allow it (16-byte aligned rows); otherwise through plain pointers.
Under TRITON_INTERPRET=1 (CPU tests) one small fixed config is used and both
addressing modes are exercised.

Launch: the host side of a call is kept short (see "launch plans" below): all
that depends only on shapes, strides, dtypes, alignment and flags is worked out
on a key's first call and kept, and later calls launch the compiled kernel
directly, without the autotuner's or Triton's per-call argument handling.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanoforge.kernels.dispatch import env_choice, interpreting, use_fast
from nanoforge.kernels.swiglu import silu_mul_ref, swiglu_round

ACTIVATIONS = (None, "gelu_tanh", "silu", "relu", "swiglu")
SCHEDULES = ("auto", "tiled", "persistent", "streamk", "hybrid")
_TRITON_DTYPES = (torch.float16, torch.bfloat16)

try:  # host-side TMA descriptors (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton: pointer path only
    TensorDescriptor = None


# --------------------------------------------------------------------------- reference


def matmul_ref(a: torch.Tensor, b: torch.Tensor, *, bias: torch.Tensor | None = None,
               activation: str | None = None) -> torch.Tensor:
    """act(a @ b + bias) with torch ops, in a's dtype (float64 in -> float64 out)."""
    out = a @ b
    if bias is not None:
        out = out + bias.to(out.dtype)
    if activation == "relu":
        out = torch.relu(out)
    elif activation == "silu":
        out = F.silu(out)
    elif activation == "gelu_tanh":
        out = F.gelu(out, approximate="tanh")
    elif activation == "swiglu":
        out = silu_mul_ref(out)
    return out


# --------------------------------------------------------------------------- public API


def matmul(a: torch.Tensor, b: torch.Tensor, *, bias: torch.Tensor | None = None,
           activation: str | None = None, schedule: str = "auto",
           out: torch.Tensor | None = None) -> torch.Tensor:
    """act(a @ b + bias) for a: (M, K), b: (K, N), bias: (N,); returns (M, N) in a's dtype.

    activation: None, "gelu_tanh", "silu", "relu" or "swiglu". "swiglu" takes b's columns as SwiGLU's
    [gate | up] halves and returns (M, N / 2) = silu(gate) * up, rounded as `swiglu.silu_mul` rounds the
    GEMM's output (gate and up to a's dtype, silu, the product): the epilogue of the "tiled" or "persistent"
    schedule ("auto": persistent) computes each tile's gate and up columns, so the (M, N) product is never
    written.
    schedule: "auto", "tiled", "persistent", "streamk" or "hybrid" (ignored on the reference path).
    `out`, if given, is a tensor of a's dtype and the result's shape that receives it.
    """
    _check_args(a, b, bias, activation, schedule, out)
    fast = (use_fast(a, b) and a.dtype in _TRITON_DTYPES and a.numel() > 0 and b.numel() > 0
            and not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (a, b, bias))))
    if not fast:
        result = matmul_ref(a, b, bias=bias, activation=activation)
        return result if out is None else out.copy_(result)
    return _matmul_triton(a, b, bias, activation, schedule, out)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           activation: str | None = None, schedule: str = "auto") -> torch.Tensor:
    """act(x @ weight.T + bias) for torch-layout weights (out_features, in_features); any leading dims of x
    ("swiglu": half the out_features)."""
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear: x has shape {tuple(x.shape)} but weight has shape {tuple(weight.shape)}; "
            f"expected x (..., in_features) and weight (out_features, in_features)")
    y = matmul(x.reshape(-1, x.shape[-1]), weight.t(), bias=bias, activation=activation, schedule=schedule)
    return y.reshape(*x.shape[:-1], y.shape[-1])


# Rows from which gate-and-up takes SwiGLU in this GEMM's epilogue by default. Session 33's H100, 16K-token rows
# down to 32 (docs/results/issue14/session33/): the persistent schedule 1.09-1.18x cuBLAS + the SwiGLU kernel
# at Llama-3.2-1B's width from 64 rows, 1.15-1.29x at Qwen3-0.6B's from 1,024, 0.78-1.05x there below.
SWIGLU_EPILOGUE_MIN_ROWS = 1024


def swiglu_epilogue(x: torch.Tensor) -> str | None:
    """The schedule that gate-and-up's projection of x runs this GEMM on, SwiGLU in its epilogue
    (`linear(..., activation="swiglu")`), or None: cuBLAS, then the SwiGLU kernel. NANOFORGE_SWIGLU_EPILOGUE:
    `auto` (the default) "persistent" for bf16/fp16 x of SWIGLU_EPILOGUE_MIN_ROWS rows or more on a GPU with
    TMA (Hopper and newer: where it was measured), else None; `0` None; `1` this module's choice ("auto");
    or the schedule itself, `tiled` or `persistent`."""
    choice = env_choice("NANOFORGE_SWIGLU_EPILOGUE", ("auto", "0", "1", "tiled", "persistent"))
    if choice == "auto":
        rows = x.numel() // max(1, x.shape[-1])
        return ("persistent" if x.is_cuda and x.dtype in _TRITON_DTYPES and rows >= SWIGLU_EPILOGUE_MIN_ROWS
                and not interpreting() and _cuda_info(x.device)[1] else None)
    return {"0": None, "1": "auto"}.get(choice, choice)


def _check_args(a, b, bias, activation, schedule, out) -> None:
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul: a has shape {tuple(a.shape)} and b has shape {tuple(b.shape)}; "
                         f"expected a (M, K) and b (K, N)")
    if a.dtype != b.dtype or a.device != b.device:
        raise ValueError(f"matmul: a is {a.dtype} on {a.device} but b is {b.dtype} on {b.device}; "
                         f"they must match")
    if bias is not None and (bias.shape != (b.shape[1],) or bias.device != a.device):
        raise ValueError(f"matmul: bias has shape {tuple(bias.shape)} on {bias.device}; "
                         f"expected ({b.shape[1]},) on {a.device}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"matmul: activation must be one of {ACTIVATIONS}, not {activation!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"matmul: schedule must be one of {SCHEDULES}, not {schedule!r}")
    if activation == "swiglu" and (b.shape[1] % 2 or schedule not in ("auto", "tiled", "persistent")):
        raise ValueError(f"matmul: swiglu needs an even N ([gate | up]) and the tiled or persistent schedule, got "
                         f"N {b.shape[1]} and {schedule!r}")
    n_out = b.shape[1] // 2 if activation == "swiglu" else b.shape[1]
    if out is not None and (out.shape != (a.shape[0], n_out) or out.dtype != a.dtype or out.device != a.device):
        raise ValueError(f"matmul: out is {tuple(out.shape)} {out.dtype} on {out.device}; expected "
                         f"({a.shape[0]}, {n_out}) {a.dtype} on {a.device}")


# --------------------------------------------------------------------------- Triton kernels

# Triton's CPU interpreter keeps bfloat16 as raw 16-bit integers (numpy has no
# bfloat16) and its tl.dot multiplies those bits. Under the interpreter only,
# bfloat16 tiles are widened to float32 (exactly) before the dot.
_WIDEN_BF16_DOT = tl.constexpr(interpreting())


@triton.jit
def _dot(x, y, acc):
    """tl.dot(x, y, acc), correct on bfloat16 under the interpreter too (the attention kernels use it). fp32
    operands multiply in full fp32 ("ieee"), as torch.matmul does by default: Triton's default is TF32 on a
    GPU (~1e-3 relative), which made fp32 engine outputs part from the reference generator on the H200."""
    if _WIDEN_BF16_DOT and x.dtype == tl.bfloat16:
        x = x.to(tl.float32)
        y = y.to(tl.float32)
        return tl.dot(x, y, acc)
    if x.dtype == tl.float32:
        return tl.dot(x, y, acc, input_precision="ieee")
    return tl.dot(x, y, acc)


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped tile order: walk GROUP_M tile-rows column by column, so that
    the programs running together reuse the same A rows and B columns in L2."""
    tiles_per_group = GROUP_M * num_pid_n
    first_pid_m = (tile_id // tiles_per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % tiles_per_group) % group_rows
    pid_n = (tile_id % tiles_per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _mac(a, b, pid_m, pid_n, k_lo, k_hi, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
         USE_TMA: tl.constexpr, B_NK: tl.constexpr):
    """fp32 tile (pid_m, pid_n) of A @ B summed over K-iterations [k_lo, k_hi)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_TMA:
        # Descriptors zero-fill out-of-bounds reads, so ragged edges need no masks.
        for ki in range(k_lo, k_hi):
            a_blk = a.load([pid_m * BLOCK_M, ki * BLOCK_K])
            if B_NK:  # b is the (N, K) weight seen through .t(): load (BN, BK), use transposed
                b_blk = b.load([pid_n * BLOCK_N, ki * BLOCK_K]).T
            else:
                b_blk = b.load([ki * BLOCK_K, pid_n * BLOCK_N])
            acc = _dot(a_blk, b_blk, acc)
    else:
        # Rows/columns past the edge are clamped to 0 instead of masked: they
        # compute garbage that the store masks off, and the loads stay unmasked
        # except along K. Row offsets in int64: M * K may pass 2**31.
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.max_contiguous(tl.multiple_of(tl.where(rm < M, rm, 0), BLOCK_M), BLOCK_M)
        rn = tl.max_contiguous(tl.multiple_of(tl.where(rn < N, rn, 0), BLOCK_N), BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        a_ptrs = a + rm[:, None].to(tl.int64) * stride_am + (k_lo * BLOCK_K + rk)[None, :] * stride_ak
        b_ptrs = b + (k_lo * BLOCK_K + rk)[:, None] * stride_bk + rn[None, :] * stride_bn
        for ki in range(k_lo, k_hi):
            k_left = K - ki * BLOCK_K
            a_blk = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0.0)
            b_blk = tl.load(b_ptrs, mask=rk[:, None] < k_left, other=0.0)
            acc = _dot(a_blk, b_blk, acc)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def _activate(x, ACTIVATION: tl.constexpr):
    if ACTIVATION == "relu":
        x = tl.maximum(x, 0.0)
    elif ACTIVATION == "silu":
        x = x * tl.sigmoid(x)
    elif ACTIVATION == "gelu_tanh":
        # 0.5 * (1 + tanh(u)) == sigmoid(2u), u = sqrt(2/pi) * (x + 0.044715 x^3)
        x = x * tl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))
    return x


@triton.jit
def _epilogue_store(c, bias, acc, pid_m, pid_n, M, N, stride_cm, stride_cn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, USE_TMA: tl.constexpr):
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    acc = _activate(acc, ACTIVATION)
    if USE_TMA:  # the descriptor clips the out-of-bounds part of edge tiles
        c.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(c.dtype))
    else:
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        c_ptrs = c + rm[:, None].to(tl.int64) * stride_cm + rn[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M_BUCKET"])
def _matmul_tiled_kernel(a, b, c, bias, M, N, K, M_BUCKET,
                         stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr,
                         HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                         USE_TMA: tl.constexpr, B_NK: tl.constexpr):
    # M_BUCKET is only the autotune key (a bucketed M).
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    if ACTIVATION == "swiglu":  # a tile's BLOCK_N columns of b: BLOCK_N / 2 of gate and the matching up
        gate, up = _mac_swiglu(a, b, pid_m, pid_n, tl.cdiv(K, BLOCK_K), M, N // 2, K, stride_am, stride_ak,
                               stride_bk, stride_bn, BLOCK_M, BLOCK_N // 2, BLOCK_K, USE_TMA, B_NK)
        _swiglu_store(c, bias, gate, up, pid_m, pid_n, M, N // 2, stride_cm, stride_cn, BLOCK_M, BLOCK_N // 2,
                      HAS_BIAS, USE_TMA)
    else:
        acc = _mac(a, b, pid_m, pid_n, 0, tl.cdiv(K, BLOCK_K), M, N, K, stride_am, stride_ak, stride_bk,
                   stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, B_NK)
        _epilogue_store(c, bias, acc, pid_m, pid_n, M, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N, HAS_BIAS,
                        ACTIVATION, USE_TMA)


@triton.jit
def _mac_swiglu(a, b, pid_m, pid_n, k_tiles, M, F, K, stride_am, stride_ak, stride_bk, stride_bn,
                BLOCK_M: tl.constexpr, HALF: tl.constexpr, BLOCK_K: tl.constexpr, USE_TMA: tl.constexpr,
                B_NK: tl.constexpr):
    """`_mac` for SwiGLU: fp32 tiles of A @ B's gate columns [pid_n * HALF, + HALF) and of the up columns F
    further, each A tile loaded once for both products. With TMA, b is a 3-D view ([2, F, K] of the (N, K)
    weight, or [K, 2, F] of a (K, N) b) whose block holds the tile's gate and up columns together: one copy and
    one product a K tile, [gate | up] BLOCK_N wide, as the plain GEMM's loop (its two halves split after it)."""
    n0 = pid_n * HALF
    if USE_TMA:
        acc = tl.zeros((BLOCK_M, 2 * HALF), dtype=tl.float32)
        for ki in range(0, k_tiles):
            a_blk = a.load([pid_m * BLOCK_M, ki * BLOCK_K])
            if B_NK:
                b_blk = tl.reshape(b.load([0, n0, ki * BLOCK_K]), (2 * HALF, BLOCK_K)).T
            else:
                b_blk = tl.reshape(b.load([ki * BLOCK_K, 0, n0]), (BLOCK_K, 2 * HALF))
            acc = _dot(a_blk, b_blk, acc)
        gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1)))
    else:  # clamped rows and columns, as `_mac`
        gate = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = n0 + tl.arange(0, HALF)
        rm = tl.max_contiguous(tl.multiple_of(tl.where(rm < M, rm, 0), BLOCK_M), BLOCK_M)
        rn = tl.max_contiguous(tl.multiple_of(tl.where(rn < F, rn, 0), HALF), HALF)
        rk = tl.arange(0, BLOCK_K)
        a_ptrs = a + rm[:, None].to(tl.int64) * stride_am + rk[None, :] * stride_ak
        g_ptrs = b + rk[:, None] * stride_bk + rn[None, :].to(tl.int64) * stride_bn
        for ki in range(0, k_tiles):
            k_left = K - ki * BLOCK_K
            a_blk = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0.0)
            g_blk = tl.load(g_ptrs, mask=rk[:, None] < k_left, other=0.0)
            u_blk = tl.load(g_ptrs + F * stride_bn, mask=rk[:, None] < k_left, other=0.0)
            gate = _dot(a_blk, g_blk, gate)
            up = _dot(a_blk, u_blk, up)
            a_ptrs += BLOCK_K * stride_ak
            g_ptrs += BLOCK_K * stride_bk
    return gate, up


@triton.jit
def _swiglu_store(c, bias, gate, up, pid_m, pid_n, M, F, stride_cm, stride_cn, BLOCK_M: tl.constexpr,
                  HALF: tl.constexpr, HAS_BIAS: tl.constexpr, USE_TMA: tl.constexpr):
    """silu(gate) * up into C's columns [pid_n * HALF, + HALF), rounded as `swiglu.silu_mul` rounds a GEMM's
    output: gate and up to C's dtype, silu to it, then the product."""
    rn = pid_n * HALF + tl.arange(0, HALF)
    if HAS_BIAS:
        gate += tl.load(bias + rn, mask=rn < F, other=0.0).to(tl.float32)[None, :]
        up += tl.load(bias + F + rn, mask=rn < F, other=0.0).to(tl.float32)[None, :]
    out = swiglu_round(gate, up, c.dtype if USE_TMA else c.dtype.element_ty)
    if USE_TMA:
        c.store([pid_m * BLOCK_M, pid_n * HALF], out)
    else:
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        tl.store(c + rm[:, None].to(tl.int64) * stride_cm + rn[None, :] * stride_cn, out,
                 mask=(rm[:, None] < M) & (rn[None, :] < F))


@triton.jit
def _sk_start(worker, workers, sk_iters):
    """First K-iteration of a Stream-K worker: sk_iters split as evenly as possible."""
    per_worker = sk_iters // workers
    return worker * per_worker + tl.minimum(worker, sk_iters % workers)


@triton.jit
def _sk_worker_of(it, workers, sk_iters):
    """The Stream-K worker whose range holds K-iteration `it` (the inverse of _sk_start)."""
    per_worker = sk_iters // workers
    rem = sk_iters % workers
    first_short = rem * (per_worker + 1)  # workers [0, rem) take per_worker + 1 iterations
    return tl.where(it < first_short, it // (per_worker + 1), rem + (it - first_short) // per_worker)


@triton.jit(do_not_specialize=["M_BUCKET", "NUM_SMS"])
def _matmul_persistent_kernel(a, b, c, bias, partials, flags, M, N, K, M_BUCKET, NUM_SMS,
                              stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              GROUP_M: tl.constexpr, SK_ITERS: tl.constexpr, MODE: tl.constexpr,
                              HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                              USE_TMA: tl.constexpr, B_NK: tl.constexpr, FIXUP: tl.constexpr = "owner",
                              WS_TILE: tl.constexpr = 0):
    """MODE "persistent", "streamk" or "hybrid"; one program per SM (grid <= NUM_SMS).

    FIXUP (hybrid only; Stream-K always uses "owner"): "owner", the tile's owner waits for its
    contributors' partials and adds them in order; or "atomic", every piece of a split tail tile is
    added into a zeroed fp32 tile of the workspace (float atomics, spread over all the pieces), and
    whichever piece arrives last reads the sum, zeroes the tile again and runs the epilogue: nobody
    waits, and no program reads more than one partial tile (the owner's serial reads are what the
    tail costs otherwise). The summation order then varies from run to run (last-bit differences).
    WS_TILE: the workspace's slot size; the atomic tiles live after the NUM_SMS owner slots."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)

    # Tiles [0, dp_tiles) run data-parallel; the rest are split Stream-K.
    if MODE == "persistent":
        dp_tiles = num_tiles
    elif MODE == "streamk":
        dp_tiles = 0
    else:  # hybrid: all full waves data-parallel
        dp_tiles = (num_tiles // NUM_SMS) * NUM_SMS

    # flatten: one pipelined loop over (tile, k), so the next tile's loads overlap this tile's epilogue
    for tile in tl.range(pid, dp_tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        if ACTIVATION == "swiglu":  # MODE "persistent" only (`_check_args`): the tiled kernel's tile, in turn
            gate, up = _mac_swiglu(a, b, pid_m, pid_n, k_tiles, M, N // 2, K, stride_am, stride_ak, stride_bk,
                                   stride_bn, BLOCK_M, BLOCK_N // 2, BLOCK_K, USE_TMA, B_NK)
            _swiglu_store(c, bias, gate, up, pid_m, pid_n, M, N // 2, stride_cm, stride_cn, BLOCK_M, BLOCK_N // 2,
                          HAS_BIAS, USE_TMA)
        else:
            acc = _mac(a, b, pid_m, pid_n, 0, k_tiles, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                       BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, B_NK)
            _epilogue_store(c, bias, acc, pid_m, pid_n, M, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N, HAS_BIAS,
                            ACTIVATION, USE_TMA)

    if MODE != "persistent":
        sk_tiles = num_tiles - dp_tiles
        sk_iters = sk_tiles * k_tiles
        if MODE == "streamk":
            workers = tl.minimum(NUM_SMS, sk_iters)
        else:
            # Split each tail tile into ~k_tiles/SK_ITERS pieces, not NUM_SMS/tail
            # pieces: each split costs a partial-tile read (the owner's, serially) or add.
            splits = tl.maximum(k_tiles // SK_ITERS, 1)
            workers = tl.minimum(tl.minimum(NUM_SMS, sk_tiles * splits), sk_iters)
        if MODE == "hybrid" and FIXUP == "atomic":  # sk_tiles < NUM_SMS: one workspace tile each
            if pid < workers:
                offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
                it = _sk_start(pid, workers, sk_iters)
                end = _sk_start(pid + 1, workers, sk_iters)
                while it < end:
                    t = it // k_tiles
                    t_begin = t * k_tiles
                    t_end = t_begin + k_tiles
                    seg_end = tl.minimum(end, t_end)
                    pid_m, pid_n = _tile_coords(dp_tiles + t, num_pid_m, num_pid_n, GROUP_M)
                    acc = _mac(a, b, pid_m, pid_n, it - t_begin, seg_end - t_begin, M, N, K, stride_am, stride_ak,
                               stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, B_NK)
                    pieces = _sk_worker_of(t_end - 1, workers, sk_iters) - _sk_worker_of(t_begin, workers, sk_iters) + 1
                    if pieces == 1:  # the whole tile is this program's
                        _epilogue_store(c, bias, acc, pid_m, pid_n, M, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N,
                                        HAS_BIAS, ACTIVATION, USE_TMA)
                    else:
                        slot = partials + NUM_SMS * WS_TILE + t * BLOCK_M * BLOCK_N + offs
                        tl.atomic_add(slot, acc, sem="relaxed")
                        tl.debug_barrier()  # every thread's share is added before the count goes up
                        if tl.atomic_add(flags + NUM_SMS + t, 1, sem="acq_rel") == pieces - 1:  # the last piece
                            tl.debug_barrier()
                            acc = tl.load(slot, cache_modifier=".cg")
                            tl.store(slot, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), cache_modifier=".cg")
                            tl.atomic_xchg(flags + NUM_SMS + t, 0, sem="relaxed")  # zero again for the next launch
                            _epilogue_store(c, bias, acc, pid_m, pid_n, M, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N,
                                            HAS_BIAS, ACTIVATION, USE_TMA)
                    it = seg_end
        else:
            if pid < workers:
                offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
                start = _sk_start(pid, workers, sk_iters)
                end = _sk_start(pid + 1, workers, sk_iters)
                owned_end = end
                # 1) Contributor segment first: the range ends inside tile t, whose
                #    last K-iteration belongs to a later program. Publish it.
                if end % k_tiles != 0:
                    t = (end - 1) // k_tiles
                    t_begin = t * k_tiles
                    lo = tl.maximum(start, t_begin)
                    pid_m, pid_n = _tile_coords(dp_tiles + t, num_pid_m, num_pid_n, GROUP_M)
                    acc = _mac(a, b, pid_m, pid_n, lo - t_begin, end - t_begin, M, N, K, stride_am, stride_ak,
                               stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, B_NK)
                    tl.store(partials + pid * BLOCK_M * BLOCK_N + offs, acc, cache_modifier=".cg")
                    tl.debug_barrier()  # every thread's partial is written before the flag goes up
                    tl.atomic_xchg(flags + pid, 1, sem="release")
                    owned_end = lo
                # 2) Owned segments: each ends at its tile's last K-iteration.
                it = start
                while it < owned_end:
                    t = it // k_tiles
                    t_begin = t * k_tiles
                    pid_m, pid_n = _tile_coords(dp_tiles + t, num_pid_m, num_pid_n, GROUP_M)
                    acc = _mac(a, b, pid_m, pid_n, it - t_begin, k_tiles, M, N, K, stride_am, stride_ak,
                               stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, B_NK)
                    # Fix-up: the tile's first iterations were done by workers
                    # pid-1, pid-2, ... back to the one whose range holds t_begin.
                    q = pid
                    q_start = it
                    while q_start > t_begin:
                        q -= 1
                        while tl.atomic_cas(flags + q, 1, 0, sem="acquire") != 1:  # take the flag, reset it
                            pass
                        tl.debug_barrier()
                        acc += tl.load(partials + q * BLOCK_M * BLOCK_N + offs, cache_modifier=".cg")
                        q_start = _sk_start(q, workers, sk_iters)
                    _epilogue_store(c, bias, acc, pid_m, pid_n, M, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N,
                                    HAS_BIAS, ACTIVATION, USE_TMA)
                    it = t_begin + k_tiles


# --------------------------------------------------------------------------- configs and launch

# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps): the Triton tutorials'
# known-good Hopper shapes, plus a BLOCK_M=64 one for few-token GEMMs.
_GPU_TILES = [
    (128, 256, 64, 3, 8),
    (128, 256, 64, 4, 8),
    (256, 128, 64, 3, 8),
    (128, 128, 64, 4, 4),
    (128, 128, 128, 3, 8),
    (64, 128, 64, 4, 4),
]
# Hybrid tail: aim for at least this many K-iterations per Stream-K piece.
_SK_ITERS = 16
# Under the interpreter: tiny, non-square tiles (catches swapped M/N indexing)
# and short Stream-K pieces so that small test shapes split tiles many ways.
_INTERPRET_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 3}
_INTERPRET_SK_ITERS = 2
_INTERPRET_FIXUP = "owner"  # the hybrid's fix-up under the interpreter (tests run both)
_INTERPRET_NUM_SMS = 4
_MAX_TILE_ELEMS = max([bm * bn for bm, bn, *_ in _GPU_TILES] + [32 * 16])


def _set_tma_block_shapes(nargs: dict) -> None:
    """Autotune pre-hook: give the TMA descriptors the block shape of the config being run."""
    if not nargs["USE_TMA"]:
        return
    nargs["a"].block_shape, nargs["b"].block_shape, nargs["c"].block_shape = _block_shapes(
        nargs, nargs["B_NK"], nargs["ACTIVATION"] == "swiglu")


def _block_shapes(config: dict, b_nk: bool, swiglu: bool) -> tuple[list, list, list]:
    """The TMA descriptors' block shapes of a block config: a (BM, BK); b (BN, BK) or (BK, BN); c (BM, BN).
    With SwiGLU, b's block is 3-D, (2, BN / 2, BK) or (BK, 2, BN / 2): a tile's gate and up columns, and c's
    BN / 2 wide: its output."""
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    if swiglu:
        return [bm, bk], [2, bn // 2, bk] if b_nk else [bk, 2, bn // 2], [bm, bn // 2]
    return [bm, bk], [bn, bk] if b_nk else [bk, bn], [bm, bn]


def _gpu_configs(**extra) -> list:
    return [triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, **extra),
                          num_stages=s, num_warps=w, pre_hook=_set_tma_block_shapes)
            for bm, bn, bk, s, w in _GPU_TILES]


def _prune_persistent(configs: list, named_args: dict, **kwargs) -> list:
    """_prune_by_m, and the atomic fix-up only where it exists (MODE "hybrid")."""
    configs = _prune_by_m(configs, named_args)
    if named_args.get("MODE", kwargs.get("MODE")) == "hybrid":  # a constexpr: in kwargs on some Triton versions
        return configs
    return [c for c in configs if c.kwargs["FIXUP"] == "owner" and c.kwargs["SK_ITERS"] == _SK_ITERS]


def _prune_by_m(configs: list, named_args: dict, **kwargs) -> list:
    """Few tokens (M <= 64): only BLOCK_M=64 tiles, so small batches never autotune. Many
    tokens (M >= 2048): no BLOCK_M=64 tiles, they never win there."""
    m = named_args["M_BUCKET"]
    if 64 < m < 2048:
        return configs
    return [c for c in configs if (c.kwargs["BLOCK_M"] == 64) == (m <= 64)]


_KEY = ["M_BUCKET", "N", "K", "HAS_BIAS", "ACTIVATION", "USE_TMA", "B_NK"]
_PRUNE = {"early_config_prune": _prune_by_m}
_tiled_tuned = triton.autotune(_gpu_configs(), key=_KEY, prune_configs_by=_PRUNE)(_matmul_tiled_kernel)
_persistent_tuned = triton.autotune(
    [c for fixup in ("owner", "atomic") for sk in (_SK_ITERS // 2, _SK_ITERS, 2 * _SK_ITERS)
     for c in _gpu_configs(SK_ITERS=sk, FIXUP=fixup, WS_TILE=_MAX_TILE_ELEMS)],
    key=_KEY + ["MODE", "NUM_SMS"], prune_configs_by={"early_config_prune": _prune_persistent},
)(_matmul_persistent_kernel)



def _autotuned(device: torch.device) -> bool:
    """Compiled and autotuned kernels (a GPU); else the interpreter's one fixed config."""
    return device.type == "cuda" and not interpreting()


@functools.cache
def _cuda_info(device: torch.device) -> tuple[int, bool]:
    """(SM count, TMA capable) of a CUDA device, queried once: a property query costs microseconds a call."""
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, TensorDescriptor is not None and props.major >= 9


def _num_sms(device: torch.device) -> int:
    """Programs of the persistent schedules: one per SM on a GPU."""
    return _cuda_info(device)[0] if device.type == "cuda" else _INTERPRET_NUM_SMS


@functools.cache
def _workspace(device: torch.device, programs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stream-K partial tiles and their flags: `programs` owner slots (any contents) and flags, then
    `programs` atomic fix-up tiles and piece counts (both kept zero between launches)."""
    partials = torch.zeros(2 * programs * _MAX_TILE_ELEMS, device=device, dtype=torch.float32)
    flags = torch.zeros(2 * programs, device=device, dtype=torch.int32)
    return partials, flags


def _pick_schedule(M: int, N: int, num_sms: int) -> str:
    """'hybrid' when, with 128x128 tiles, data-parallel waves would leave over a
    quarter of the SM slots idle (e.g. 1.1 waves run as 2); else 'tiled'."""
    tiles = triton.cdiv(M, 128) * triton.cdiv(N, 128)
    waves = triton.cdiv(tiles, num_sms)
    return "hybrid" if tiles < 0.75 * waves * num_sms else "tiled"


def _tma_layout_ok(device: torch.device, elem_size: int, a_strides, b_strides, c_strides) -> bool:
    """TMA's needs that do not depend on where the tensors are: Hopper+, and each operand row-major
    (b may be column-major: it is then read as the (N, K) matrix it is a view of) with 16-byte rows."""
    if TensorDescriptor is None or (device.type == "cuda" and not _cuda_info(device)[1]):
        return False
    b_row = b_strides[0] if b_strides[1] == 1 else b_strides[1] if b_strides[0] == 1 else None
    return (b_row is not None and a_strides[1] == 1 and c_strides[1] == 1
            and all(row * elem_size % 16 == 0 for row in (a_strides[0], b_row, c_strides[0])))


def _tma_ok(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> bool:
    """TMA needs Hopper+, a last dim of stride 1, and 16-byte-aligned base and row strides."""
    return (_tma_layout_ok(a.device, a.element_size(), a.stride(), b.stride(), c.stride())
            and (a.data_ptr() | b.data_ptr() | c.data_ptr()) % 16 == 0)


# --------------------------------------------------------------------------- launch plans
#
# A Python matmul call used to cost the host 110-180 us on the H200 machine (argument checks, device
# queries, three TMA descriptors, the autotuner's key and pre-hook, Triton's argument binding and
# specialization), more than GPT-2's 16,384 x 768 x 768 GEMM takes on the GPU. So everything that
# depends only on the call's shapes, strides, dtypes and flags is worked out once per such key, into a
# `_Plan`: the schedule, the addressing mode, the autotuned block config, the grid, the constexpr
# arguments and, on a GPU, the compiled kernel itself, which later calls launch directly. The key holds
# every value that Triton specializes a compiled kernel on (integer arguments, 16-byte alignment of
# pointers), so the kernel that the first call compiled is the one Triton would pick for the next.


class _Plan:
    """How calls of one key launch. `rest`: the kernel's arguments after (a, b, c, bias), i.e. the
    Stream-K workspace and every integer (sizes, the autotune key, the SM count, strides), then, once the
    kernel is compiled, the constexprs too: all of them are fixed by the key."""

    __slots__ = ("b_nk", "blocks", "compiled", "consts", "grid", "kernel", "rest", "schedule", "use_tma")

    def __init__(self, schedule, use_tma, b_nk, kernel, consts, rest):
        self.schedule, self.use_tma, self.b_nk = schedule, use_tma, b_nk
        self.kernel = kernel  # the Autotuner until the config is known, then the bare JITFunction
        self.consts = consts  # constexpr keyword arguments (with the block config once known)
        self.rest = rest
        self.blocks = self.grid = None  # descriptor block shapes and grid, once the config is known
        self.compiled = None  # on a GPU: the compiled kernel, launched directly with (*args, *consts)

    def fix_config(self, M: int, N: int, config: dict, num_sms: int) -> None:
        """Freeze the block config: the descriptors' block shapes and the grid follow from it."""
        self.blocks = _block_shapes(config, self.b_nk, self.consts["ACTIVATION"] == "swiglu")
        self.grid = (_programs(self.schedule, M, N, config["BLOCK_M"], config["BLOCK_N"], num_sms), 1, 1)


def _programs(schedule: str, M: int, N: int, block_m: int, block_n: int, num_sms: int) -> int:
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    if schedule == "tiled":
        return tiles
    # persistent: one program per SM, at most one per tile; Stream-K modes: num_sms programs, and the
    # kernel decides how many of them get a share of the work
    return min(num_sms, tiles) if schedule == "persistent" else num_sms


_PLANS: dict[tuple, _Plan] = {}
_MAX_PLANS = 4096  # one per distinct (shape, strides, ...) seen; a serving engine sees one per batch size


def _new_plan(a, b, c_strides, bias, activation, schedule, num_sms, tuned, operands_aligned) -> _Plan:
    (M, K), N = a.shape, b.shape[1]
    if schedule == "auto":  # SwiGLU: persistent (programs loop over tiles, the next one's loads in flight during
        # this one's epilogue; session 33's H100, 16K rows: 1.05x the tiled at Llama-3.2-1B's, 1.12x at Qwen3's)
        schedule = "persistent" if activation == "swiglu" else _pick_schedule(M, N, num_sms)
    use_tma = operands_aligned and _tma_layout_ok(a.device, a.element_size(), a.stride(), b.stride(), c_strides)
    if activation == "swiglu" and b.stride(1) == 1:  # its 3-D view of a (K, N) b strides N / 2 between halves
        use_tma = use_tma and N // 2 * a.element_size() % 16 == 0
    consts = {"HAS_BIAS": bias is not None, "ACTIVATION": activation or "none", "USE_TMA": use_tma,
              "B_NK": use_tma and b.stride(1) != 1}
    m_bucket = triton.next_power_of_2(M)  # the autotune key: tuned once per power-of-two token count
    strides = (*a.stride(), *b.stride(), *c_strides)
    if schedule == "tiled":
        kernel, rest = (_tiled_tuned if tuned else _matmul_tiled_kernel), (M, N, K, m_bucket, *strides)
    else:
        kernel = _persistent_tuned if tuned else _matmul_persistent_kernel
        rest = (*_workspace(a.device, num_sms), M, N, K, m_bucket, num_sms, *strides)
        consts["MODE"] = schedule
        if not tuned:
            consts |= {"SK_ITERS": _INTERPRET_SK_ITERS, "WS_TILE": _MAX_TILE_ELEMS,
                       "FIXUP": _INTERPRET_FIXUP if schedule == "hybrid" else "owner"}
    plan = _Plan(schedule, use_tma, consts["B_NK"], kernel, consts, rest)
    if not tuned:
        plan.consts |= _INTERPRET_CONFIG
        plan.fix_config(M, N, _INTERPRET_CONFIG, num_sms)
    return plan


def _descriptor(base: torch.Tensor, shape: list, strides: list, block_shape: list) -> TensorDescriptor:
    """TensorDescriptor(base, shape, strides, block_shape) without its checks (a few us a call): the plan's
    key already holds what they check (strides, 16-byte alignment)."""
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides, desc.block_shape = base, shape, strides, block_shape
    return desc


def _operands(plan: _Plan, a, b, c, blocks) -> tuple:
    """a, b, c as the kernel takes them: TMA descriptors or the tensors themselves."""
    if not plan.use_tma:
        return a, b, c
    (M, K), N = a.shape, b.shape[1]
    # b as (N, K) when it is the transposed view of a row-major weight; same base address either way. SwiGLU's
    # b as [gate, up] halves: (2, N / 2, K), or (K, 2, N / 2)
    row = b.stride(1) if plan.b_nk else b.stride(0)
    if plan.consts["ACTIVATION"] == "swiglu":
        f = N // 2
        b_desc = (_descriptor(b, [2, f, K], [f * row, row, 1], blocks[1]) if plan.b_nk
                  else _descriptor(b, [K, 2, f], [row, f, 1], blocks[1]))
    else:
        b_desc = _descriptor(b, [N, K] if plan.b_nk else [K, N], [row, 1], blocks[1])
    return (_descriptor(a, [M, K], [a.stride(0), 1], blocks[0]), b_desc,
            _descriptor(c, [M, c.shape[1]], [c.stride(0), 1], blocks[2]))


def _matmul_triton(a, b, bias, activation, schedule, out):
    (M, K), N = a.shape, b.shape[1]
    n_out = N // 2 if activation == "swiglu" else N
    device = a.device
    num_sms = _num_sms(device)
    tuned = _autotuned(device)
    c_strides = (n_out, 1) if out is None else out.stride()
    if bias is not None:
        bias = bias.contiguous()
    # Triton specializes pointers on 16-byte alignment: part of the key (a fresh `c` is always aligned).
    aligned = tuple(t is None or t.data_ptr() % 16 == 0 for t in (a, b, out, bias))
    key = (device, a.dtype, M, N, K, a.stride(), b.stride(), c_strides, bias is not None, aligned, activation,
           schedule, num_sms, tuned, _INTERPRET_FIXUP)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        operands_aligned = all(aligned[:3])  # TMA bases must be 16-byte aligned
        plan = _PLANS[key] = _new_plan(a, b, c_strides, bias, activation, schedule, num_sms, tuned, operands_aligned)
    c = out if out is not None else torch.empty((M, n_out), device=device, dtype=a.dtype)
    bias_arg = bias if bias is not None else c  # c: any pointer, never read without HAS_BIAS
    if plan.compiled is not None:  # the steady state on a GPU
        plan.compiled[plan.grid](*_operands(plan, a, b, c, plan.blocks), bias_arg, *plan.rest)
    elif plan.blocks is not None:  # the interpreter, or a Triton that returned no compiled kernel
        plan.kernel[plan.grid](*_operands(plan, a, b, c, plan.blocks), bias_arg, *plan.rest, **plan.consts)
    else:  # first call on a GPU: the autotuner picks (or recalls) the block config
        # The descriptors get their block shapes from the autotune pre-hook, the grid from the config run.
        operands = _operands(plan, a, b, c, ([1, 1], [1, 1], [1, 1]))
        grid = lambda meta: (_programs(plan.schedule, M, N, meta["BLOCK_M"], meta["BLOCK_N"], num_sms),)
        compiled = plan.kernel[grid](*operands, bias_arg, *plan.rest, **plan.consts)
        config = plan.kernel.best_config
        plan.kernel = plan.kernel.fn  # the JITFunction under the autotuner
        plan.consts = plan.consts | config.all_kwargs()  # block shapes, num_warps, num_stages
        plan.fix_config(M, N, config.kwargs, num_sms)
        # Triton's launch returns the compiled kernel. Launched directly, it takes every parameter in
        # order, the constexprs too, and skips the binding and specialization of the arguments.
        tail = plan.kernel.arg_names[len(operands) + 1 + len(plan.rest):]
        if hasattr(compiled, "packed_metadata") and all(n in plan.consts for n in tail):
            plan.rest = (*plan.rest, *(plan.consts[n] for n in tail))
            plan.compiled = compiled
    return c
