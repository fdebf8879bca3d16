"""The OpenAI-compatible HTTP server: `nanoforge serve --model DIR`.

    POST /v1/completions        prompt: text, token ids, or a batch of either
    POST /v1/chat/completions   messages rendered with the model's chat template
    GET  /v1/models, /v1/models/{id}, /health, /metrics (Prometheus)

Both POST endpoints take the usual fields (`max_tokens`, `temperature`,
`top_p`, `n`, `stop`, `seed`, `logprobs`, `user`, `stream`, `stream_options`)
plus vLLM's extensions `top_k`, `ignore_eos` and `stop_token_ids`, and stream
server-sent events ending in `data: [DONE]` when `stream` is true. Every
request goes into one `AsyncEngine`, whose background thread batches all
requests in flight into each engine step.

Completions also take `echo` (as OpenAI and vLLM): each choice's text starts
with the prompt, and with `logprobs=k` its logprobs cover the prompt tokens
first (the first one has none: null) and then the generated ones; a stream
sends the prompt in each choice's first chunk. `max_tokens=0` is accepted
with `echo` only: it scores the prompt and generates nothing, which is how
lm-evaluation-harness computes loglikelihoods.

Bad input never reaches the engine as a surprise: the body is read with a
size limit (413), parsed as a JSON object (422), every field is type-checked
here and range-checked by `SamplingParams` and the engine (400, with `param`
naming the field), the model name is checked (404), the prompt is checked
against the context (400), and a full waiting queue answers 429 with
`Retry-After`. Errors have OpenAI's shape:
`{"error": {"message", "type", "param", "code"}}`. Fields that OpenAI
defines but we do not implement are accepted only at their neutral value;
unknown fields are rejected, as OpenAI does.

A client that disconnects has its requests aborted and their KV blocks freed
(streaming: the response generator is cancelled; otherwise a watcher on the
connection cancels the handler). On SIGTERM the server stops accepting,
lets requests in flight finish for `--shutdown-timeout` seconds, then ends
the rest with an error event and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanoforge.errors import InternalError, NanoforgeError
from nanoforge.serve.async_engine import AsyncEngine, RequestStream
from nanoforge.serve.llm_engine import LLMEngine, RequestOutput
from nanoforge.serve.sampling_params import SamplingParams
from nanoforge.tokenizer import CHAT_ROLES

log = logging.getLogger("nanoforge.serve")

DEFAULT_MAX_REQUEST_BYTES = 8 << 20
MAX_STOP_STRINGS = 16  # each is searched for in the text after every step
MAX_LOGPROBS = 20

# (type, code) of an error body, by status
_ERROR_KINDS = {
    400: ("invalid_request_error", None),
    404: ("invalid_request_error", "model_not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    422: ("invalid_request_error", "invalid_json"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    500: ("server_error", "internal_error"),
    503: ("server_error", "service_unavailable"),
}

# The fields each endpoint accepts and their JSON types (None: checked where used). The shared ones include
# vLLM's extensions top_k, ignore_eos and stop_token_ids; `_NEUTRAL` fields are OpenAI's that we do not
# implement, accepted only with a value that changes nothing.
_NEUTRAL = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logit_bias": ({},), "suffix": ("",),
            "best_of": (1,), "response_format": ({"type": "text"},), "tools": ([],), "tool_choice": ("none",)}
_COMMON_FIELDS = {"model": "string", "stream": "boolean", "stream_options": "object", "max_tokens": "integer",
                  "temperature": "number", "top_p": "number", "n": "integer", "stop": None, "seed": "integer",
                  "user": "string", "top_k": "integer", "ignore_eos": "boolean", "stop_token_ids": "array",
                  "frequency_penalty": None, "presence_penalty": None, "logit_bias": None}
_COMPLETION_FIELDS = {**_COMMON_FIELDS, "prompt": None, "logprobs": "integer", "echo": "boolean", "suffix": None,
                      "best_of": None}
_CHAT_FIELDS = {**_COMMON_FIELDS, "messages": None, "logprobs": "boolean", "top_logprobs": "integer",
                "max_completion_tokens": "integer", "response_format": None, "tools": None, "tool_choice": None}


# --- errors --------------------------------------------------------------------------------------

def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    kind, default_code = _ERROR_KINDS.get(status, ("invalid_request_error" if status < 500 else "server_error", None))
    return {"error": {"message": message, "type": kind, "param": param, "code": code or default_code}}


def _error_response(e: NanoforgeError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    return JSONResponse(error_body(str(e), e.status, e.param), status_code=e.status, headers=headers)


# --- reading and checking a request body -----------------------------------------------------------

def _no_constants(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def _read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object; 413 over `limit` bytes, 422 if it is not UTF-8 JSON holding an object."""
    body = bytearray()
    size = 0
    async for chunk in request.stream():  # read to the end (the client is still sending) but keep at most `limit`
        size += len(chunk)
        if size <= limit:
            body += chunk
    if size > limit:
        raise NanoforgeError(f"request body is {size} bytes, more than the limit of {limit} (--max-request-bytes)",
                             status=413)
    try:
        data = json.loads(body.decode("utf-8"), parse_constant=_no_constants)
    except UnicodeDecodeError as e:
        raise NanoforgeError(f"request body is not UTF-8: {e}", status=422) from None
    except (ValueError, RecursionError) as e:  # RecursionError: absurdly deep nesting
        raise NanoforgeError(f"request body is not valid JSON: {e}", status=422) from None
    if not isinstance(data, dict):
        raise NanoforgeError(f"request body must be a JSON object, got {type(data).__name__}", status=422)
    try:  # JSON may spell a lone UTF-16 surrogate ("\\ud800"), which is no Unicode text: nothing can encode it
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise NanoforgeError(f"request body holds a lone UTF-16 surrogate ({e.object[e.start:e.end]!r}), which is "
                             f"not valid Unicode text", status=400) from None
    return data


