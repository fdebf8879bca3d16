"""AsyncEngine: one `LLMEngine`, driven by one background thread, shared by many asyncio requests.

`LLMEngine` is not thread-safe, so a single thread owns it and does everything
that touches it:

    HTTP handlers (event loop)                 engine thread
    await engine.add(prompts, params)  ──fn──▶  engine.add_request(...)   validate, queue (or raise)
    stream.abort()  (client went away) ──fn──▶  engine.abort(...)         blocks freed at once
    await engine.stats_async()         ──fn──▶  engine.stats()
                                                while work: engine.step() (all in-flight requests batched)
    async for i, out in stream  ◀──────────────  loop.call_soon_threadsafe(put outputs)

Commands are plain functions put on a thread-safe queue; the thread runs them
between steps and answers through a `concurrent.futures.Future`. When nothing
is running it blocks on that queue, so an idle server burns no CPU.

One HTTP request may hold several engine requests (a batch of prompts); a
`RequestStream` yields `(prompt_index, RequestOutput)` for all of them. The
engine's outputs are cumulative, so a consumer that falls behind only sees the
latest output of each prompt.

Failures stay contained: a request the engine rejects raises `NanoforgeError`
in its own handler; if `step()` itself raises, the requests in flight end with
a server error and the loop goes on serving new ones.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections import defaultdict
from collections.abc import AsyncIterator, Callable

import torch

from nanoforge.errors import InternalError, NanoforgeError
from nanoforge.serve.llm_engine import LLMEngine, RequestOutput, frozen_heap
from nanoforge.serve.sampling_params import SamplingParams

log = logging.getLogger("nanoforge.serve")

_STOP = object()  # tells the engine thread to exit


class RequestStream:
    """Outputs of the engine requests made for one HTTP request, delivered on the caller's event loop."""

    def __init__(self, engine: AsyncEngine, request_ids: list[str]):
        self._engine = engine
        self.request_ids = request_ids
        self._index = {rid: i for i, rid in enumerate(request_ids)}
        self._unfinished = set(request_ids)
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()  # RequestOutput, or an Exception that ends the stream

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self._unfinished:
            items = [await self.queue.get()]
            while not self.queue.empty():  # catch up: outputs are cumulative, keep the newest per request
                items.append(self.queue.get_nowait())
            latest: dict[str, RequestOutput] = {}
            for item in items:
                if isinstance(item, Exception):  # the engine thread already dropped every request of ours
                    self._unfinished.clear()
                    raise item
                latest[item.request_id] = item
            for rid, out in latest.items():
                if out.finished:
                    self._unfinished.discard(rid)
                yield self._index[rid], out

    def abort(self) -> None:
        """Stop whatever has not finished (the client left); a no-op once everything has."""
        if self._unfinished:
            self._engine.abort(list(self._unfinished))
            self._unfinished.clear()


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, max_waiting: int = 256):
        if max_waiting < 1:
            raise NanoforgeError(f"max_waiting must be >= 1, got {max_waiting}", param="max_waiting")
        self.engine = engine
        self.max_waiting = max_waiting
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine request id -> its stream; engine thread only
        self._thread = threading.Thread(target=self._run, name="nanoforge-engine", daemon=True)
        self._accepting = True
        self._stopped = False
        self._lock = threading.Lock()  # orders _submit's put against the thread's final drain
        self.on_finished: Callable[[RequestOutput], None] | None = None  # metrics hook, called on the engine thread

    # --- called from any thread / the event loop ------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    async def add(self, prompts: list[list[int]], params: SamplingParams, *, request_id: str,
                  arrival_time: float | None = None, outputs: list | None = None) -> RequestStream:
        """Queue one engine request per prompt, all or none; raises NanoforgeError (400, 429, 503). `outputs[i]`,
        when given, resumes prompt i from tokens another engine generated (`LLMEngine.add_request`)."""
        if not self._accepting:
            raise NanoforgeError("the server is shutting down", status=503)
        ids = [f"{request_id}-{i}" for i in range(len(prompts))] if len(prompts) > 1 else [request_id]
        stream = RequestStream(self, ids)

        def add_all():
            waiting = self.engine.num_waiting()
            if waiting + len(prompts) > self.max_waiting:
                raise NanoforgeError(f"the server is busy: {waiting} requests are "
                                     f"waiting (limit {self.max_waiting}); retry later", status=429)
            added = []
            try:
                for i, (rid, prompt) in enumerate(zip(ids, prompts)):
                    self.engine.add_request(prompt, params, request_id=rid, arrival_time=arrival_time,
                                            outputs=outputs[i] if outputs else None)
                    added.append(rid)
            except Exception:
                for rid in added:
                    self.engine.abort(rid)
                raise
            self._streams.update(dict.fromkeys(ids, stream))

        try:
            await asyncio.wrap_future(self._submit(add_all))
        except asyncio.CancelledError:  # the client left while we queued: undo whatever got in
            stream.abort()
            raise
        return stream

    def abort(self, request_ids: list[str]) -> None:
        def drop():
            for rid in request_ids:
                self._streams.pop(rid, None)
                self.engine.abort(rid)

        self._submit(drop)

    def stats(self, timeout: float | None = 30.0) -> dict:
        """`LLMEngine.stats()`, taken on the engine thread between steps (blocks; not for the event loop)."""
        return self._submit(self.engine.stats).result(timeout)

    async def stats_async(self) -> dict:
        return await asyncio.wrap_future(self._submit(self.engine.stats))

    def stop_accepting(self) -> None:
        """Graceful shutdown, phase 1: new requests get 503; those in flight go on."""
        self._accepting = False

    def abort_all(self, reason: str) -> None:
        """End every request in flight: its stream raises NanoforgeError(reason, status=503)."""
        self._submit(lambda: self._fail_all(NanoforgeError(reason, status=503)))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is left, stop the engine thread and wait for it."""
        self._accepting = False
        if self._thread.is_alive():
            self._commands.put(_STOP)
            self._thread.join(timeout)

    # --- the engine thread ------------------------------------------------------------------------

    def _submit(self, fn: Callable) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._stopped or not self._thread.is_alive():  # never started, or gone: nobody would answer
                fut.set_exception(NanoforgeError("the engine is not running", status=503))
            else:
                self._commands.put((fn, fut))
        return fut

    def _run(self) -> None:
        device = self.engine.model.embed.weight.device
        if device.type == "cuda":
            torch.cuda.set_device(device)  # a new thread starts on GPU 0; Triton launches on the current one
        try:
            with frozen_heap():  # what the server built stays out of the collector's walks while it serves
                self._loop()
        except BaseException:  # a bug in this file: say so, and do not leave anyone waiting
            log.exception("the engine thread crashed")
        finally:
            self._close()

    def _loop(self) -> None:
        while True:
            # Idle: block until a command arrives. Busy: take what is queued and step.
            try:
                cmd = self._commands.get(block=not self.engine.has_unfinished())
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if cmd is _STOP:
                    return
                fn, fut = cmd
                try:
                    fut.set_result(fn())
                except Exception as e:
                    fut.set_exception(e)
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if self.engine.has_unfinished():
                try:
                    outputs = self.engine.step()
                except Exception as e:  # a bug or a device error: fail what is in flight, keep serving
                    log.exception("engine step failed; aborting the %d requests in flight", len(self._streams))
                    self._fail_all(InternalError(f"internal error in the engine step: {type(e).__name__}: {e}"))
                    continue
                self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        # one wake-up per event loop and step, however many requests progressed
        batches: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for out in outputs:
            stream = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted after the step was scheduled
            if out.finished and self.on_finished is not None:
                self.on_finished(out)
            batches[stream.loop].append((stream.queue, out))
        for loop, items in batches.items():
            _call_soon(loop, items)

    def _fail_all(self, error: Exception) -> None:
        batches: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for rid, stream in self._streams.items():
            try:
                self.engine.abort(rid)
            except Exception:  # the engine is already broken; the client must still hear about it
                log.exception("could not abort %s", rid)
            batches[stream.loop].append((stream.queue, error))
        self._streams.clear()
        for loop, items in batches.items():
            _call_soon(loop, items)

    def _close(self) -> None:
        """End every request in flight and every queued command; nothing is accepted afterwards."""
        with self._lock:
            self._stopped = True
        self._fail_all(NanoforgeError("the server shut down before the request finished", status=503))
        while True:  # commands queued before _stopped was set
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd is not _STOP:
                cmd[1].set_exception(NanoforgeError("the engine is not running", status=503))


def _put_all(items: list) -> None:
    for q, item in items:
        q.put_nowait(item)


def _call_soon(loop: asyncio.AbstractEventLoop, items: list) -> None:
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:  # that event loop is closed: nobody is listening any more
        pass
