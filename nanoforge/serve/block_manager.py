"""The paged KV cache's bookkeeping: block ids, reference counts, prefix cache, swap.

The model runner preallocates the KV cache as `num_blocks` blocks of
`block_size` token slots each (and, for swapping, `num_cpu_blocks` blocks in
pinned CPU memory). This class never touches those tensors: it decides which
block ids each sequence uses and reports the copies the runner must make.

- Block tables. A sequence's `block_table[i]` is the block holding its
  positions i*block_size .. (i+1)*block_size-1. Blocks are taken lazily, one at
  a time, as the sequence's computed tokens cross a block boundary, so at most
  the last block of a sequence is partly empty (utilisation stays high).
- Reference counts. A block may appear in several tables (forked sequences of
  an n > 1 request; requests with a common prefix). It is free when its count
  drops to zero.
- Copy-on-write. A write goes to position `num_computed_tokens`; if that
  position lies in an existing block that another table also holds, the writer
  gets a fresh block and the runner is told to copy (src, dst) before the step.
  Only a partly filled last block can be hit this way: full blocks are never
  written again.
- Prefix caching. A full, computed block is registered under a chained hash:
  key_i = blake2b(key_{i-1} || tokens of block i), so a key names the whole
  prefix up to and including its block (and is stable across processes, so it
  can serve as a cluster-wide key). A new sequence walks its keys from the
  first block and reuses every block it finds, after checking the stored token
  ids and parent key (a hash collision can never serve wrong KV). It reuses
  blocks covering at most num_tokens - 1 tokens: the last token is always
  computed, because its logits give the next token. Freed blocks that are
  registered keep their contents and their key, in LRU order, until a new
  allocation needs them; registering happens only after the runner has
  computed the block (`cache_computed_blocks`, called after each step), so a
  hit never reads a block that is still being written. A KV connector
  (`serve/kv_connector.py`) registers blocks it loaded from the cluster's pool
  the same way (`add_cached_block`), so the scheduler finds them like any hit.
- Swapping. `swap_out` moves a group's blocks to CPU blocks (shared blocks map
  once, keeping the sharing) and reports {gpu: cpu}; `swap_in` does the
  reverse and reports {cpu: gpu}. The runner executes, before the forward pass
  of the step they were reported for: swap-outs, then swap-ins, then copies.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Sequence as Seq

from nanoforge.serve.sequence import Sequence


def hash_block_tokens(parent_hash: int | None, token_ids: Seq[int]) -> int:
    """Chained prefix key of one full block: 8-byte blake2b of the parent key and the int64 token ids."""
    parent = b"" if parent_hash is None else parent_hash.to_bytes(8, "little")
    data = parent + struct.pack(f"<{len(token_ids)}q", *token_ids)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def prefix_block_hashes(token_ids: Seq[int], block_size: int, num_blocks: int | None = None,
                        hashes: list[int] | None = None) -> list[int]:
    """Keys of the first `num_blocks` (default: all) full blocks of a token sequence.

    `hashes`, when given, holds keys already computed for this sequence; it is
    extended in place and returned (it may then hold more than num_blocks keys).
    """
    hashes = [] if hashes is None else hashes
    n = len(token_ids) // block_size if num_blocks is None else num_blocks
    for i in range(len(hashes), n):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, token_ids[i * block_size:(i + 1) * block_size]))
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, num_cpu_blocks: int = 0,
                 enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # count 0, no cached content
        self._evictable: OrderedDict[int, None] = OrderedDict()  # count 0, cached content; least recently used first
        self._cached: dict[int, int] = {}  # prefix key -> block id
        # what a registered block holds: (key, parent key, token ids), for verification on a hit
        self._content: list[tuple[int, int | None, tuple[int, ...]] | None] = [None] * num_blocks
        self.cpu_ref_counts = [0] * num_cpu_blocks
        self._cpu_free: deque[int] = deque(range(num_cpu_blocks))
        self.num_evictions = 0  # cached blocks reused for new contents

    # ---- queries ---------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: never-used/freed ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self._cpu_free)

    def free_block_ids(self) -> set[int]:
        return set(self._free) | set(self._evictable)

    def free_cpu_block_ids(self) -> set[int]:
        return set(self._cpu_free)

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Verified cached blocks holding the longest prefix of `seq` (which must hold no blocks yet)."""
        assert not seq.block_table, "prefix matching is for a sequence that holds no blocks"
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        num_candidates = (seq.num_tokens - 1) // bs
        hashes = self._block_hashes(seq, num_candidates)
        blocks: list[int] = []
        parent = None
        for i in range(num_candidates):
            key = hashes[i]
            block = self._cached.get(key)
            if block is None:
                break
            stored_key, stored_parent, stored_tokens = self._content[block]
            if stored_parent != parent or stored_tokens != tuple(seq.token_ids[i * bs:(i + 1) * bs]):
                break  # a hash collision: never serve another prefix's KV
            blocks.append(block)
            parent = key
        return blocks

    def num_blocks_needed(self, seqs: Seq[Sequence], num_new_tokens: Seq[int],
                          prefixes: Seq[list[int]] | None = None) -> int:
        """Free blocks consumed if each seqs[i] attaches prefixes[i] and then appends num_new_tokens[i] slots.

        Counts fresh blocks, copy-on-write copies (a partly filled block shared
        by k of these sequences costs at most k - 1 copies: the last writer keeps
        it) and cached blocks that a prefix takes out of the evictable pool.
        """
        bs = self.block_size
        need = 0
        refs_left: dict[int, int] = {}  # shared write blocks: references not yet copied away
        revived: set[int] = set()
        for i, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
            prefix = prefixes[i] if prefixes is not None else None
            if prefix:
                for b in prefix:
                    if self.ref_counts[b] == 0 and b not in revived:
                        revived.add(b)
                        need += 1
                table_len, computed = len(prefix), len(prefix) * bs
            else:
                table_len, computed = len(seq.block_table), seq.num_computed_tokens
            need += max(0, -(-(computed + n) // bs) - table_len)
            if computed % bs:  # the first write lands in an existing, partly filled block
                block = seq.block_table[computed // bs]
                refs = refs_left.get(block, self.ref_counts[block])
                if refs > 1:
                    need += 1
                    refs_left[block] = refs - 1
        return need

    def can_append_slots(self, seqs: Seq[Sequence], num_new_tokens: Seq[int],
                         prefixes: Seq[list[int]] | None = None, reserve: int = 0) -> bool:
        """Whether `num_blocks_needed` blocks are free with `reserve` blocks to spare."""
        return self.num_blocks_needed(seqs, num_new_tokens, prefixes) + reserve <= self.num_free_blocks

    # ---- allocation -----------------------------------------------------

    def attach_prefix(self, seq: Sequence, blocks: list[int]) -> None:
        """Give `seq` the cached `blocks` from `match_prefix`: their tokens count as computed."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        for b in blocks:
            self._acquire(b)
        seq.block_table = list(blocks)
        seq.num_computed_tokens = seq.num_cached_tokens = len(blocks) * self.block_size
        seq.num_hashed_blocks = len(blocks)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make slots for positions [num_computed_tokens, + num_new_tokens); return the (src, dst) copies to run first.

        The caller checks `can_append_slots` first; running out here is a bug.
        """
        bs = self.block_size
        start = seq.num_computed_tokens
        copies = []
        if start % bs:
            i = start // bs
            src = seq.block_table[i]
            if self.ref_counts[src] > 1:  # copy-on-write: others keep src, we write into a copy
                dst = self._allocate_block()
                self.ref_counts[src] -= 1
                seq.block_table[i] = dst
                copies.append((src, dst))
        for _ in range(-(-(start + num_new_tokens) // bs) - len(seq.block_table)):
            seq.block_table.append(self._allocate_block())
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent`."""
        for b in parent.block_table:
            self.ref_counts[b] += 1
        child.block_table = list(parent.block_table)

    def free(self, seq: Sequence) -> None:
        """Release the GPU blocks of `seq` (and forget its progress into the cache)."""
        self._release(seq.block_table)
        seq.block_table = []
        seq.num_hashed_blocks = 0

    def cache_computed_blocks(self, seq: Sequence, upto: int | None = None) -> None:
        """Register the full blocks of `seq` that the runner has now computed (its first `upto` tokens, when a
        later step is already scheduled), unless their key is already cached."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens, seq.num_tokens if upto is None else upto) // bs
        if num_full <= seq.num_hashed_blocks:
            return
        hashes = self._block_hashes(seq, num_full)
        for i in range(seq.num_hashed_blocks, num_full):
            block, key = seq.block_table[i], hashes[i]
            if self._content[block] is None and key not in self._cached:
                self._content[block] = (key, hashes[i - 1] if i else None, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
                self._cached[key] = block
        seq.num_hashed_blocks = num_full

    def add_cached_block(self, key: int, parent: int | None, token_ids: Seq[int]) -> int | None:
        """Register a block whose contents come from elsewhere (the KV pool) under `key`: unreferenced and most
        recently used, as if a sequence had just computed and freed it. Returns its id for the caller to fill
        before the next step, or None if `key` is cached already or no block is free."""
        if not self.enable_prefix_caching or key in self._cached or not self.num_free_blocks:
            return None
        block = self._allocate_block()
        self.ref_counts[block] = 0
        self._content[block] = (key, parent, tuple(token_ids))
        self._cached[key] = block
        self._evictable[block] = None
        return block

    # ---- swapping -------------------------------------------------------

    def can_swap_out(self, seqs: Seq[Sequence]) -> bool:
        return len({b for s in seqs for b in s.block_table}) <= len(self._cpu_free)

    def swap_out(self, seqs: Seq[Sequence], mapping: dict[int, int] | None = None) -> dict[int, int]:
        """Move the blocks of `seqs` (one group) to CPU blocks; return {gpu block: cpu block}.

        Pass the step's map as `mapping` when several groups swap out in one
        step: a block that two groups share (a common prefix) is then copied
        once and its CPU copy shared, instead of one GPU block mapping to two
        CPU blocks.
        """
        mapping = {} if mapping is None else mapping
        for seq in seqs:
            cpu_table = []
            for b in seq.block_table:
                if b not in mapping:
                    mapping[b] = self._cpu_free.popleft()
                self.cpu_ref_counts[mapping[b]] += 1
                cpu_table.append(mapping[b])
            self.free(seq)
            seq.block_table = cpu_table
        return mapping

    def can_swap_in(self, seqs: Seq[Sequence], reserve: int = 0) -> bool:
        return len({b for s in seqs for b in s.block_table}) + reserve <= self.num_free_blocks

    def swap_in(self, seqs: Seq[Sequence], mapping: dict[int, int] | None = None) -> dict[int, int]:
        """Move the CPU blocks of `seqs` back to fresh GPU blocks; return {cpu block: gpu block}.

        `mapping` as in `swap_out`. The new blocks are registered in the prefix
        cache after the next step, like any other computed block.
        """
        mapping = {} if mapping is None else mapping
        for seq in seqs:
            gpu_table = []
            for c in seq.block_table:
                if c not in mapping:
                    mapping[c] = self._allocate_block()
                else:
                    self.ref_counts[mapping[c]] += 1
                gpu_table.append(mapping[c])
            self.free_swapped(seq)
            seq.block_table = gpu_table
        return mapping

    def free_swapped(self, seq: Sequence) -> None:
        """Release the CPU blocks of a swapped-out `seq`."""
        for c in seq.block_table:
            self.cpu_ref_counts[c] -= 1
            assert self.cpu_ref_counts[c] >= 0, f"cpu block {c} freed twice"
            if self.cpu_ref_counts[c] == 0:
                self._cpu_free.append(c)
        seq.block_table = []
        seq.num_hashed_blocks = 0

    # ---- metrics --------------------------------------------------------

    def stats(self) -> dict:
        return {
            "kv_blocks_total": self.num_blocks,
            "kv_blocks_used": self.num_used_blocks,
            "kv_blocks_free": self.num_free_blocks,
            "kv_blocks_cached_free": len(self._evictable),
            "cpu_blocks_total": self.num_cpu_blocks,
            "cpu_blocks_used": self.num_cpu_blocks - len(self._cpu_free),
            "prefix_cache_evictions": self.num_evictions,
        }

    # ---- internals ------------------------------------------------------

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """`seq.block_hashes`, extended to hold at least its first `num_blocks` keys (each computed once)."""
        return prefix_block_hashes(seq.token_ids, self.block_size, num_blocks, seq.block_hashes)

    def _allocate_block(self) -> int:
        """A block with count 1: a never-cached free one if any, else the least recently used cached one."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            key = self._content[block][0]
            del self._cached[key]
            self._content[block] = None
            self.num_evictions += 1
        self.ref_counts[block] = 1
        return block

    def _acquire(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self._evictable[block]
        self.ref_counts[block] += 1

    def _release(self, blocks: list[int]) -> None:
        # Last block first: a sequence's tail is then evicted before its head,
        # which more requests are likely to share.
        for b in reversed(blocks):
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] >= 0, f"block {b} freed twice"
            if self.ref_counts[b] == 0:
                if self._content[b] is not None:
                    self._evictable[b] = None
                else:
                    self._free.append(b)
