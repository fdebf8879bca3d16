"""The persistent batch: the host side of a step's inputs, kept from step to step (vLLM v1's input batch).

A sequence takes a row of the batch (its *slot*) the first time it is scheduled and keeps it until it
finishes, is preempted or is swapped out. The device holds, per slot, the sequence's block table and its
sampling parameters (`ModelRunner`), so a step sends only what changed since the last one:

- the block-table entries that are new (a block every `block_size` tokens, a copy-on-write replacement,
  the whole table of a sequence that joins), as (slot * width + index, block) pairs;
- the sampling parameters of the sequences that join (temperature, top-k, top-p, seed);
- the step's own token-level inputs, which change every step anyway: token ids, positions, cache slots,
  and per sequence its slot, context length and query offsets; per sampled row the row it samples from,
  its slot, its completion offset (n > 1) and its draw index (the sequence's output tokens so far).

All of it is packed into one int64 array in a pinned buffer (`Layout` says where each field lives), so
the upload is one host-to-device copy. A decode step (one token per sequence) whose size has a CUDA graph
is packed at the graph's size, padded with rows that read and write only the scratch block, so the graph
reads its inputs at fixed addresses. Two staging buffers alternate: the host fills one while the copy from
the other may still be queued behind the step before (asynchronous scheduling keeps one step in flight).

`StepInputs` is everything a rank needs to run the step (tensor parallelism sends it to the other ranks);
`StepSamples` is what only the first rank, which reads the sampled tokens back, needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from nanoforge.model.sampling import SEED_MOD, random_seed
from nanoforge.serve.scheduler import SchedulerOutput
from nanoforge.serve.sequence import Sequence, SequenceStatus

TOKEN_FIELDS = ("ids", "positions", "slots", "token_src")  # one per token of the step
SEQ_FIELDS = ("row_slot", "sample_row", "sample_slot", "seed_offset", "draw")  # one per sequence / sampled row
TABLE_UPDATE_WORDS = 2  # flat index into the (slots, width) table, block id
PARAM_UPDATE_WORDS = 5  # slot, top_k, seed, temperature (float64 bits), top_p (float64 bits)


def _even(words: int) -> int:
    return words + (words & 1)


class Layout:
    """Offsets of a step's fields in the packed int64 array, for `t` token rows and `s` sequence rows.

    Context lengths and query offsets (int32, as the attention kernels take them) are packed two to a word.
    Every field starts on a 16-byte boundary (an even word): Triton specializes a kernel on its pointers'
    16-byte alignment, so fields whose alignment changed with the step's sizes compiled new kernel variants
    mid-run (~0.7 s each on the H200). The same layout views a numpy array (the host fills it) or a torch
    tensor (the device reads it)."""

    def __init__(self, t: int, s: int):
        self.t, self.s = t, s
        self.spans: dict[str, tuple[int, int]] = {}
        off = 0
        for name, n in [(name, t) for name in TOKEN_FIELDS] + [(name, s) for name in SEQ_FIELDS]:
            self.spans[name] = (off, n)
            off += _even(n)
        self.int32_spans = {"seq_lens": (off, s), "cu_seqlens": (off + _even((s + 1) // 2), s + 1)}
        self.size = off + _even((s + 1) // 2) + (s + 2) // 2

    def views(self, buf) -> dict:
        """Each field of `buf` (numpy int64 or torch int64, at least `size` long) as a view."""
        out = {name: buf[a:a + n] for name, (a, n) in self.spans.items()}
        i32 = np.int32 if isinstance(buf, np.ndarray) else torch.int32
        for name, (a, n) in self.int32_spans.items():
            out[name] = buf[a:a + (n + 1) // 2].view(i32)[:n]
        return out


@dataclass
class StepInputs:
    """One step for the device: the packed inputs and the block operations to run first."""

    layout: Layout
    packed: torch.Tensor  # int64 (pinned on a GPU machine): layout.size words, then the updates
    num_table_updates: int
    num_param_updates: int
    num_tokens: int
    num_seqs: int
    num_samples: int
    max_q_len: int
    table_width: int  # block-table columns the step's attention reads
    graph: str | None  # "decode": padded to a decode graph's batch (layout.t = layout.s); "prefill": to a token
    # bucket (layout.t) and every sequence slot (layout.s); None: run eagerly at its own size
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    needs_filter: bool = False  # some sampled row has top-k or top-p
    stop: bool = False  # tensor parallelism: the first rank is shutting down


@dataclass
class StepSamples:
    """The first rank's view of the step's sampled rows and scored prompt positions, in row order."""

    seqs: list[tuple[Sequence, int]]  # per sampled row: its sequence and the completion offset j (n > 1 forks)
    logprob_rows: list[int]  # sampled rows that asked for logprobs
    score_rows: list[int]  # flattened token rows whose logits score a prompt token
    score_targets: list[int]  # the prompt token each of those scores
    scored: list  # (ScheduledSeq, number of score rows), in row order


class InputBatch:
    def __init__(self, *, max_num_seqs: int, block_size: int, max_blocks_per_seq: int, scratch_block: int,
                 max_num_tokens: int, graph_sizes: list[int], pin_memory: bool, prefill_buckets=(),
                 seed_source=None):
        self.block_size = block_size
        self.width = max_blocks_per_seq
        self.scratch_slot = max_num_seqs  # the device's extra row: a table of scratch blocks, greedy params
        self.scratch_cache_slot = scratch_block * block_size
        # The scratch's second slot (the cache holds at least two past `scratch_block`'s first): where a bucket's
        # padding tokens beyond the one each padding sequence takes write their keys. No sequence owns them, so their
        # attention rows are never computed (garbage, NaN at times) and nothing reads that slot; the first, which
        # padding sequences read, holds only finite keys.
        self.spare_cache_slot = self.scratch_cache_slot + 1
        self.graph_sizes = sorted(graph_sizes)
        self.prefill_buckets = sorted(prefill_buckets)
        self._free = list(range(max_num_seqs - 1, -1, -1))  # pop() hands out the lowest slot
        self._slot_of: dict[int, int] = {}  # seq_id -> slot
        self._seq: list[Sequence | None] = [None] * max_num_seqs
        self._table_obj: list[list[int] | None] = [None] * max_num_seqs  # the block_table list the device mirrors
        self._mirror: list[list[int]] = [[] for _ in range(max_num_seqs)]  # the leading table entries it holds
        self._seed_source = seed_source or random_seed
        self.max_num_tokens = max(max_num_tokens, self.graph_sizes[-1] if self.graph_sizes else 0)
        self.max_num_seqs = max(max_num_seqs, self.graph_sizes[-1] if self.graph_sizes else 0)
        self._pin = pin_memory
        size = Layout(self.max_num_tokens, self.max_num_seqs).size
        self._staging = [self._alloc(size + 1024), self._alloc(size + 1024)]
        self._turn = 0

    # --- slots ---------------------------------------------------------------------------------------------

    @property
    def num_active(self) -> int:
        return len(self._slot_of)

    def slot(self, seq: Sequence) -> int | None:
        return self._slot_of.get(seq.seq_id)

    def _release_departed(self) -> None:
        """Free the slots of sequences that finished, were preempted or swapped out since the last step."""
        for seq_id, slot in list(self._slot_of.items()):
            if self._seq[slot].status is not SequenceStatus.RUNNING:
                del self._slot_of[seq_id]
                self._seq[slot] = self._table_obj[slot] = None
                self._free.append(slot)

    def _join(self, seq: Sequence, params: list) -> int:
        slot = self._free.pop()
        self._slot_of[seq.seq_id] = slot
        self._seq[slot] = seq
        p = seq.sampling_params
        seed = (p.seed + seq.index) % SEED_MOD if p.seed is not None else self._seed_source()
        params.append((slot, max(p.top_k, 0), seed, float(p.temperature), float(p.top_p)))
        return slot

    def _table_updates(self, seq: Sequence, slot: int, first_written: int, updates: list) -> None:
        """Queue the entries of the sequence's block table that the device does not hold yet."""
        table = seq.block_table
        mirror = self._mirror[slot]
        if table is not self._table_obj[slot]:  # joined, or its table was rebuilt: send it all
            self._table_obj[slot] = table
            mirror.clear()
        base = slot * self.width
        if first_written < len(mirror) and mirror[first_written] != table[first_written]:  # copy-on-write
            mirror[first_written] = table[first_written]
            updates += (base + first_written, table[first_written])
        for j in range(len(mirror), len(table)):
            mirror.append(table[j])
            updates += (base + j, table[j])

    # --- the step ------------------------------------------------------------------------------------------

    def prepare(self, out: SchedulerOutput, pending: dict[int, int] | None = None) -> tuple[StepInputs, StepSamples]:
        """Pack the step's inputs. `pending` maps the seq_id of a sequence whose last token is still on the
        device (sampled by the step in flight) to that token's row in the device's sampled-token buffer."""
        self._release_departed()
        pending = pending or {}
        bs = self.block_size
        ids, pos, slots, src = [], [], [], []
        row_slot, seq_lens, cu = [], [], [0]
        sample_row, sample_slot, seed_off, draw = [], [], [], []
        samples, logprob_rows = [], []
        score_rows, score_targets, scored = [], [], []
        table_updates, params = [], []
        width, max_q, needs_filter = 1, 1, False
        slot_of, table_updates_of = self._slot_of, self._table_updates
        for item in out.scheduled:
            seq = item.seq
            slot = slot_of.get(seq.seq_id)
            if slot is None:
                slot = self._join(seq, params)
            start = item.start
            end = start + item.num_tokens
            table_updates_of(seq, slot, start // bs, table_updates)
            table = seq.block_table
            if len(table) > width:
                width = len(table)
            token_ids = seq.token_ids
            if seq.prompt_logprobs is not None and item.scored_positions:
                positions = item.scored_positions
                score_rows += [cu[-1] + p - start for p in positions]
                score_targets += token_ids[positions.start + 1:positions.stop + 1]
                scored.append((item, len(positions)))
            known = min(end, len(token_ids))
            if end - start == 1:
                pos.append(start)
                slots.append(table[start // bs] * bs + start % bs)
                if known > start:
                    ids.append(token_ids[start])
                    src.append(-1)
                else:  # the token the step in flight samples: the device fills it in
                    ids.append(0)
                    src.append(pending[seq.seq_id])
            else:
                max_q = max(max_q, end - start)
                ids += token_ids[start:known]
                src += [-1] * (known - start)
                if known < end:
                    ids.append(0)
                    src.append(pending[seq.seq_id])
                pos += range(start, end)
                slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            row_slot.append(slot)
            seq_lens.append(end)
            row = cu[-1] + end - start
            cu.append(row)
            if not item.num_samples:
                continue
            p = seq.sampling_params
            drawn = len(token_ids) - seq.num_prompt_tokens + (known < end)  # the sequence's output tokens so far
            needs_filter |= (p.top_k > 0 or p.top_p < 1.0) and p.temperature > 0
            for j in range(item.num_samples):
                if p.logprobs is not None:
                    logprob_rows.append(len(sample_row))
                sample_row.append(row - 1)
                sample_slot.append(slot)
                seed_off.append(j)
                draw.append(drawn)
                samples.append((seq, j))
        n_tok, n_seq = len(ids), len(row_slot)
        graph = None
        if bool(self.graph_sizes) and max_q == 1 and n_tok == n_seq == len(sample_row) \
                and n_seq <= self.graph_sizes[-1] and not scored:
            graph = "decode"
            size = next(g for g in self.graph_sizes if g >= n_seq)
            layout = Layout(size, size)
        elif self.prefill_buckets and 0 < n_tok <= self.prefill_buckets[-1] and not scored \
                and max(n_seq, len(sample_row)) <= self.max_num_seqs:
            graph = "prefill"  # (`_pad`: padding sequences past the padding tokens have none, skipped by attention)
            layout = Layout(next(t for t in self.prefill_buckets if t >= n_tok), self.max_num_seqs)
        else:
            layout = Layout(n_tok, max(n_seq, len(sample_row)))
        total = layout.size + TABLE_UPDATE_WORDS * (len(table_updates) // 2) + PARAM_UPDATE_WORDS * len(params)
        packed = self._buffer(total)
        buf = packed.numpy()
        v = layout.views(buf)
        for name, values in (("ids", ids), ("positions", pos), ("slots", slots), ("token_src", src),
                             ("row_slot", row_slot), ("seq_lens", seq_lens), ("cu_seqlens", cu),
                             ("sample_row", sample_row), ("sample_slot", sample_slot), ("seed_offset", seed_off),
                             ("draw", draw)):
            v[name][:len(values)] = values
        n_samp = len(sample_row)
        if layout.t > n_tok or layout.s > n_seq or layout.s > n_samp:
            self._pad(v, layout, n_tok, n_seq, n_samp)
        a = layout.size
        if table_updates:
            buf[a:a + len(table_updates)] = table_updates
            a += len(table_updates)
        if params:
            rows = buf[a:a + PARAM_UPDATE_WORDS * len(params)].reshape(len(params), PARAM_UPDATE_WORDS)
            rows[:, :3] = [q[:3] for q in params]
            rows[:, 3:].view(np.float64)[:] = [q[3:] for q in params]
        step = StepInputs(layout, packed, len(table_updates) // 2, len(params), n_tok, n_seq, n_samp, max_q,
                          width, graph, list(out.blocks_to_swap_out.items()), list(out.blocks_to_swap_in.items()),
                          list(out.blocks_to_copy), needs_filter)
        return step, StepSamples(samples, logprob_rows, score_rows, score_targets, scored)

    def idle(self, layout: Layout) -> np.ndarray:
        """Packed inputs whose every row is padding (what a graph is captured with)."""
        buf = np.zeros(layout.size, dtype=np.int64)
        self._pad(layout.views(buf), layout, 0, 0, 0)  # (cu_seqlens[0], the sequences' start, is 0)
        return buf

    def _pad(self, v: dict, layout: Layout, n_tok: int, n_seq: int, n_samp: int) -> None:
        """Every row of `layout` past the step's own n_tok tokens, n_seq sequences and n_samp sampled rows a padding
        row, reading and writing only the scratch block: a padding token is token 0 at position 0; a padding
        sequence (the scratch slot's table, context 1) takes one padding token while there are some (a decode
        graph's: all), then none; tokens beyond those belong to no sequence (their attention rows are never
        computed) and write the scratch block's spare slot, so the slot padding sequences read holds only their
        keys; a padding sampled row samples a row some sequence owns (greedy, never read back)."""
        pad_t, pad_s = layout.t - n_tok, layout.s - n_seq
        owned = n_tok + min(pad_s, pad_t)
        v["ids"][n_tok:] = v["positions"][n_tok:] = 0
        v["slots"][n_tok:owned] = self.scratch_cache_slot
        v["slots"][owned:] = self.spare_cache_slot
        v["token_src"][n_tok:] = -1
        v["row_slot"][n_seq:] = self.scratch_slot
        v["seq_lens"][n_seq:] = 1
        v["cu_seqlens"][n_seq + 1:] = n_tok + np.minimum(np.arange(1, pad_s + 1), pad_t)
        v["sample_row"][n_samp:] = np.arange(n_samp, layout.s) % layout.t
        v["sample_slot"][n_samp:] = self.scratch_slot
        v["seed_offset"][n_samp:] = v["draw"][n_samp:] = 0

    # --- staging buffers -----------------------------------------------------------------------------------

    def _alloc(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.int64, pin_memory=self._pin)

    def _buffer(self, n: int) -> torch.Tensor:
        """The next staging buffer, at least n words; the other one may still be queued for its copy."""
        self._turn ^= 1
        if self._staging[self._turn].numel() < n:
            self._staging[self._turn] = self._alloc(max(n, math.ceil(self._staging[self._turn].numel() * 1.5)))
        return self._staging[self._turn][:n]
