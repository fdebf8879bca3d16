"""Flash attention for training: causal, grouped-query, document-masked (Triton forward and backward).

`attention(q, k, v, doc_ids=..., causal=..., scale=...)` is the entry point. On a CUDA GPU it runs the
Triton kernels below, wrapped in a `torch.autograd.Function`; elsewhere it runs `attention_ref`
(PyTorch SDPA with a boolean mask), which is also the definition of correct.

Layout: q is (B, T, Hq, D), k and v are (B, T, Hkv, D); query head h reads kv head h // (Hq // Hkv).
`doc_ids` (B, T) labels each token with its document. Documents are contiguous runs (packed sequences):
a query attends only to keys of its own document and, when causal, not to later ones. (The kernels find
documents where the id changes, so an id that comes back later in a row starts a new document; the
reference would join the two. Packed batches never do that.)

The kernels are FlashAttention-2 with the exp2 trick (log2(e) folded into the scale):
  forward   one program per (query block, batch * q head) streams key/value blocks, keeps a running row
            max m and row sum l of exp2(score - m), rescales its accumulator when m grows, and stores O
            and the base-2 log-sum-exp of each row for the backward;
  backward  delta = rowsum(dO * O); then one program per (key block, batch * kv head) accumulates dK and
            dV over every query block of every q head in its group (so no atomics), and one program per
            (query block, batch * q head) accumulates dQ.

Block skipping. With documents, each token knows the [start, end) of its document. A query block
[m0, m1] (causal) can only see keys in [doc_start[m0], m1], and every row sees every key in
[doc_start[m1], m0], so only the blocks on the edges of that range need a mask. `_split_range` cuts the
visible range into masked / unmasked / masked block-aligned pieces, and the loops run over exactly
those; key blocks outside every row's document are never loaded, so document masking costs no more
than the work it skips. The backward uses the same idea with the roles of queries and keys swapped.
Causal query blocks are launched last-first (the longest rows first), which shortens the tail of the grid.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanoforge.errors import NanoforgeError
from nanoforge.kernels.dispatch import interpreting, use_fast
from nanoforge.kernels.matmul import _dot  # tl.dot that also works on bfloat16 under the CPU interpreter

LOG2E = 1.4426950408889634
_NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for the running max: exp2(-inf - _NEG_BIG) is 0, never NaN


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    doc_ids: torch.Tensor | None = None,
    causal: bool = True,
    scale: float | None = None,
    bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
    q_offset: int | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention, (B, T, Hq, D) x (B, T, Hkv, D) -> (B, T, Hq, D), differentiable.

    Query i of row b attends key j iff (j <= i when `causal`) and doc_ids[b, i] == doc_ids[b, j].
    `scale` defaults to 1/sqrt(D). Triton on CUDA tensors, the PyTorch reference elsewhere.
    `bounds`: doc_bounds(doc_ids), when the caller has it already (computed here otherwise).
    `q_offset`: q holds only rows q_offset .. q_offset + Tq of the T-token rows that k, v and doc_ids hold
    (context parallelism: a rank's chunk of queries against the gathered keys); the result has q's shape.
    None: q holds the same T rows as k.
    """
    _check_inputs(q, k, v, doc_ids, q_offset)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if not use_fast(q, k, v):
        return attention_ref(q, k, v, doc_ids=doc_ids, causal=causal, scale=scale, q_offset=q_offset)
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"flash attention runs on float16/bfloat16/float32, not {q.dtype}")
    if doc_ids is not None and bounds is None:
        bounds = doc_bounds(doc_ids)
    starts, ends = bounds if doc_ids is not None else (None, None)
    return _flash_fwd(q, k, v, starts, ends, causal, scale, q_offset or 0)[0]


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    doc_ids: torch.Tensor | None = None,
    causal: bool = True,
    scale: float | None = None,
    q_offset: int | None = None,
) -> torch.Tensor:
    """The definition of correct: PyTorch SDPA with one boolean mask built per call (any dtype, float64 too)."""
    _check_inputs(q, k, v, doc_ids, q_offset)
    T, Tq = k.shape[1], q.shape[1]
    rows = None if not q_offset and Tq == T else torch.arange(q_offset, q_offset + Tq, device=q.device)
    if doc_ids is not None:
        mask = document_mask(doc_ids, causal, rows=rows)
    elif causal and rows is not None:
        mask = torch.arange(T, device=q.device)[None, :] <= rows[:, None]
    else:
        mask = None
    return sdpa(q, k, v, mask=mask, causal=causal and mask is None, scale=scale)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None,
         causal: bool = False, scale: float | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """PyTorch's scaled_dot_product_attention in our (B, T, H, D) layout with grouped-query heads: the one
    SDPA reference that every attention path falls back on (this file's reference, the model's backends,
    the paged reference). q (B, Tq, Hq, D), k and v (B, Tk, Hkv, D); `mask` a boolean (B or 1, 1, Tq, Tk),
    True where a query may see a key; `causal` (no mask) aligns query i with key i."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=causal,
        dropout_p=dropout_p,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def document_mask(doc_ids: torch.Tensor, causal: bool = True, rows: torch.Tensor | None = None,
                  cols: torch.Tensor | None = None) -> torch.Tensor:
    """The dense (B, 1, Tq, Tk) boolean mask of `doc_ids` (B, T) for SDPA: same document, and not later when
    `causal`. What the kernels compute without ever building it. `rows` / `cols` (int64 indices into the T
    tokens of a row) pick the queries / keys (default: all T of each, in order): context parallelism's
    local queries against its gathered keys."""
    T = doc_ids.shape[1]
    rows = torch.arange(T, device=doc_ids.device) if rows is None else rows
    cols = torch.arange(T, device=doc_ids.device) if cols is None else cols
    mask = (doc_ids[:, rows, None] == doc_ids[:, None, cols])[:, None]
    if causal:
        mask = mask & (cols[None, :] <= rows[:, None])
    return mask


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None,
                  q_offset: int | None = None) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"attention wants q (B, T, Hq, D) and k, v (B, T, Hkv, D), got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    B, Tq, hq, d = q.shape
    T = k.shape[1]
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != d or (q_offset is None and Tq != T):
        raise ValueError(
            f"attention: k {tuple(k.shape)} and v {tuple(v.shape)} must both be (B={B}, T={Tq}, Hkv, D={d}) "
            f"to match q {tuple(q.shape)} (or q_offset must place q's rows among theirs)"
        )
    if q_offset is not None and not 0 <= q_offset <= T - Tq:
        raise ValueError(f"attention: q_offset {q_offset} puts q's {Tq} rows outside the keys' {T}")
    if hq % k.shape[2]:
        raise ValueError(f"attention: {hq} query heads is not a multiple of {k.shape[2]} kv heads")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if doc_ids is not None and (doc_ids.shape != (B, T) or doc_ids.is_floating_point() or doc_ids.device != q.device):
        raise ValueError(
            f"attention: doc_ids must be an integer tensor of shape (B={B}, T={T}) on {q.device}, got "
            f"{doc_ids.dtype} {tuple(doc_ids.shape)} on {doc_ids.device}"
        )


# ----------------------------------------------------------------------------------------------
# Autograd wrapper and launchers
# ----------------------------------------------------------------------------------------------


def random_doc_ids(B: int, T: int, gen: torch.Generator, max_len: int = 600) -> torch.Tensor:
    """Test and benchmark data: per row, contiguous documents of random lengths (one in four of length 1,
    else 2..max_len-1) labelled by random, unsorted ids. A (B, T) int64 CPU tensor."""
    rows = []
    for _ in range(B):
        lens = []
        while sum(lens) < T:
            singleton = torch.rand(1, generator=gen).item() < 0.25
            lens.append(1 if singleton else int(torch.randint(2, max_len, (1,), generator=gen)))
        lens[-1] -= sum(lens) - T
        labels = torch.randperm(10 * len(lens), generator=gen)[: len(lens)]  # ids need not be sorted or consecutive
        rows.append(torch.repeat_interleave(labels, torch.tensor(lens)))
    return torch.stack(rows)


def _empty(*shape: int, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Every kernel output is allocated here (tests swap it for a NaN-filled one to catch unwritten elements)."""
    return torch.empty(shape, device=like.device, dtype=dtype or like.dtype)


