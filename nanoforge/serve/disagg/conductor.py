"""The conductor: the cluster's OpenAI-compatible front door (`nanoforge conductor`).

    nanoforge conductor --prefill URL... --decode URL... [--store MASTER] [--policy cache-aware]
                        [--ttft-slo S] [--tpot-slo S]
    nanoforge conductor --colocated URL... [...]          (instances started with --role both)

It serves the single server's API with the single server's code (`serve/api/`:
the same parsing, 4xx bodies, streams, usage and `/metrics`), but instead of an
engine, its frontend hands every prompt over to a prefill instance and then a
decode instance (`handover.py` has the protocol):

1. Check the request as an engine would (`check_request` against the
   instances' limits), compute the prompt's chained block keys, ask the pool
   how many leading blocks it holds (one call, bounded in time), and let the
   `Router` choose the instances, or reject early with 429 (`router.py`).
2. POST the prompt to the prefill instance with max_tokens 1: it computes
   what neither its cache nor the pool holds, saves the blocks, answers with
   the first tokens. They go to the client at once.
3. POST the prompt and first tokens to the decode instance: it loads the
   blocks from the pool and streams the rest, which goes on to the client.

Over colocated instances (`--colocated`, the baseline at the same GPU count) step 1
is the same, with the Router choosing one instance for the whole request (its
`colocated` mode, as the cluster simulator's), and steps 2-3 are one POST to
that instance's /disagg/generate, whose events stream on to the client; the
router learns from the first event what it learns from a prefill answer, and
from the rest what it learns from a decode instance.

An instance that cannot be reached, or drops the connection before its answer
began, is marked down (a health check brings it back) and the step is retried
on another; a decode instance lost mid-stream ends its requests with an error
event (503) at once. Every wait is bounded (`--request-timeout`); a client that
leaves cancels its requests on the instances.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nanoforge.errors import InternalError, NanoforgeError
from nanoforge.serve.api.app import openai_app, serve_app
from nanoforge.serve.api.metrics import Metrics, StatsCollector, counter, gauge
from nanoforge.serve.api.protocol import DEFAULT_MAX_REQUEST_BYTES, RequestParser
from nanoforge.serve.block_manager import prefix_block_hashes
from nanoforge.serve.disagg.handover import OutputDecoder, handover_body
from nanoforge.serve.disagg.router import Instance, Plan, Router
from nanoforge.serve.kv_connector import Breaker, PoolError, block_key
from nanoforge.serve.llm_engine import CompletionOutput, RequestOutput
from nanoforge.serve.sampling_params import SamplingParams
from nanoforge.serve.scheduler import SchedulerConfig, check_request
from nanoforge.serve.sequence import SequenceGroup
from nanoforge.tokenizer import IncrementalDecoder, Tokenizer

log = logging.getLogger("nanoforge.serve")

POOL_LOOKUP_TIMEOUT_S = 0.25  # a lookup slower than this counts as "nothing cached" (and the pool is left alone)


def base_url(url: str) -> str:
    """http://host:port from http://host:port, http://host:port/ or http://host:port/v1."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


# --- learning the cluster ------------------------------------------------------------------------------

