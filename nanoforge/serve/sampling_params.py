"""How to sample one request: the knobs of vLLM's `SamplingParams`.

A request asks for `n` completions of a prompt. Each completion draws tokens
with `temperature` (0 means greedy), keeps only the `top_k` most likely tokens
(-1 or 0: no limit) and the smallest nucleus of probability `top_p`, and stops
at the first of: an end-of-sequence token (unless `ignore_eos`), one of
`stop_token_ids`, one of the `stop` strings (checked by the engine, which owns
the tokenizer), `max_tokens` generated tokens, or the model's context length.

`seed` makes a request's draws reproducible whatever else shares its batch;
`logprobs=k` returns, for each generated token, its log-probability and the
`k` most likely alternatives (0: only the chosen token's); `prompt_logprobs=k`
does the same for every prompt token but the first (which nothing predicts:
its entry is None), as vLLM does. `max_tokens=0` scores the prompt and
generates nothing (the request finishes with reason "length" once its prompt
is computed); with nothing generated the n completions would all be the same,
so it needs n=1.

`output_kind` says which steps report the request (vLLM's `RequestOutputKind`): "cumulative" (the default)
returns its output, every token so far, from each step that gave it a token, as a stream needs; "final_only"
only from the step that finishes it, as `LLM.generate` and a non-streaming HTTP request need (building an
output every step was the largest part of the engine's host work per step).

Field checks run at construction; `validate(vocab_size)` adds the checks that
need the vocabulary (token ids). Every failure raises `NanoforgeError` naming
the field, so the HTTP server can answer 400 with `param` set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nanoforge.errors import NanoforgeError


OUTPUT_KINDS = ("cumulative", "final_only")


def _fail(param: str, message: str) -> None:
    raise NanoforgeError(f"{param} {message}", param=param)


def _check_int(param: str, value, minimum: int) -> None:
    # bool is an int subclass; `n=True` is a bug in the caller, not a count
    if not isinstance(value, int) or isinstance(value, bool):
        _fail(param, f"must be an integer, got {value!r}")
    if value < minimum:
        _fail(param, f"must be >= {minimum}, got {value}")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    output_kind: str = "cumulative"  # or "final_only"

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise NanoforgeError naming the first bad field; token ids are checked when vocab_size is given."""
        _check_int("n", self.n, 1)
        _check_int("max_tokens", self.max_tokens, 0)
        if self.max_tokens == 0 and self.n != 1:
            _fail("n", f"must be 1 when max_tokens=0 (nothing is generated), got {self.n}")
        if not isinstance(self.temperature, (int, float)) or not (self.temperature >= 0 and math.isfinite(self.temperature)):
            _fail("temperature", f"must be a finite number >= 0 (0 means greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            _fail("top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check_int("top_k", self.top_k, -1)  # -1 and 0 both mean "no limit"
        if self.seed is not None:
            _check_int("seed", self.seed, 0)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0)
        if self.output_kind not in OUTPUT_KINDS:
            _fail("output_kind", f"must be one of {', '.join(OUTPUT_KINDS)}, got {self.output_kind!r}")
        if self.stop is not None:
            if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
                _fail("stop", f"must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, list):
                _fail("stop_token_ids", f"must be a list of token ids, got {self.stop_token_ids!r}")
            for t in self.stop_token_ids:
                _check_int("stop_token_ids", t, 0)
        if vocab_size is not None:
            if self.stop_token_ids and max(self.stop_token_ids) >= vocab_size:
                _fail("stop_token_ids", f"holds token id {max(self.stop_token_ids)}, outside the vocabulary of {vocab_size}")
            for name in ("logprobs", "prompt_logprobs"):
                k = getattr(self, name)
                if k is not None and k > vocab_size:
                    _fail(name, f"asks for {k} alternatives but the vocabulary has {vocab_size} tokens")