def doc_bounds(doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, the [start, end) of its document, as two int32 (B, T) tensors: what the kernels read
    instead of the ids. One Triton launch on a GPU (`_doc_bounds_ref`, a dozen PyTorch ops, elsewhere).
    Every layer of a forward pass sees the same documents, so callers compute this once per batch
    (`DenseAttention` does) and pass it to `attention(..., bounds=...)`."""
    if not use_fast(doc_ids):
        return _doc_bounds_ref(doc_ids)
    return _doc_bounds_op(doc_ids)


@torch.library.custom_op("nanoforge::doc_bounds", mutates_args=())
def _doc_bounds_op(doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    doc_ids = doc_ids.contiguous()
    B, T = doc_ids.shape
    starts = _empty(B, T, like=doc_ids, dtype=torch.int32)
    ends = _empty(B, T, like=doc_ids, dtype=torch.int32)
    _doc_bounds_kernel[(B,)](doc_ids, starts, ends, T, BLOCK=16 if interpreting() else 1024)
    return starts, ends


@_doc_bounds_op.register_fake
def _(doc_ids):
    return doc_ids.new_empty(doc_ids.shape, dtype=torch.int32), doc_ids.new_empty(doc_ids.shape, dtype=torch.int32)


def _doc_bounds_ref(doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """doc_bounds in PyTorch ops: the reference of the kernel, and the CPU path."""
    B, T = doc_ids.shape
    idx = torch.arange(T, device=doc_ids.device).expand(B, T)
    first = torch.ones_like(doc_ids, dtype=torch.bool)
    first[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    last = torch.ones_like(first)
    last[:, :-1] = first[:, 1:]
    start = torch.where(first, idx, 0).cummax(dim=1).values
    end = torch.where(last, idx + 1, T).flip(1).cummin(dim=1).values.flip(1)
    return start.to(torch.int32).contiguous(), end.to(torch.int32).contiguous()


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    """The kernels index the head dimension with stride 1; any other stride is free."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))  # tl.dot wants every dimension >= 16


# The Triton launches are wrapped as torch custom ops, so `torch.compile` treats attention as one
# opaque node (with a registered shape function and backward) rather than tracing into the kernels.

@torch.library.custom_op(
    "nanoforge::flash_attn_fwd", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor? starts, Tensor? ends, bool causal, float scale, int q_off) "
           "-> (Tensor, Tensor)")
