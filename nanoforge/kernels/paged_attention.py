"""Paged attention for serving: decode and chunked prefill over a block-table KV cache (Triton).

The KV cache of one layer is `k_cache`, `v_cache`: (num_blocks, block_size, Hkv, D). Sequence i owns the
blocks `block_tables[i, :]` (logical block j of the sequence is physical block block_tables[i, j]) and has
`seq_lens[i]` tokens of context, which INCLUDE its new query tokens (their K/V are already written, see
`write_kv`). Its query tokens are q[cu_seqlens_q[i] : cu_seqlens_q[i+1]], the last positions of its
context, and attention is causal. Decode is the case where every sequence has one query token.

The Triton kernel (one for decode and chunked prefill) gives each program a tile of query tokens of one
sequence, times all the query heads of one kv head: the rows of its score matrix are (token, head) pairs,
so K and V are read once per kv head however many query heads share it. Keys are gathered token by
token through the block table, so any cache block size works. For decode (one token, few rows) the
context is also split across programs, flash-decoding style: each split writes a partial output and its
log-sum-exp, and a small second kernel combines them (or, with NANOFORGE_ATTN_COMBINE=fused, the last of a
tile's splits to finish combines them itself, counted in `dispatch.arrival_counters`: one launch a layer fewer,
yet slower in batch-1 decode on the H200, session 15, so not the default). Launch shapes depend only on tensor
shapes and `max_q_len`, never on tensor values, so a step can be captured in a CUDA graph.

Decode gives program i sequence i. Prefill and mixed steps hand out query tiles ragged: sequence i owns
cdiv(q_len_i, BLOCK_Q) consecutive programs (`tile_starts`, a prefix sum over the sequences, found by binary
search in the kernel), so a step of 200 decodes and one 2,000-token chunk launches ~270 programs per kv head,
not 201 x 63 of which all but 263 exit at once; the grid, cdiv(total_q, BLOCK_Q) + num_seqs, bounds the
tiles whatever the lengths, and zero-length (padding) sequences cost nothing.
"""

from __future__ import annotations

import functools
import math
import os
import re
from unittest import mock

import torch
import triton
import triton.language as tl

from nanoforge.errors import NanoforgeError
from nanoforge.kernels import pdl
from nanoforge.kernels.dispatch import arrival_counters, env_choice, interpreting, sm_count, use_fast
from nanoforge.kernels.matmul import _dot  # tl.dot that also works on bfloat16 under the CPU interpreter
from nanoforge.kernels.flash_attention import LOG2E, sdpa

_NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for the running max (see flash_attention.py)
_TABLE_TILES = tl.constexpr(16)  # key tiles whose block-table entries a program holds in registers at once


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    scale: float | None = None,
    max_q_len: int | None = None,
    tile_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of q (total_q, Hq, D) over each sequence's paged context; returns (total_q, Hq, D).

    `max_q_len` must be at least the number of query tokens of every sequence (1 for decode); it picks the
    tile configuration (decode or prefill), so it is taken as given, not checked. It defaults to total_q.
    `tile_starts`: `query_tile_starts(...)` of this batch, to share across layers (computed here if None).
    """
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if not use_fast(q, k_cache, v_cache):
        return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale=scale)
    max_q_len = q.shape[0] if max_q_len is None else int(max_q_len)
    return _paged_attention_triton(
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, max_q_len, tile_starts=tile_starts,
        fused_combine=combine_mode() == "fused", **_launch_plan(q, k_cache, block_tables, seq_lens, max_q_len),
    )  # fmt: skip


def _launch_plan(q, k_cache, block_tables, seq_lens, max_q_len: int) -> dict:
    """The tile configuration and split count of a launch, from shapes only."""
    block_m, block_q, block_n, num_warps, num_stages = _tile_config(max_q_len, q.shape[1] // k_cache.shape[2],
                                                                    q.shape[2])
    varlen, hkv = max_q_len > 1, k_cache.shape[2]
    num_splits = _num_splits(_busy_tiles(q.shape[0], seq_lens.shape[0], block_q, varlen) * hkv,
                             _grid_tiles(q.shape[0], seq_lens.shape[0], block_q, varlen) * hkv,
                             block_tables.shape[1] * k_cache.shape[1], q.device)
    return {"block_m": block_m, "block_q": block_q, "block_n": block_n, "num_splits": num_splits,
            "num_warps": num_warps, "num_stages": num_stages}


def rope_write_and_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, qk_norm=None, *, scale: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """A decode step's attention from its projections (one query token per sequence): `rope.rope_qkv_and_write_kv`
    (q and k normalised by `qk_norm` if given, rotated by cos, sin; K and V stored at `slot_mapping`), then
    `paged_attention`, in the attention kernel alone where it can (NANOFORGE_ATTN_ROPE=fused: each program
    rotates its query heads, and the last split (`split_span`) writes the token's K and V and attends to its key
    from registers; slower in batch-1 decode on the H200, session 15, so not the default).
    Returns (num_seqs, Hq, D)."""
    from nanoforge.kernels.rope import qkv_fused, rope_qkv_and_write_kv

    fused = (rope_mode() == "fused" and qkv_fused(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, qk_norm)
             and q.shape[0] == seq_lens.shape[0] and use_fast(q, k_cache, v_cache))
    if not fused:
        q = rope_qkv_and_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, qk_norm)
        return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale=scale, max_q_len=1)
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _paged_attention_triton(
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, 1, fused_combine=combine_mode() == "fused",
        new_kv=(k, v, cos, sin, slot_mapping, qk_norm), **_launch_plan(q, k_cache, block_tables, seq_lens, 1),
    )  # fmt: skip


def rope_mode() -> str:
    """Where a decode step's RoPE and KV write run: "kernel" (their own kernel; the default) or "fused" (in the
    attention kernel: `rope_write_and_attend`)."""
    return env_choice("NANOFORGE_ATTN_ROPE", ("kernel", "fused"))


def combine_mode() -> str:
    """How split contexts are combined: "kernel" (a second, small kernel; the default) or "fused" (the last split
    of each tile to finish, in the attention kernel itself)."""
    return env_choice("NANOFORGE_ATTN_COMBINE", ("kernel", "fused"))


def query_tile_starts(q: torch.Tensor, k_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      max_q_len: int) -> torch.Tensor | None:
    """Where each sequence's query tiles start among the programs (int32, num_seqs + 1: the last is the
    total), for the tile size `paged_attention` picks for these shapes; None for decode (one program per
    sequence) or where the kernel does not run. Depends on tensor values: compute it once per step."""
    if max_q_len <= 1 or not use_fast(q, k_cache):
        return None
    block_q = _tile_config(max_q_len, q.shape[1] // k_cache.shape[2], q.shape[2])[1]
    return _tile_starts(cu_seqlens_q, block_q)


def _tile_starts(cu_seqlens_q: torch.Tensor, block_q: int) -> torch.Tensor:
    tiles = (cu_seqlens_q[1:] - cu_seqlens_q[:-1] + (block_q - 1)) // block_q
    return torch.cat([cu_seqlens_q.new_zeros(1), tiles.cumsum(0)]).to(torch.int32)


def _grid_tiles(total_q: int, num_seqs: int, block_q: int, varlen: bool) -> int:
    """Programs along the query axis: one per sequence for decode, else an upper bound of
    sum_i cdiv(q_len_i, block_q) from shapes alone."""
    return triton.cdiv(total_q, block_q) + num_seqs if varlen else num_seqs


def _busy_tiles(total_q: int, num_seqs: int, block_q: int, varlen: bool) -> int:
    """The query tiles that do work, as the split count sees them: one per sequence for decode; for prefill and
    mixed steps, those of the query tokens, cdiv(total_q, block_q), not the grid's bound (which adds one per
    sequence: a graphed step's padding slots would count, and a short chunk after a long cached prefix, alone
    with hundreds of empty slots, would walk its whole context in one program per kv head)."""
    return triton.cdiv(total_q, block_q) if varlen else num_seqs


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    scale: float | None = None,
    max_q_len: int | None = None,
) -> torch.Tensor:
    """The definition of correct: gather each sequence's blocks and run SDPA (any dtype, float64 too).

    `max_q_len` is accepted for signature parity and unused.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)
    block_size = k_cache.shape[1]
    out = torch.zeros_like(q)  # tokens outside every sequence (none, for a well-formed batch) stay 0
    bounds = cu_seqlens_q.tolist()
    for i, ctx in enumerate(seq_lens.tolist()):
        q0, q1 = bounds[i], bounds[i + 1]
        if q1 == q0:
            continue
        blocks = block_tables[i, : triton.cdiv(ctx, block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:ctx]  # (ctx, Hkv, D)
        v = v_cache[blocks].flatten(0, 1)[:ctx]
        pos = torch.arange(ctx - (q1 - q0), ctx, device=q.device)  # the query tokens' positions
        mask = torch.arange(ctx, device=q.device)[None, :] <= pos[:, None]
        out[q0:q1] = sdpa(q[None, q0:q1], k[None], v[None], mask=mask, scale=scale)[0]
    return out


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store k, v (N, Hkv, D) into the cache at slots slot_mapping (N,), slot = block_id * block_size + offset."""
    if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != k_cache.shape[2:] or slot_mapping.shape != k.shape[:1]:
        raise ValueError(
            f"write_kv: k {tuple(k.shape)} and v {tuple(v.shape)} must be (N, Hkv, D) matching the cache "
            f"{tuple(k_cache.shape)}, with slot_mapping (N,), got {tuple(slot_mapping.shape)}"
        )
    slots = slot_mapping.long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[3] != q.shape[2]:
        raise ValueError(
            f"paged attention wants q (total_q, Hq, D) and k_cache, v_cache (num_blocks, block_size, Hkv, D), got "
            f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(
            f"paged attention: q, k_cache, v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(
            f"paged attention: {q.shape[1]} query heads is not a multiple of {k_cache.shape[2]} kv heads"
        )
    n = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if block_tables.dim() != 2 or block_tables.shape[0] != n or cu_seqlens_q.shape != (n + 1,):
        raise ValueError(
            f"paged attention: block_tables {tuple(block_tables.shape)}, seq_lens {tuple(seq_lens.shape)} and "
            f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} must be (num_seqs, max_blocks), (num_seqs,), (num_seqs+1,)"
        )


# ----------------------------------------------------------------------------------------------
# Launch configuration and launcher
# ----------------------------------------------------------------------------------------------

_PROGRAMS_PER_SM = 8  # split the context until there are about this many programs per SM...
_MIN_SPLIT_TOKENS = 256  # ...but give every split at least this much context (of the cache's capacity)
_MAX_SPLITS = 32
_MAX_PROGRAMS = 16384  # ...and the grid under this (programs that exit at once still pass the block scheduler)
_SPLITS_P2 = triton.next_power_of_2(_MAX_SPLITS)  # the combine kernel's lanes: one variant for any split count


# Prefill and mixed steps' tile, NANOFORGE_ATTN_PREFILL_TILE = "{rows}x{keys}w{warps}s{stages}": BLOCK_M rows of
# (token, head) pairs x BLOCK_N keys, num_warps, num_stages. Unset, the tile depends on the head dim: at 64
# (Llama-3.2-1B, GPT-2) two warpgroups over 128 rows, the fastest of `benchmarks/gpu_kernels_attention.py
# --prefill-sweep`'s 24 tiles at Llama's heads in session 30 (H100: 286 TFLOP/s, 1.13x 64x64w4s3; gpu_engine's
# (c) 1.02x), and where a loop of 64 keys issues fewer instructions per product (`--prefill-sweep --compiled`);
# elsewhere one warpgroup over 64 rows (the smallest wgmma tile), which the sweep found fastest at Qwen3's head
# dim of 128 (128x64w8s3: 0.88x there). `gpu_engine.py --prefill-variants` runs (a) and (c) again with others.
# Compiled for sm_90 (`nanoforge kernels inspect`), 64x64w4s3, 128x64w8s3 and 128x128w8s2 spill nothing at D 64
# or D 128.
PREFILL_TILE_DEFAULT = "64x64w4s3"
PREFILL_TILE_BY_HEAD_DIM = {64: "128x64w8s3"}


def prefill_tile(head_dim: int) -> tuple[int, int, int, int]:
    """(rows, keys, warps, stages) of prefill and mixed steps' attention tiles at this head dim
    (NANOFORGE_ATTN_PREFILL_TILE, else the default for the head dim)."""
    default = PREFILL_TILE_BY_HEAD_DIM.get(head_dim, PREFILL_TILE_DEFAULT)
    return _parse_tile(os.environ.get("NANOFORGE_ATTN_PREFILL_TILE", default))


@functools.lru_cache(maxsize=None)
def _parse_tile(value: str) -> tuple[int, int, int, int]:
    m = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)", value.strip().lower())
    tile = tuple(map(int, m.groups())) if m else ()
    if not (tile and all(16 <= x <= 256 and x & (x - 1) == 0 for x in tile[:2]) and tile[2] in (1, 2, 4, 8, 16)
            and 1 <= tile[3] <= 6):
        raise NanoforgeError(
            "NANOFORGE_ATTN_PREFILL_TILE must be ROWSxKEYSwWARPSsSTAGES (rows and keys powers of two from 16 to 256, "
            f"warps a power of two up to 16, stages 1 to 6), e.g. 64x64w4s3, not {value!r}",
            param="NANOFORGE_ATTN_PREFILL_TILE")
    return tile


def _tile_config(max_q_len: int, group: int, head_dim: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M rows = BLOCK_Q tokens x group heads, BLOCK_Q, BLOCK_N keys, num_warps, num_stages)."""
    if interpreting():
        block_m = max(16, triton.next_power_of_2(group))
        return block_m, 1 if max_q_len == 1 else block_m // group, 16, 1, 1
    if max_q_len == 1:  # decode: one token's heads; memory-bound, so small tiles and deep pipelining
        block_m = max(16, triton.next_power_of_2(group))
        return block_m, 1, 64, 4, 3
    rows, block_n, warps, stages = prefill_tile(head_dim)  # chunked prefill: compute-bound, big tiles
    block_m = max(rows, triton.next_power_of_2(group))
    return block_m, block_m // group, block_n, warps, stages


def _num_splits(busy: int, programs: int, max_context: int, device: torch.device) -> int:
    """How many pieces to cut each context into, from launch shapes only (never from tensor values): enough for
    `busy` working programs to fill the GPU, while the grid (`programs` per split, most of them empty in a
    graphed step's padding) stays under _MAX_PROGRAMS."""
    if device.type != "cuda":
        return 1
    want = triton.cdiv(_PROGRAMS_PER_SM * sm_count(device), busy)
    return max(1, min(want, triton.cdiv(max_context, _MIN_SPLIT_TOKENS), _MAX_SPLITS, _MAX_PROGRAMS // programs))


def _paged_attention_triton(
    q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale: float, max_q_len: int, *,
    block_m: int, block_q: int, block_n: int, num_splits: int, num_warps: int, num_stages: int,
    tile_starts: torch.Tensor | None = None, fused_combine: bool = False, new_kv: tuple | None = None,
) -> torch.Tensor:  # fmt: skip
    """Launch with an explicit configuration (the benchmark sweeps these); `fused_combine`: split contexts are
    combined by each tile's last split to finish, not by `_combine_splits`; `new_kv`: (k, v, cos, sin,
    slot_mapping, qk_norm) of a decode step, q as projected (`rope_write_and_attend`)."""
    total_q, hq, d = q.shape
    hkv, block_size = k_cache.shape[2], k_cache.shape[1]
    group = hq // hkv
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged attention: the KV cache's head dimension must be contiguous")
    block_tables, seq_lens, cu_seqlens_q = (x.to(torch.int32) for x in (block_tables, seq_lens, cu_seqlens_q))
    out = _empty(total_q, hq, d, like=q)
    if num_splits > 1:
        o_part = _empty(total_q, hq, num_splits, d, like=q, dtype=torch.float32)
        lse_part = _empty(total_q, hq, num_splits, like=q, dtype=torch.float32)
    else:  # the kernel writes `out` directly; the partial buffers are unused
        o_part = lse_part = out
    varlen = max_q_len > 1
    if varlen and tile_starts is None:
        tile_starts = _tile_starts(cu_seqlens_q, block_q)
    block_d = max(16, triton.next_power_of_2(d))
    grid = (_grid_tiles(total_q, seq_lens.shape[0], block_q, varlen), hkv, num_splits)
    on = pdl.enabled(q)
    fuse = fused_combine and num_splits > 1
    counts = arrival_counters(q.device, grid[0] * hkv) if fuse else seq_lens  # one count a tile and kv head
    if new_kv is not None:
        if varlen:
            raise ValueError("paged attention: the new tokens' K/V are taken in decode steps only (max_q_len 1)")
        k_new, v_new, cos, sin, slots, qk_norm = new_kv
        qw, kw, eps = (qk_norm[0].weight, qk_norm[1].weight, float(qk_norm[0].eps)) if qk_norm else (q, q, 0.0)
        rope_args = (k_new, v_new, cos, sin, qw, kw, slots)  # int64 or int32: the kernel widens it (no cast kernel)
        rope_strides = (*k_new.stride()[:2], *v_new.stride()[:2], cos.stride(0), eps)
    else:  # never read
        rope_args, rope_strides = (q, q, q, q, q, q, seq_lens), (0, 0, 0, 0, 0, 0.0)
    _paged_attn_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, tile_starts if varlen else cu_seqlens_q,
        out, o_part, lse_part, counts, *rope_args,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        out.stride(0), out.stride(1), scale * LOG2E, seq_lens.shape[0], num_splits, *rope_strides,
        GROUP=group, HEAD_D=d, BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q,
        BLOCK_N=block_n, SPLIT=num_splits > 1, FUSE=fuse, SPLITS_P2=_SPLITS_P2, VARLEN=varlen, PDL=on,
        ROPE=new_kv is not None, HAS_NORM=bool(new_kv and new_kv[5]),
        num_warps=num_warps, num_stages=num_stages, launch_pdl=bool(on),
    )  # fmt: skip
    if num_splits > 1 and not fuse:
        _combine_splits[(total_q, hq)](
            o_part, lse_part, out, out.stride(0), out.stride(1), hq, num_splits,
            HEAD_D=d, BLOCK_D=block_d, SPLITS_P2=_SPLITS_P2, PDL=on, launch_pdl=bool(on),
        )  # fmt: skip
    return out


def _empty(*shape: int, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Every kernel output is allocated here (tests swap it for a NaN-filled one to catch unwritten elements)."""
    return torch.empty(shape, device=like.device, dtype=dtype or like.dtype)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


# num_seqs, the block tables' row stride (the step's table width) and the split count change from step to step:
# runtime values, never specialized on (Triton would compile a variant for each split count and for each of
# value 1 / multiple of 16 / other, ~0.7 s each: a stall of every running request in the middle of serving)
@triton.jit(do_not_specialize=["num_seqs", "stride_bt", "num_splits"])
def _paged_attn_kernel(
    Q, K, V, BLOCK_TABLES, SEQ_LENS, CU_Q, TILE_STARTS, O, O_PART, LSE_PART, C,
    KN, VN, COS, SIN, QW, KW, SLOTS,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    stride_ot, stride_oh, qk_scale, num_seqs, num_splits, stride_knt, stride_knh, stride_vnt, stride_vnh,
    stride_ct, eps,
    GROUP: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    FUSE: tl.constexpr, SPLITS_P2: tl.constexpr, VARLEN: tl.constexpr, PDL: tl.constexpr,
    ROPE: tl.constexpr, HAS_NORM: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pdl.enter(PDL)
    if not VARLEN:  # decode: program i is sequence i's one token
        seq = pid
        tok0 = 0
    else:  # the last sequence whose tiles start at or before pid (zero-tile sequences share a start)
        if pid >= tl.load(TILE_STARTS + num_seqs):
            return
        lo = 0
        hi = num_seqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if tl.load(TILE_STARTS + mid) <= pid:
                lo = mid
            else:
                hi = mid - 1
        seq = lo
        tok0 = (pid - tl.load(TILE_STARTS + seq)) * BLOCK_Q  # this tile's first query token in the sequence
    hk = tl.program_id(1)
    split = tl.program_id(2)
    q_begin = tl.load(CU_Q + seq)
    q_len = tl.load(CU_Q + seq + 1) - q_begin
    if tok0 >= q_len:
        return
    seq_len = tl.load(SEQ_LENS + seq)

    # Row r of the tile is query token tok0 + r // GROUP, query head hk * GROUP + r % GROUP.
    rows = tl.arange(0, BLOCK_M)
    tok = tok0 + rows // GROUP
    head = hk * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    pos = seq_len - q_len + tok  # each row's position in the context: it sees keys 0..pos
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_D
    q_rows = (q_begin + tok).to(tl.int64)
    if ROPE:  # decode: q straight from the projection, normalised (Qwen3) and rotated here
        t = q_begin.to(tl.int64)
        q = _norm_rope_rows(Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh, offs_d, row_ok,
                            COS + t * stride_ct, SIN + t * stride_ct, QW, eps, HEAD_D, HAS_NORM)  # fmt: skip
    else:
        q = tl.load(Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip

    # The keys the tile needs are [0, kv_hi); this split takes one contiguous, BLOCK_N-aligned share. ROPE: the
    # new token's key is the context's last: its split attends to it from registers, not the cache.
    kv_hi = tl.minimum(seq_len, seq_len - q_len + tok0 + BLOCK_Q)
    lo, hi, new_here = split_span(kv_hi, split, num_splits, BLOCK_N, ROPE)
    TABLE = BLOCK_TABLES + seq.to(tl.int64) * stride_bt
    K += hk * stride_kh
    V += hk * stride_vh

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    # Keys before the tile's first position + 1 are seen by every row: whole blocks of them need no causal or
    # bounds mask (most of a long prompt's blocks); the rest (the diagonal, the split's ragged end) are masked.
    full_hi = lo + tl.maximum(tl.minimum(hi, seq_len - q_len + tok0 + 1) - lo, 0) // BLOCK_N * BLOCK_N
    acc, l_i, m_i = attend_span(acc, l_i, m_i, q, K, V, TABLE, lo, full_hi, hi, pos, offs_d, d_ok, qk_scale,
                                stride_kb, stride_ks, stride_vb, stride_vs, BLOCK_N, BLOCK_SIZE, HEAD_D == BLOCK_D,
                                (BLOCK_N + BLOCK_Q) * VARLEN)
    if ROPE:
        if new_here:  # write the token's K and V into its cache slot and take its key into the softmax
            acc, l_i, m_i = attend_new_key(
                acc, l_i, m_i, q, KN + t * stride_knt + hk * stride_knh, VN + t * stride_vnt + hk * stride_vnh, K, V,
                tl.load(SLOTS + t).to(tl.int64), COS + t * stride_ct, SIN + t * stride_ct, KW, eps, offs_d, d_ok,
                qk_scale, stride_kb, stride_ks, stride_vb, stride_vs, HEAD_D, BLOCK_SIZE, HAS_NORM)

    l_safe = tl.where(l_i > 0, l_i, 1.0)  # an empty split (past the end of a short context) has l = 0
    o = acc / l_safe[:, None]
    io_mask = row_ok[:, None] & d_ok[None, :]
    if not SPLIT:
        tl.store(O + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(O.dtype.element_ty), mask=io_mask)  # fmt: skip
    else:  # partials are (total_q, Hq, num_splits, HEAD_D) and (total_q, Hq, num_splits), contiguous
        part = (q_rows * (GROUP * tl.num_programs(1)) + head) * num_splits + split
        tl.store(O_PART + part[:, None] * HEAD_D + offs_d[None, :], o, mask=io_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(LSE_PART + part, lse, mask=row_ok)
        if FUSE:  # the tile's last split to finish combines them all (the others' partials visible to it)
            tl.debug_barrier()  # every thread's partials stored before the count (the atomic releases them)
            count = C + pid * tl.num_programs(1) + hk
            if tl.atomic_add(count, 1, sem="acq_rel") == num_splits - 1:
                tl.atomic_xchg(count, 0, sem="relaxed")  # zero again for the next launch (no wait on it)
                o = combine_parts(O_PART, LSE_PART, part - split, num_splits, row_ok, io_mask, offs_d, HEAD_D,
                                  BLOCK_M, BLOCK_D, SPLITS_P2)
                tl.store(O + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                         o.to(O.dtype.element_ty), mask=io_mask)  # fmt: skip


@triton.jit
def split_span(n, split, num_splits, BLOCK_N: tl.constexpr, LEAVE_LAST: tl.constexpr):
    """Split `split`'s share of keys 0 .. n: keys lo .. hi, whole BLOCK_N tiles a split. LEAVE_LAST: key n - 1 (a
    decode token's own) left out of the split that holds it and given to the last split (last_here: it takes
    that key from registers), which holds the fewest keys or none (session 43: at a short context most splits
    are empty, and the token's key, normalised, rotated and written to the cache, then lengthened the chain of
    the split holding the context's last keys)."""
    share = tl.cdiv(tl.cdiv(n, BLOCK_N), num_splits) * BLOCK_N
    lo = split * share
    hi = tl.minimum(lo + share, n)
    last_here = split == num_splits - 1
    if LEAVE_LAST:
        hi = tl.where(hi == n, hi - 1, hi)  # (a split past the end stays empty: hi < lo)
    return lo, hi, last_here


@triton.jit
def attend_new_key(acc, l_i, m_i, q, KN, VN, K, V, slot, COS, SIN, KW, eps, offs_d, d_ok, qk_scale,
                   stride_kb, stride_ks, stride_vb, stride_vs, HEAD_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   HAS_NORM: tl.constexpr):
    """A decode token's own key and value, from the projection (KN, VN: its kv head's rows): the key normalised
    (Qwen3) and rotated as `_norm_rope_rows` does, both written to the cache slot `slot`, and taken into the
    rows' online softmax from registers (no program reads the slot this one writes)."""
    ones = tl.full([1], 1, dtype=tl.int1)
    k_new = _norm_rope_rows(KN + tl.zeros([1, 1], dtype=tl.int64), offs_d, ones, COS, SIN, KW, eps, HEAD_D, HAS_NORM)
    v_new = tl.load(VN + offs_d[None, :], mask=d_ok[None, :], other=0.0)
    tl.store(K + (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_ks + offs_d[None, :], k_new,
             mask=d_ok[None, :])
    tl.store(V + (slot // BLOCK_SIZE) * stride_vb + (slot % BLOCK_SIZE) * stride_vs + offs_d[None, :], v_new,
             mask=d_ok[None, :])
    s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * qk_scale
    m_new = tl.maximum(m_i, s_new)
    p_new = tl.exp2(s_new - m_new)
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + p_new
    acc = acc * alpha[:, None] + p_new.to(v_new.dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)
    return acc, l_i, m_new


@triton.jit
def combined_heads(O_PART, LSE_PART, first, num_splits, n_heads, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
                   HEADS_P2: tl.constexpr, SPLITS_P2: tl.constexpr):
    """One token's `n_heads` consecutive heads over the whole context from their splits' partials (head g's
    split s at part first + g * num_splits + s): `combine_parts` with a row a head, as fp32 (HEADS_P2, BLOCK_D)."""
    g = tl.arange(0, HEADS_P2)
    d = tl.arange(0, BLOCK_D)
    ok = g < n_heads
    return combine_parts(O_PART, LSE_PART, first + g * num_splits, num_splits, ok, ok[:, None] & (d < HEAD_D)[None, :],
                         d, HEAD_D, HEADS_P2, BLOCK_D, SPLITS_P2)


@triton.jit
def combine_heads(O_PART, LSE_PART, O, first, num_splits, n_heads, stride_oh, HEAD_D: tl.constexpr,
                  BLOCK_D: tl.constexpr, HEADS_P2: tl.constexpr, SPLITS_P2: tl.constexpr):
    """`combined_heads`, stored to O + g * stride_oh for head g."""
    out = combined_heads(O_PART, LSE_PART, first, num_splits, n_heads, HEAD_D, BLOCK_D, HEADS_P2, SPLITS_P2)
    heads = tl.arange(0, HEADS_P2)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    tl.store(O + heads * stride_oh + dims, out.to(O.dtype.element_ty), mask=(heads < n_heads) & (dims < HEAD_D))


@triton.jit
def combine_parts(O_PART, LSE_PART, first, num_splits, row_ok, io_mask, offs_d, HEAD_D: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_P2: tl.constexpr):
    """The rows' outputs over the whole context from their splits' partials (row r's are at part first[r] + s,
    s < num_splits), read from L2 (.cg: other programs of this launch wrote them): sum_s w_s o_s / sum_s w_s
    with w_s = 2^(lse_s - max lse), added split by split. The split loops are unrolled to SPLITS_P2 (the splits
    from num_splits on masked off), so that every split's loads can issue at once, one L2 round trip, and each
    thread adds up its own elements over the splits: no sum or max across threads. (Session 43: the earlier
    three-dimensional form, splits a dimension reduced by `tl.sum`, took the persistent decode kernel's combine
    11 CTA barriers and 30 shuffles, compiled for sm_90.)"""
    top = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for s in tl.static_range(SPLITS_P2):
        here = row_ok & (tl.full([BLOCK_M], s, tl.int32) < num_splits)  # (a tensor: the interpreter takes no bool)
        top = tl.maximum(top, tl.load(LSE_PART + first + s, mask=here, other=float("-inf"), cache_modifier=".cg"))
    top = tl.where(top > float("-inf"), top, 0.0)  # a row no split saw (masked by callers)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    for s in tl.static_range(SPLITS_P2):
        here = row_ok & (tl.full([BLOCK_M], s, tl.int32) < num_splits)
        w = tl.exp2(tl.load(LSE_PART + first + s, mask=here, other=float("-inf"), cache_modifier=".cg") - top)
        acc += w[:, None] * tl.load(O_PART + (first + s)[:, None] * HEAD_D + offs_d[None, :],
                                    mask=io_mask & here[:, None], other=0.0, cache_modifier=".cg")
        total += w
    return acc / tl.where(total > 0, total, 1.0)[:, None]


@triton.jit
def _norm_rope_rows(X, offs_d, rows_ok, COS, SIN, W, eps, HEAD_D: tl.constexpr, HAS_NORM: tl.constexpr):
    """Rows of heads at X (a column of row pointers) normalised over each head with weight W (if HAS_NORM) and
    rotated by one token's COS, SIN rows: rope.py's `_norm_rope_heads` over whole rows, each element paired with
    the one half a head away (x * cos - partner * sin in the first half, + in the second), each product and the
    sum rounded to X's dtype as there."""
    half: tl.constexpr = HEAD_D // 2
    d_ok = offs_d < HEAD_D
    partner = tl.where(offs_d < half, offs_d + half, offs_d - half)
    m = rows_ok[:, None] & d_ok[None, :]
    x = tl.load(X + offs_d[None, :], mask=m, other=0.0)
    ty = x.dtype
    x = x.to(tl.float32)
    xp = tl.load(X + partner[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_NORM:
        r = tl.rsqrt(tl.sum(x * x, 1) / HEAD_D + eps)[:, None]
        x = (x * r * tl.load(W + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]).to(ty).to(tl.float32)
        xp = (xp * r * tl.load(W + partner, mask=d_ok, other=0.0).to(tl.float32)[None, :]).to(ty).to(tl.float32)
    c = tl.load(COS + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sn = tl.load(SIN + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    turned = (xp * sn).to(ty).to(tl.float32)
    return ((x * c).to(ty).to(tl.float32) + tl.where(offs_d < half, -turned, turned)).to(ty)


@triton.jit
def attend_span(acc, l_i, m_i, q, K, V, TABLE, lo, full_hi, hi, pos, offs_d, d_ok, qk_scale,
                stride_kb, stride_ks, stride_vb, stride_vs, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                EVEN_D: tl.constexpr, TAIL_KEYS: tl.constexpr):
    """The online softmax over keys lo .. hi in BLOCK_N tiles: those before full_hi (whole tiles every row sees)
    without a mask, the rest masked (`_attend_keys`): the diagonal of a tile's query tokens, a split's ragged end.

    The unmasked tiles take their block ids from a chunk of the block table held in registers (_TABLE_TILES
    tiles' worth, loaded once a chunk), not from a load a tile: a table load inside the loop is an asynchronous
    copy that each tile's K and V addresses wait on, and as such copies complete in order, the wait is for all of
    them: compiled for sm_90 (Triton 3.6 and 3.9), every iteration then began with `cp.async.wait_group 0` and
    no K/V load overlapped a product. Gathered from registers, the loop keeps two tiles of K and V in flight
    (`nanoforge kernels inspect` shows the wait). TAIL_KEYS > 0 (prefill: BLOCK_N + the tile's query tokens, more
    than there are masked keys): the masked tiles' entries are loaded before the unmasked loop too, so their K/V
    loads wait on no table load once it drains; 0 (decode, where that costs Triton 3.6 27 registers): a load a
    masked tile."""
    if TAIL_KEYS > 0:
        tail_entries: tl.constexpr = triton.next_power_of_2(TAIL_KEYS // BLOCK_SIZE + 2)
        tail_first = full_hi // BLOCK_SIZE
        tail_ids = tail_first + tl.arange(0, tail_entries)
        tail_table = tl.load(TABLE + tail_ids, mask=tail_ids * BLOCK_SIZE < hi, other=0)
    chunk: tl.constexpr = _TABLE_TILES * BLOCK_N
    entries: tl.constexpr = triton.next_power_of_2(chunk // BLOCK_SIZE + 1)
    for c0 in range(lo, full_hi, chunk):
        first = c0 // BLOCK_SIZE
        ids = first + tl.arange(0, entries)
        table = tl.load(TABLE + ids, mask=ids * BLOCK_SIZE < full_hi, other=0)
        for n0 in range(c0, tl.minimum(c0 + chunk, full_hi), BLOCK_N):
            block = tl.gather(table, (n0 + tl.arange(0, BLOCK_N)) // BLOCK_SIZE - first, 0).to(tl.int64)
            acc, l_i, m_i = _attend_keys(acc, l_i, m_i, q, K, V, block, n0, hi, pos, offs_d, d_ok, qk_scale,
                                         stride_kb, stride_ks, stride_vb, stride_vs, BLOCK_N, BLOCK_SIZE, EVEN_D,
                                         False)
    for n0 in range(full_hi, hi, BLOCK_N):
        if TAIL_KEYS > 0:
            keys = n0 + tl.arange(0, BLOCK_N)
            block = tl.gather(tail_table, tl.where(keys < hi, keys // BLOCK_SIZE - tail_first, 0), 0).to(tl.int64)
        else:
            block = _table_blocks(TABLE, n0, hi, BLOCK_N, BLOCK_SIZE, True)
        acc, l_i, m_i = _attend_keys(acc, l_i, m_i, q, K, V, block, n0, hi, pos, offs_d, d_ok, qk_scale,
                                     stride_kb, stride_ks, stride_vb, stride_vs, BLOCK_N, BLOCK_SIZE, EVEN_D, True)
    return acc, l_i, m_i


@triton.jit
def _attend_keys(acc, l_i, m_i, q, K, V, block, n0, hi, pos, offs_d, d_ok, qk_scale,
                 stride_kb, stride_ks, stride_vb, stride_vs, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 EVEN_D: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """One online-softmax step of a tile over keys n0 .. n0 + BLOCK_N, each in cache block `block` (int64, one a
    key, from the block table); MASKED: the block may hold keys past `hi` or past a row's position (else every
    row sees all of them); EVEN_D: the head dimension fills BLOCK_D (no mask along it). V is loaded after the
    scores (its registers free until then)."""
    k_ptrs, v_ptrs, kv_mask = _key_tile_ptrs(K, V, block, n0, hi, offs_d, d_ok, stride_kb, stride_ks, stride_vb,
                                             stride_vs, BLOCK_N, BLOCK_SIZE, MASKED)
    if EVEN_D and not MASKED:
        kt = tl.load(k_ptrs)  # (BLOCK_D, BLOCK_N)
    else:
        kt = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    p, alpha, l_i, m_new = _softmax_step(l_i, m_i, q, kt, n0, hi, pos, qk_scale, BLOCK_N, MASKED)
    if EVEN_D and not MASKED:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=tl.trans(kv_mask), other=0.0)
    acc = _dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def _table_blocks(TABLE, n0, hi, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """The cache block of each key n0 .. n0 + BLOCK_N, read from the block table (MASKED: keys before `hi`
    only; 0 for the rest), int64."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        return tl.load(TABLE + offs_n // BLOCK_SIZE, mask=offs_n < hi, other=0).to(tl.int64)
    return tl.load(TABLE + offs_n // BLOCK_SIZE).to(tl.int64)


@triton.jit
def _key_tile_ptrs(K, V, block, n0, hi, offs_d, d_ok, stride_kb, stride_ks, stride_vb, stride_vs,
                   BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """Pointers to keys n0 .. n0 + BLOCK_N of a paged context, each in cache block `block` (K transposed:
    (BLOCK_D, BLOCK_N); V: (BLOCK_N, BLOCK_D)) and K's mask (MASKED: keys before `hi` only)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    slot = offs_n % BLOCK_SIZE
    if MASKED:
        kv_mask = (offs_n < hi)[None, :] & d_ok[:, None]
    else:
        kv_mask = d_ok[:, None] & (offs_n[None, :] >= 0)
    k_ptrs = K + block[None, :] * stride_kb + slot[None, :] * stride_ks + offs_d[:, None]
    v_ptrs = V + block[:, None] * stride_vb + slot[:, None] * stride_vs + offs_d[None, :]
    return k_ptrs, v_ptrs, kv_mask


@triton.jit
def _softmax_step(l_i, m_i, q, kt, n0, hi, pos, qk_scale, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """The scores of q against a tile's keys (kt: (BLOCK_D, BLOCK_N), keys n0 ..), in log2 units, and the online
    softmax's step over them: (p, the running sums' rescale alpha, l, the new max). The scale goes into the
    exponent's argument (one fused multiply-add an element: the row's max is taken of the raw scores and scaled
    once, as qk_scale > 0), not onto the scores (a multiply and a subtraction an element)."""
    s = _dot(q, kt, None)  # (BLOCK_M, BLOCK_N), unscaled
    if MASKED:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        s = tl.where((offs_n < hi)[None, :] & (offs_n[None, :] <= pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit(do_not_specialize=["num_splits"])
def _combine_splits(
    O_PART, LSE_PART, O, stride_ot, stride_oh, H, num_splits,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_P2: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Head h of token t over the whole context from its splits' partials (`combine_heads`, one head)."""
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    combine_heads(O_PART, LSE_PART, O + t * stride_ot + h * stride_oh, (t * H + h) * num_splits, num_splits, 1,
                  stride_oh, HEAD_D, BLOCK_D, 1, SPLITS_P2)


# ----------------------------------------------------------------------------------------------
# Benchmark rows (for nanoforge.kernels.bench)
# ----------------------------------------------------------------------------------------------

HBM_COPY_TBPS = 4.17  # H200 device-to-device copy rate measured on the project's machine


def make_paged_batch(
    context_lens: list[int], q_lens: list[int], hq: int, hkv: int, d: int, block_size: int,
    dtype: torch.dtype, device: torch.device | str, seed: int = 0,
) -> dict:  # fmt: skip
    """A random batch: shuffled cache blocks, block tables padded to the longest context, random K/V/q."""
    gen = torch.Generator().manual_seed(seed)
    dev_gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = [triton.cdiv(n, block_size) for n in context_lens]
    max_blocks = max(blocks_per_seq)
    perm = torch.randperm(sum(blocks_per_seq) + 1, generator=gen)  # +1: a spare block, never read
    tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = perm[used : used + n]
        used += n
    cache_shape = (perm.numel(), block_size, hkv, d)
    k_cache = torch.randn(cache_shape, generator=dev_gen, device=device, dtype=dtype)
    v_cache = torch.randn(cache_shape, generator=dev_gen, device=device, dtype=dtype)
    q = torch.randn(sum(q_lens), hq, d, generator=dev_gen, device=device, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return dict(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables.to(device),
        seq_lens=torch.tensor(context_lens, dtype=torch.int32, device=device), cu_seqlens_q=cu.to(device),
    )  # fmt: skip


def _kv_bytes(context_lens: list[int], hkv: int, d: int, dtype: torch.dtype) -> int:
    """Bytes of K and V that attention must read (every context token, every kv head, K and V)."""
    return 2 * sum(context_lens) * hkv * d * torch.finfo(dtype).bits // 8


def _bench_case(kind: str, ctx: list[int], qlens: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype,
                combine: str = "kernel", graph: bool = False) -> dict:
    from nanoforge.kernels.bench import make_row, time_ms

    batch = make_paged_batch(ctx, qlens, hq, hkv, d, 16, dtype, "cuda")
    with mock.patch.dict(os.environ, {"NANOFORGE_ATTN_COMBINE": combine}):
        ours = time_ms(lambda: paged_attention(**batch, max_q_len=max(qlens)), graph=graph)
    base = time_ms(lambda: paged_attention_ref(**batch))  # eager: the reference reads its bounds on the host
    shape, flops, kv = _case(kind, ctx, qlens, hq, hkv, d, dtype)
    shape += " fused combine" if combine == "fused" else ""
    row = make_row(f"paged_{kind}", shape, ours, base, "torch reference (gather + SDPA)" + (", eager" if graph else ""),
                   flops, kv)
    row["hbm_fraction"] = row["ours_gbps"] / (HBM_COPY_TBPS * 1000)
    return row


def _case(kind: str, ctx: list[int], qlens: list[int], hq: int, hkv: int, d: int,
          dtype: torch.dtype) -> tuple[str, int, int]:
    """A benchmark row's shape, its FLOPs (each query token sees its prefix) and its K/V bytes."""
    pairs = sum(sum(c - j for j in range(n)) for c, n in zip(ctx, qlens))
    shape = f"{kind} B{len(ctx)} ctx {min(ctx)}-{max(ctx)} q/seq {max(qlens)} Hq{hq} Hkv{hkv} D{d} {dtype}"
    return shape, 4 * pairs * hq * d, _kv_bytes(ctx, hkv, d, dtype)


def _prefill_cudnn_rows(b: int, t: int, hq: int, hkv: int, d: int) -> list[dict]:
    """(c)'s step again (b fresh prompts of t tokens): the kernel against cuDNN's attention on the same shapes
    dense ([b, heads, t, d], causal, GQA), the fastest library kernel session 38 found (1.33x ours at D 64, 1.85x
    at D 128 on an H100; FlashAttention-2, HF's SDPA default, 0.73x and 1.02x). No row (a line saying so) where
    this build has no cuDNN attention."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from nanoforge.kernels.bench import make_row, time_ms

    batch = make_paged_batch([t] * b, [t] * b, hq, hkv, d, 16, torch.bfloat16, "cuda")
    shape, flops, kv = _case("prefill", [t] * b, [t] * b, hq, hkv, d, torch.bfloat16)
    ours = time_ms(lambda: paged_attention(**batch, max_q_len=t))
    q = torch.randn(b, hq, t, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            dense = time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                     enable_gqa=True))
    except RuntimeError as e:  # (no cuDNN attention in this build: no row, a line saying so)
        print(f"paged prefill: no cuDNN attention here ({str(e).splitlines()[0]})")
        return []
    return [make_row("paged_prefill", shape, ours, dense, "cuDNN SDPA, dense (no pages)", flops, kv)]


def bench_rows(quick: bool) -> list[dict]:
    """Decode at batch 64 with Llama-8B heads over 4k-32k contexts, and a chunked prefill, vs the torch reference;
    and batch-1 decode with Llama-3.2-1B's heads, timed in CUDA graphs (its context split across the GPU: a
    second kernel combines the splits, or the last split does, `fused`)."""
    if not torch.cuda.is_available():
        raise NanoforgeError("paged attention benchmarks need a CUDA GPU", param="kinds")
    mixed = torch.randint(4096, 32769, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    cases = [("decode", [4096] * 64, [1] * 64), ("decode", mixed, [1] * 64)]
    if not quick:
        cases += [("decode", [32768] * 64, [1] * 64), ("prefill", [8192] * 8, [512] * 8)]
    rows = [_bench_case(kind, ctx, qlens, 32, 8, 128, torch.bfloat16) for kind, ctx, qlens in cases]
    if not quick:  # gpu_engine.py (c)'s step: 8 fresh prompts of 2,000 tokens, Llama-3.2-1B's heads (D 64), where
        # session 7's profile of one 16K-token step had this kernel at 11.1 of ~58 ms (~190 TFLOP/s)
        rows.append(_bench_case("prefill", [2000] * 8, [2000] * 8, 32, 8, 64, torch.bfloat16))
        rows += [r for hq, d in ((32, 64), (16, 128)) for r in _prefill_cudnn_rows(8, 2000, hq, 8, d)]
    return rows + [_bench_case("decode", [1024], [1], 32, 8, 64, torch.bfloat16, combine, graph=True)  # CUDA graphs:
                   for combine in ("kernel", "fused")]  # the GPU's time, as the engine replays a decode step