def discover(prefill_urls: list[str], decode_urls: list[str], timeout: float,
             colocated_urls: list[str] = ()) -> list[Instance]:
    """Every instance's /disagg/info, waiting up to `timeout` s for those still starting; NanoforgeError (one
    line) if one never answers, has the wrong role, or serves another model than the rest. Colocated instances
    (role "both") are listed alone: a conductor routes to them or to prefill and decode instances."""
    if colocated_urls and (prefill_urls or decode_urls):
        raise NanoforgeError("give colocated instances, or prefill and decode instances, not both kinds",
                             param="colocated")
    if not colocated_urls and not (prefill_urls and decode_urls):
        raise NanoforgeError("a conductor needs --prefill and --decode instances, or --colocated ones",
                             param="prefill")
    instances = [Instance(base_url(u), "prefill") for u in prefill_urls] + \
                [Instance(base_url(u), "decode") for u in decode_urls] + \
                [Instance(base_url(u), "both") for u in colocated_urls]
    deadline = time.monotonic() + timeout
    waiting = list(instances)
    told = False
    with httpx.Client(timeout=5.0) as client:
        while waiting:
            for inst in list(waiting):
                try:
                    r = client.get(inst.url + "/disagg/info")
                except httpx.HTTPError:
                    continue
                if r.status_code != 200:
                    raise NanoforgeError(f"{inst.url} is not a nanoforge instance (GET /disagg/info answered "
                                         f"{r.status_code}): start it with nanoforge serve --role ...", param="url")
                inst.info = r.json()
                waiting.remove(inst)
            if not waiting:
                break
            if time.monotonic() > deadline:
                raise NanoforgeError(f"no answer from {', '.join(i.url for i in waiting)} within {timeout:g} s",
                                     param="url")
            if not told:
                print(f"conductor: waiting for {', '.join(i.url for i in waiting)} ...", flush=True)
                told = True
            time.sleep(0.25)
    first = instances[0].info
    for inst in instances:
        if inst.info["role"] not in (inst.role, "both"):
            raise NanoforgeError(f"{inst.url} is a {inst.info['role']} instance, listed as a {inst.role} one",
                                 param=inst.role)
        for key in ("model", "kv_namespace", "block_size", "max_model_len", "vocab_size", "tokenizer"):
            if inst.info[key] != first[key]:
                raise NanoforgeError(f"{inst.url} and {instances[0].url} differ in {key} "
                                     f"({str(inst.info[key])[:60]!r} vs {str(first[key])[:60]!r}): a conductor's "
                                     f"instances must serve the same model the same way", param=key)
    return instances


class PoolLookup:
    """How many leading blocks of a prompt the pool holds: one `contains` call, off the event loop, bounded."""

    def __init__(self, store, namespace: str | None):
        self.store, self.namespace = store, namespace
        self.breaker = Breaker()
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nanoforge-pool-lookup")
        self.lookups = self.hit_blocks = 0

    async def leading_blocks(self, hashes: list[int]) -> int:
        if self.store is None or self.namespace is None or not hashes or not self.breaker.up:
            return 0
        keys = [block_key(self.namespace, h) for h in hashes]
        self.lookups += 1
        call = asyncio.get_running_loop().run_in_executor(self.executor, self.store.contains, keys)
        try:
            found = await asyncio.wait_for(call, POOL_LOOKUP_TIMEOUT_S)
        except (TimeoutError, PoolError) as e:
            self.breaker.failed(f"a lookup failed ({type(e).__name__}: {e})")
            return 0
        n = next((i for i, ok in enumerate(found) if not ok), len(found))
        self.hit_blocks += n
        return n


# --- one request's outputs ----------------------------------------------------------------------------------

