"""Sequences and sequence groups: what the scheduler schedules.

A `Sequence` is one token stream: the prompt followed by the tokens generated
so far. Its KV cache lives in fixed-size blocks listed by `block_table`
(block i holds the keys/values of positions i*block_size .. (i+1)*block_size-1).
`num_computed_tokens` counts the leading tokens whose KV is in the cache; the
step that computes tokens [num_computed_tokens, num_tokens) ends with a
sampled token. There is no separate "prefill" and "decode" state: a decode is
simply a chunk of one token, a prefill a chunk of many, and a prefill may be
cut into several chunks (chunked prefill). A sequence preempted by
recomputation drops its KV (num_computed_tokens = 0) but keeps its generated
tokens, so its next prefill recomputes prompt + output.

A `SequenceGroup` is one request. It starts with a single sequence. When that
sequence's prefill completes and the request asked for n > 1 completions, the
runner samples n tokens from the same last-position logits and the scheduler
forks n - 1 children from the parent before appending one token to each
(`Scheduler.update`). The children share every KV block of the parent by
reference count; the first write into a shared, partly filled block copies it
(copy-on-write), so the prompt's KV is stored once until the samples diverge.
The group is scheduled, preempted and finished as a whole.

Stop conditions that need only token ids live here (`check_stop`); stop
strings need the tokenizer and are checked by the engine, which then calls
`Scheduler.finish_seq`.
"""

from __future__ import annotations

import enum
import itertools
import time

from nanoforge.serve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()  # no KV on the GPU: new, or preempted by recomputation
    RUNNING = enum.auto()  # block_table holds GPU block ids
    SWAPPED = enum.auto()  # block_table holds CPU block ids
    FINISHED = enum.auto()  # finish_reason says why; no blocks held


# finish reasons, as in the OpenAI API ("abort" and "error" are ours)
FINISH_REASONS = ("stop", "length", "abort", "error")

_seq_ids = itertools.count()


class Sequence:
    def __init__(self, token_ids: list[int], sampling_params: SamplingParams, request_id: str = "",
                 index: int = 0, arrival_time: float | None = None):
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.index = index  # which of the request's n completions this is (seeds, output order)
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0  # leading tokens whose KV is in the cache
        self.num_cached_tokens = 0  # of those, prompt tokens taken from the prefix cache at (re)admission
        # Tokens a scheduled step samples for this sequence that `Scheduler.update` has not appended yet (0 or 1):
        # with asynchronous scheduling the next step is scheduled before the last one's tokens are read back.
        self.num_pending = 0
        self.block_table: list[int] = []
        # Prefix-cache bookkeeping, owned by the BlockManager: chained hashes of
        # this sequence's full blocks (a pure function of token_ids) and how many
        # leading blocks of block_table were already offered to the cache.
        self.block_hashes: list[int] = []
        self.num_hashed_blocks = 0
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.output_logprobs: list = []  # one runner-defined entry per output token, when logprobs is set
        # When prompt_logprobs is set: one entry per prompt token scored so far, None for the first (nothing
        # predicts it). Complete once the prompt is computed; a recomputation never scores a position twice.
        self.prompt_logprobs: list | None = [None] if sampling_params.prompt_logprobs is not None else None

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, request={self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table}, {self.status.name})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to compute before the next sample: 1 when decoding, more while prefilling."""
        return len(self.token_ids) - self.num_computed_tokens

    def append_token(self, token_id: int, logprob=None) -> None:
        self.token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)

    def fork(self, index: int) -> Sequence:
        """A child with the same tokens and progress; the BlockManager shares the blocks (`BlockManager.fork`)."""
        child = Sequence(self.token_ids, self.sampling_params, self.request_id, index, self.arrival_time)
        child.num_prompt_tokens = self.num_prompt_tokens
        child.num_computed_tokens = self.num_computed_tokens
        child.num_pending = self.num_pending
        child.num_cached_tokens = self.num_cached_tokens
        child.block_hashes = list(self.block_hashes)
        child.num_hashed_blocks = self.num_hashed_blocks
        child.status = self.status
        child.output_logprobs = list(self.output_logprobs)
        child.prompt_logprobs = self.prompt_logprobs  # complete by now (forks end the prefill), never changed
        return child


class SequenceGroup:
    """One request: `sampling_params.n` sequences sharing a prompt, scheduled together."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None,
                 arrival_time: float | None = None, outputs: list[tuple[int, list[int], list | None]] | None = None):
        """`outputs`, when given, resumes a request that another engine started (a prefill instance's first
        token): one sequence per (index, output token ids so far, their logprob entries or None), already
        forked; the sequences compute prompt + those tokens and generate the rest."""
        self.request_id = request_id
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.resumed = outputs is not None
        self._prompt = list(prompt_token_ids)  # every output of the request shares this list: read it, never write
        if outputs is None:
            self.seqs = [Sequence(prompt_token_ids, self.sampling_params, request_id, 0, self.arrival_time)]
        else:
            self.seqs = []
            for index, token_ids, logprobs in outputs:
                seq = Sequence(list(prompt_token_ids) + list(token_ids), self.sampling_params, request_id, index,
                               self.arrival_time)
                seq.num_prompt_tokens = len(prompt_token_ids)
                seq.output_logprobs = list(logprobs or [])
                self.seqs.append(seq)
        self.arrival_index = -1  # first-come-first-served order, set by Scheduler.add
        self.num_preemptions = 0
        self.error: str | None = None  # set when finished with reason "error"

    def __repr__(self) -> str:
        return f"SequenceGroup({self.request_id!r}, seqs={[s.seq_id for s in self.seqs]})"

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._prompt

    @property
    def fork_pending(self) -> bool:
        """True until the prefill completes and the n - 1 children are forked (a resumed request never forks)."""
        return self.sampling_params.n > 1 and len(self.seqs) == 1 and not self.resumed

    @property
    def num_reserved_seqs(self) -> int:
        """Batch slots this group may occupy: n before the fork, its live sequences after."""
        return self.sampling_params.n if self.fork_pending else len(self.unfinished_seqs())

    @property
    def is_finished(self) -> bool:
        for s in self.seqs:  # (a loop, not all() over a generator: the engine asks every step)
            if s.status is not SequenceStatus.FINISHED:
                return False
        return True

    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]


def check_stop(seq: Sequence, eos_token_ids=(), max_model_len: int | None = None) -> str | None:
    """Why `seq` must stop after its last appended token ("stop" or "length"), or None to go on.

    An eos token (unless ignore_eos) or a stop token id gives "stop"; the token
    stays in token_ids, the engine leaves it out of the text. Reaching
    max_tokens, or max_model_len tokens in all (no position left to compute),
    gives "length".
    """
    params = seq.sampling_params
    last = seq.last_token_id
    if (not params.ignore_eos and last in eos_token_ids) or (params.stop_token_ids and last in params.stop_token_ids):
        return "stop"
    if seq.num_output_tokens >= params.max_tokens:
        return "length"
    if max_model_len is not None and seq.num_tokens >= max_model_len:
        return "length"
    return None
