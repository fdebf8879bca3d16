"""BlockManager: allocation, reference counts, copy-on-write, prefix cache (chained keys, verification, LRU), swap."""

import hashlib
import random
import struct

import pytest

from nanoforge.serve import block_manager as bm_module
from nanoforge.serve.block_manager import BlockManager, hash_block_tokens, prefix_block_hashes
from nanoforge.serve.sampling_params import SamplingParams
from nanoforge.serve.sequence import Sequence

BS = 4


def make_seq(tokens):
    return Sequence(tokens, SamplingParams())


def compute(bm: BlockManager, seq: Sequence, n: int | None = None):
    """What scheduler + runner do for one chunk: make slots, 'compute' them, offer full blocks to the cache."""
    n = seq.num_uncomputed_tokens if n is None else n
    copies = bm.append_slots(seq, n)
    seq.num_computed_tokens += n
    bm.cache_computed_blocks(seq)
    return copies


def assert_consistent(bm: BlockManager, seqs):
    """Reference counts equal the number of tables holding each block; free and used never overlap."""
    expected = [0] * bm.num_blocks
    for s in seqs:
        for b in s.block_table:
            expected[b] += 1
    assert bm.ref_counts == expected
    assert bm.free_block_ids() == {b for b in range(bm.num_blocks) if expected[b] == 0}
    assert bm.num_free_blocks == len(bm.free_block_ids())  # no block listed twice


def test_hash_is_stable_and_chained():
    # an independent re-derivation: blake2b-64 over parent key (8 bytes LE) + int64 LE token ids
    want = int.from_bytes(hashlib.blake2b(struct.pack("<3q", 1, 2, 3), digest_size=8).digest(), "little")
    assert hash_block_tokens(None, [1, 2, 3]) == want
    child = hash_block_tokens(want, [4, 5, 6])
    assert child == int.from_bytes(hashlib.blake2b(want.to_bytes(8, "little") + struct.pack("<3q", 4, 5, 6),
                                                   digest_size=8).digest(), "little")
    # a key names the whole prefix: same block tokens after a different parent give a different key
    a = prefix_block_hashes([1, 2, 3, 4, 9, 9, 9, 9], BS)
    b = prefix_block_hashes([1, 2, 3, 5, 9, 9, 9, 9], BS)
    assert len(a) == 2 and a[1] != b[1]
    assert prefix_block_hashes([1, 2, 3, 4, 9, 9, 9, 9, 7], BS) == a  # the partial block has no key


def test_lazy_allocation_and_free():
    bm = BlockManager(8, BS)
    s = make_seq(list(range(10)))
    compute(bm, s, 5)
    assert len(s.block_table) == 2  # ceil(5 / 4): blocks are taken as positions need them
    compute(bm, s)
    assert len(s.block_table) == 3
    assert bm.num_used_blocks == 3
    assert_consistent(bm, [s])
    bm.free(s)
    assert s.block_table == [] and bm.num_free_blocks == 8
    assert_consistent(bm, [s])


def test_fork_and_copy_on_write():
    bm = BlockManager(16, BS)
    parent = make_seq(list(range(10)))  # 2 full blocks + 1 partial (2 tokens)
    compute(bm, parent)
    children = [parent.fork(i) for i in (1, 2, 3)]
    for c in children:
        bm.fork(parent, c)
    seqs = [parent, *children]
    assert bm.num_used_blocks == 3  # one copy of the prompt for all four
    assert all(bm.ref_counts[b] == 4 for b in parent.block_table)
    for i, s in enumerate(seqs):
        s.append_token(100 + i)
    partial = parent.block_table[2]
    # exact accounting: 3 copies, not 4 -- the last writer keeps the shared block
    assert bm.num_blocks_needed(seqs, [1] * 4) == 3
    copies = [cp for s in seqs for cp in compute(bm, s)]
    assert [src for src, _ in copies] == [partial] * 3
    assert len({dst for _, dst in copies}) == 3
    assert bm.ref_counts[partial] == 1 and seqs[-1].block_table[2] == partial
    assert all(bm.ref_counts[b] == 4 for b in parent.block_table[:2])  # full prompt blocks still shared
    assert_consistent(bm, seqs)
    for s in seqs:
        bm.free(s)
    assert bm.num_free_blocks == 16