class RemoteStream:
    """An OutputStream (`serve/api/streaming.py`) over the prompts of one HTTP request, each run by its own task."""

    def __init__(self, request_ids: list[str], runs: list[AsyncIterator[RequestOutput]], on_close):
        self.request_ids = request_ids
        self.queue: asyncio.Queue = asyncio.Queue()
        self._unfinished = set(range(len(runs)))
        self._on_close = on_close
        self.tasks = [asyncio.create_task(self._pump(i, run)) for i, run in enumerate(runs)]

    async def _pump(self, i: int, run: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in run:
                self.queue.put_nowait((i, out))
        except Exception as e:  # NanoforgeError, InternalError, or a bug: the consumer raises it
            self.queue.put_nowait(e)

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self._unfinished:
            item = await self.queue.get()
            if isinstance(item, Exception):
                self.abort()
                raise item
            i, out = item
            if out.finished:
                self._unfinished.discard(i)
            yield i, out
        self._on_close(self)

    def fail(self, error: Exception) -> None:
        """End the stream with `error` (the conductor shuts down)."""
        self.queue.put_nowait(error)
        for t in self.tasks:
            t.cancel()

    def abort(self) -> None:
        """Stop what has not finished (the client left): cancelling a task closes its connections to instances."""
        if self._unfinished:
            for t in self.tasks:
                t.cancel()
            self._unfinished.clear()
        self._on_close(self)


# --- the conductor ---------------------------------------------------------------------------------------

class Conductor:
    """The frontend `openai_app` routes to (see serve/api/app.py) for a cluster of instances."""

    def __init__(self, instances: list[Instance], *, policy: str = "cache-aware", store=None,
                 ttft_slo: float | None = None, tpot_slo: float | None = None, request_timeout: float = 300.0,
                 health_interval: float = 1.0, seed: int = 0):
        info = instances[0].info
        self.instances = instances
        both = [i for i in instances if i.role == "both"]  # colocated instances come alone (`discover`)
        self.router = Router(both or [i for i in instances if i.role == "prefill"],
                             both or [i for i in instances if i.role == "decode"], policy, ttft_slo=ttft_slo,
                             tpot_slo=tpot_slo, seed=seed, colocated=bool(both))
        self.tokenizer = Tokenizer.from_dict(info["tokenizer"])
        self.model_name, self.max_model_len, self.block_size = info["model"], info["max_model_len"], info["block_size"]
        self.limits = SchedulerConfig(max_model_len=self.max_model_len, block_size=self.block_size,
                                      num_gpu_blocks=min(i.info["num_gpu_blocks"] for i in instances),
                                      max_num_seqs=min(i.info["max_num_seqs"] for i in instances),
                                      vocab_size=info["vocab_size"])
        self.pool = PoolLookup(store, info["kv_namespace"])
        self.timeout = httpx.Timeout(request_timeout, connect=5.0)
        self.health_interval = health_interval
        self.client: httpx.AsyncClient | None = None
        self.accepting = True
        self.streams: set[RemoteStream] = set()
        self.counters = dict.fromkeys(("retries", "instance_failures", "prompt_tokens", "cached_prompt_tokens"), 0)
        self.on_finished = None  # Metrics.observe
        self._watch: asyncio.Task | None = None

    # --- the frontend interface ------------------------------------------------------------------------

    async def start(self) -> None:
        self.client = httpx.AsyncClient(timeout=self.timeout, limits=httpx.Limits(max_connections=None,
                                                                                  max_keepalive_connections=64))
        self._watch = asyncio.create_task(self._watch_health())

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        self.abort_all("the conductor shut down before the request finished")
        if self.client is not None:
            await self.client.aclose()
        self.pool.executor.shutdown(wait=False, cancel_futures=True)

    @property
    def is_alive(self) -> bool:
        return self.accepting and any(i.healthy for i in self.router.prefill) and \
            any(i.healthy for i in self.router.decode)

    def stop_accepting(self) -> None:
        self.accepting = False

    def abort_all(self, reason: str) -> None:
        for stream in list(self.streams):
            stream.fail(NanoforgeError(reason, status=503))

    async def stats_async(self) -> dict:
        return {"instances": self.instances, "in_flight": len(self.streams),
                "rejected": dict(self.router.rejected), "pool_lookups": self.pool.lookups,
                "pool_hit_blocks": self.pool.hit_blocks, **self.counters}

    async def add(self, prompts: list[list[int]], params: SamplingParams, *, request_id: str,
                  arrival_time: float | None = None) -> RemoteStream:
        """Check, route (or reject early) and start every prompt; all or none. NanoforgeError 400, 429, 503."""
        if not self.accepting:
            raise NanoforgeError("the server is shutting down", status=503)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        rids = [f"{request_id}-{i}" for i in range(len(prompts))] if len(prompts) > 1 else [request_id]
        for rid, prompt in zip(rids, prompts):
            check_request(self.limits, SequenceGroup(rid, prompt, params))  # the engine's own checks, same errors
        plans = []
        for prompt in prompts:
            hashes = prefix_block_hashes(prompt, self.block_size, (len(prompt) - 1) // self.block_size)
            pool_blocks = await self.pool.leading_blocks(hashes)
            plans.append((self.router.plan(len(prompt), hashes, pool_blocks, params.max_tokens), pool_blocks))
        stream = RemoteStream(rids, [self._run(rid, prompt, params, plan, pool_blocks, arrival)
                                     for rid, prompt, (plan, pool_blocks) in zip(rids, prompts, plans)],
                              self.streams.discard)
        self.streams.add(stream)
        return stream

    # --- one prompt --------------------------------------------------------------------------------------

    async def _run(self, rid: str, prompt: list[int], params: SamplingParams, plan: Plan, pool_blocks: int,
                   arrival: float) -> AsyncIterator[RequestOutput]:
        """The prompt's cumulative outputs: the first tokens from the prefill instance, the rest from decode (or
        all from one colocated instance)."""
        if self.router.colocated:
            metrics = {"arrival_time": arrival}
            async for out in self._generate(rid, prompt, params, plan, pool_blocks):
                metrics.setdefault("first_token_time", time.monotonic())
                out.metrics = dict(metrics)
                if out.finished:
                    out.metrics["finish_time"] = time.monotonic()
                    self._finished(out)
                yield out
            return
        first_params = dataclasses.replace(params, max_tokens=min(params.max_tokens, 1))
        answer = await self._prefill(rid, prompt, first_params, plan, pool_blocks)
        first = OutputDecoder(rid, prompt).apply(answer["output"])
        metrics = {"arrival_time": arrival, "first_token_time": time.monotonic()}
        done = [c for c in first.outputs if self._ends_at_first(c, params, len(prompt))]
        pending = [dataclasses.replace(c, text=self._text(c.token_ids), finish_reason=None)
                   for c in first.outputs if c.index not in {d.index for d in done}]

        def merged(outputs: list[CompletionOutput], finished: bool, error: str | None) -> RequestOutput:
            out = RequestOutput(rid, None, prompt, sorted([*done, *outputs], key=lambda c: c.index), finished,
                                prompt_logprobs=first.prompt_logprobs, num_cached_tokens=first.num_cached_tokens,
                                metrics=dict(metrics), error=error)
            if finished:
                out.metrics["finish_time"] = time.monotonic()
                self._finished(out)
            return out

        if first.error or not pending:
            yield merged([], True, first.error)
            return
        yield merged(pending, False, None)
        async for out in self._decode(rid, prompt, dataclasses.replace(params, prompt_logprobs=None), pending, plan):
            yield merged(out.outputs, out.finished, out.error)

    def _ends_at_first(self, c: CompletionOutput, params: SamplingParams, prompt_len: int) -> bool:
        """Whether a completion is over after the prefill instance's tokens: it stopped (end token, stop string,
        stop id), or reached max_tokens or the context."""
        return (c.finish_reason not in (None, "length") or len(c.token_ids) >= params.max_tokens
                or prompt_len + len(c.token_ids) >= self.max_model_len)

    def _text(self, token_ids: list[int]) -> str:
        """The text a decode instance's engine will have for these first tokens (not flushed, unlike the prefill
        instance's, whose request ended there: a token may hold part of a UTF-8 character)."""
        decoder = IncrementalDecoder(self.tokenizer)
        return "".join(decoder.push(t) for t in token_ids)

    def _finished(self, out: RequestOutput) -> None:
        self.counters["prompt_tokens"] += len(out.prompt_token_ids)
        self.counters["cached_prompt_tokens"] += out.num_cached_tokens
        if self.on_finished is not None and not out.error:
            self.on_finished(out)

    async def _prefill(self, rid: str, prompt: list[int], params: SamplingParams, plan: Plan,
                       pool_blocks: int) -> dict:
        body = handover_body(rid, prompt, params)
        tried: list[Instance] = []
        while True:
            inst = plan.prefill
            ahead = self.router.prefill_started(plan)
            answer = None
            try:
                r = await self.client.post(inst.url + "/disagg/prefill", json=body)
                if r.status_code == 200:
                    answer = r.json()
                    return answer
                if r.status_code != 503:
                    raise _relayed(inst, r.json(), r.status_code)
                self._lost(inst, "answered 503")
            except httpx.TransportError as e:
                self._lost(inst, f"{type(e).__name__}: {e}")
            finally:
                self.router.prefill_done(plan, ahead, answer and answer["prefill_s"],
                                         answer and answer["computed_tokens"])
            tried.append(inst)
            self.counters["retries"] += 1
            self.router.reroute_prefill(plan, len(prompt), pool_blocks, tuple(tried))

    async def _outputs(self, inst: Instance, path: str, body: dict, rid: str,
                       prompt: list[int]) -> AsyncIterator[RequestOutput]:
        """The cumulative outputs an instance streams for a request (/disagg/decode, /disagg/generate), to the
        finished one; its error answers and events raised as its errors (a 503 as a transport error: routed
        around)."""
        async with self.client.stream("POST", inst.url + path, json=body) as r:
            if r.status_code != 200:
                error = json.loads(await r.aread())
                if r.status_code != 503:
                    raise _relayed(inst, error, r.status_code)
                raise httpx.RemoteProtocolError(f"answered 503: {error['error']['message']}")
            decoder = OutputDecoder(rid, prompt)
            async for line in r.aiter_lines():
                if not line:
                    continue
                event = json.loads(line)
                if "outputs" not in event:  # an error event
                    raise _relayed(inst, event, event["status"])
                out = decoder.apply(event)
                yield out
                if out.finished:
                    return
            raise httpx.RemoteProtocolError("the stream ended before the request finished")

    async def _relay(self, inst: Instance, path: str, body: dict, rid: str,
                     prompt: list[int]) -> AsyncIterator[RequestOutput]:
        """`_outputs`, with an instance that cannot be reached marked down: before its first event the transport
        error goes on (the caller tries another instance), after it the request ends with a 503."""
        events = 0
        try:
            async with contextlib.aclosing(self._outputs(inst, path, body, rid, prompt)) as outs:
                async for out in outs:
                    events += 1
                    yield out
        except httpx.TransportError as e:
            self._lost(inst, f"{type(e).__name__}: {e}")
            if events:
                role = "colocated" if inst.role == "both" else inst.role
                raise NanoforgeError(f"the {role} instance {inst.url} failed during the request "
                                     f"({type(e).__name__}); retry it", status=503) from None
            raise

    async def _on_instances(self, inst: Instance, attempt, another) -> AsyncIterator[RequestOutput]:
        """`attempt(inst)`'s outputs. Where an instance cannot be reached before its first event (`_relay`), the
        same on `another(tried)`: an instance the router picks, not one of those tried so far."""
        tried: list[Instance] = []
        while True:
            try:
                async with contextlib.aclosing(attempt(inst)) as outs:
                    async for out in outs:
                        yield out
                return
            except httpx.TransportError:
                tried.append(inst)
                self.counters["retries"] += 1
                inst = another(tuple(tried))

    async def _generate(self, rid: str, prompt: list[int], params: SamplingParams, plan: Plan,
                        pool_blocks: int) -> AsyncIterator[RequestOutput]:
        """A whole request on the colocated instance the router chose. The router learns what it learns in a
        disaggregated cluster: the first event's delay and computed tokens as a prefill answer's, then the next
        token's delay after it and the time per token of the rest as a decode instance's."""
        body = handover_body(rid, prompt, params)

        async def attempt(inst: Instance) -> AsyncIterator[RequestOutput]:
            ahead = self.router.prefill_started(plan)
            start, batch, pace = time.monotonic(), None, None
            try:
                async with contextlib.aclosing(self._relay(inst, "/disagg/generate", body, rid, prompt)) as outs:
                    async for out in outs:
                        if pace is None:  # the prompt is done: as a prefill instance's answer
                            self.router.prefill_done(plan, ahead, time.monotonic() - start,
                                                     len(prompt) - out.num_cached_tokens)
                            batch, pace = self.router.decode_started(inst), _DecodePace()
                        else:  # the rest: as a decode instance's, from here
                            pace.observe(out)
                        yield out
            finally:
                if pace is None:
                    self.router.prefill_done(plan, ahead, None, None)
                else:
                    self.router.decode_done(inst, batch, *pace.learned(), len(prompt))

        def another(tried: tuple[Instance, ...]) -> Instance:
            self.router.reroute_prefill(plan, len(prompt), pool_blocks, tried)
            plan.decode = plan.prefill
            return plan.prefill

        async for out in self._on_instances(plan.prefill, attempt, another):
            yield out

    async def _decode(self, rid: str, prompt: list[int], params: SamplingParams, pending: list[CompletionOutput],
                      plan: Plan) -> AsyncIterator[RequestOutput]:
        body = handover_body(rid, prompt, params, pending)

        async def attempt(inst: Instance) -> AsyncIterator[RequestOutput]:
            batch, pace = self.router.decode_started(inst), _DecodePace()
            try:
                async with contextlib.aclosing(self._relay(inst, "/disagg/decode", body, rid, prompt)) as outs:
                    async for out in outs:
                        pace.observe(out)
                        yield out
            finally:
                self.router.decode_done(inst, batch, *pace.learned(), len(prompt))

        def another(tried: tuple[Instance, ...]) -> Instance:
            plan.decode = self.router.choose_decode(exclude=tried)
            return plan.decode

        async for out in self._on_instances(plan.decode, attempt, another):
            yield out

    # --- health ------------------------------------------------------------------------------------------

    def _lost(self, inst: Instance, why: str) -> None:
        self.counters["instance_failures"] += 1
        if inst.healthy:
            log.warning("conductor: %s instance %s is down (%s); routing around it", inst.role, inst.url, why)
        inst.healthy = False

    async def _watch_health(self) -> None:
        async def check(inst: Instance):
            try:
                ok = (await self.client.get(inst.url + "/health", timeout=self.health_interval)).status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok and not inst.healthy:
                log.warning("conductor: %s instance %s is up again", inst.role, inst.url)
            inst.healthy = ok

        while True:
            await asyncio.sleep(self.health_interval)
            await asyncio.gather(*map(check, self.instances))


class _DecodePace:
    """What the router learns from a decode: its first token's delay after the pace starts (at the hand-over,
    or at a colocated request's first token), then the mean time per token after that one."""

    def __init__(self):
        self.start, self.tokens = time.monotonic(), 0
        self.first = self.step = self.at = None
        self.finished = False

    def observe(self, out: RequestOutput) -> None:
        now, tokens = time.monotonic(), max(len(c.token_ids) for c in out.outputs)
        if self.at is None:
            self.first, self.at, self.tokens = now - self.start, now, tokens
        elif out.finished:
            later = tokens - self.tokens
            self.step = (now - self.at) / later if later > 0 else None
        self.finished = out.finished

    def learned(self) -> tuple[float | None, float | None]:
        """(first token's delay, time per token) of a finished decode; (None, None) for one that failed."""
        return (self.first, self.step) if self.finished else (None, None)


def _relayed(inst: Instance, body: dict, status: int) -> Exception:
    """An instance's error answer, for the client: 4xx as it is (the same checks as ours), else a 500."""
    error = body.get("error", {}) if isinstance(body, dict) else {}
    message = error.get("message", str(body)[:200])
    if 400 <= status < 500:
        return NanoforgeError(message, status=status, param=error.get("param"))
    log.error("conductor: %s instance %s failed a request: %s", inst.role, inst.url, message)
    return InternalError(f"the {inst.role} instance {inst.url} failed: {message}")


class ConductorCollector(StatsCollector):
    """The conductor's gauges for /metrics: requests in flight, prefix-cache hits, instances, routing."""

    def collect(self):
        s = self.stats
        yield gauge("num_requests_running", "requests in flight through the cluster", s.get("in_flight", 0))
        prompt = s.get("prompt_tokens", 0)
        yield gauge("prefix_cache_hit_rate", "prompt tokens the prefill instances did not compute (their prefix "
                    "cache or the KV pool) / prompt tokens", s.get("cached_prompt_tokens", 0) / prompt if prompt else 0)
        yield counter("handover_retries", "hand-overs retried on another instance", s.get("retries", 0))
        yield counter("instance_failures", "requests that found an instance down", s.get("instance_failures", 0))
        yield counter("kv_pool_lookups", "prompts looked up in the KV pool", s.get("pool_lookups", 0))
        yield counter("kv_pool_lookup_hit_blocks", "leading prompt blocks found in the KV pool", s.get("pool_hit_blocks", 0))
        rejected = CounterMetricFamily("nanoforge_early_rejections", "requests answered 429 at once: the predicted "
                                       "TTFT or TPOT was over its objective", labels=["slo"])
        for slo, n in s.get("rejected", {}).items():
            rejected.add_metric([slo], n)
        yield rejected
        up = GaugeMetricFamily("nanoforge_instance_up", "1 while the instance answers", labels=["url", "role"])
        running = GaugeMetricFamily("nanoforge_instance_requests_running", "requests in flight on the instance",
                                    labels=["url", "role"])
        routed = CounterMetricFamily("nanoforge_instance_requests_routed", "requests sent to the instance",
                                     labels=["url", "role"])
        for inst in s.get("instances", []):
            up.add_metric([inst.url, inst.role], int(inst.healthy))
            running.add_metric([inst.url, inst.role], inst.running)
            routed.add_metric([inst.url, inst.role], inst.routed)
        yield from (up, running, routed)


def build_conductor_app(conductor: Conductor, *, max_waiting: int = 256,
                        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    metrics = Metrics(ConductorCollector())
    conductor.on_finished = metrics.observe
    parser = RequestParser(conductor.tokenizer, conductor.model_name, conductor.max_model_len, max_batch=max_waiting,
                           max_request_bytes=max_request_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await conductor.start()
        try:
            yield
        finally:
            await conductor.stop()

    app = openai_app(conductor, parser, metrics, lifespan, title="nanoforge conductor")
    app.state.conductor = conductor
    return app


def describe(conductor: Conductor) -> str:
    """"2 prefill + 1 decode instances" or "2 colocated instances"."""
    r = conductor.router
    return f"{len(r.prefill)} colocated instances" if r.colocated else \
        f"{len(r.prefill)} prefill + {len(r.decode)} decode instances"


def run_conductor(args) -> int:
    """`nanoforge conductor`: learn the instances, serve until SIGTERM / Ctrl-C."""
    instances = discover(args.prefill, args.decode, args.wait_timeout, args.colocated)
    store = None
    if args.store:
        from nanoforge.serve.disagg.mooncake_store import MooncakeStore

        store = MooncakeStore(args.store, hostname=args.store_hostname)  # looks up, holds no part of the pool
    try:
        conductor = Conductor(instances, policy=args.policy, store=store, ttft_slo=args.ttft_slo,
                              tpot_slo=args.tpot_slo, request_timeout=args.request_timeout, seed=args.seed)
        app = build_conductor_app(conductor, max_waiting=args.max_waiting, max_request_bytes=args.max_request_bytes)
        slos = "".join(f", {name} SLO {v:g} s" for name, v in (("TTFT", args.ttft_slo), ("TPOT", args.tpot_slo)) if v)
        banner = (f"nanoforge conductor: {conductor.model_name} at {{url}} ({describe(conductor)}, policy "
                  f"{args.policy}{slos}, {'KV pool at ' + args.store if store else 'no KV pool lookups'})")
        return serve_app(app, args, banner)
    finally:
        if store is not None:
            store.close()