def _flash_fwd(q, k, v, starts, ends, causal, scale, q_off):
    """q: rows q_off .. q_off + Tq of the T-token rows of k and v (and of starts, ends)."""
    q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
    B, TQ, hq, d = q.shape
    T = k.shape[1]
    has_docs = starts is not None
    if not has_docs:  # the kernels never read starts/ends then; any tensor does as a placeholder
        starts = ends = q
    o = _empty(B, TQ, hq, d, like=q)
    lse = _empty(B, hq, TQ, like=q, dtype=torch.float32)
    _attn_fwd[lambda meta: (B * hq, triton.cdiv(TQ, meta["BLOCK_M"]))](
        q, k, v, o, lse, starts, ends,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
        T, hq, scale * LOG2E, q_off, TQ,
        GROUP=hq // k.shape[2], HEAD_D=d, BLOCK_D=_block_d(d), CAUSAL=causal, HAS_DOCS=has_docs,
    )  # fmt: skip
    return o, lse


@_flash_fwd.register_fake
def _(q, k, v, starts, ends, causal, scale, q_off):
    B, TQ, hq, d = q.shape
    return q.new_empty(B, TQ, hq, d), q.new_empty(B, hq, TQ, dtype=torch.float32)


@torch.library.custom_op(
    "nanoforge::flash_attn_bwd", mutates_args=(),
    schema="(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor? starts, Tensor? ends, "
           "bool causal, float scale, int q_off) -> (Tensor, Tensor, Tensor)")
def _flash_bwd(do, q, k, v, o, lse, starts, ends, causal, scale, q_off):
    q, k, v, o, do = (_unit_stride(x) for x in (q, k, v, o, do))
    B, TQ, hq, d = q.shape
    T, hkv = k.shape[1], k.shape[2]
    has_docs = starts is not None
    if not has_docs:
        starts = ends = q
    common = dict(HEAD_D=d, BLOCK_D=_block_d(d), CAUSAL=causal, HAS_DOCS=has_docs)

    delta = _empty(B, hq, TQ, like=q, dtype=torch.float32)
    _attn_bwd_delta[(B * hq, triton.cdiv(TQ, 64))](
        o, do, delta, *o.stride()[:3], *do.stride()[:3], TQ, hq,
        HEAD_D=d, BLOCK_D=_block_d(d), BLOCK_M=64,
    )  # fmt: skip

    dk, dv = _empty(*k.shape, like=k), _empty(*v.shape, like=v)
    _attn_bwd_dkdv[lambda meta: (B * hkv, triton.cdiv(T, meta["BLOCK_N"]))](
        q, k, v, do, lse, delta, dk, dv, starts, ends,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3],
        *dk.stride()[:3], *dv.stride()[:3],
        T, hkv, scale, scale * LOG2E, q_off, TQ, GROUP=hq // hkv, **common,
    )  # fmt: skip

    dq = _empty(*q.shape, like=q)
    _attn_bwd_dq[lambda meta: (B * hq, triton.cdiv(TQ, meta["BLOCK_M"]))](
        q, k, v, do, lse, delta, dq, starts, ends,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *dq.stride()[:3],
        T, hq, scale, scale * LOG2E, q_off, TQ, GROUP=hq // hkv, **common,
    )  # fmt: skip
    return dq, dk, dv


@_flash_bwd.register_fake
def _(do, q, k, v, o, lse, starts, ends, causal, scale, q_off):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, starts, ends, causal, scale, q_off = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, starts, ends)
    ctx.causal, ctx.scale, ctx.q_off = causal, scale, q_off


def _backward(ctx, do, _dlse):
    q, k, v, o, lse, starts, ends = ctx.saved_tensors
    dq, dk, dv = _flash_bwd(do, q, k, v, o, lse, starts, ends, ctx.causal, ctx.scale, ctx.q_off)
    return dq, dk, dv, None, None, None, None, None


_flash_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


