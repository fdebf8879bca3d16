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


def launch(b, max_q_len, tile, splits=1, fused=False, **kw):
    """The kernel at an explicit tile, (block_m, block_q, block_n, warps, stages), and split count."""
    block_m, block_q, block_n, warps, stages = tile
    return pa._paged_attention_triton(
        **b, scale=1 / math.sqrt(b["q"].shape[-1]), max_q_len=max_q_len, block_m=block_m, block_q=block_q,
        block_n=block_n, num_splits=splits, num_warps=warps, num_stages=stages, fused_combine=fused, **kw,
    )  # fmt: skip


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
    check(b, launch(b, 1, pa._tile_config(1, hq // hkv, d), splits, fused))
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
    check(b, launch(b, 20, pa._tile_config(20, 2, 16), splits, fused))
    assert all(not c.any() for c in dispatch._COUNTERS.values())


@interpreter
@pytest.mark.parametrize("bs", [4, 16, 32])  # cache blocks smaller than a key tile, equal, larger
def test_block_table_chunks_held_in_registers_cover_every_tile(poisoned, monkeypatch, bs):
    """The unmasked key tiles take their cache blocks from a chunk of the block table loaded once (here 2 tiles'
    worth, so that contexts of a few hundred keys cross several chunks, with tiles and cache blocks that do not
    line up with them): prefill and decode (split contexts) still equal the float64 reference."""
    import triton.language as tl

    monkeypatch.setattr(pa, "_TABLE_TILES", tl.constexpr(2))
    b = batch([170, 97, 33], [60, 1, 33], 4, 2, 16, bs, seed=bs)
    check(b, launch(b, 60, pa._tile_config(60, 2, 16)))
    d = batch([170, 97, 33, 250], [1] * 4, 4, 2, 16, bs, seed=bs + 1)
    for splits in (1, 3):
        check(d, launch(d, 1, pa._tile_config(1, 2, 16), splits))


@interpreter
@pytest.mark.parametrize("tile", ["128x64w8s3", "128x128w8s2", "64x32w4s2"])
def test_chunked_prefill_with_each_prefill_tile_matches_float64(poisoned, tile):
    """The tiles NANOFORGE_ATTN_PREFILL_TILE can pick (rows of (token, head) pairs x keys): whole prompts longer
    than a tile, chunks after cached prefixes, a decode, padding; group 2, group 3 and Qwen2-0.5B's 7 (rows left
    unused), and GPT-2's 1 (a query head a kv head)."""
    rows, keys, warps, stages = pa._parse_tile(tile)
    for ctx, qlens, hq, hkv in (([150, 20, 9, 170, 1], [150, 20, 1, 37, 0], 4, 2), ([75, 3], [40, 3], 6, 2),
                                ([90, 1], [60, 1], 14, 2), ([140, 5], [140, 1], 2, 2)):
        b = batch(ctx, qlens, hq, hkv, 16, 8, seed=rows + keys)
        check(b, launch(b, max(qlens), (rows, rows // (hq // hkv), keys, warps, stages)))


def test_the_prefill_tile_comes_from_the_environment(monkeypatch):
    """NANOFORGE_ATTN_PREFILL_TILE sets prefill steps' launch (decode keeps its own), rows widened to a group's
    heads; unset, the tile depends on the head dim (two warpgroups over 128 rows at 64, session 30's sweep); a
    malformed value is one line naming the setting."""
    monkeypatch.setattr(pa, "interpreting", lambda: False)
    assert pa._tile_config(100, 2, 128) == (64, 32, 64, 4, 3)  # the default (Qwen3's head dim)
    assert pa._tile_config(100, 4, 64) == (128, 32, 64, 8, 3)  # the default at Llama-3.2-1B's head dim
    assert pa._tile_config(1, 4, 64) == (16, 1, 64, 4, 3)  # decode
    monkeypatch.setenv("NANOFORGE_ATTN_PREFILL_TILE", "128X128w8s2")
    for d in (64, 128):
        assert pa._tile_config(100, 4, d) == (128, 32, 128, 8, 2)
    assert pa._tile_config(2, 2, 128) == (128, 64, 128, 8, 2)
    assert pa._tile_config(1, 4, 128) == (16, 1, 64, 4, 3)  # decode
    monkeypatch.setenv("NANOFORGE_ATTN_PREFILL_TILE", "16x64w4s3")
    assert pa._tile_config(100, 32, 128)[:2] == (32, 1)  # 32 query heads a kv head: one token's rows at least
    for bad in ("128x64", "96x64w4s3", "128x64w3s2", "128x512w8s2", "128x64w8s0"):
        monkeypatch.setenv("NANOFORGE_ATTN_PREFILL_TILE", bad)
        with pytest.raises(NanoforgeError, match=f"NANOFORGE_ATTN_PREFILL_TILE must be .* not '{bad}'"):
            pa._tile_config(100, 4, 64)


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
    block_q = pa._tile_config(37, 2, 16)[1]
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
@pytest.mark.parametrize("tile", ["64x64w4s3", "128x64w8s3", "128x64w8s2", "128x128w8s2"])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 64), (16, 8, 128), (12, 12, 64), (14, 2, 64)],
                         ids=["llama3-1b", "qwen3-0.6b", "gpt2", "qwen2-0.5b"])  # each family's heads
def test_gpu_prefill_tiles_full_size_bf16(poisoned, monkeypatch, tile, hq, hkv, d):
    """Each prefill tile the sweep and gpu_engine.py --prefill-variants try, through the public entry point: whole
    prompts, a chunk after a long cached prefix and decodes in one step."""
    monkeypatch.setenv("NANOFORGE_ATTN_PREFILL_TILE", tile)
    b = pa.make_paged_batch([2000, 2000, 5000, 700, 33], [2000, 2000, 300, 1, 1], hq, hkv, d, 16, torch.bfloat16,
                            "cuda")
    out = pa.paged_attention(**b, max_q_len=2000)
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


# ------------------------------------------------------------------------------ RoPE and the KV write inside


def _projections(ctx, hq, hkv, d, norm, seed):
    """A decode step's raw q, k, v (strided views of one projection, as the engine's), the angles at each
    sequence's last position, and Qwen3-style q/k norms if `norm`."""
    from nanoforge.model.config import preset
    from nanoforge.model.transformer import RMSNorm, Transformer

    gen = torch.Generator().manual_seed(seed)
    n = len(ctx)
    qkv = 3 * torch.randn(n, (hq + 2 * hkv) * d, generator=gen)
    q, k, v = qkv[:, :hq * d].view(n, hq, d), qkv[:, hq * d:(hq + hkv) * d].view(n, hkv, d), \
        qkv[:, (hq + hkv) * d:].view(n, hkv, d)
    model = Transformer(preset("tiny-llama", max_seq_len=4096, d_model=4 * d, n_heads=4, n_kv_heads=2, head_dim=d))
    cos, sin = (t[0] for t in model.rope(torch.tensor(ctx)[None] - 1, torch.float32))
    qk_norm = None
    if norm:
        qk_norm = (RMSNorm(d, 0.5), RMSNorm(d, 0.5))  # an eps large enough to matter
        with torch.no_grad():
            for m in qk_norm:
                m.weight.copy_(torch.rand(d, generator=gen) + 0.5)
    return q, k, v, cos, sin, qk_norm



def token_slots(b: dict, ctx: list[int], block_size: int) -> torch.Tensor:
    """Each sequence's token slot (its context's last position) through its block table, int32, on its device."""
    table = b["block_tables"].cpu()
    return torch.tensor([table[i, (n - 1) // block_size] * block_size + (n - 1) % block_size
                         for i, n in enumerate(ctx)], dtype=torch.int32, device=b["block_tables"].device)


def gpu_projections(ctx, hq, hkv, d, norm, seed):
    """`_projections` in bf16 on the GPU (the q/k norms too)."""
    q, k, v, cos, sin, qk_norm = (t.cuda().bfloat16() if torch.is_tensor(t) else t
                                  for t in _projections(ctx, hq, hkv, d, norm, seed))
    return q, k, v, cos, sin, tuple(m.cuda().bfloat16() for m in qk_norm) if qk_norm else None

@interpreter
@pytest.mark.parametrize("hq,hkv,d,norm", [(6, 2, 16, False), (6, 2, 16, True), (4, 4, 24, True)])
@pytest.mark.parametrize("splits,fused", [(1, False), (3, False), (3, True)])
def test_rope_and_kv_write_inside_attention_equal_the_parts(poisoned, hq, hkv, d, norm, splits, fused):
    """NANOFORGE_ATTN_ROPE=fused: the attention kernel normalises (Qwen3) and rotates q and the new key itself,
    writes the token's K and V into its slot and attends to that key from registers; the output and the cache
    are what `rope_qkv_and_write_kv` then paged attention give (float64 attention over the parts' cache), and
    no other slot is written. Contexts of 1 (only the new key), cache-block edges, and splits of one key."""
    from nanoforge.kernels.rope import rope_qkv_and_write_kv

    ctx = [1, 16, 17, 40, 5]
    b = batch(ctx, [1] * len(ctx), hq, hkv, d, 8, seed=splits)
    q, k, v, cos, sin, qk_norm = _projections(ctx, hq, hkv, d, norm, seed=d)
    slots = token_slots(b, ctx, 8)
    want_k, want_v = b["k_cache"].clone(), b["v_cache"].clone()
    with torch.no_grad():
        q_rot = rope_qkv_and_write_kv(q, k, v, cos, sin, want_k, want_v, slots, qk_norm)  # Triton's own kernel
        want = pa.paged_attention_ref(**as_float64({**b, "q": q_rot, "k_cache": want_k, "v_cache": want_v}))
        out = launch({**b, "q": q}, 1, pa._tile_config(1, hq // hkv, d), splits, fused,
                     new_kv=(k, v, cos, sin, slots, qk_norm))
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5)
    tol = dict(rtol=1e-5, atol=1e-5) if norm else dict(rtol=0, atol=0)  # a norm's sum in another order
    torch.testing.assert_close(b["k_cache"], want_k, equal_nan=True, **tol)  # the new keys; NaN elsewhere kept
    assert torch.equal(b["v_cache"].nan_to_num(7.0), want_v.nan_to_num(7.0))
    assert all(not c.any() for c in dispatch._COUNTERS.values())


@interpreter
def test_rope_write_and_attend_takes_the_switch(poisoned, monkeypatch):
    """The engine's entry point: the parts by default, the attention kernel alone with NANOFORGE_ATTN_ROPE=fused;
    the same answer and cache either way."""
    ctx = [9, 30]
    q, k, v, cos, sin, qk_norm = _projections(ctx, 4, 2, 16, True, seed=3)
    got = {}
    for mode in ("kernel", "fused"):
        monkeypatch.setenv("NANOFORGE_ATTN_ROPE", mode)
        b = batch(ctx, [1, 1], 4, 2, 16, 8, seed=5)
        slots = token_slots(b, ctx, 8)
        with torch.no_grad():
            out = pa.rope_write_and_attend(q, k, v, cos, sin, b["k_cache"], b["v_cache"], slots, b["block_tables"],
                                           b["seq_lens"], b["cu_seqlens_q"], qk_norm)
        got[mode] = out, b["k_cache"]
    torch.testing.assert_close(got["fused"][0], got["kernel"][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["fused"][1], got["kernel"][1], rtol=1e-5, atol=1e-5, equal_nan=True)
    monkeypatch.setenv("NANOFORGE_ATTN_ROPE", "yes")
    with pytest.raises(NanoforgeError, match="NANOFORGE_ATTN_ROPE must be kernel or fused, not 'yes'"):
        pa.rope_mode()


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,d,norm", [(32, 8, 64, False), (16, 8, 128, True)])  # Llama-3.2-1B, Qwen3-0.6B
@pytest.mark.parametrize("combine", ["kernel", "fused"])
def test_gpu_rope_and_kv_write_inside_attention_in_a_cuda_graph(poisoned, monkeypatch, hq, hkv, d, norm, combine):
    """NANOFORGE_ATTN_ROPE=fused at the models' head shapes in bf16, captured in a CUDA graph: the output within
    bf16 of float64 attention over the parts' cache (`rope_qkv_and_write_kv`), the written keys within one
    rounding of theirs, and the same bits over replays."""
    from nanoforge.kernels.rope import rope_qkv_and_write_kv

    monkeypatch.setenv("NANOFORGE_ATTN_COMBINE", combine)
    ctx = [4096, 1, 777, 20000, 16]
    b = pa.make_paged_batch(ctx, [1] * len(ctx), hq, hkv, d, 16, torch.bfloat16, "cuda")
    q, k, v, cos, sin, qk_norm = gpu_projections(ctx, hq, hkv, d, norm, seed=1)
    slots = token_slots(b, ctx, 16)
    want_k, want_v = b["k_cache"].clone(), b["v_cache"].clone()
    with torch.no_grad():
        q_rot = rope_qkv_and_write_kv(q, k, v, cos, sin, want_k, want_v, slots, qk_norm)
        want = pa.paged_attention_ref(**as_float64({**b, "q": q_rot, "k_cache": want_k, "v_cache": want_v}))
        monkeypatch.setenv("NANOFORGE_ATTN_ROPE", "fused")
        args = (q, k, v, cos, sin, b["k_cache"], b["v_cache"], slots, b["block_tables"], b["seq_lens"],
                b["cu_seqlens_q"], qk_norm)
        pa.rope_write_and_attend(*args)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = pa.rope_write_and_attend(*args)
        graph.replay()
        first = out.clone()
        for _ in range(2):
            graph.replay()
            assert torch.equal(out, first)
    assert rel_error(out, want) < 1e-2
    flat, ref = b["k_cache"].view(-1, hkv, d)[slots.long()].float(), want_k.view(-1, hkv, d)[slots.long()].float()
    torch.testing.assert_close(flat, ref, rtol=2 ** -7, atol=2 ** -7)
    assert torch.equal(b["v_cache"], want_v)


@interpreter
def test_the_prefill_sweep_checks_every_tile_and_names_the_fastest_as_a_setting(poisoned, capsys, monkeypatch):
    """benchmarks/gpu_kernels_attention.py --prefill-sweep (never run on a GPU yet) on the CPU at a tiny size, a
    stand-in timer: every one of its 30 tiles per head shape computes the reference's output, the engine's
    default is among them, and the fastest comes out as a NANOFORGE_ATTN_PREFILL_TILE setting the engine takes."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import gpu_kernels_attention as sweep

    monkeypatch.setattr(pa, "interpreting", lambda: False)  # the default it marks: a GPU's, not the interpreter's
    times = iter(range(1000, 0, -1))  # each tile timed faster than the one before: the last is the fastest
    rows = sweep.sweep_paged_prefill(prompts=1, length=20, device="cpu", timer=lambda f: float(next(times)))
    assert len(rows) == 60 and all(r["ok"] for r in rows)
    for shape in ("llama3-1b", "qwen3-0.6b"):
        mine = [r for r in rows if r["shape"] == shape]
        assert sum(r["default"] for r in mine) == 1
        (best,) = [r for r in mine if "setting" in r]
        assert best is mine[-1] and pa._parse_tile(best["setting"]) == (256, 64, 16, 3)
    assert "in the engine: NANOFORGE_ATTN_PREFILL_TILE=256x64w16s3" in capsys.readouterr().out