_KINDS: dict[str, Callable[[object], bool]] = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
    "boolean": lambda v: isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}


class _Fields:
    """A request's JSON object, its field names and types checked up front (400 naming the field)."""

    def __init__(self, data: dict, spec: dict[str, str | None]):
        for name, value in data.items():
            if name not in spec:
                raise NanoforgeError(f"unrecognized request argument: {name!r}", param=name)
            kind = spec[name]
            if value is None:
                continue  # null means "the default", as in OpenAI's API
            if kind is not None and not _KINDS[kind](value):
                raise NanoforgeError(f"{name} must be a{'n' if kind[0] in 'aeiou' else ''} {kind}, "
                                     f"got {value!r:.80}", param=name)
            if name in _NEUTRAL and value not in _NEUTRAL[name]:
                raise NanoforgeError(f"{name}={value!r:.80} is not supported by this server", param=name)
        self.data = data

    def get(self, name: str, default=None):
        value = self.data.get(name)
        return default if value is None else value


def _stop_strings(fields: _Fields) -> list[str] | None:
    stop = fields.data.get("stop")
    if stop is None:
        return None
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise NanoforgeError(f"stop must be a non-empty string or a list of them, got {stop!r:.80}", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise NanoforgeError(f"stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed", param="stop")
    return stop


def _token_ids(value) -> list[int] | None:
    """`value` as a list of token ids, or None if it is not a list of integers."""
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    return None


def _batch(prompt) -> list:
    """A completions `prompt` as a batch: text or token ids alone are a batch of one."""
    return [prompt] if isinstance(prompt, str) or _token_ids(prompt) is not None else prompt


def _sampling_params(fields: _Fields, max_tokens: int, logprobs: int | None,
                     prompt_logprobs: int | None = None) -> SamplingParams:
    """Ranges are SamplingParams' to check (NanoforgeError naming the field)."""
    stop_token_ids = fields.get("stop_token_ids")
    if stop_token_ids is not None and _token_ids(stop_token_ids) is None:
        raise NanoforgeError("stop_token_ids must be a list of integers", param="stop_token_ids")
    return SamplingParams(n=fields.get("n", 1), temperature=fields.get("temperature", 1.0),
                          top_p=fields.get("top_p", 1.0), top_k=fields.get("top_k", -1), seed=fields.get("seed"),
                          max_tokens=max_tokens, stop=_stop_strings(fields), stop_token_ids=stop_token_ids,
                          ignore_eos=fields.get("ignore_eos", False), logprobs=logprobs,
                          prompt_logprobs=prompt_logprobs)


# --- turning cumulative engine outputs into per-choice deltas ---------------------------------------

@dataclass
class _Delta:
    index: int  # choice index: prompt_index * n + completion index
    text: str
    logprobs: list | None  # engine entries for the new tokens, when asked for
    finish_reason: str | None


class _Choices:
    """What each choice has sent so far. The engine's text only grows, except that a stop string cuts it
    where it starts; holding back the last len(longest stop) - 1 characters means we never send text
    that a later cut would take back. With `echo` (the prompt texts, by prompt index), each choice's first
    delta starts with its prompt's text and, when logprobs are asked for, the prompt's logprobs."""

    def __init__(self, n: int, stop: list[str] | None, echo: list[str] | None = None):
        self.n = n
        self.hold = max(map(len, stop)) - 1 if stop else 0
        self.echo = echo
        self.sent: dict[int, tuple[int, int] | None] = {}  # choice -> (chars, tokens) sent; None when finished
        self.completion_tokens = 0

    def deltas(self, prompt_index: int, out: RequestOutput) -> list[_Delta]:
        if out.error:  # e.g. the sequence outgrew the whole KV cache
            raise NanoforgeError(out.error, status=400)
        result = []
        for c in out.outputs:
            index = prompt_index * self.n + c.index
            if index in self.sent and self.sent[index] is None:
                continue
            chars, toks = self.sent.get(index) or (0, 0)
            end = len(c.text) if c.finish_reason else max(chars, len(c.text) - self.hold)
            if end == chars and len(c.token_ids) == toks and not c.finish_reason:
                continue
            text, logprobs = c.text[chars:end], c.logprobs[toks:] if c.logprobs is not None else None
            if self.echo is not None and index not in self.sent:  # the first delta of this choice
                text = self.echo[prompt_index] + text
                logprobs = _prompt_entries(out) + logprobs if logprobs is not None else None
            result.append(_Delta(index, text, logprobs, c.finish_reason))
            if c.finish_reason:
                self.sent[index] = None
                self.completion_tokens += len(c.token_ids)
            else:
                self.sent[index] = (end, len(c.token_ids))
        return result


def _prompt_entries(out: RequestOutput) -> list[dict]:
    """The engine's prompt logprobs, the first token (which nothing predicts) given an entry without any."""
    return [{"token_id": out.prompt_token_ids[0], "logprob": None, "top": None}, *out.prompt_logprobs[1:]]


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# --- metrics -----------------------------------------------------------------------------------------

class _EngineCollector:
    """Engine gauges and counters, from a stats snapshot taken just before each scrape."""

    def __init__(self):
        self.stats: dict = {}

    def collect(self):
        s = self.stats

        def gauge(name, doc, value):
            return GaugeMetricFamily(f"nanoforge_{name}", doc, value=value)

        def counter(name, doc, value):
            return CounterMetricFamily(f"nanoforge_{name}", doc, value=value)

        yield gauge("num_requests_running", "requests in the running batch", s.get("num_running", 0))
        yield gauge("num_requests_waiting", "requests waiting to be scheduled", s.get("num_waiting", 0))
        yield gauge("num_requests_swapped", "requests swapped out to CPU memory", s.get("num_swapped", 0))
        yield gauge("kv_blocks_used", "KV-cache blocks held by requests", s.get("kv_blocks_used", 0))
        yield gauge("kv_blocks_total", "KV-cache blocks in all", s.get("kv_blocks_total", 0))
        yield gauge("kv_cache_usage_ratio", "fraction of KV-cache blocks in use",
                    s.get("kv_blocks_used", 0) / max(1, s.get("kv_blocks_total", 1)))
        yield gauge("prefix_cache_hit_rate", "prompt tokens found in the prefix cache / prompt tokens",
                    s.get("prefix_cache_hit_rate", 0.0))
        yield counter("prefix_cache_queries", "prompt tokens looked up in the prefix cache", s.get("prompt_tokens", 0))
        yield counter("prefix_cache_hits", "prompt tokens found in the prefix cache", s.get("cached_prompt_tokens", 0))
        yield counter("preemptions", "requests preempted to free KV-cache blocks", s.get("preemptions", 0))


class _Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("nanoforge_time_to_first_token_seconds", "arrival to first output token", registry=r,
                              buckets=(.001, .005, .01, .02, .04, .06, .08, .1, .25, .5, .75, 1, 2.5, 5, 7.5, 10, 20,
                                       40, 80))
        self.tpot = Histogram("nanoforge_time_per_output_token_seconds", "per request: (finish - first token) / "
                              "(output tokens - 1)", registry=r,
                              buckets=(.001, .0025, .005, .01, .015, .02, .025, .03, .04, .05, .075, .1, .15, .2, .3,
                                       .4, .5, .75, 1, 2.5))
        self.e2e = Histogram("nanoforge_e2e_request_latency_seconds", "arrival to last token", registry=r,
                             buckets=(.05, .1, .3, .5, .8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 300))
        self.success = Counter("nanoforge_request_success", "finished requests, by finish reason", ["finish_reason"],
                               registry=r)
        self.rejected = Counter("nanoforge_request_rejected", "requests answered with an error, by HTTP status",
                                ["status"], registry=r)
        self.prompt_tokens = Counter("nanoforge_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("nanoforge_generation_tokens", "tokens generated by finished requests",
                                         registry=r)
        self.engine = _EngineCollector()
        r.register(self.engine)

    def observe(self, out: RequestOutput) -> None:
        """A request finished (called on the engine thread; prometheus_client is thread-safe)."""
        m = out.metrics
        arrival, first, finish = m.get("arrival_time"), m.get("first_token_time"), m.get("finish_time")
        if first is not None:
            self.ttft.observe(first - arrival)
        self.e2e.observe(finish - arrival)
        num_out = max(len(c.token_ids) for c in out.outputs)
        if first is not None and num_out > 1:
            self.tpot.observe((finish - first) / (num_out - 1))
        self.success.labels(out.outputs[0].finish_reason or "unknown").inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(sum(len(c.token_ids) for c in out.outputs))


# --- the two endpoints ---------------------------------------------------------------------------

class _Api:
    """Handlers over one AsyncEngine; `build_app` routes to them."""

    def __init__(self, engine: AsyncEngine, model_name: str, max_request_bytes: int):
        self.engine = engine
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        self.model_name = model_name
        self.max_request_bytes = max_request_bytes
        self.created = int(time.time())

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "nanoforge",
                "max_model_len": self.max_model_len}

    def _check_model(self, fields: _Fields) -> None:
        model = fields.get("model")
        if model is None:
            raise NanoforgeError("model is required", param="model")
        if model != self.model_name:
            raise NanoforgeError(f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                                 param="model", status=404)

    def _max_tokens(self, requested: int | None, prompts: list[list[int]], param: str, minimum: int = 1) -> int:
        """Check each prompt against the context; `requested=None` means whatever room is left. `minimum=0`
        (completions with echo) lets a request score its prompt and generate nothing."""
        if requested is not None and requested < minimum:
            raise NanoforgeError(f"{param} must be >= {minimum}, got {requested}", param=param)
        longest = max(len(p) for p in prompts)
        if requested == 0:
            if longest > self.max_model_len:
                raise NanoforgeError(f"prompt is {longest} tokens; the model's context is {self.max_model_len} tokens",
                                     param="prompt")
            return 0
        if longest >= self.max_model_len:
            raise NanoforgeError(f"prompt is {longest} tokens; the model's context is {self.max_model_len} tokens "
                                 f"(prompt + at least one generated token must fit)", param="prompt")
        if requested is None:
            return self.max_model_len - longest
        if longest + requested > self.max_model_len:
            raise NanoforgeError(f"prompt ({longest} tokens) + {param} ({requested}) is more than the model's context "
                                 f"of {self.max_model_len} tokens", param=param)
        return requested

    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        fields = _Fields(await _read_json(request, self.max_request_bytes), _COMPLETION_FIELDS)
        self._check_model(fields)
        logprobs = fields.get("logprobs")
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise NanoforgeError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}", param="logprobs")
        echo = fields.get("echo", False)
        requested = fields.get("max_tokens", 16)
        if requested == 0 and not echo:
            raise NanoforgeError("max_tokens must be >= 1, got 0 (0 is accepted only with echo=true: it scores the "
                                 "prompt and generates nothing)", param="max_tokens")
        prompts = await self._completion_prompts(fields.get("prompt"))
        max_tokens = self._max_tokens(requested, prompts, "max_tokens", minimum=0 if echo else 1)
        params = _sampling_params(fields, max_tokens, logprobs, logprobs if echo else None)
        # echo: the prompts as given, token ids decoded
        texts = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in _batch(fields.get("prompt"))] \
            if echo else None
        rid = f"cmpl-{uuid.uuid4().hex}"
        return await self._respond(request, fields, prompts, params, rid, "text_completion", arrival, texts)

    async def chat(self, request: Request) -> Response:
        arrival = time.monotonic()
        fields = _Fields(await _read_json(request, self.max_request_bytes), _CHAT_FIELDS)
        self._check_model(fields)
        want_logprobs = fields.get("logprobs", False)
        top = fields.get("top_logprobs")
        if top is not None and not (want_logprobs and 0 <= top <= MAX_LOGPROBS):
            raise NanoforgeError(f"top_logprobs must be in [0, {MAX_LOGPROBS}] and needs logprobs=true",
                                 param="top_logprobs")
        messages = _chat_messages(fields.get("messages"))
        prompt = await asyncio.to_thread(self.tokenizer.encode_chat, messages)
        param = "max_completion_tokens" if fields.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = self._max_tokens(fields.get(param), [prompt], param)
        params = _sampling_params(fields, max_tokens, (top or 0) if want_logprobs else None)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        return await self._respond(request, fields, [prompt], params, rid, "chat.completion", arrival)

    async def _completion_prompts(self, prompt) -> list[list[int]]:
        """`prompt` as token ids: text, token ids, or a non-empty batch of either."""
        prompt = _batch(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            batch = await asyncio.to_thread(self.tokenizer.encode_prompt_batch, prompt)
        elif isinstance(prompt, list) and prompt and all(_token_ids(p) is not None for p in prompt):
            batch = prompt
        else:
            raise NanoforgeError("prompt must be a string, a list of token ids, or a non-empty list of either "
                                 f"(got {type(prompt).__name__})", param="prompt")
        if len(batch) > self.engine.max_waiting:
            raise NanoforgeError(f"prompt is a batch of {len(batch)}; at most {self.engine.max_waiting} are allowed",
                                 param="prompt")
        return batch

    async def _respond(self, request: Request, fields: _Fields, prompts: list[list[int]], params: SamplingParams,
                       rid: str, kind: str, arrival: float, echo: list[str] | None = None) -> Response:
        include_usage = fields.get("stream_options", {}).get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise NanoforgeError("stream_options.include_usage must be a boolean", param="stream_options")
        render = _Render(kind, rid, self.model_name, self.tokenizer)
        choices = _Choices(params.n, params.stop, echo)
        prompt_tokens = sum(map(len, prompts))
        stream = await self.engine.add(prompts, params, request_id=rid, arrival_time=arrival)
        if fields.get("stream", False):
            events = _events(stream, choices, render, prompt_tokens if include_usage else None)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        finals = await _unless_disconnected(request, _collect(stream))
        if finals is None:
            return Response(status_code=499)  # nobody is listening
        deltas = [d for i, out in enumerate(finals) for d in choices.deltas(i, out)]
        return JSONResponse(render.response(deltas, _usage(prompt_tokens, choices.completion_tokens)))


def _chat_messages(messages) -> list[dict]:
    """OpenAI messages as [{role, content}] with string contents (text parts joined)."""
    if not isinstance(messages, list) or not messages:
        raise NanoforgeError("messages must be a non-empty list of {role, content} objects", param="messages")
    result = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise NanoforgeError(f"messages[{i}] must be an object, got {type(m).__name__}", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise NanoforgeError(f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(p["text"] for p in content)
        if isinstance(m.get("role"), str) and m["role"] not in CHAT_ROLES:
            raise NanoforgeError(f"messages[{i}] has role {m['role']!r}; this server takes {', '.join(CHAT_ROLES)}",
                                 param="messages")
        result.append({"role": m.get("role"), "content": content})
    return result  # Tokenizer.encode_chat checks that roles and contents are strings


async def _collect(stream: RequestStream) -> list[RequestOutput]:
    """The final output of every prompt, in order."""
    finals: dict[int, RequestOutput] = {}
    try:
        async for i, out in stream:
            if out.finished:
                finals[i] = out
    finally:
        stream.abort()  # a no-op unless we were cancelled or failed
    return [finals[i] for i in range(len(finals))]


async def _unless_disconnected(request: Request, work):
    """Run `work`; if the client disconnects first, cancel it (its `finally` aborts the requests) and return None."""

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when we are cancelled ourselves (uvicorn's shutdown deadline)
        watch.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    return task.result()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _events(stream: RequestStream, choices: _Choices, render: _Render,
                  usage_prompt_tokens: int | None) -> AsyncIterator[str]:
    """Server-sent events: chunks as tokens arrive, the usage (when asked for), an error event if the request
    fails, then [DONE]."""
    try:
        for chunk in render.first_chunks(stream, choices.n):
            yield _sse(chunk)
        async for i, out in stream:
            for d in choices.deltas(i, out):
                yield _sse(render.chunk(d))
        if usage_prompt_tokens is not None:
            yield _sse(render.usage_chunk(_usage(usage_prompt_tokens, choices.completion_tokens)))
    except NanoforgeError as e:
        yield _sse(error_body(str(e), e.status, e.param))
    except InternalError as e:  # the engine thread logged it with its traceback
        yield _sse(error_body(str(e), 500))
    except Exception as e:  # a bug: tell the client, keep the server up
        log.exception("error while streaming %s", render.id)
        yield _sse(error_body(f"internal error: {type(e).__name__}: {e}", 500))
    finally:
        stream.abort()  # the client left (we are cancelled) or we failed: free the blocks
    yield "data: [DONE]\n\n"


class _Render:
    """OpenAI's JSON shapes for one request: completions or chat, whole or as stream chunks."""

    def __init__(self, kind: str, rid: str, model: str, tokenizer):
        self.chat = kind == "chat.completion"
        self.kind, self.id, self.model, self.tokenizer = kind, rid, model, tokenizer
        self.chunk_kind = "chat.completion.chunk" if self.chat else "text_completion"
        self.created = int(time.time())
        self.text_offset: dict[int, int] = {}  # completions logprobs: characters of tokens so far, per choice

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def first_chunks(self, stream: RequestStream, n: int) -> list[dict]:
        """Chat streams open every choice with the assistant's role."""
        if not self.chat:
            return []
        return [{**self._head(self.chunk_kind),
                 "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]} for i in range(len(stream.request_ids) * n)]

    def chunk(self, d: _Delta) -> dict:
        if self.chat:
            choice = {"index": d.index, "delta": {"content": d.text}}
        else:
            choice = {"index": d.index, "text": d.text}
        choice.update(logprobs=self._logprobs(d), finish_reason=d.finish_reason)
        return {**self._head(self.chunk_kind), "choices": [choice]}

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._head(self.chunk_kind), "choices": [], "usage": usage}

    def response(self, deltas: list[_Delta], usage: dict) -> dict:
        choices = []
        for d in sorted(deltas, key=lambda d: d.index):
            body = {"message": {"role": "assistant", "content": d.text}} if self.chat else {"text": d.text}
            choices.append({"index": d.index, **body, "logprobs": self._logprobs(d), "finish_reason": d.finish_reason})
        return {**self._head(self.kind), "choices": choices, "usage": usage}

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _logprobs(self, d: _Delta) -> dict | None:
        if d.logprobs is None:
            return None
        if self.chat:
            def entry(token_id, logprob):
                s = self._token(token_id)
                return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

            return {"content": [{**entry(e["token_id"], e["logprob"]), "top_logprobs": [entry(*t) for t in e["top"]]}
                                for e in d.logprobs]}
        tokens = [self._token(e["token_id"]) for e in d.logprobs]
        offsets, offset = [], self.text_offset.get(d.index, 0)
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        self.text_offset[d.index] = offset
        return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in d.logprobs],  # null: an echoed first token
                "top_logprobs": [None if e["top"] is None else {self._token(t): lp for t, lp in e["top"]}
                                 for e in d.logprobs],
                "text_offset": offsets}


# --- the app -------------------------------------------------------------------------------------------

def build_app(engine: LLMEngine, model_name: str, *, max_waiting: int = 256,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """A FastAPI app serving `engine` as `model_name`. Its lifespan starts and stops the engine thread;
    `app.state.engine` is the AsyncEngine (e.g. for `.stats()`)."""
    if engine.tokenizer is None:
        raise NanoforgeError("the server needs an engine with a tokenizer (text, chat, stop strings)",
                             param="tokenizer")
    async_engine = AsyncEngine(engine, max_waiting=max_waiting)
    metrics = _Metrics()
    async_engine.on_finished = metrics.observe
    api = _Api(async_engine, model_name, max_request_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(async_engine.shutdown)

    app = FastAPI(title="nanoforge", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = async_engine

    @app.exception_handler(NanoforgeError)
    async def nanoforge_error(request: Request, e: NanoforgeError):
        metrics.rejected.labels(str(e.status)).inc()
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found"}.get(e.status_code)
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {e.detail}", e.status_code, code=code),
                            status_code=e.status_code, headers=e.headers)

    @app.exception_handler(InternalError)
    async def engine_failure(request: Request, e: InternalError):  # logged by the engine thread already
        metrics.rejected.labels("500").inc()
        return JSONResponse(error_body(str(e), 500), status_code=500)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        metrics.rejected.labels("500").inc()
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", 500), status_code=500)

    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat, methods=["POST"])

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [api.model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != model_name:
            raise NanoforgeError(f"the model {model!r} does not exist; this server serves {model_name!r}",
                                 param="model", status=404)
        return api.model_card()

    @app.get("/health")
    async def health():
        if not async_engine.is_alive:
            raise NanoforgeError("the engine is not running", status=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        metrics.engine.stats = await async_engine.stats_async()
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


class Server(uvicorn.Server):
    """uvicorn, with a graceful drain: on shutdown (SIGTERM, SIGINT) new requests get 503 at once; those in
    flight have `grace` seconds to finish, then end with an error event (streams) or a 503."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *, grace: float = 30.0,
                 log_level: str = "info"):
        # uvicorn's own deadline comes after ours, so requests end with our error, not a cut connection
        # (one access-log line per request costs the event loop more than it tells; on with log_level "debug")
        super().__init__(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                        access_log=log_level == "debug", timeout_graceful_shutdown=grace + 5))
        self.engine: AsyncEngine = app.state.engine
        self.grace = grace

    async def shutdown(self, sockets=None) -> None:
        self.engine.stop_accepting()
        deadline = asyncio.get_running_loop().call_later(
            self.grace, self.engine.abort_all, f"the server shut down before the request finished "
                                               f"(--shutdown-timeout {self.grace:g} s)")
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()


def run_server(args, on_ready=None) -> int:
    """`nanoforge serve`: load the model, bind, print the address, serve until SIGTERM / Ctrl-C.

    `on_ready(base_url)`, if given, runs in a thread once the server accepts requests."""
    from pathlib import Path

    from nanoforge.serve.llm_engine import EngineConfig

    config = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=args.max_model_len, block_size=args.block_size,
                          kv_cache_memory=int(args.kv_cache_memory * 2**30) if args.kv_cache_memory else None,
                          enable_prefix_caching=not args.no_prefix_caching, device=args.device, dtype=args.dtype)
    engine = LLMEngine.from_pretrained(args.model, config)
    name = args.served_model_name or Path(args.model).resolve().name
    app = build_app(engine, name, max_waiting=args.max_waiting, max_request_bytes=args.max_request_bytes)
    server = Server(app, args.host, args.port, grace=args.shutdown_timeout, log_level=args.log_level)
    sock = server.config.bind_socket()
    host, port = sock.getsockname()[:2]
    print(f"nanoforge serve: {name} at http://{host}:{port}/v1 (context {engine.max_model_len} tokens, "
          f"{engine.stats()['kv_blocks_total']} KV blocks)", flush=True)
    if on_ready is not None:
        def wait_then_call():
            while not server.started and not server.should_exit:
                time.sleep(0.05)
            if server.started:
                on_ready(f"http://{host}:{port}/v1")

        threading.Thread(target=wait_then_call, daemon=True).start()
    server.run(sockets=[sock])
    return 0