def _configs(names: tuple[str, str], shapes: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    """Autotune candidates (block sizes, warps, stages); one small config under the CPU interpreter."""
    if interpreting():
        shapes = [(16, 16, 1, 1)]
    return [triton.Config({names[0]: a, names[1]: b}, num_warps=w, num_stages=s) for a, b, w, s in shapes]


_TUNE_KEY = ["HEAD_D", "GROUP", "CAUSAL", "HAS_DOCS"]
# Hopper candidates. The H200 runs (B16 H12 T1024 D64 and B2 H32/8 T4096 D128, with and without documents)
# chose the small tiles: forward 128x32 / 64x64, dK/dV 32x64, dQ 64x32 (once 128x64 at 8 warps). The
# candidates keep those, step once more towards smaller tiles, and keep one larger tile at 8 warps; the
# configurations that spill registers at 4 warps (128-wide dK/dV key blocks, 128x32 dQ) are gone.
_FWD_CONFIGS = _configs(
    ("BLOCK_M", "BLOCK_N"),
    [(128, 32, 4, 4), (64, 64, 4, 3), (64, 64, 4, 4), (64, 32, 4, 3), (128, 64, 8, 3)],
)
_DKDV_CONFIGS = _configs(
    ("BLOCK_M", "BLOCK_N"),
    [(32, 64, 4, 3), (32, 64, 4, 4), (16, 64, 4, 3), (32, 32, 4, 3), (64, 64, 8, 3), (32, 128, 8, 3)],
)
_DQ_CONFIGS = _configs(
    ("BLOCK_M", "BLOCK_N"),
    [(64, 32, 4, 3), (64, 32, 4, 4), (32, 32, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3), (128, 32, 8, 3)],
)


@triton.jit
def _max2(a, b):
    return tl.maximum(a, b)


@triton.jit
def _min2(a, b):
    return tl.minimum(a, b)


@triton.jit
def _doc_bounds_kernel(IDS, STARTS, ENDS, T, BLOCK: tl.constexpr):
    """One program per row. starts: a running max of "a document starts here" positions, left to right;
    ends: a running min of "one past a document's last token" positions, right to left. Each BLOCK of
    tokens is one associative scan, carried into the next block."""
    row = tl.program_id(0).to(tl.int64) * T
    carry = tl.zeros([], dtype=tl.int32)
    for t0 in range(0, T, BLOCK):
        offs = t0 + tl.arange(0, BLOCK)
        ok = offs < T
        ids = tl.load(IDS + row + offs, mask=ok)
        prev = tl.load(IDS + row + offs - 1, mask=ok & (offs > 0))
        first = (offs == 0) | (ids != prev)
        s = tl.maximum(tl.associative_scan(tl.where(first, offs, 0), 0, _max2), carry)
        tl.store(STARTS + row + offs, s, mask=ok)
        carry = tl.max(tl.where(ok, s, 0), 0)
    carry = tl.zeros([], dtype=tl.int32) + T
    for t0 in range(0, T, BLOCK):
        offs = T - 1 - t0 - tl.arange(0, BLOCK)  # right to left
        ok = offs >= 0
        ids = tl.load(IDS + row + offs, mask=ok)
        nxt = tl.load(IDS + row + offs + 1, mask=ok & (offs < T - 1))
        last = (offs == T - 1) | (ids != nxt)
        e = tl.minimum(tl.associative_scan(tl.where(last, offs + 1, T), 0, _min2), carry)
        tl.store(ENDS + row + offs, e, mask=ok)
        carry = tl.min(tl.where(ok, e, T), 0)


@triton.jit
def _split_range(lo, full_lo, full_hi, hi, BLOCK: tl.constexpr):
    """Cut [lo, hi) into block-aligned pieces [a, b) masked, [b, c) unmasked, [c, hi) masked.

    Every block of [b, c) lies inside [full_lo, full_hi), the range that needs no mask.
    """
    a = lo // BLOCK * BLOCK
    b = tl.minimum(tl.maximum((full_lo + BLOCK - 1) // BLOCK * BLOCK, a), hi)
    c = tl.minimum(tl.maximum(full_hi // BLOCK * BLOCK, b), hi)
    return a, b, c


@triton.jit
def _doc_range(STARTS, ENDS, x0, X_END, T, BLOCK: tl.constexpr, HAS_DOCS: tl.constexpr):
    """For tokens [x0, min(x0+BLOCK, X_END)): the union [lo, hi) and the intersection [full_lo, full_hi) of
    their documents (doc starts and ends are non-decreasing along the row), and the block's last token."""
    x_last = tl.minimum(x0 + BLOCK, X_END) - 1
    if HAS_DOCS:
        lo = tl.load(STARTS + x0)
        full_lo = tl.load(STARTS + x_last)
        full_hi = tl.load(ENDS + x0)
        hi = tl.load(ENDS + x_last)
    else:
        lo = 0
        full_lo = 0
        full_hi = T
        hi = T
    return lo, full_lo, full_hi, hi, x_last


@triton.jit
def _keys_of_query_block(STARTS, ENDS, m0, M_END, T, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr,
                         HAS_DOCS: tl.constexpr):
    """Keys that rows [m0, min(m0+BLOCK_M, M_END)) may see: [lo, hi); every row sees all of [full_lo, full_hi)."""
    lo, full_lo, full_hi, hi, m_last = _doc_range(STARTS, ENDS, m0, M_END, T, BLOCK_M, HAS_DOCS)
    if CAUSAL:  # no key after the query
        full_hi = tl.minimum(full_hi, m0 + 1)
        hi = tl.minimum(hi, m_last + 1)
    return lo, full_lo, full_hi, hi


@triton.jit
def _queries_of_key_block(STARTS, ENDS, n0, T, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr):
    """Queries that may see keys [n0, n0+BLOCK_N): [lo, hi); all of [full_lo, full_hi) see every key."""
    lo, full_lo, full_hi, hi, n_last = _doc_range(STARTS, ENDS, n0, T, T, BLOCK_N, HAS_DOCS)
    if CAUSAL:  # no query before the key
        lo = tl.maximum(lo, n0)
        full_lo = tl.maximum(full_lo, n_last)
    return lo, full_lo, full_hi, hi


@triton.jit
def _load_tile(ptrs, offs_d, offs_t, T, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
               TOKENS_FIRST: tl.constexpr):
    """A (D, tokens) tile, or (tokens, D) with TOKENS_FIRST, with zeros outside T and HEAD_D. Unmasked blocks
    whose head size fills BLOCK_D (D = 64, 128) load without any mask, so the loads vectorize freely."""
    if TOKENS_FIRST:
        t_ok = offs_t[:, None] < T
        d_ok = offs_d[None, :] < HEAD_D
    else:
        t_ok = offs_t[None, :] < T
        d_ok = offs_d[:, None] < HEAD_D
    if MASKED:
        x = tl.load(ptrs, mask=t_ok & d_ok, other=0.0)
    elif BLOCK_D != HEAD_D:
        x = tl.load(ptrs, mask=d_ok, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _visible(offs_q, offs_k, q_start, q_end, T, CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr):
    """(len(offs_q), len(offs_k)) mask: key in range, not in the future, in the query's document.

    Rows past T are never stored; they see in-range keys so that their softmax stays finite."""
    keep = offs_k[None, :] < T
    if CAUSAL:
        keep &= offs_k[None, :] <= offs_q[:, None]
    if HAS_DOCS:
        keep &= (offs_k[None, :] >= q_start[:, None]) & (offs_k[None, :] < q_end[:, None])
    return keep


@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i, q, K, V, stride_kt, stride_vt, offs_m, q_start, q_end, T, qk_scale, lo, hi,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr,
):  # fmt: skip
    offs_d = tl.arange(0, BLOCK_D)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        kt = _load_tile(K + offs_n[None, :] * stride_kt + offs_d[:, None], offs_d, offs_n, T, HEAD_D, BLOCK_D, MASKED, False)  # (D, N)
        s = _dot(q, kt, None) * qk_scale  # scores in log2 units
        if MASKED:
            s = tl.where(_visible(offs_m, offs_n, q_start, q_end, T, CAUSAL, HAS_DOCS), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(V + offs_n[:, None] * stride_vt + offs_d[None, :], offs_d, offs_n, T, HEAD_D, BLOCK_D, MASKED, True)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=_FWD_CONFIGS, key=_TUNE_KEY)
@triton.jit
def _attn_fwd(
    Q, K, V, O, LSE, STARTS, ENDS,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_ob, stride_ot, stride_oh,
    T, H, qk_scale, Q_OFF, TQ,
    GROUP: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_DOCS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Queries are rows [Q_OFF, Q_OFF + TQ) of the T-token row whose keys K, V hold (all of a row: Q_OFF 0,
    TQ T); Q, O and LSE hold only those TQ rows."""
    m0_local = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M  # causal: heaviest query blocks first
    m0 = Q_OFF + m0_local  # the block's position in the row
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = bh % H
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + (h // GROUP) * stride_kh
    V += b * stride_vb + (h // GROUP) * stride_vh
    O += b * stride_ob + h * stride_oh
    STARTS += b * T
    ENDS += b * T

    offs_local = m0_local + tl.arange(0, BLOCK_M)
    offs_m = Q_OFF + offs_local
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_local < TQ
    io_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_D)
    q = tl.load(Q + offs_local[:, None] * stride_qt + offs_d[None, :], mask=io_mask, other=0.0)
    if HAS_DOCS:
        q_start = tl.load(STARTS + offs_m, mask=row_ok, other=0)
        q_end = tl.load(ENDS + offs_m, mask=row_ok, other=T)
    else:
        q_start = 0
        q_end = 0

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    lo, full_lo, full_hi, hi = _keys_of_query_block(STARTS, ENDS, m0, Q_OFF + TQ, T, BLOCK_M, CAUSAL, HAS_DOCS)
    a, b_, c = _split_range(lo, full_lo, full_hi, hi, BLOCK_N)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K, V, stride_kt, stride_vt, offs_m, q_start, q_end, T, qk_scale, a, b_, HEAD_D, BLOCK_D, BLOCK_N, True, CAUSAL, HAS_DOCS)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K, V, stride_kt, stride_vt, offs_m, q_start, q_end, T, qk_scale, b_, c, HEAD_D, BLOCK_D, BLOCK_N, False, CAUSAL, HAS_DOCS)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K, V, stride_kt, stride_vt, offs_m, q_start, q_end, T, qk_scale, c, hi, HEAD_D, BLOCK_D, BLOCK_N, True, CAUSAL, HAS_DOCS)

    o = (acc / l_i[:, None]).to(O.dtype.element_ty)
    tl.store(O + offs_local[:, None] * stride_ot + offs_d[None, :], o, mask=io_mask)
    tl.store(LSE + bh.to(tl.int64) * TQ + offs_local, m_i + tl.log2(l_i), mask=row_ok)


@triton.jit
def _attn_bwd_delta(
    O, DO, DELTA, stride_ob, stride_ot, stride_oh, stride_db, stride_dt, stride_dh, T, H,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """delta[b, h, t] = sum_d dO * O, the correction term of the softmax backward."""
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = bh % H
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < T) & (offs_d[None, :] < HEAD_D)
    O += b * stride_ob + h * stride_oh
    DO += b * stride_db + h * stride_dh
    o = tl.load(O + offs_m[:, None] * stride_ot + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + offs_m[:, None] * stride_dt + offs_d[None, :], mask=mask, other=0.0)
    tl.store(DELTA + bh.to(tl.int64) * T + offs_m, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=offs_m < T)


@triton.jit
def _attn_bwd_dkdv_inner(
    dk, dv, k, v, Q, DO, LSE, DELTA, stride_qt, stride_dot, offs_n, k_start, k_end, Q_OFF, TQ, qk_scale, lo, hi,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr,
):  # fmt: skip
    """Works on transposed scores (keys x queries) so that dK and dV come out as (BLOCK_N, D). lo, hi and the
    loads count in this launch's TQ query rows; the masks in the row's positions (Q_OFF + local)."""
    offs_d = tl.arange(0, BLOCK_D)
    for m0 in range(lo, hi, BLOCK_M):
        offs_local = m0 + tl.arange(0, BLOCK_M)
        offs_m = Q_OFF + offs_local
        qt = _load_tile(Q + offs_local[None, :] * stride_qt + offs_d[:, None], offs_d, offs_local, TQ, HEAD_D, BLOCK_D, MASKED, False)  # (D, M)
        lse = tl.load(LSE + offs_local, mask=offs_local < TQ, other=0.0)
        pt = tl.exp2(_dot(k, qt, None) * qk_scale - lse[None, :])  # (N, M) probabilities
        if MASKED:
            # Documents are symmetric, so _visible with the roles swapped gives the in-range, same-document
            # (key, query) pairs; causality is not symmetric and is added here.
            keep = _visible(offs_n, offs_m, k_start, k_end, Q_OFF + TQ, False, HAS_DOCS)
            if CAUSAL:
                keep &= offs_m[None, :] >= offs_n[:, None]
            pt = tl.where(keep, pt, 0.0)
        do = _load_tile(DO + offs_local[:, None] * stride_dot + offs_d[None, :], offs_d, offs_local, TQ, HEAD_D, BLOCK_D, MASKED, True)
        dv = _dot(pt.to(do.dtype), do, dv)
        delta = tl.load(DELTA + offs_local, mask=offs_local < TQ, other=0.0)
        dst = pt * (_dot(v, tl.trans(do), None) - delta[None, :])
        dk = _dot(dst.to(qt.dtype), tl.trans(qt), dk)
    return dk, dv


@triton.autotune(configs=_DKDV_CONFIGS, key=_TUNE_KEY)
@triton.jit
def _attn_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV, STARTS, ENDS,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh, stride_dkb, stride_dkt, stride_dkh, stride_dvb, stride_dvt, stride_dvh,
    T, HKV, scale, qk_scale, Q_OFF, TQ,
    GROUP: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_DOCS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    n0 = tl.program_id(1) * BLOCK_N  # causal: the first key blocks have the most queries, so they go first
    bh = tl.program_id(0)
    b = (bh // HKV).to(tl.int64)
    hk = bh % HKV
    STARTS += b * T
    ENDS += b * T
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    io_mask = (offs_n[:, None] < T) & (offs_d[None, :] < HEAD_D)
    K += b * stride_kb + hk * stride_kh
    V += b * stride_vb + hk * stride_vh
    k = tl.load(K + offs_n[:, None] * stride_kt + offs_d[None, :], mask=io_mask, other=0.0)
    v = tl.load(V + offs_n[:, None] * stride_vt + offs_d[None, :], mask=io_mask, other=0.0)
    if HAS_DOCS:
        k_start = tl.load(STARTS + offs_n, mask=offs_n < T, other=0)
        k_end = tl.load(ENDS + offs_n, mask=offs_n < T, other=0)
    else:
        k_start = 0
        k_end = 0

    lo, full_lo, full_hi, hi = _queries_of_key_block(STARTS, ENDS, n0, T, BLOCK_N, CAUSAL, HAS_DOCS)
    # This launch's queries are rows [Q_OFF, Q_OFF + TQ): the ranges in their local rows.
    lo = tl.minimum(tl.maximum(lo - Q_OFF, 0), TQ)
    full_lo = tl.minimum(tl.maximum(full_lo - Q_OFF, 0), TQ)
    full_hi = tl.minimum(tl.maximum(full_hi - Q_OFF, 0), TQ)
    hi = tl.minimum(tl.maximum(hi - Q_OFF, 0), TQ)
    a, b_, c = _split_range(lo, full_lo, full_hi, hi, BLOCK_M)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for g in range(GROUP):  # every query head that reads this kv head
        h = hk * GROUP + g
        Qh = Q + b * stride_qb + h * stride_qh
        DOh = DO + b * stride_dob + h * stride_doh
        LSEh = LSE + (b * HKV * GROUP + h) * TQ
        DELTAh = DELTA + (b * HKV * GROUP + h) * TQ
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, stride_qt, stride_dot, offs_n, k_start, k_end, Q_OFF, TQ, qk_scale, a, b_, HEAD_D, BLOCK_D, BLOCK_M, True, CAUSAL, HAS_DOCS)
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, stride_qt, stride_dot, offs_n, k_start, k_end, Q_OFF, TQ, qk_scale, b_, c, HEAD_D, BLOCK_D, BLOCK_M, False, CAUSAL, HAS_DOCS)
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, stride_qt, stride_dot, offs_n, k_start, k_end, Q_OFF, TQ, qk_scale, c, hi, HEAD_D, BLOCK_D, BLOCK_M, True, CAUSAL, HAS_DOCS)

    offs = offs_n[:, None] * stride_dkt + offs_d[None, :]
    tl.store(DK + b * stride_dkb + hk * stride_dkh + offs, (dk * scale).to(DK.dtype.element_ty), mask=io_mask)
    offs = offs_n[:, None] * stride_dvt + offs_d[None, :]
    tl.store(DV + b * stride_dvb + hk * stride_dvh + offs, dv.to(DV.dtype.element_ty), mask=io_mask)


@triton.jit
def _attn_bwd_dq_inner(
    dq, q, do, lse, delta, K, V, stride_kt, stride_vt, offs_m, q_start, q_end, T, qk_scale, lo, hi,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr,
):  # fmt: skip
    offs_d = tl.arange(0, BLOCK_D)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        kt = _load_tile(K + offs_n[None, :] * stride_kt + offs_d[:, None], offs_d, offs_n, T, HEAD_D, BLOCK_D, MASKED, False)  # (D, N)
        vt = _load_tile(V + offs_n[None, :] * stride_vt + offs_d[:, None], offs_d, offs_n, T, HEAD_D, BLOCK_D, MASKED, False)
        p = tl.exp2(_dot(q, kt, None) * qk_scale - lse[:, None])
        if MASKED:
            p = tl.where(_visible(offs_m, offs_n, q_start, q_end, T, CAUSAL, HAS_DOCS), p, 0.0)
        ds = p * (_dot(do, vt, None) - delta[:, None])
        dq = _dot(ds.to(kt.dtype), tl.trans(kt), dq)
    return dq


@triton.autotune(configs=_DQ_CONFIGS, key=_TUNE_KEY)
@triton.jit
def _attn_bwd_dq(
    Q, K, V, DO, LSE, DELTA, DQ, STARTS, ENDS,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh, stride_dqb, stride_dqt, stride_dqh,
    T, H, scale, qk_scale, Q_OFF, TQ,
    GROUP: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_DOCS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    m0_local = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M  # causal: heaviest query blocks first
    m0 = Q_OFF + m0_local
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = bh % H
    K += b * stride_kb + (h // GROUP) * stride_kh
    V += b * stride_vb + (h // GROUP) * stride_vh
    STARTS += b * T
    ENDS += b * T
    offs_local = m0_local + tl.arange(0, BLOCK_M)
    offs_m = Q_OFF + offs_local
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_local < TQ
    io_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_D)
    Q += b * stride_qb + h * stride_qh
    DO += b * stride_dob + h * stride_doh
    q = tl.load(Q + offs_local[:, None] * stride_qt + offs_d[None, :], mask=io_mask, other=0.0)
    do = tl.load(DO + offs_local[:, None] * stride_dot + offs_d[None, :], mask=io_mask, other=0.0)
    lse = tl.load(LSE + bh.to(tl.int64) * TQ + offs_local, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + bh.to(tl.int64) * TQ + offs_local, mask=row_ok, other=0.0)
    if HAS_DOCS:
        q_start = tl.load(STARTS + offs_m, mask=row_ok, other=0)
        q_end = tl.load(ENDS + offs_m, mask=row_ok, other=T)
    else:
        q_start = 0
        q_end = 0

    lo, full_lo, full_hi, hi = _keys_of_query_block(STARTS, ENDS, m0, Q_OFF + TQ, T, BLOCK_M, CAUSAL, HAS_DOCS)
    a, b_, c = _split_range(lo, full_lo, full_hi, hi, BLOCK_N)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_kt, stride_vt, offs_m, q_start, q_end, T, qk_scale, a, b_, HEAD_D, BLOCK_D, BLOCK_N, True, CAUSAL, HAS_DOCS)
    dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_kt, stride_vt, offs_m, q_start, q_end, T, qk_scale, b_, c, HEAD_D, BLOCK_D, BLOCK_N, False, CAUSAL, HAS_DOCS)
    dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_kt, stride_vt, offs_m, q_start, q_end, T, qk_scale, c, hi, HEAD_D, BLOCK_D, BLOCK_N, True, CAUSAL, HAS_DOCS)
    offs = offs_local[:, None] * stride_dqt + offs_d[None, :]
    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs, (dq * scale).to(DQ.dtype.element_ty), mask=io_mask)


# ----------------------------------------------------------------------------------------------
# Benchmark rows (for nanoforge.kernels.bench)
# ----------------------------------------------------------------------------------------------


def _sdpa_flash(q, k, v, causal: bool):
    """The baseline: PyTorch SDPA restricted to its FlashAttention-2 backend, on the same (B, T, H, D) tensors."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return sdpa(q, k, v, causal=causal)


def _visible_pairs(T: int, doc_lens: list[int] | None) -> int:
    """(query, key) pairs that causal attention computes in one row (per head)."""
    return sum(n * (n + 1) // 2 for n in (doc_lens or [T]))


def bench_rows(quick: bool) -> list[dict]:
    """Forward and forward+backward vs SDPA (flash backend), and document masking vs the same kernel without it."""
    from nanoforge.kernels.bench import make_row, time_ms
    if not torch.cuda.is_available():
        raise NanoforgeError("flash attention benchmarks need a CUDA GPU", param="kinds")
    dtype = torch.bfloat16
    # (B, T, Hq, Hkv, D, documents per row or None)
    shapes = [(16, 1024, 12, 12, 64, None), (16, 1024, 12, 12, 64, 4)]
    if not quick:
        shapes += [(2, 4096, 32, 8, 128, None), (2, 4096, 32, 8, 128, 8)]
    rows = []
    for B, T, hq, hkv, d, ndocs in shapes:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (
            torch.randn(B, T, h, d, device="cuda", dtype=dtype, generator=gen).requires_grad_(i < 3)
            for i, h in enumerate((hq, hkv, hkv, hq))
        )
        doc_ids, doc_lens = None, None
        if ndocs:
            doc_lens = [T // ndocs] * ndocs
            doc_ids = torch.arange(T, device="cuda").div(T // ndocs, rounding_mode="floor").expand(B, T)

        bounds = doc_bounds(doc_ids) if ndocs else None  # once per batch, shared by every layer

        def ours():
            return attention(q, k, v, doc_ids=doc_ids, bounds=bounds)

        def base():  # with documents, the same kernel without them: masking should pay for itself
            return attention(q, k, v) if ndocs else _sdpa_flash(q, k, v, causal=True)

        baseline = "same kernel, no doc mask" if ndocs else "SDPA flash backend"
        shape = f"B{B} T{T} Hq{hq} Hkv{hkv} D{d} causal" + (f" {ndocs} docs" if ndocs else "")
        flops = 4 * B * hq * d * _visible_pairs(T, doc_lens)
        io = B * T * (2 * hq + 2 * hkv) * d * (torch.finfo(dtype).bits // 8)  # forward: read q, k, v; write o
        # GPU time (CUDA-graph replays, as in the training step): the host's launch overhead is not the kernel's.
        rows.append(make_row("flash_fwd", shape, time_ms(ours, graph=True), time_ms(base, graph=True), baseline,
                             flops, io))
        # The backward does 5 matmuls to the forward's 2; it reads q, k, v, o, dO and writes dq, dk, dv.
        ours_ms = time_ms(lambda: ours().backward(do), grad_to_none=[q, k, v], graph=True)
        base_ms = time_ms(lambda: base().backward(do), grad_to_none=[q, k, v], graph=True)
        rows.append(make_row("flash_fwd_bwd", shape, ours_ms, base_ms, baseline, 3.5 * flops, 3 * io))
    return rows