def test_num_blocks_needed_is_exact():
    """Property: the prediction equals the free blocks actually consumed, over random states."""
    rng = random.Random(0)
    for trial in range(200):
        bm = BlockManager(64, BS)
        base = [rng.randrange(5) for _ in range(rng.randrange(1, 20))]
        donor = make_seq(base)  # fills the prefix cache, then is freed (evictable blocks)
        compute(bm, donor)
        if rng.random() < 0.5:
            bm.free(donor)
        parent = make_seq(base[:rng.randrange(1, len(base) + 1)] + [rng.randrange(5) for _ in range(rng.randrange(4))])
        prefix = bm.match_prefix(parent)
        bm.attach_prefix(parent, prefix)
        compute(bm, parent)
        seqs = [parent]
        for i in range(rng.randrange(3)):
            c = parent.fork(i + 1)
            bm.fork(parent, c)
            seqs.append(c)
        for s in seqs:
            s.append_token(rng.randrange(5))
        # two new sequences that may hit the same cached (possibly evictable) blocks
        fresh = [make_seq(base + [1] * rng.randrange(3)) for _ in range(2)]
        all_seqs = seqs + fresh
        prefixes = [[]] * len(seqs) + [bm.match_prefix(f) for f in fresh]
        news = [rng.randrange(1, 9) for _ in seqs] + [
            min(rng.randrange(1, 9), f.num_tokens - len(p) * BS) for f, p in zip(fresh, prefixes[-2:])]
        predicted = bm.num_blocks_needed(all_seqs, news, prefixes)
        before = bm.num_free_blocks
        for f, p in zip(fresh, prefixes[-2:]):
            bm.attach_prefix(f, p)
        for s, n in zip(all_seqs, news):
            bm.append_slots(s, n)
        assert before - bm.num_free_blocks == predicted, trial
        assert_consistent(bm, all_seqs + ([donor] if donor.block_table and bm.ref_counts[donor.block_table[0]] else []))


def test_prefix_hit_reuses_blocks_and_leaves_last_token():
    bm = BlockManager(32, BS)
    a = make_seq(list(range(1, 15)))  # 14 tokens: 3 full blocks
    compute(bm, a)
    b = make_seq(list(range(1, 13)) + [99, 98])  # shares 12 tokens = 3 blocks
    hit = bm.match_prefix(b)
    assert hit == a.block_table[:3]
    bm.attach_prefix(b, hit)
    assert b.num_computed_tokens == b.num_cached_tokens == 12
    assert all(bm.ref_counts[x] == 2 for x in hit)
    # an identical 12-token prompt reuses only 2 blocks: the last token must be computed for its logits
    c = make_seq(list(range(1, 13)))
    assert bm.match_prefix(c) == a.block_table[:2]
    # a block is offered to the cache only once computed: an uncomputed chunk gives no hit
    d = make_seq(list(range(50, 70)))
    bm.append_slots(d, 20)
    assert bm.match_prefix(make_seq(list(range(50, 70)))) == []


def test_a_recomputed_sequence_fills_the_cache_again():
    bm = BlockManager(3, BS)
    a = make_seq(list(range(9)))
    compute(bm, a)
    bm.free(a)  # preempted by recomputation: its two full blocks stay cached...
    other = make_seq(list(range(20, 29)))
    compute(bm, other)  # ...until another sequence evicts them
    assert bm.match_prefix(make_seq(list(range(9)))) == []
    bm.free(other)
    a.num_computed_tokens = 0
    compute(bm, a)  # the recomputation registers the blocks again
    assert bm.match_prefix(make_seq(list(range(9)))) == a.block_table[:2]


def test_hit_is_verified_against_stored_tokens(monkeypatch):
    # every key collides: only the stored token ids and parent keys can tell prefixes apart
    monkeypatch.setattr(bm_module, "hash_block_tokens", lambda parent, tokens: 7)
    bm = BlockManager(16, BS)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute(bm, a)
    assert bm.match_prefix(make_seq([1, 2, 3, 5, 0, 0, 0, 0, 0])) == []
    assert bm.match_prefix(make_seq([1, 2, 3, 4, 0, 0, 0, 0, 0])) == a.block_table[:1]


