"""The hand-over: how the conductor runs one prompt on a prefill instance, then on a decode instance.

    conductor                                               prefill instance
    POST /disagg/prefill {request_id, prompt, params}  ───▶  computes the prompt (taking what its prefix cache and
        (params.max_tokens <= 1)                             the pool hold), samples each completion's first token,
                                                             saves the prompt's full blocks to the pool, waits for that
                                  ◀───  {"output": event, "saved_blocks", "prefill_s", "computed_tokens"}
    The first tokens go to the client at once (time to first token); completions that ended there are done.

    conductor                                               decode instance
    POST /disagg/decode {request_id, prompt, params,  ───▶  loads the prompt's blocks from the pool into its cache,
                         outputs: [{index, token_ids,        computes what it lacks (the last partial block and the
                                    logprobs}]}              first token), generates the rest (seeded draws go on)
                                  ◀───  NDJSON, one event per engine step that moved the request, the last finished

Both bodies carry token ids and `SamplingParams` as JSON; both instances check
them as any request (a 4xx answer is relayed to the client as it is). An event
is a RequestOutput as deltas: per completion the new token ids and logprob
entries and a text splice (`text_from`, `text`: keep that many characters,
append the text; a stop string can cut text already sent). `OutputEncoder`
writes events; `OutputDecoder` rebuilds the cumulative RequestOutput, so the
conductor renders with the single server's code.
"""

from __future__ import annotations

import dataclasses

from nanoforge.errors import NanoforgeError
from nanoforge.serve.llm_engine import CompletionOutput, RequestOutput
from nanoforge.serve.sampling_params import SamplingParams

SAVE_TIMEOUT_S = 10.0  # how long a prefill answer waits for its blocks to reach the pool
_PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def params_to_json(params: SamplingParams) -> dict:
    return dataclasses.asdict(params)


def params_from_json(d) -> SamplingParams:
    if not isinstance(d, dict) or set(d) - _PARAM_FIELDS:
        raise NanoforgeError(f"params must be an object with SamplingParams fields ({', '.join(sorted(_PARAM_FIELDS))})",
                             param="params")
    return SamplingParams(**d)  # checks every field


def handover_body(request_id: str, prompt: list[int], params: SamplingParams,
                  outputs: list[CompletionOutput] | None = None) -> dict:
    """The body of /disagg/prefill (no outputs) or /disagg/decode (the completions to go on with). An instance
    reports every step to the conductor, whatever its client asked for (the conductor learns each decode
    instance's pace from them), so the params go as "cumulative"."""
    params = dataclasses.replace(params, output_kind="cumulative")
    body = {"request_id": request_id, "prompt": prompt, "params": params_to_json(params)}
    if outputs is not None:
        body["outputs"] = [{"index": c.index, "token_ids": c.token_ids, "logprobs": c.logprobs} for c in outputs]
    return body


def parse_handover(body: dict, *, resume: bool) -> tuple[str, list[int], SamplingParams, list | None]:
    """(request_id, prompt, params, outputs for `LLMEngine.add_request`); NanoforgeError naming a bad field."""
    expected = {"request_id", "prompt", "params"} | ({"outputs"} if resume else set())
    if set(body) != expected:
        raise NanoforgeError(f"a hand-over body has exactly the fields {sorted(expected)}, got {sorted(body)}",
                             param="body")
    rid, prompt = body["request_id"], body["prompt"]
    if not isinstance(rid, str) or not rid:
        raise NanoforgeError("request_id must be a non-empty string", param="request_id")
    if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise NanoforgeError("prompt must be a list of token ids", param="prompt")
    params = params_from_json(body["params"])
    if not resume:
        return rid, prompt, params, None
    outputs = body["outputs"]
    ok = isinstance(outputs, list) and outputs and all(
        isinstance(o, dict) and set(o) == {"index", "token_ids", "logprobs"} and isinstance(o["index"], int)
        and isinstance(o["token_ids"], list) and all(isinstance(t, int) for t in o["token_ids"])
        and (o["logprobs"] is None or isinstance(o["logprobs"], list)) for o in outputs)
    if not ok:
        raise NanoforgeError("outputs must be a non-empty list of {index, token_ids, logprobs}", param="outputs")
    return rid, prompt, params, [(o["index"], o["token_ids"], o["logprobs"]) for o in outputs]


class OutputEncoder:
    """One request's outputs as events: what changed since the last event."""

    def __init__(self):
        self.sent: dict[int, tuple[str, int]] = {}  # completion index -> (text sent, tokens sent)
        self.first = True

    def event(self, out: RequestOutput) -> dict:
        completions = []
        for c in out.outputs:
            text, toks = self.sent.get(c.index, ("", 0))
            keep = _common_prefix(text, c.text)
            completions.append({"index": c.index, "text_from": keep, "text": c.text[keep:],
                                "token_ids": c.token_ids[toks:],
                                "logprobs": c.logprobs[toks:] if c.logprobs is not None else None,
                                "finish_reason": c.finish_reason})
            self.sent[c.index] = (c.text, len(c.token_ids))
        event = {"outputs": completions, "finished": out.finished, "error": out.error,
                 "num_cached_tokens": out.num_cached_tokens}
        if self.first and out.prompt_logprobs is not None:
            event["prompt_logprobs"] = out.prompt_logprobs
        self.first = False
        return event


def _common_prefix(sent: str, text: str) -> int:
    """The length of the longest common prefix of the text sent and the text now. Almost always all that was
    sent (the text grew): one C-speed check, where a character loop made every event cost the whole output so far
    (1.7 us a token held, on the decode instance's event loop: session 12's 1P+1D time per token). The text
    changes behind what was sent only when a stop string cuts it or a character the detokenizer held back
    resolves differently: then the first difference, halving on slices."""
    if text.startswith(sent):
        return len(sent)
    lo, hi = 0, min(len(sent), len(text))  # sent[:lo] == text[:lo]; the first difference is before hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sent[:mid] == text[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class OutputDecoder:
    """The cumulative RequestOutput of a request, rebuilt from its events."""

    def __init__(self, request_id: str, prompt_token_ids: list[int]):
        self.request_id, self.prompt_token_ids = request_id, prompt_token_ids
        self.completions: dict[int, CompletionOutput] = {}
        self.prompt_logprobs = None

    def apply(self, event: dict) -> RequestOutput:
        if "prompt_logprobs" in event:
            self.prompt_logprobs = event["prompt_logprobs"]
        for d in event["outputs"]:
            c = self.completions.setdefault(d["index"], CompletionOutput(d["index"], "", [], None,
                                                                         [] if d["logprobs"] is not None else None))
            c.text = c.text[:d["text_from"]] + d["text"]
            c.token_ids = c.token_ids + d["token_ids"]
            if d["logprobs"] is not None:
                c.logprobs = c.logprobs + d["logprobs"]
            c.finish_reason = d["finish_reason"]
        outputs = [dataclasses.replace(c) for _, c in sorted(self.completions.items())]
        return RequestOutput(self.request_id, None, self.prompt_token_ids, outputs, event["finished"],
                             prompt_logprobs=self.prompt_logprobs, num_cached_tokens=event["num_cached_tokens"],
                             error=event["error"])
