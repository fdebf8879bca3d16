"""Prometheus metrics for `/metrics`: per-request latencies and counts, plus a snapshot of whoever serves.

`Metrics.observe(out)` records a finished request (TTFT, TPOT, end-to-end,
finish reason, tokens); `rejected` counts error answers by status. The gauges
come from a collector over a stats dict refreshed just before each scrape:
`EngineCollector` for an engine (queues, KV blocks, prefix cache), or the
conductor's own (instances, routing, the pool).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from nanoforge.serve.llm_engine import RequestOutput
from nanoforge.serve.step_profile import STEP_BUCKETS


def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"nanoforge_{name}", doc, value=value)


def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"nanoforge_{name}", doc, value=value)


class StatsCollector:
    """A prometheus_client collector over `stats`, a dict the app refreshes just before each scrape."""

    def __init__(self):
        self.stats: dict = {}

    def collect(self):
        raise NotImplementedError


class EngineCollector(StatsCollector):
    """Engine gauges and counters: queues, KV blocks, the prefix cache, the KV pool."""

    def collect(self):
        s = self.stats
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
        if "steps" in s:  # StepStats: each step's turn, from when it could run to its tokens read back
            h = HistogramMetricFamily("nanoforge_engine_step_seconds", "engine steps by kind: from when a step could "
                                      "run (launched, the step before read back) to its tokens read back",
                                      labels=["kind"])
            t = CounterMetricFamily("nanoforge_engine_step_tokens", "tokens computed by engine steps, by kind",
                                    labels=["kind"])
            for kind, k in s["steps"].items():
                h.add_metric([kind], [(str(b), n) for b, n in zip(STEP_BUCKETS, k["buckets"])]
                             + [("+Inf", k["steps"])], k["seconds"])
                t.add_metric([kind], k["tokens"])
            yield h
            yield t
        if "kv_pool" in s:  # an engine with a KV connector: what moved between its cache and the pool
            p = s["kv_pool"]
            yield gauge("kv_pool_up", "1 while the KV cache pool answers, 0 while it is skipped", p["up"])
            yield counter("kv_pool_loaded_blocks", "KV blocks loaded from the pool", p["loaded_blocks"])
            yield counter("kv_pool_saved_blocks", "KV blocks saved to the pool", p["saved_blocks"])
            yield counter("kv_pool_refused_blocks", "KV blocks the pool turned away (no room it could evict)",
                          p["refused_blocks"])
            yield counter("kv_pool_load_misses", "lookups that found no block in the pool", p["load_misses"])
            yield counter("kv_pool_failures", "pool calls that failed or ran out of time", p["failures"])
            yield counter("kv_pool_skipped", "loads and saves skipped (pool down, staging full)", p["skipped"])
            calls = {"calls": ("kv_pool_calls", "batched pool calls, by kind (put: a save, get: a load)"),
                     "call_blocks": ("kv_pool_call_blocks", "KV blocks the pool calls asked to move, by kind"),
                     "call_s": ("kv_pool_call_seconds", "seconds in the pool calls themselves, by kind (not the "
                                                        "wait for the worker or the device copy)"),
                     "job_s": ("kv_pool_job_seconds", "seconds from each call's submission to its end, by kind (the "
                                                      "wait for a worker and a put's device copy included)")}
            for field, (name, doc) in calls.items():
                c = CounterMetricFamily(f"nanoforge_{name}", doc, labels=["kind"])
                for kind in ("put", "get"):
                    c.add_metric([kind], p.get(f"{kind}_{field}", 0))
                yield c


class Metrics:
    """The registry behind `/metrics`; `collector.stats` is refreshed before each scrape."""

    def __init__(self, collector=None):
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
        self.cached_tokens = Counter("nanoforge_cached_prompt_tokens", "prompt tokens of finished requests served "
                                     "from a cache (usage.prompt_tokens_details.cached_tokens)", registry=r)
        self.collector = collector if collector is not None else EngineCollector()
        r.register(self.collector)

    def observe(self, out: RequestOutput) -> None:
        """A request finished (the engine calls this on its thread; prometheus_client is thread-safe)."""
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
        self.cached_tokens.inc(out.num_cached_tokens)
