"""Turning a stream of engine outputs into OpenAI responses: whole JSON, or server-sent events.

What feeds it is any `OutputStream`: an async iterator of `(prompt_index,
RequestOutput)` with cumulative outputs, `request_ids` (one per prompt) and
`abort()`. The single server's comes from its `AsyncEngine`; the conductor's
from the prefill and decode instances it hands the request to. Both render
through `respond`, so a client cannot tell them apart.

A stream sends chunks as tokens arrive, the usage (when asked for), an error
event if the request fails, then `data: [DONE]`. A client that disconnects has
its requests aborted (streaming: the response generator is cancelled;
otherwise a watcher on the connection cancels the handler).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanoforge.errors import InternalError, NanoforgeError
from nanoforge.serve.api.protocol import ParsedRequest, error_body, usage
from nanoforge.serve.llm_engine import RequestOutput

log = logging.getLogger("nanoforge.serve")


class OutputStream(Protocol):
    request_ids: list[str]

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]: ...

    def abort(self) -> None: ...


# --- turning cumulative engine outputs into per-choice deltas ---------------------------------------

@dataclass
class Delta:
    index: int  # choice index: prompt_index * n + completion index
    text: str
    logprobs: list | None  # engine entries for the new tokens, when asked for
    finish_reason: str | None


class Choices:
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
        self.cached: dict[int, int] = {}  # prompt index -> its prompt tokens served from a cache

    @property
    def cached_tokens(self) -> int:
        return sum(self.cached.values())

    def deltas(self, prompt_index: int, out: RequestOutput) -> list[Delta]:
        if out.error:  # e.g. the sequence outgrew the whole KV cache
            raise NanoforgeError(out.error, status=400)
        self.cached[prompt_index] = out.num_cached_tokens
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
            result.append(Delta(index, text, logprobs, c.finish_reason))
            if c.finish_reason:
                self.sent[index] = None
                self.completion_tokens += len(c.token_ids)
            else:
                self.sent[index] = (end, len(c.token_ids))
        return result


def _prompt_entries(out: RequestOutput) -> list[dict]:
    """The engine's prompt logprobs, the first token (which nothing predicts) given an entry without any."""
    return [{"token_id": out.prompt_token_ids[0], "logprob": None, "top": None}, *out.prompt_logprobs[1:]]


# --- OpenAI's JSON shapes -------------------------------------------------------------------------------

class Render:
    """OpenAI's JSON shapes for one request: completions or chat, whole or as stream chunks."""

    def __init__(self, kind: str, rid: str, model: str, tokenizer):
        self.chat = kind == "chat.completion"
        self.kind, self.id, self.model, self.tokenizer = kind, rid, model, tokenizer
        self.chunk_kind = "chat.completion.chunk" if self.chat else "text_completion"
        self.created = int(time.time())
        self.text_offset: dict[int, int] = {}  # completions logprobs: characters of tokens so far, per choice

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def first_chunks(self, num_prompts: int, n: int) -> list[dict]:
        """Chat streams open every choice with the assistant's role."""
        if not self.chat:
            return []
        return [{**self._head(self.chunk_kind),
                 "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]} for i in range(num_prompts * n)]

    def chunk(self, d: Delta) -> dict:
        if self.chat:
            choice = {"index": d.index, "delta": {"content": d.text}}
        else:
            choice = {"index": d.index, "text": d.text}
        choice.update(logprobs=self._logprobs(d), finish_reason=d.finish_reason)
        return {**self._head(self.chunk_kind), "choices": [choice]}

    def usage_chunk(self, usage_: dict) -> dict:
        return {**self._head(self.chunk_kind), "choices": [], "usage": usage_}

    def response(self, deltas: list[Delta], usage_: dict) -> dict:
        choices = []
        for d in sorted(deltas, key=lambda d: d.index):
            body = {"message": {"role": "assistant", "content": d.text}} if self.chat else {"text": d.text}
            choices.append({"index": d.index, **body, "logprobs": self._logprobs(d), "finish_reason": d.finish_reason})
        return {**self._head(self.kind), "choices": choices, "usage": usage_}

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _logprobs(self, d: Delta) -> dict | None:
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


# --- whole responses and streams --------------------------------------------------------------------------

async def respond(request: Request, parsed: ParsedRequest, stream: OutputStream, model_name: str,
                  tokenizer) -> Response:
    """The response to `parsed`, whose requests `stream` is running: SSE if it asked to stream, else JSON."""
    render = Render(parsed.kind, parsed.request_id, model_name, tokenizer)
    choices = Choices(parsed.params.n, parsed.params.stop, parsed.echo)
    prompt_tokens = sum(map(len, parsed.prompts))
    if parsed.stream:
        events = _events(stream, choices, render, prompt_tokens if parsed.include_usage else None)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    finals = await unless_disconnected(request, collect(stream))
    if finals is None:
        return Response(status_code=499)  # nobody is listening
    deltas = [d for i, out in enumerate(finals) for d in choices.deltas(i, out)]
    return JSONResponse(render.response(deltas, usage(prompt_tokens, choices.completion_tokens,
                                                      choices.cached_tokens)))


async def collect(stream: OutputStream) -> list[RequestOutput]:
    """The final output of every prompt, in order."""
    finals: dict[int, RequestOutput] = {}
    try:
        async for i, out in stream:
            if out.finished:
                finals[i] = out
    finally:
        stream.abort()  # a no-op unless we were cancelled or failed
    return [finals[i] for i in range(len(finals))]


async def unless_disconnected(request: Request, work):
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


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _events(stream: OutputStream, choices: Choices, render: Render,
                  usage_prompt_tokens: int | None) -> AsyncIterator[str]:
    """Server-sent events: chunks as tokens arrive, the usage (when asked for), an error event if the request
    fails, then [DONE]."""
    try:
        for chunk in render.first_chunks(len(stream.request_ids), choices.n):
            yield sse(chunk)
        async for i, out in stream:
            for d in choices.deltas(i, out):
                yield sse(render.chunk(d))
        if usage_prompt_tokens is not None:
            yield sse(render.usage_chunk(usage(usage_prompt_tokens, choices.completion_tokens,
                                               choices.cached_tokens)))
    except NanoforgeError as e:
        yield sse(error_body(str(e), e.status, e.param))
    except InternalError as e:  # the engine thread logged it with its traceback
        yield sse(error_body(str(e), 500))
    except Exception as e:  # a bug: tell the client, keep the server up
        log.exception("error while streaming %s", render.id)
        yield sse(error_body(f"internal error: {type(e).__name__}: {e}", 500))
    finally:
        stream.abort()  # the client left (we are cancelled) or we failed: free the blocks
    yield "data: [DONE]\n\n"