def test_lru_eviction_of_unreferenced_cached_blocks():
    bm = BlockManager(4, BS)
    a = make_seq(list(range(9)))  # 2 full blocks + 1 token
    compute(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)  # a's full blocks stay cached (evictable), its partial block is plain free
    assert bm.num_free_blocks == 4
    assert bm.stats()["kv_blocks_cached_free"] == 2
    # two plain-free blocks are used before any cached one is evicted
    b = make_seq(list(range(100, 108)))
    compute(bm, b)
    assert not set(b.block_table) & set(a_blocks[:2])
    assert bm.match_prefix(make_seq(list(range(9)))) == a_blocks[:2]
    # the next allocation evicts the least recently used cached block: a's tail (freed first)
    c = make_seq([50])
    compute(bm, c)
    assert c.block_table == [a_blocks[1]]
    assert bm.match_prefix(make_seq(list(range(9)))) == a_blocks[:1]
    assert bm.num_evictions == 1
    # a hit takes a block out of the evictable pool: it cannot be evicted while in use
    d = make_seq(list(range(9)))
    bm.attach_prefix(d, bm.match_prefix(d))
    assert bm.ref_counts[a_blocks[0]] == 1
    assert_consistent(bm, [b, c, d])


def test_swap_out_and_in_keeps_sharing():
    bm = BlockManager(8, BS, num_cpu_blocks=8)
    parent = make_seq(list(range(6)))
    compute(bm, parent)
    child = parent.fork(1)
    bm.fork(parent, child)
    gpu_tables = [list(parent.block_table), list(child.block_table)]
    assert bm.can_swap_out([parent, child])
    out_map = bm.swap_out([parent, child])
    assert sorted(out_map) == sorted(gpu_tables[0])  # shared blocks copied once
    assert bm.num_free_blocks == 8 and bm.num_free_cpu_blocks == 6
    assert parent.block_table == child.block_table == [out_map[b] for b in gpu_tables[0]]
    assert all(bm.cpu_ref_counts[c] == 2 for c in parent.block_table)
    in_map = bm.swap_in([parent, child])
    assert sorted(in_map) == sorted(out_map.values())
    assert bm.num_free_cpu_blocks == 8 and bm.num_used_blocks == 2
    assert parent.block_table == child.block_table
    assert_consistent(bm, [parent, child])


def test_swap_maps_shared_across_groups_in_one_step():
    bm = BlockManager(8, BS, num_cpu_blocks=8)
    a = make_seq(list(range(9)))
    compute(bm, a)
    b = make_seq(list(range(9)))  # another request with the same prefix: shares 2 cached blocks
    bm.attach_prefix(b, bm.match_prefix(b))
    compute(bm, b)
    step_map: dict[int, int] = {}
    bm.swap_out([a], step_map)
    bm.swap_out([b], step_map)
    # one GPU block never maps to two CPU blocks: the shared prefix has one CPU copy
    assert a.block_table[:2] == b.block_table[:2]
    assert len(step_map) == 4 and bm.num_free_cpu_blocks == 4
    in_map: dict[int, int] = {}
    bm.swap_in([a], in_map)
    bm.swap_in([b], in_map)
    assert a.block_table[:2] == b.block_table[:2] and bm.num_used_blocks == 4
    assert_consistent(bm, [a, b])


@pytest.mark.parametrize("caching", [True, False])
def test_random_alloc_free_never_leaks(caching):
    rng = random.Random(1)
    bm = BlockManager(40, BS, enable_prefix_caching=caching)
    live: list[Sequence] = []
    for _ in range(400):
        if live and (rng.random() < 0.3 or bm.num_free_blocks < 4):
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            s = make_seq([rng.randrange(3) for _ in range(rng.randrange(1, 12))])
            prefix = bm.match_prefix(s)
            if bm.can_append_slots([s], [s.num_tokens - len(prefix) * BS], [prefix]):
                bm.attach_prefix(s, prefix)
                compute(bm, s)
                live.append(s)
        assert_consistent(bm, live)
    for s in live:
        bm.free(s)
    assert bm.num_free_blocks == 40 and all(r == 0 for r in bm.ref_counts)
