"""OpenAI's request protocol: reading a body, checking every field, and the error bodies.

One `RequestParser` turns an HTTP request into a `ParsedRequest` (token-id
prompts, `SamplingParams`, what to echo, whether to stream) or raises
`NanoforgeError` with the status and the field at fault. The single server and
the conductor parse with it, so both answer bad input with the same bodies:

    413 over the size limit            422 not UTF-8 JSON holding an object
    400 a field of the wrong type or range, an unknown field, a prompt over the context
    404 an unknown model               (429 and 503 come from whoever queues the request)

Errors have OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
Fields that OpenAI defines but we do not implement are accepted only at their
neutral value; unknown fields are rejected, as OpenAI does.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse

from nanoforge.errors import NanoforgeError
from nanoforge.serve.sampling_params import SamplingParams
from nanoforge.tokenizer import CHAT_ROLES, Tokenizer

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


def error_response(e: NanoforgeError) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after)} if e.status in (429, 503) else None
    return JSONResponse(error_body(str(e), e.status, e.param), status_code=e.status, headers=headers)


# --- reading and checking a request body -----------------------------------------------------------

def _no_constants(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request, limit: int) -> dict:
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


class Fields:
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


def _stop_strings(fields: Fields) -> list[str] | None:
    stop = fields.data.get("stop")
    if stop is None:
        return None
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise NanoforgeError(f"stop must be a non-empty string or a list of them, got {stop!r:.80}", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise NanoforgeError(f"stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed", param="stop")
    return stop


def token_ids(value) -> list[int] | None:
    """`value` as a list of token ids, or None if it is not a list of integers."""
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    return None


def _batch(prompt) -> list:
    """A completions `prompt` as a batch: text or token ids alone are a batch of one."""
    return [prompt] if isinstance(prompt, str) or token_ids(prompt) is not None else prompt


def _sampling_params(fields: Fields, max_tokens: int, logprobs: int | None,
                     prompt_logprobs: int | None = None) -> SamplingParams:
    """Ranges are SamplingParams' to check (NanoforgeError naming the field)."""
    stop_token_ids = fields.get("stop_token_ids")
    if stop_token_ids is not None and token_ids(stop_token_ids) is None:
        raise NanoforgeError("stop_token_ids must be a list of integers", param="stop_token_ids")
    return SamplingParams(n=fields.get("n", 1), temperature=fields.get("temperature", 1.0),
                          top_p=fields.get("top_p", 1.0), top_k=fields.get("top_k", -1), seed=fields.get("seed"),
                          max_tokens=max_tokens, stop=_stop_strings(fields), stop_token_ids=stop_token_ids,
                          ignore_eos=fields.get("ignore_eos", False), logprobs=logprobs,
                          prompt_logprobs=prompt_logprobs)


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


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens` counts prompt tokens served from a cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


# --- whole requests ------------------------------------------------------------------------------------

@dataclass
class ParsedRequest:
    """A checked request, ready to queue: one token-id prompt per completion prompt (chat: exactly one)."""

    kind: str  # "text_completion" or "chat.completion"
    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool  # streams: send a usage chunk at the end
    echo: list[str] | None  # completions with echo: each prompt's text, sent before its completion
    arrival: float  # time.monotonic() when the request arrived


class RequestParser:
    """Checks OpenAI requests for one served model; `completion` and `chat` raise NanoforgeError or return a
    ParsedRequest."""

    def __init__(self, tokenizer: Tokenizer, model_name: str, max_model_len: int, *, max_batch: int,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES):
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.max_batch = max_batch  # most prompts in one completions request
        self.max_request_bytes = max_request_bytes
        self.created = int(time.time())

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "nanoforge",
                "max_model_len": self.max_model_len}

    def check_model_name(self, model: str) -> None:
        if model != self.model_name:
            raise NanoforgeError(f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                                 param="model", status=404)

    async def completion(self, request: Request) -> ParsedRequest:
        arrival = time.monotonic()
        fields = await self._fields(request, _COMPLETION_FIELDS)
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
        return self._parsed(fields, "text_completion", f"cmpl-{uuid.uuid4().hex}", prompts, params, texts, arrival)

    async def chat(self, request: Request) -> ParsedRequest:
        arrival = time.monotonic()
        fields = await self._fields(request, _CHAT_FIELDS)
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
        return self._parsed(fields, "chat.completion", f"chatcmpl-{uuid.uuid4().hex}", [prompt], params, None,
                            arrival)

    # --- pieces -------------------------------------------------------------------------------------

    async def _fields(self, request: Request, spec: dict) -> Fields:
        fields = Fields(await read_json(request, self.max_request_bytes), spec)
        model = fields.get("model")
        if model is None:
            raise NanoforgeError("model is required", param="model")
        self.check_model_name(model)
        return fields

    @staticmethod
    def _parsed(fields: Fields, kind: str, rid: str, prompts: list[list[int]], params: SamplingParams,
                echo: list[str] | None, arrival: float) -> ParsedRequest:
        include_usage = fields.get("stream_options", {}).get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise NanoforgeError("stream_options.include_usage must be a boolean", param="stream_options")
        return ParsedRequest(kind, rid, prompts, params, fields.get("stream", False), include_usage, echo, arrival)

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

    async def _completion_prompts(self, prompt) -> list[list[int]]:
        """`prompt` as token ids: text, token ids, or a non-empty batch of either."""
        prompt = _batch(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            batch = await asyncio.to_thread(self.tokenizer.encode_prompt_batch, prompt)
        elif isinstance(prompt, list) and prompt and all(token_ids(p) is not None for p in prompt):
            batch = prompt
        else:
            raise NanoforgeError("prompt must be a string, a list of token ids, or a non-empty list of either "
                                 f"(got {type(prompt).__name__})", param="prompt")
        if len(batch) > self.max_batch:
            raise NanoforgeError(f"prompt is a batch of {len(batch)}; at most {self.max_batch} are allowed",
                                 param="prompt")
        return batch
