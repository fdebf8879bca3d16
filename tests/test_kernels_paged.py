"""Paged attention (Triton decode and chunked prefill) and write_kv against float64 references.

CPU tests run the kernel under TRITON_INTERPRET=1 with 16-row, 16-key tiles; contexts straddle cache
blocks and tiles (1, 15, 17, 100 tokens...), cache blocks are shuffled, and the slots past each context
hold NaN so a kernel that reads them fails. Kernel outputs start as NaN (the `poisoned` fixture).
`gpu` tests repeat the checks at full size in bfloat16 and replay a decode step captured in a CUDA graph.
"""

import math

import pytest
import torch

from nanoforge.errors import NanoforgeError
from nanoforge.kernels import dispatch
from nanoforge.kernels import paged_attention as pa
from conftest import interpreter, nan_empty, raises_bug

@pytest.fixture
def poisoned(monkeypatch):
    """Force the Triton path and make every kernel output start as NaN."""
    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")
    monkeypatch.setattr(pa, "_empty", nan_empty)


def batch(ctx, qlens, hq, hkv, d, block_size, dtype=torch.float32, device="cpu", seed=0):
    """make_paged_batch, with NaN in every cache slot that no context covers."""
    b = pa.make_paged_batch(ctx, qlens, hq, hkv, d, block_size, dtype, device, seed)
    live = torch.zeros(b["k_cache"].shape[:2], dtype=torch.bool, device=device)
    for table, n in zip(b["block_tables"].tolist(), ctx):
        for pos in range(n):
            live[table[pos // block_size], pos % block_size] = True
    b["k_cache"][~live] = math.nan
    b["v_cache"][~live] = math.nan
    return b


def as_float64(b):
    return {k: v.double() if v.is_floating_point() else v for k, v in b.items()}


def naive_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale):
    """Independent definition, one query token at a time: read its context slot by slot, softmax, sum."""
    out = torch.zeros_like(q)
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    for s, n in enumerate(seq_lens.tolist()):
        q0, q1 = cu_seqlens_q[s].item(), cu_seqlens_q[s + 1].item()
        for t in range(q0, q1):
            pos = n - (q1 - t)  # the query's position; it sees keys 0..pos
            slots = [(block_tables[s, j // block_size].item(), j % block_size) for j in range(pos + 1)]
            k = torch.stack([k_cache[b, o] for b, o in slots])  # (pos+1, Hkv, D)
            v = torch.stack([v_cache[b, o] for b, o in slots])
            for h in range(q.shape[1]):
                w = torch.softmax(k[:, h // group] @ q[t, h] * scale, dim=0)
                out[t, h] = w @ v[:, h // group]
    return out


# ------------------------------------------------------------------------------ the reference itself


def test_reference_matches_naive_definition():
    b = as_float64(batch([17, 5, 33], [1, 5, 9], 6, 2, 8, 4))
    got = pa.paged_attention_ref(**b, scale=0.4)
    torch.testing.assert_close(got, naive_paged_attention(**b, scale=0.4))


def test_write_kv_puts_each_token_in_its_slot():
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.randn(2, 5, 4, 2, 8, generator=gen)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    k, v = torch.randn(2, 6, 2, 8, generator=gen)
    slots = torch.tensor([19, 0, 7, 3, 12, 8], dtype=torch.int32)
    pa.write_kv(k, v, k_cache, v_cache, slots)
    for i, slot in enumerate(slots.tolist()):
        before_k[slot // 4, slot % 4] = k[i]
        before_v[slot // 4, slot % 4] = v[i]
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)


# ------------------------------------------------------------------------------ Triton vs float64


def check(b, out, rtol=1e-4, atol=1e-5):
    assert out.shape == b["q"].shape and out.dtype == b["q"].dtype
    ref = pa.paged_attention_ref(**as_float64(b))
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=atol)


# (contexts, query tokens per sequence, Hq, Hkv, D, cache block size)
DECODE = [
    ([1, 15, 16, 17, 100], 4, 4, 16, 16),  # no GQA
    ([37, 5, 64, 2], 6, 2, 32, 8),  # group 3, cache blocks smaller than a key tile
    ([50, 90], 8, 1, 24, 32),  # group 8 (multi-query), D not a power of two, blocks larger than a tile
]


@interpreter
@pytest.mark.parametrize("ctx,hq,hkv,d,bs", DECODE)
@pytest.mark.parametrize("splits,fused", [(1, False), (2, False), (3, False), (3, True)])
def test_decode_matches_float64(poisoned, ctx, hq, hkv, d, bs, splits, fused):
    """fused: the last split of each tile to finish combines the splits (NANOFORGE_ATTN_COMBINE=fused), and
    leaves its arrival count at zero for the next kernel on the stream."""
    b = batch(ctx, [1] * len(ctx), hq, hkv, d, bs, seed=len(ctx))
    block_m, block_q, block_n, warps, stages = pa._tile_config(1, hq // hkv)
    out = pa._paged_attention_triton(
        **b, scale=1 / math.sqrt(d), max_q_len=1, block_m=block_m, block_q=block_q, block_n=block_n,
        num_splits=splits, num_warps=warps, num_stages=stages, fused_combine=fused,
    )  # fmt: skip
    check(b, out)
    assert all(not c.any() for c in dispatch._COUNTERS.values())


@interpreter
@pytest.mark.parametrize(
    "ctx,qlens,hq,hkv,d,bs",
    [
        ([20, 9, 70, 33], [20, 1, 17, 5], 4, 2, 16, 16),  # a whole prompt, a decode, chunks on a cached prefix
        ([45, 3], [12, 3], 6, 2, 32, 8),  # group 3: 5 tokens x 3 heads per 16-row tile
        ([31], [31], 2, 2, 16, 4),
    ],
)
def test_chunked_prefill_matches_float64(poisoned, ctx, qlens, hq, hkv, d, bs):
    b = batch(ctx, qlens, hq, hkv, d, bs, seed=sum(qlens))
    check(b, pa.paged_attention(**b, max_q_len=max(qlens)))
    check(b, pa.paged_attention(**b))  # max_q_len defaults to total_q: more programs, same answer


@interpreter
@pytest.mark.parametrize("splits,fused", [(2, False), (3, False), (3, True)])
def test_chunked_prefill_with_split_contexts_matches_float64(poisoned, splits, fused):
    """Each query tile's keys cut into `splits` pieces and combined (by a second kernel, or `fused`: by the
    tile's last split): chunks after long cached prefixes (whole unmasked key blocks, then the diagonal), a
    whole prompt and a decode, beside padding sequences (whose tiles exit at once and count nothing)."""
    ctx, qlens = [90, 20, 9, 70, 1], [3, 20, 1, 17, 0]
    b = batch(ctx, qlens, 4, 2, 16, 8, seed=splits)
    block_m, block_q, block_n, warps, stages = pa._tile_config(20, 2)
    out = pa._paged_attention_triton(
        **b, scale=1 / math.sqrt(16), max_q_len=20, block_m=block_m, block_q=block_q, block_n=block_n,
        num_splits=splits, num_warps=warps, num_stages=stages, fused_combine=fused,
    )  # fmt: skip
    check(b, out)
    assert all(not c.any() for c in dispatch._COUNTERS.values())


def test_the_combine_switch_takes_two_values(monkeypatch):
    monkeypatch.setenv("NANOFORGE_ATTN_COMBINE", "Fused")
    assert pa.combine_mode() == "fused"
    monkeypatch.setenv("NANOFORGE_ATTN_COMBINE", "late")
    with pytest.raises(NanoforgeError, match="NANOFORGE_ATTN_COMBINE must be kernel or fused, not 'late'"):
        pa.combine_mode()


def test_split_count_ignores_padding_sequences():
    """A graphed 16-token prefill step has a program bound per sequence slot (256) but one busy tile per kv
    head: its context is split as a decode's would be, not walked by one program."""
    assert pa._busy_tiles(16, 256, 32, varlen=True) == 1
    assert pa._busy_tiles(8192, 1, 32, varlen=True) == 256
    assert pa._busy_tiles(1, 7, 1, varlen=False) == 7


@interpreter
def test_ragged_tiles_with_padding_sequences_and_shared_starts(poisoned):
    """Query tiles handed out ragged (one program per tile of each sequence, found by binary search):
    decodes around a long chunk, zero-length padding sequences (a graphed step's) between and after them,
    and the starts computed once and passed in, as the engine shares them across layers."""
    ctx, qlens = [5, 40, 9, 1, 23, 1, 1], [1, 37, 0, 0, 4, 1, 0]
    b = batch(ctx, qlens, 4, 2, 16, 8, seed=7)
    check(b, pa.paged_attention(**b, max_q_len=37))
    starts = pa.query_tile_starts(b["q"], b["k_cache"], b["cu_seqlens_q"], 37)
    block_q = pa._tile_config(37, 2)[1]
    want = [0]
    for n in qlens:
        want.append(want[-1] + -(-n // block_q))
    assert starts.tolist() == want
    check(b, pa.paged_attention(**b, max_q_len=37, tile_starts=starts))
    assert pa.query_tile_starts(b["q"], b["k_cache"], b["cu_seqlens_q"], 1) is None  # decode: none needed


@interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(poisoned, dtype):
    b = batch([40, 7, 64], [1, 7, 3], 8, 2, 32, 16, dtype=dtype)
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    check(b, pa.paged_attention(**b, max_q_len=7), rtol=4 * ulp, atol=4 * ulp)


def test_cpu_default_is_the_reference(monkeypatch):
    monkeypatch.setenv("NANOFORGE_KERNELS", "auto")
    b = batch([12, 30], [3, 1], 4, 2, 8, 4)
    check(b, pa.paged_attention(**b))


def test_bad_inputs_raise_clear_errors():
    b = batch([5], [1], 4, 2, 8, 4)
    with raises_bug("not a multiple of 2 kv heads"):
        pa.paged_attention(**{**b, "q": torch.randn(1, 3, 8)})
    with raises_bug("cu_seqlens_q"):
        pa.paged_attention(**{**b, "cu_seqlens_q": torch.tensor([0, 1, 2], dtype=torch.int32)})
    with raises_bug("slot_mapping"):
        pa.write_kv(torch.randn(3, 2, 8), torch.randn(3, 2, 8), b["k_cache"], b["v_cache"], torch.arange(2))


# ------------------------------------------------------------------------------ full size on the GPU


def rel_error(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "ctx,qlens",
    [
        ([4096, 1, 777, 20000, 8191, 16], [1] * 6),  # decode, long and ragged contexts
        ([3000, 512, 9000], [256, 512, 1]),  # chunked prefill mixed with a decode
        # a short chunk after a long cached prefix beside a graphed step's padding slots: its context is split
        ([20000] + [1] * 255, [16] + [0] * 255),
    ],
)
@pytest.mark.parametrize("combine", ["kernel", "fused"])
def test_gpu_full_size_bf16(poisoned, monkeypatch, ctx, qlens, combine):
    monkeypatch.setenv("NANOFORGE_ATTN_COMBINE", combine)
    b = pa.make_paged_batch(ctx, qlens, 32, 8, 128, 16, torch.bfloat16, "cuda")
    out = pa.paged_attention(**b, max_q_len=max(qlens))
    assert rel_error(out, pa.paged_attention_ref(**as_float64(b))) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("combine", ["kernel", "fused"])
def test_gpu_decode_replays_in_a_cuda_graph(poisoned, monkeypatch, combine):
    """Capture one decode step, then change the lengths and block tables in place and replay (three times: the
    same bits each time, so a fused combine's arrival counts reset themselves)."""
    monkeypatch.setenv("NANOFORGE_ATTN_COMBINE", combine)
    ctx = [300, 1000, 64, 2048]
    b = pa.make_paged_batch(ctx, [1] * 4, 16, 4, 64, 16, torch.bfloat16, "cuda")
    pa.paged_attention(**b, max_q_len=1)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pa.paged_attention(**b, max_q_len=1)
    b["block_tables"].copy_(b["block_tables"].flip(0))  # the tables now hold 2048, 64, 1008, 304 tokens
    b["seq_lens"].copy_(torch.tensor([2048, 17, 1000, 1], dtype=torch.int32))
    graph.replay()
    assert rel_error(out, pa.paged_attention_ref(**as_float64(b))) < 1e-2
    first = out.clone()
    for _ in range(2):
        graph.replay()
        assert torch.equal(out, first)
