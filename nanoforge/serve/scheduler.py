"""Continuous batching: which sequences compute which tokens in the next step.

Each step the engine calls `schedule()`, runs the model on the chunks it
returns, and reports the sampled tokens with `update()`. `schedule()` counts
the chunks as computed and their samples as pending (`Sequence.num_pending`)
at once, so with asynchronous scheduling the next `schedule()` may run before
this step's `update()`: it plans a one-token decode over each pending token,
whose id the runner takes from the device. A sequence that stops at step n
after being scheduled in step n + 1 simply has that chunk ignored by `update()`. Sequences join and
leave the batch at every step (continuous batching), within two budgets: at
most `max_num_batched_tokens` tokens and `max_num_seqs` sequences.

One step, in order (vLLM's scheduler, v1-style unified chunks):

1. Running groups, oldest first. Every unfinished sequence gets a chunk of
   its uncomputed tokens: one token when decoding, up to the remaining budget
   when prefilling (chunked prefill: a long prompt is spread over several
   steps). Decodes keep going meanwhile: the groups that are decoding arrived
   before the one still prefilling, so they are served first.
   If the KV cache has no room for a group's chunks, the running group that
   arrived last is preempted, all its sequences at once, and we retry;
   preempting by arrival order means the oldest request always progresses,
   so nothing starves. A group that cannot fit even alone (it needs more
   blocks than the whole cache) finishes with reason "error".
   Preemption either recomputes (free the blocks; the group goes back to the
   front of the waiting queue and later prefills prompt + generated tokens)
   or swaps (its blocks move to the CPU pool and back later; falls back to
   recomputation when the CPU pool is full).
2. Swapped groups, first in first out, if nothing was preempted or left out
   in step 1 and their blocks fit with a little room to grow.
3. Waiting groups, first in first out, under the same condition and while
   their first chunk fits, keeping `watermark` of the cache free for the
   running groups to grow into. The head of the queue blocks those behind it.

Prefix caching: a sequence that holds no KV yet starts from the longest
cached prefix of its tokens (`BlockManager.match_prefix`); only the rest is
computed. Forked siblings recomputed after a preemption prefill one at a
time, so the later ones find the first one's prompt blocks in the cache.
A request that asks for prompt logprobs needs the logits at every prompt
position, so it takes cached blocks only over positions it has already
scored: none when it is new (vLLM does the same), what it had computed when
it is recomputed after a preemption. Its own blocks are cached as usual.

Prompt logprobs: each chunk's `scored_positions` are the positions whose
logits the runner turns into logprobs of the next prompt token; `update()`
appends them to the sequence. A `max_tokens=0` request samples nothing: it
finishes ("length") in the step that computes the end of its prompt.

Parallel sampling (n > 1): the group's one sequence prefills; its last chunk
is scheduled with `num_samples = n`, and `schedule()` forks n - 1 children
sharing its blocks (`ScheduledSeq.targets`); `update()` appends one of the n
sampled tokens to each.

Decode fast path: when the last full pass decoded every running sequence and
nobody has joined or left since, `schedule()` repeats those decodes without
planning (`_repeat_decodes`), which is what the full pass would build.

The runner executes a `SchedulerOutput` as: swap-outs, swap-ins, copies (all
before the forward pass, in that order), then the forward pass over
`scheduled`, then sampling for the chunks with `num_samples > 0`.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from dataclasses import dataclass, field

from nanoforge.errors import NanoforgeError
from nanoforge.serve.block_manager import BlockManager
from nanoforge.serve.sequence import Sequence, SequenceGroup, SequenceStatus, check_stop

PREEMPTION_MODES = ("recompute", "swap")


@dataclass(kw_only=True)
class SchedulerConfig:
    max_model_len: int  # most tokens (prompt + output) a sequence may hold
    num_gpu_blocks: int  # size of the runner's KV cache, in blocks
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192  # per step; also the largest prefill chunk
    block_size: int = 16
    num_cpu_blocks: int = 0  # swap space, in blocks
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    watermark: float = 0.01  # fraction of the cache that admitting new requests leaves free
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int | None = None  # when set, add() rejects out-of-vocabulary prompt token ids

    def __post_init__(self):
        for name in ("max_model_len", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise NanoforgeError(f"{name} must be >= 1, got {getattr(self, name)}", param=name)
        if self.num_cpu_blocks < 0:
            raise NanoforgeError(f"num_cpu_blocks must be >= 0, got {self.num_cpu_blocks}", param="num_cpu_blocks")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise NanoforgeError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}",
                                 param="preemption_mode")
        if self.preemption_mode == "swap" and self.num_cpu_blocks == 0:
            raise NanoforgeError("preemption_mode='swap' needs num_cpu_blocks > 0", param="num_cpu_blocks")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise NanoforgeError(f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) "
                                 f"must be >= max_model_len ({self.max_model_len})", param="max_num_batched_tokens")
        if not 0 <= self.watermark < 1:
            raise NanoforgeError(f"watermark must be in [0, 1), got {self.watermark}", param="watermark")
        self.eos_token_ids = tuple(self.eos_token_ids)


def check_request(cfg: SchedulerConfig, group: SequenceGroup) -> None:
    """Raise NanoforgeError (naming the field) if `group` is invalid or can never fit in an engine of `cfg`.
    `Scheduler.add` checks this; so does the conductor before it routes a request, for the same errors."""
    prompt = group.prompt_token_ids
    if not prompt:
        raise NanoforgeError("prompt is empty", param="prompt")
    if len(prompt) > cfg.max_model_len:
        raise NanoforgeError(f"prompt has {len(prompt)} tokens, more than max_model_len={cfg.max_model_len}",
                             param="prompt")
    params = group.sampling_params
    if cfg.vocab_size is not None:
        for seq in group.seqs:  # the prompt, and a resumed request's tokens so far
            bad = min(seq.token_ids) if min(seq.token_ids) < 0 else max(seq.token_ids)
            if not 0 <= bad < cfg.vocab_size:
                raise NanoforgeError(f"prompt holds token id {bad}, outside the vocabulary of {cfg.vocab_size}",
                                     param="prompt")
    params.validate(cfg.vocab_size)
    if params.n > cfg.max_num_seqs:
        raise NanoforgeError(f"n={params.n} is more than max_num_seqs={cfg.max_num_seqs}", param="n")
    num_blocks = -(-len(prompt) // cfg.block_size)
    if num_blocks > cfg.num_gpu_blocks:
        raise NanoforgeError(f"prompt needs {num_blocks} KV-cache blocks but the cache holds {cfg.num_gpu_blocks}",
                             param="prompt")
    if group.resumed:
        indices = [seq.index for seq in group.seqs]
        if len(set(indices)) != len(indices) or not all(0 <= i < params.n for i in indices):
            raise NanoforgeError(f"outputs must name distinct completions in [0, n={params.n}), got {indices}",
                                 param="outputs")
        for seq in group.seqs:
            if not 0 < seq.num_output_tokens < params.max_tokens or seq.num_tokens >= cfg.max_model_len:
                raise NanoforgeError(f"outputs[{seq.index}] holds {seq.num_output_tokens} tokens: a resumed "
                                     f"completion needs at least one, fewer than max_tokens={params.max_tokens}, "
                                     f"and room in the context", param="outputs")
            if params.logprobs is not None and len(seq.output_logprobs) != seq.num_output_tokens:
                raise NanoforgeError(f"outputs[{seq.index}] needs one logprob entry per token (logprobs is set)",
                                     param="outputs")


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's work in a step: compute token_ids[start : start + num_tokens]."""

    seq: Sequence
    start: int  # first position to compute (the sequence's num_computed_tokens)
    num_tokens: int
    # 0: a prefill chunk that does not end the prompt, nothing to sample;
    # 1: sample the next token from the last position's logits;
    # n > 1: the prefill of an n-completion request ends here: sample n tokens (schedule() forks)
    num_samples: int
    targets: list[Sequence] = field(default_factory=list)  # the sequences the samples go to: seq, then its forks

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def is_decode(self) -> bool:
        """One query token and one sample: a plain decode (what CUDA-graph batches are made of)."""
        return self.num_tokens == 1 and self.num_samples == 1

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start:self.end]

    @property
    def scored_positions(self) -> range:
        """Positions of this chunk whose logits score a prompt token that has no logprob yet (prompt_logprobs):
        the logits at position p give the logprob of token p + 1."""
        seq = self.seq
        if seq.prompt_logprobs is None:
            return range(0)
        return range(max(self.start, len(seq.prompt_logprobs) - 1), min(self.end, seq.num_prompt_tokens - 1))

    @property
    def block_table(self) -> list[int]:
        """The sequence's block table (GPU block ids), valid until the next schedule()."""
        return self.seq.block_table

    def slot_mapping(self, block_size: int) -> list[int]:
        """Cache slot (block * block_size + offset) of each computed position, where the runner writes its K and V."""
        table = self.seq.block_table
        return [table[p // block_size] * block_size + p % block_size for p in range(self.start, self.end)]


@dataclass
class SchedulerOutput:
    """What the runner does this step, in this order: swap out, swap in, copy, then compute `scheduled`.

    The order matters: a block swapped out (or preempted) in this step may be
    handed to another sequence and written in the forward pass of the same step.
    """

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    blocks_to_swap_out: dict[int, int] = field(default_factory=dict)  # gpu block -> cpu block
    blocks_to_swap_in: dict[int, int] = field(default_factory=dict)  # cpu block -> gpu block
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) gpu blocks, copy-on-write
    finished: list[SequenceGroup] = field(default_factory=list)  # finished by this schedule(): reason "error"

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """Nothing for the runner to do (finished groups may still need reporting)."""
        return not (self.scheduled or self.blocks_to_swap_out or self.blocks_to_swap_in or self.blocks_to_copy)


@dataclass(slots=True)
class _Chunk:
    seq: Sequence
    prefix: list[int]  # cached blocks to attach first (a sequence that holds no KV yet)
    num_tokens: int


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.block_manager = BlockManager(config.num_gpu_blocks, config.block_size, config.num_cpu_blocks,
                                          config.enable_prefix_caching)
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []  # sorted by arrival
        self.swapped: deque[SequenceGroup] = deque()
        self._groups: dict[str, SequenceGroup] = {}  # every unfinished group, by request id
        self._arrival_order = itertools.count()
        self._watermark_blocks = int(config.watermark * config.num_gpu_blocks)
        self._decoding: list[Sequence] = []  # the last full pass's decodes, when it decoded every running sequence
        self._counters = dict.fromkeys(
            ("steps", "computed_tokens", "prompt_tokens", "cached_prompt_tokens", "preemptions", "swap_outs",
             "swap_ins", "blocks_swapped_out", "blocks_swapped_in", "blocks_copied"), 0)

    # ---- requests -------------------------------------------------------

    def add(self, group: SequenceGroup) -> None:
        """Queue a new request; raise NanoforgeError (naming the field) if it is invalid or can never fit."""
        if group.request_id in self._groups:
            raise NanoforgeError(f"request_id {group.request_id!r} is already in use", param="request_id")
        check_request(self.config, group)
        self.enqueue(group)

    def enqueue(self, group: SequenceGroup) -> None:
        """Queue a request that `check_request` has passed (a KV connector hands back what it loaded for)."""
        group.arrival_index = next(self._arrival_order)
        self._groups[group.request_id] = group
        self.waiting.append(group)

    def abort(self, request_id: str) -> SequenceGroup | None:
        """Finish a request with reason "abort" and free its blocks; None if it is unknown or already finished."""
        group = self._groups.get(request_id)
        if group is None:
            return None
        for seq in group.unfinished_seqs():
            self._finish_seq(seq, "abort")
        return self._retire(group)

    def finish_seq(self, seq: Sequence, reason: str = "stop") -> SequenceGroup | None:
        """Finish one sequence (the engine found a stop string); return its group if that finished the group."""
        if seq.is_finished:
            return None
        self._finish_seq(seq, reason)
        group = self._groups[seq.request_id]
        return self._retire(group) if group.is_finished else None

    def has_unfinished(self) -> bool:
        return bool(self._groups)

    def get_group(self, request_id: str) -> SequenceGroup | None:
        return self._groups.get(request_id)

    # ---- one step -------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = self._repeat_decodes()
        if out is None:
            out = SchedulerOutput()
            tokens_left = self.config.max_num_batched_tokens
            tokens_left, blocked = self._schedule_running(out, tokens_left)
            if not blocked:
                seqs_left = self.config.max_num_seqs - sum(g.num_reserved_seqs for g in self.running)
                tokens_left, seqs_left, blocked = self._schedule_swapped(out, tokens_left, seqs_left)
                if not blocked:
                    self._schedule_waiting(out, tokens_left, seqs_left)
            self._decoding = self._decodes_of_all_running(out)
        self._counters["blocks_copied"] += len(out.blocks_to_copy)
        self._counters["blocks_swapped_out"] += len(out.blocks_to_swap_out)
        self._counters["blocks_swapped_in"] += len(out.blocks_to_swap_in)
        return out

    def update(self, output: SchedulerOutput, sampled: dict[int, int | list[int]],
               logprobs: dict[int, list] | None = None,
               prompt_logprobs: dict[int, list] | None = None) -> list[SequenceGroup]:
        """Record a finished step: advance every scheduled chunk, append the sampled tokens, check stops.

        `sampled` maps seq_id to the token (or list of `num_samples` tokens) drawn
        for each chunk with num_samples > 0; `logprobs`, when given, maps seq_id
        to one runner-defined entry per sampled token; `prompt_logprobs` to one
        entry per position of the chunk's `scored_positions`. Returns the groups
        that finished in this step ("stop" / "length"; a max_tokens=0 request
        once its prompt is computed); their blocks are already free.
        """
        bm = self.block_manager
        eos, max_len = self.config.eos_token_ids, self.config.max_model_len
        finished = []
        computed = 0
        for item in output.scheduled:
            seq = item.seq
            if seq.status is SequenceStatus.FINISHED:
                continue  # aborted, or stopped by the engine or by its previous token, after schedule()
            if seq.status is SequenceStatus.RUNNING:  # (not preempted by a later schedule())
                bm.cache_computed_blocks(seq, item.end)
            computed += item.num_tokens
            if seq.prompt_logprobs is not None:
                self._record_prompt_logprobs(item, prompt_logprobs)
            if not item.num_samples:
                if item.end == seq.num_tokens:  # max_tokens=0: the prompt is all it asked for
                    self._finish_seq(seq, "length")
                    finished.append(self._retire(self._groups[seq.request_id]))
                continue
            tokens = sampled.get(seq.seq_id)
            tokens = [tokens] if isinstance(tokens, int) else tokens
            if tokens is None or len(tokens) != item.num_samples:
                raise RuntimeError(f"update(): sequence {seq.seq_id} needs {item.num_samples} sampled token(s), "
                                   f"got {tokens!r}")
            seq_logprobs = logprobs.get(seq.seq_id) if logprobs else None
            ended = False  # (only a sequence that ends here can end its group: the rest ended in earlier updates)
            for i, (target, token) in enumerate(zip(item.targets, tokens)):
                if target.status is SequenceStatus.FINISHED:
                    continue
                target.num_pending -= 1
                target.append_token(token, seq_logprobs[i] if seq_logprobs else None)
                reason = check_stop(target, eos, max_len)
                if reason:
                    self._finish_seq(target, reason)
                    ended = True
            if ended and (group := self._groups[seq.request_id]).is_finished:
                finished.append(self._retire(group))
        self._counters["computed_tokens"] += computed
        if output.scheduled:
            self._counters["steps"] += 1
        return finished

    @staticmethod
    def _record_prompt_logprobs(item: ScheduledSeq, prompt_logprobs: dict[int, list] | None) -> None:
        """Append the prompt logprobs of a chunk's `scored_positions` to its sequence's (which asked for them)."""
        seq = item.seq
        scored = seq.prompt_logprobs
        if len(scored) < seq.num_prompt_tokens and item.start > len(scored) - 1:
            raise RuntimeError(f"update(): sequence {seq.seq_id} computed from position {item.start} but scored "
                               f"only {len(scored) - 1} prompt positions: prompt logprobs would be skipped")
        if item.scored_positions:
            entries = (prompt_logprobs or {}).get(seq.seq_id)
            if entries is None or len(entries) != len(item.scored_positions):
                raise RuntimeError(f"update(): sequence {seq.seq_id} needs prompt logprobs for positions "
                                   f"{item.scored_positions}, got {entries!r:.200}")
            scored.extend(entries)

    # ---- the decode fast path --------------------------------------------

    def _decodes_of_all_running(self, out: SchedulerOutput) -> list[Sequence]:
        """The sequences of `out` if it is one plain decode of every running sequence and nothing else."""
        if out.finished or out.blocks_to_copy or out.blocks_to_swap_in or out.blocks_to_swap_out or \
                not all(item.is_decode for item in out.scheduled):
            return []
        if len(out.scheduled) != sum(len(g.unfinished_seqs()) for g in self.running):
            return []
        return [item.seq for item in out.scheduled]

    def _repeat_decodes(self) -> SchedulerOutput | None:
        """The last step's decodes again, or None: the full pass is needed. Valid, and what the full pass would
        build, when the last step decoded every running sequence, nobody has joined (nothing waits or is
        swapped out) or left since, no write needs a copy-on-write, and the new blocks (one for each sequence
        whose next token starts a block) are free. A sequence whose token still on the device is its last one
        (it ends by length) is left out, here and in the repeats after, as the full pass leaves it out."""
        seqs = self._decoding
        if not seqs or self.waiting or self.swapped:
            return None
        bm, bs = self.block_manager, self.config.block_size
        new_blocks = 0
        going_on = []
        for seq in seqs:
            start = seq.num_computed_tokens
            if seq.status is not SequenceStatus.RUNNING or seq.num_tokens + seq.num_pending - start != 1:
                return None
            if seq.num_pending and self._ends_by_length(seq):
                continue
            if not start % bs:
                new_blocks += 1
            elif bm.ref_counts[seq.block_table[start // bs]] != 1:
                return None
            going_on.append(seq)
        if new_blocks > bm.num_free_blocks:
            return None
        self._decoding = going_on
        out = SchedulerOutput()
        for seq in going_on:
            if not seq.num_computed_tokens % bs:
                bm.append_slots(seq, 1)
            item = ScheduledSeq(seq, seq.num_computed_tokens, 1, 1)
            out.scheduled.append(item)
            self._advance(item)
        return out

    # ---- the three queues ------------------------------------------------

    def _schedule_running(self, out: SchedulerOutput, tokens_left: int) -> tuple[int, bool]:
        """Step 1. Returns the token budget left and whether any running work was preempted or left out."""
        bm = self.block_manager
        blocked = False
        i = 0
        while i < len(self.running):
            group = self.running[i]
            plan, complete = self._plan(group, tokens_left)
            left = False  # whether `group` itself had to leave the running list
            while plan and not left and not bm.can_append_slots(*self._plan_args(plan)):
                victim = self.running[-1]  # the group that arrived last
                blocked = True
                if victim is not group:
                    self._preempt(victim, out)
                elif i > 0:
                    self._preempt(group, out)
                    left = True
                else:  # alone, and still does not fit: it never will
                    need = bm.num_blocks_needed(*self._plan_args(plan)) + bm.num_used_blocks
                    out.finished.append(self._fail(group, need))
                    left = True
            if left:
                continue  # running[i] is now the next group
            if plan:
                tokens_left -= self._commit(group, plan, out)
            blocked |= not complete
            i += 1
        return tokens_left, blocked

    def _schedule_swapped(self, out: SchedulerOutput, tokens_left: int, seqs_left: int) -> tuple[int, int, bool]:
        """Step 2. Returns the budgets left and whether a swapped group had to stay out."""
        bm = self.block_manager
        while self.swapped:
            group = self.swapped[0]
            seqs = group.unfinished_seqs()
            # room for the blocks, plus one block per sequence to grow into
            reserve = self._watermark_blocks + len(seqs) if self.running else 0
            if group.num_reserved_seqs > seqs_left or not bm.can_swap_in(seqs, reserve):
                return tokens_left, seqs_left, True
            self.swapped.popleft()
            bm.swap_in(seqs, out.blocks_to_swap_in)
            self._counters["swap_ins"] += 1
            self._make_running(group)
            seqs_left -= group.num_reserved_seqs
            plan, complete = self._plan(group, tokens_left)
            if plan and bm.can_append_slots(*self._plan_args(plan)):
                tokens_left -= self._commit(group, plan, out)
            elif plan:
                complete = False  # it is running now; step 1 of the next step sees to it
            if not complete:
                return tokens_left, seqs_left, True
        return tokens_left, seqs_left, False

    def _schedule_waiting(self, out: SchedulerOutput, tokens_left: int, seqs_left: int) -> None:
        """Step 3: admit waiting groups while their first chunk fits."""
        bm = self.block_manager
        while self.waiting and tokens_left > 0:
            group = self.waiting[0]
            if group.num_reserved_seqs > seqs_left:
                return
            plan, _ = self._plan(group, tokens_left)
            if not plan:
                return
            reserve = self._watermark_blocks if self.running else 0
            if not bm.can_append_slots(*self._plan_args(plan), reserve=reserve):
                if self.running:
                    return  # wait for running groups to free blocks
                # the whole cache is free and this chunk still does not fit: it never will
                self.waiting.popleft()
                out.finished.append(self._fail(group, bm.num_blocks_needed(*self._plan_args(plan))))
                continue
            self.waiting.popleft()
            self._make_running(group)
            seqs_left -= group.num_reserved_seqs
            tokens_left -= self._commit(group, plan, out)

    # ---- helpers --------------------------------------------------------

    def _plan(self, group: SequenceGroup, tokens_available: int) -> tuple[list[_Chunk], bool]:
        """The chunk each unfinished sequence of `group` would compute within `tokens_available` tokens.

        Returns the chunks and whether every sequence that has work got a chunk
        (siblings deliberately held back for prefix sharing do not count).
        """
        bm, bs = self.block_manager, self.config.block_size
        plan: list[_Chunk] = []
        complete = True
        sibling_prefilling = False
        for seq in group.seqs:
            if seq.is_finished:
                continue
            if seq.num_pending:  # its last token is still on the device
                if self._ends_by_length(seq):
                    continue  # that token is its last one: nothing more to compute
                if seq.num_computed_tokens != seq.num_tokens:  # preempted meanwhile: recompute once it is known
                    complete = False
                    continue
            fresh = seq.num_computed_tokens == 0
            if fresh and sibling_prefilling and bm.enable_prefix_caching:
                continue  # prefill after the sibling, reusing its cached prompt blocks
            prefix = self._cached_prefix(seq) if fresh else []
            start = len(prefix) * bs if fresh else seq.num_computed_tokens
            remaining = seq.num_tokens + seq.num_pending - start
            sibling_prefilling |= remaining > 1
            n = min(remaining, tokens_available)
            if n <= 0 or (n < remaining and not self.config.enable_chunked_prefill):
                complete = False
                continue
            plan.append(_Chunk(seq, prefix, n))
            tokens_available -= n
        return plan, complete

    def _ends_by_length(self, seq: Sequence) -> bool:
        """Whether the token still on the device ends `seq` by its length (max_tokens or the context)."""
        total = seq.num_tokens + seq.num_pending
        return seq.num_output_tokens + seq.num_pending >= seq.sampling_params.max_tokens or \
            total >= self.config.max_model_len

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The prefix-cache blocks a sequence that holds no KV starts from. Prompt logprobs come from the logits
        at every prompt position, which a cached block skips, so a sequence that still needs some takes cached
        blocks only over positions it has already scored: none for a new request (as vLLM), all it had computed
        for one recomputed after a preemption."""
        scored = seq.prompt_logprobs
        if scored is not None and len(scored) < seq.num_prompt_tokens:
            limit = (len(scored) - 1) // self.config.block_size
            return self.block_manager.match_prefix(seq)[:limit] if limit else []
        return self.block_manager.match_prefix(seq)

    @staticmethod
    def _plan_args(plan: list[_Chunk]) -> tuple[list[Sequence], list[int], list[list[int]]]:
        return [c.seq for c in plan], [c.num_tokens for c in plan], [c.prefix for c in plan]

    def _commit(self, group: SequenceGroup, plan: list[_Chunk], out: SchedulerOutput) -> int:
        """Allocate the planned chunks (the caller checked they fit), add them to `out`; return tokens used."""
        bm = self.block_manager
        # attach every cached prefix before allocating anything, so no allocation evicts a block the plan reuses
        for c in plan:
            if c.seq.num_computed_tokens == 0 and group.num_preemptions == 0:  # first admission
                self._counters["prompt_tokens"] += c.seq.num_prompt_tokens
                self._counters["cached_prompt_tokens"] += len(c.prefix) * self.config.block_size
            if c.prefix:
                bm.attach_prefix(c.seq, c.prefix)
        for c in plan:
            seq = c.seq
            out.blocks_to_copy.extend(bm.append_slots(seq, c.num_tokens))
            ends_prompt = seq.num_computed_tokens + c.num_tokens == seq.num_tokens + seq.num_pending
            samples = (group.sampling_params.n if group.fork_pending else 1) if group.sampling_params.max_tokens else 0
            item = ScheduledSeq(seq, seq.num_computed_tokens, c.num_tokens, samples if ends_prompt else 0)
            out.scheduled.append(item)
            self._advance(item)
        return sum(c.num_tokens for c in plan)

    def _advance(self, item: ScheduledSeq) -> None:
        """Count a scheduled chunk as computed and its samples as pending (the next schedule() may run before
        update() reads them): forks an n > 1 request's children here, each waiting for its own sample."""
        seq = item.seq
        seq.num_computed_tokens = item.end
        if not item.num_samples:
            return
        item.targets.append(seq)
        if item.num_samples == 1:
            seq.num_pending += 1
            return
        group = self._groups[seq.request_id]
        for _ in range(item.num_samples - 1):  # n > 1: fork at the end of the prefill
            child = seq.fork(index=len(group.seqs))
            self.block_manager.fork(seq, child)
            group.seqs.append(child)
            item.targets.append(child)
        for target in item.targets:
            target.num_pending += 1

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        bm = self.block_manager
        self.running.remove(group)
        group.num_preemptions += 1
        self._counters["preemptions"] += 1
        seqs = group.unfinished_seqs()
        if self.config.preemption_mode == "swap" and bm.can_swap_out(seqs):
            bm.swap_out(seqs, out.blocks_to_swap_out)
            for seq in seqs:
                seq.status = SequenceStatus.SWAPPED
            self._counters["swap_outs"] += 1
            self.swapped.appendleft(group)
        else:  # recompute: drop the KV, keep the tokens
            for seq in seqs:
                bm.free(seq)
                seq.num_computed_tokens = 0
                seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(group)

    def _make_running(self, group: SequenceGroup) -> None:
        for seq in group.unfinished_seqs():
            seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, group, key=lambda g: g.arrival_index)

    def _fail(self, group: SequenceGroup, blocks_needed: int) -> SequenceGroup:
        group.error = (f"request {group.request_id!r} needs {blocks_needed} KV-cache blocks to go on but the cache "
                       f"holds {self.config.num_gpu_blocks}")
        for seq in group.unfinished_seqs():
            self._finish_seq(seq, "error")
        return self._retire(group)

    def _finish_seq(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.block_manager.free(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.block_manager.free_swapped(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.num_pending = 0  # a token still on the device is dropped

    def _retire(self, group: SequenceGroup) -> SequenceGroup:
        """Take a finished group out of its queue and out of the scheduler."""
        for queue in (self.running, self.waiting, self.swapped):
            if group in queue:
                queue.remove(group)
                break
        del self._groups[group.request_id]
        return group

    # ---- metrics --------------------------------------------------------

    def kv_utilization(self) -> float:
        """Tokens whose KV is held / slots in the blocks in use (shared blocks counted once)."""
        bs = self.config.block_size
        filled: dict[int, int] = {}
        for group in self.running:
            for seq in group.seqs:
                if seq.status is SequenceStatus.RUNNING:
                    for j, b in enumerate(seq.block_table):
                        filled[b] = max(filled.get(b, 0), min(bs, seq.num_computed_tokens - j * bs))
        used = self.block_manager.num_used_blocks
        return sum(filled.values()) / (used * bs) if used else 1.0

    def stats(self) -> dict:
        """Engine metrics: queue lengths, KV blocks, utilisation, prefix-cache hit rate, preemptions, swaps."""
        c = self._counters
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_swapped": len(self.swapped),
            **self.block_manager.stats(),
            "kv_utilization": self.kv_utilization(),
            **c,
            "prefix_cache_hit_rate": c["cached_prompt_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0,
            "tokens_per_step": c["computed_tokens"] / c["steps"] if c["steps"] else 0.0,
        }
