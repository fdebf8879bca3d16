"""A serving step's input gathers in one launch: its tokens, their embedding and RoPE rows, its block tables.

Before its first layer a step gathers: each token's id (given, or the token the step before sampled, still on
the device: asynchronous scheduling), that id's embedding row (plus its position's, for learned positions), its
position's RoPE row (cos and sin, from the engine's table) and each sequence's block-table row. As PyTorch ops
that is seven small kernels of ~2 us each; in a batch-1 decode step's CUDA graph they ran back to back between
the graph's start and its first layer (session 21's trace of a Qwen3-0.6B step: 16 us). Here it is one kernel:
a program per token row, then one per sequence row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoforge.kernels import pdl
from nanoforge.kernels.dispatch import interpreting, use_fast


def gather_step_inputs_ref(src, sampled, ids, positions, embed, pos_embed, rope_table, row_slot, table, width):
    """The definition of correct: PyTorch's ops, as the engine ran them before this kernel."""
    tokens = torch.where(src >= 0, sampled[src.clamp(min=0)], ids)
    x = torch.nn.functional.embedding(tokens, embed)
    if pos_embed is not None:
        x = x + torch.nn.functional.embedding(positions, pos_embed)
    cs = rope_table[positions] if rope_table is not None else None
    return tokens, x, cs, table[:, :width].index_select(0, row_slot)


def gather_step_inputs(src: torch.Tensor, sampled: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                       embed: torch.Tensor, pos_embed: torch.Tensor | None, rope_table: torch.Tensor | None,
                       row_slot: torch.Tensor, table: torch.Tensor, width: int):
    """A step's inputs, for its n token rows (src, ids, positions: (n,) int64) and s sequence rows (row_slot:
    (s,) int64): (tokens (n,) int64: sampled[src] where src >= 0, else ids; x (n, D): embed's rows of the tokens
    plus pos_embed's of the positions, if given; cs (n, 2, head_dim): rope_table's rows of the positions, None
    without a table; tables (s, width) int32: table's first `width` columns of rows row_slot)."""
    n, s = src.shape[0], row_slot.shape[0]
    if not (use_fast(embed) and n and embed.stride(1) == 1 and table.stride(1) == 1
            and (pos_embed is None or pos_embed.stride(1) == 1)
            and (rope_table is None or rope_table.is_contiguous())):
        return gather_step_inputs_ref(src, sampled, ids, positions, embed, pos_embed, rope_table, row_slot, table,
                                      width)
    dev, d = embed.device, embed.shape[1]
    tokens = torch.empty(n, dtype=torch.int64, device=dev)
    x = torch.empty(n, d, dtype=embed.dtype, device=dev)
    cs = torch.empty(n, *rope_table.shape[1:], dtype=rope_table.dtype, device=dev) if rope_table is not None else None
    tables = torch.empty(s, width, dtype=table.dtype, device=dev)
    r = rope_table[0].numel() if rope_table is not None else 0
    small = interpreting()
    on = pdl.enabled(embed)
    _gather_step_kernel[(n + s,)](
        src, sampled, ids, positions, embed, embed.stride(0), pos_embed if pos_embed is not None else embed,
        pos_embed.stride(0) if pos_embed is not None else 0, rope_table if rope_table is not None else embed,
        row_slot, table, table.stride(0), tokens, x, cs if cs is not None else x, tables, n, d, r, width,
        BLOCK_D=min(triton.next_power_of_2(d), 16 if small else 4096), BLOCK_R=max(2, triton.next_power_of_2(r)),
        BLOCK_W=min(triton.next_power_of_2(max(width, 1)), 16 if small else 1024), HAS_POS=pos_embed is not None,
        HAS_ROPE=rope_table is not None, PDL=on, num_warps=1 if small else 4, launch_pdl=bool(on))
    return tokens, x, cs, tables


@triton.jit
def _gather_step_kernel(SRC, SAMPLED, IDS, POSITIONS, EMBED, stride_e, POS_EMBED, stride_p, ROPE, ROW_SLOT, TABLE,
                        stride_t, TOKENS, X, CS, TABLES, n, D, R, width, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_W: tl.constexpr, HAS_POS: tl.constexpr, HAS_ROPE: tl.constexpr, PDL: tl.constexpr):
    """Program p < n: token row p (its id, embedding row and RoPE row); program n + q: sequence row q's table."""
    pdl.enter(PDL)  # (SAMPLED, the step before's tokens, and the table's updates are earlier kernels' writes)
    p = tl.program_id(0)
    if p < n:
        src = tl.load(SRC + p)
        token = tl.load(IDS + p)
        if src >= 0:
            token = tl.load(SAMPLED + src)
        tl.store(TOKENS + p, token)
        pos = tl.load(POSITIONS + p)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            e = tl.load(EMBED + token * stride_e + d, mask=d < D)
            if HAS_POS:
                e = (e.to(tl.float32) + tl.load(POS_EMBED + pos * stride_p + d, mask=d < D).to(tl.float32)).to(
                    e.dtype)
            tl.store(X + p.to(tl.int64) * D + d, e, mask=d < D)
        if HAS_ROPE:
            r = tl.arange(0, BLOCK_R)
            tl.store(CS + p.to(tl.int64) * R + r, tl.load(ROPE + pos * R + r, mask=r < R), mask=r < R)
    else:
        q = p - n
        row = tl.load(ROW_SLOT + q)
        for w0 in range(0, width, BLOCK_W):
            w = w0 + tl.arange(0, BLOCK_W)
            tl.store(TABLES + q.to(tl.int64) * width + w, tl.load(TABLE + row * stride_t + w, mask=w < width),
                     mask=w < width)
