"""`nanoforge bench serve`: a load generator for any OpenAI-compatible completions endpoint.

Two workloads:

- Poisson arrivals: `--num-requests` requests at `--rate` per second (`inf`:
  all at once), each `--input-len` random tokens in, `--output-len` out.
- A Mooncake trace (JSONL rows `timestamp` (ms), `input_length`,
  `output_length`, `hash_ids`). Each hash id names one 512-token block of
  prompt, so requests whose `hash_ids` share a prefix get prompts that share
  the same token prefix, block by block, and a prefix cache can hit on them.
  A small model needs the trace shrunk: `--length-scale` scales input lengths
  and the block size (0.1: 51-token blocks), `--max-input-len` and
  `--max-output-len` cap the lengths, `--time-scale` stretches or compresses
  the arrival times, `--num-requests` keeps the first N rows.

Prompts go out as token-id lists (`prompt: [ids]` is valid in the OpenAI API),
or, with `--tokenizer`, as the text those ids decode to. Every request streams
(SSE) with `stream_options.include_usage`, so the time to first token (TTFT)
is measured at the first chunk and output tokens are counted by the server's
`usage`; time per output token (TPOT) is (end-to-end - TTFT) / (output - 1).

It reports throughput, TTFT / TPOT / end-to-end latency (mean, p50, p90,
p99), and goodput: completed requests per second that met every SLO given
(`--slo-ttft-ms`, `--slo-tpot-ms`, `--slo-e2e-ms`). It writes a JSON file
with the summary and every request's numbers, and a PNG of the latency CDFs.
If the server exposes nanoforge's Prometheus `/metrics`, the prefix-cache hit
rate and preemptions are scraped at the end and reported too.

It talks HTTP only (httpx), and imports no engine code.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from nanoforge.errors import NanoforgeError

MOONCAKE_BLOCK_TOKENS = 512  # prompt tokens per hash id in the Mooncake traces
PERCENTILES = (50, 90, 99)


@dataclass
class Request:
    arrival_s: float  # when to send it, in seconds after the start
    prompt: list[int] | str
    input_len: int  # prompt tokens, as the server counts them
    output_len: int  # max_tokens
    hash_ids: list[int] = field(default_factory=list)


@dataclass
class Result:
    arrival_s: float
    start_s: float  # when it was actually sent
    input_len: int
    output_len: int  # tokens generated, as the server counted them (else the number of chunks)
    ttft_ms: float | None = None
    tpot_ms: float | None = None  # None for a single output token
    e2e_ms: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


# --- workloads ---------------------------------------------------------------------------------------

class Vocab:
    """Where prompts' token ids come from: [0, vocab_size), minus the tokenizer's special tokens if one is given."""

    def __init__(self, vocab_size: int | None, tokenizer=None):
        if tokenizer is not None:
            special = {tokenizer.eos_id, tokenizer.eot_id, tokenizer.bos_id} | set(tokenizer.stop_ids)
            self.ids = [i for i in range(tokenizer.vocab_size) if i not in special]
        elif vocab_size:
            self.ids = list(range(vocab_size))
        else:
            raise NanoforgeError("give --tokenizer DIR or --vocab-size N (prompts are random token ids)",
                                 param="vocab_size")
        self.tokenizer = tokenizer

    def draw(self, rng: random.Random, n: int) -> list[int]:
        return rng.choices(self.ids, k=n)

    def prompt(self, blocks: list[list[int]]) -> tuple[list[int] | str, int]:
        """Token ids, or with a tokenizer their text (block by block, so shared blocks give shared text); and
        the prompt's length in tokens as the server will count it (text is re-encoded as a prompt: its
        tokenizer's post-processor may add a BOS token, and decoded ids need not encode back to as many)."""
        if self.tokenizer is None:
            ids = [t for b in blocks for t in b]
            return ids, len(ids)
        text = "".join(self.tokenizer.decode(b) for b in blocks)
        return text, len(self.tokenizer.encode_prompt(text))


def poisson_workload(num_requests: int, rate: float, input_len: int, output_len: int, vocab: Vocab,
                     seed: int = 0) -> list[Request]:
    """Arrivals of a Poisson process (exponential gaps of mean 1/rate, the first at 0); rate=inf: all at 0."""
    if not rate > 0:
        raise NanoforgeError(f"--rate must be > 0 (inf: all at once), got {rate}", param="rate")
    rng = random.Random(seed)
    requests, t = [], 0.0
    for i in range(num_requests):
        if i and math.isfinite(rate):
            t += rng.expovariate(rate)
        requests.append(Request(t, *vocab.prompt([vocab.draw(rng, input_len)]), output_len))
    return requests


def read_trace(path: str | Path) -> list[dict]:
    """Rows of a Mooncake trace, checked and sorted by timestamp."""
    path = Path(path)
    if not path.is_file():
        raise NanoforgeError(f"trace file not found: {path}", param="trace")
    rows = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise NanoforgeError(f"{path}:{n}: not JSON: {e}", param="trace") from None
            ok = isinstance(row, dict) and all(
                isinstance(row.get(k), int) and not isinstance(row.get(k), bool) and row[k] >= lo
                for k, lo in (("timestamp", 0), ("input_length", 1), ("output_length", 1)))
            hashes = row.get("hash_ids", []) if isinstance(row, dict) else None
            if not ok or not isinstance(hashes, list) or not all(isinstance(h, int) for h in hashes):
                raise NanoforgeError(f"{path}:{n}: a row needs integer timestamp >= 0, input_length >= 1, "
                                     f"output_length >= 1 and a list of integer hash_ids", param="trace")
            rows.append(row)
    if not rows:
        raise NanoforgeError(f"{path} holds no requests", param="trace")
    return sorted(rows, key=lambda r: r["timestamp"])


class TraceReplay:
    """The requests of a trace's rows, each built when asked for (`request(i)`), so that a long trace's prompts
    need not all be in memory at once (the cluster simulator builds each at its arrival).

    Block `h` is the same `round(block_tokens * length_scale)` random tokens wherever hash id `h` appears: drawn
    from a generator seeded by (`seed`, h), so a block is rebuilt the same when it is not among the
    `cache_blocks` most recently used ones kept (None: keep all). A prompt is its blocks, cut to its scaled
    input length; a row with fewer hash ids than its length needs gets its own random tokens for the rest."""

    def __init__(self, rows: list[dict], vocab: Vocab, *, length_scale: float = 1.0, time_scale: float = 1.0,
                 max_input_len: int | None = None, max_output_len: int | None = None,
                 num_requests: int | None = None, block_tokens: int = MOONCAKE_BLOCK_TOKENS, seed: int = 0,
                 cache_blocks: int | None = None):
        if not length_scale > 0 or not time_scale >= 0:
            raise NanoforgeError(f"--length-scale must be > 0 and --time-scale >= 0, got {length_scale}, "
                                 f"{time_scale}", param="length_scale")
        self.rows = rows[:num_requests] if num_requests else rows
        self.vocab, self.seed = vocab, seed
        self.length_scale, self.time_scale = length_scale, time_scale
        self.max_input_len, self.max_output_len = max_input_len, max_output_len
        self.tokens_per_block = max(1, round(block_tokens * length_scale))
        self.cache_blocks = cache_blocks
        self._blocks: OrderedDict[int, list[int]] = OrderedDict()
        self._t0 = self.rows[0]["timestamp"]

    def __len__(self) -> int:
        return len(self.rows)

    def arrival_s(self, i: int) -> float:
        """When row i is sent, in seconds after the first row."""
        return (self.rows[i]["timestamp"] - self._t0) / 1000 * self.time_scale

    def input_len(self, i: int) -> int:
        """Prompt tokens of row i as drawn (a tokenizer's count of their text may differ: `Request.input_len`)."""
        n_in = max(1, round(self.rows[i]["input_length"] * self.length_scale))
        return min(n_in, self.max_input_len) if self.max_input_len else n_in

    def output_len(self, i: int) -> int:
        n_out = self.rows[i]["output_length"]
        return min(n_out, self.max_output_len) if self.max_output_len else n_out

    def request(self, i: int) -> Request:
        n_in = self.input_len(i)
        hashes = self.rows[i]["hash_ids"][:math.ceil(n_in / self.tokens_per_block)]
        parts = [self._block(h) for h in hashes]
        missing = n_in - len(hashes) * self.tokens_per_block  # a trace row with fewer hash ids than its length needs
        if missing > 0:
            parts.append(self.vocab.draw(random.Random(f"{self.seed}/row{i}"), missing))
        parts[-1] = parts[-1][:len(parts[-1]) - (sum(map(len, parts)) - n_in)]  # cut the last block to n_in
        return Request(self.arrival_s(i), *self.vocab.prompt(parts), self.output_len(i), hashes)

    def _block(self, h: int) -> list[int]:
        block = self._blocks.get(h)
        if block is None:
            block = self._blocks[h] = self.vocab.draw(random.Random(f"{self.seed}/{h}"), self.tokens_per_block)
            if self.cache_blocks is not None and len(self._blocks) > self.cache_blocks:
                self._blocks.popitem(last=False)
        elif self.cache_blocks is not None:
            self._blocks.move_to_end(h)
        return block


def trace_workload(rows: list[dict], vocab: Vocab, *, length_scale: float = 1.0, time_scale: float = 1.0,
                   max_input_len: int | None = None, max_output_len: int | None = None,
                   num_requests: int | None = None, block_tokens: int = MOONCAKE_BLOCK_TOKENS,
                   seed: int = 0) -> list[Request]:
    """Every request of a trace replay (`TraceReplay`), built at once."""
    replay = TraceReplay(rows, vocab, length_scale=length_scale, time_scale=time_scale, max_input_len=max_input_len,
                         max_output_len=max_output_len, num_requests=num_requests, block_tokens=block_tokens,
                         seed=seed)
    return [replay.request(i) for i in range(len(replay))]


# --- sending -----------------------------------------------------------------------------------------

def _root(base_url: str) -> str:
    """http://host:port from http://host:port or http://host:port/v1."""
    url = base_url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


async def _send(client, url: str, model: str, req: Request, t0: float, temperature: float,
                ignore_eos: bool) -> Result:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    start = time.perf_counter()
    result = Result(req.arrival_s, start - t0, req.input_len, 0)
    first = None
    chunks = 0
    usage = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    result.error = f"stream error: {chunk['error'].get('message')}"
                    return result
                if chunk.get("choices"):
                    first = first or time.perf_counter()
                    chunks += 1
                usage = chunk.get("usage") or usage
    except Exception as e:  # connection refused or reset, bad JSON, timeout: a failed request, not a crash
        result.error = f"{type(e).__name__}: {e}"
        return result
    end = time.perf_counter()
    if first is None:
        result.error = "the stream held no tokens"
        return result
    result.output_len = usage["completion_tokens"] if usage else chunks
    if usage and usage.get("prompt_tokens"):
        result.input_len = usage["prompt_tokens"]
    result.ttft_ms = (first - start) * 1000
    result.e2e_ms = (end - start) * 1000
    if result.output_len > 1:
        result.tpot_ms = (result.e2e_ms - result.ttft_ms) / (result.output_len - 1)
    return result


async def run_requests(base_url: str, model: str, requests: list[Request], *, temperature: float = 0.0,
                       ignore_eos: bool = False, max_concurrency: int | None = None,
                       timeout: float = 600.0) -> tuple[list[Result], float]:
    """Send every request at its arrival time (at most `max_concurrency` at once); return results and duration."""
    import httpx

    url = _root(base_url) + "/v1/completions"
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        t0 = time.perf_counter()

        async def one(req: Request) -> Result:
            await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
            if limit is None:
                return await _send(client, url, model, req, t0, temperature, ignore_eos)
            async with limit:
                return await _send(client, url, model, req, t0, temperature, ignore_eos)

        results = await asyncio.gather(*(one(r) for r in requests))
        return list(results), time.perf_counter() - t0


def metric_values(text: str, prefix: str = "nanoforge_", totals: tuple[str, ...] = (),
                  labelled: bool = False) -> dict[str, float]:
    """Unlabelled samples named `prefix*` of a Prometheus text exposition; a labelled family named in `totals`
    is summed over its labels under its bare name (e.g. early rejections by SLO); with `labelled`, the other
    labelled samples too, each under its name as written (e.g. 'x_sum{kind="decode"}')."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        bare = name.partition("{")[0]
        if line.startswith("#") or not bare.startswith(prefix):
            continue
        try:
            v = float(value)
        except ValueError:
            continue
        if "{" not in name:
            values[name] = v
        elif bare in totals:
            values[bare] = values.get(bare, 0.0) + v
        elif labelled:
            values[name] = v
    return values


def scrape_metrics(base_url: str, prefix: str = "nanoforge_") -> dict[str, float]:
    """`metric_values` of the server's Prometheus /metrics ({} if it does not answer)."""
    import httpx

    try:
        text = httpx.get(_root(base_url) + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    return metric_values(text, prefix)


# --- the numbers ---------------------------------------------------------------------------------------

def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), **{f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}}


def meets_slo(r: Result, slo: dict[str, float | None]) -> bool:
    """A completed request within every SLO given (a single-token output has no TPOT and passes that one)."""
    if not r.ok:
        return False
    return all(limit is None or (getattr(r, f"{name}_ms") or 0.0) <= limit for name, limit in slo.items())


def summarize(results: list[Result], duration_s: float, slo: dict[str, float | None]) -> dict:
    ok = [r for r in results if r.ok]
    good = [r for r in ok if meets_slo(r, slo)]
    input_tokens = sum(r.input_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    return {
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s,
        "input_token_throughput": input_tokens / duration_s,
        "output_token_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "ttft_ms": _stats([r.ttft_ms for r in ok]),
        "tpot_ms": _stats([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        "e2e_ms": _stats([r.e2e_ms for r in ok]),
        "slo_ms": {k: v for k, v in slo.items() if v is not None},
        "goodput": len(good) / duration_s,
        "slo_attainment": len(good) / len(results) if results else 0.0,
    }


def print_table(summary: dict, server: dict[str, float]) -> None:
    s = summary
    print(f"\n{'requests completed / failed':<34}{s['completed']:>10} / {s['failed']}")
    print(f"{'duration (s)':<34}{s['duration_s']:>10.2f}")
    print(f"{'throughput (req/s)':<34}{s['request_throughput']:>10.2f}")
    print(f"{'output tokens/s':<34}{s['output_token_throughput']:>10.1f}")
    print(f"{'total tokens/s (in + out)':<34}{s['total_token_throughput']:>10.1f}")
    print(f"\n{'latency (ms)':<16}{'mean':>10}" + "".join(f"{'p' + str(p):>10}" for p in PERCENTILES))
    for name, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "end-to-end")):
        row = s[name]
        print(f"{label:<16}" + "".join(f"{row[k]:>10.1f}" if row[k] is not None else f"{'-':>10}"
                                       for k in ("mean", *(f"p{p}" for p in PERCENTILES))))
    slos = ", ".join(f"{k} <= {v:g} ms" for k, v in s["slo_ms"].items()) or "none given"
    print(f"\ngoodput: {s['goodput']:.2f} req/s ({100 * s['slo_attainment']:.1f}% of requests within SLOs: {slos})")
    if "nanoforge_prefix_cache_hit_rate" in server:
        print(f"server: prefix-cache hit rate {100 * server['nanoforge_prefix_cache_hit_rate']:.1f}%, "
              f"preemptions {server.get('nanoforge_preemptions_total', 0):.0f}")


def plot_cdf(results: list[Result], path: Path) -> None:
    """One panel per latency: the fraction of completed requests at or under each value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.ok]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (name, label) in zip(axes, (("ttft_ms", "time to first token"), ("tpot_ms", "time per output token"),
                                        ("e2e_ms", "end-to-end latency"))):
        values = np.sort([getattr(r, name) for r in ok if getattr(r, name) is not None])
        if len(values):
            ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post")
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    fig.suptitle(f"latency CDFs, {len(ok)} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bench_serve(base_url: str, model: str, requests: list[Request], *, out_dir: Path, slo: dict[str, float | None],
                temperature: float = 0.0, ignore_eos: bool = False, max_concurrency: int | None = None,
                config: dict | None = None) -> dict:
    """Run the workload; print the table; write serve.json and serve_cdf.png under `out_dir` (with the wall clock
    at its start: runs sent one after another, as gpu_disagg.sh's warm-ups and trace, can be laid end to end)."""
    started = time.time()
    results, duration = asyncio.run(run_requests(base_url, model, requests, temperature=temperature,
                                                 ignore_eos=ignore_eos, max_concurrency=max_concurrency))
    summary = summarize(results, duration, slo)
    server = scrape_metrics(base_url)
    print_table(summary, server)
    failures = [r.error for r in results if not r.ok]
    if failures:
        print(f"first failure: {failures[0]}")
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"config": config or {}, "started_unix": started, "summary": summary, "server_metrics": server,
              "requests": [{**asdict(r), "hash_ids": q.hash_ids} for r, q in zip(results, requests)]}
    (out_dir / "serve.json").write_text(json.dumps(report, indent=2))
    plot_cdf(results, out_dir / "serve_cdf.png")
    print(f"wrote {out_dir / 'serve.json'} and {out_dir / 'serve_cdf.png'}")
    return report


# --- the command line ------------------------------------------------------------------------------------

def add_cli_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    p.add_argument("--model", required=True, help="the model name the server serves")
    p.add_argument("--trace", help="a Mooncake trace (JSONL) to replay, instead of Poisson arrivals")
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second (inf: all at once)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests to send (Poisson: required; trace: the first N rows)")
    p.add_argument("--input-len", type=int, default=512, help="Poisson: prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="Poisson: output tokens per request")
    p.add_argument("--length-scale", type=float, default=1.0, help="trace: scale input lengths and block size")
    p.add_argument("--time-scale", type=float, default=1.0, help="trace: scale arrival times (0.5: twice as fast)")
    p.add_argument("--max-input-len", type=int, default=None, help="trace: cap prompt tokens")
    p.add_argument("--max-output-len", type=int, default=None, help="trace: cap output tokens")
    p.add_argument("--trace-block-tokens", type=int, default=MOONCAKE_BLOCK_TOKENS,
                   help="prompt tokens per hash id in the trace (Mooncake: 512)")
    p.add_argument("--tokenizer", help="send prompts as text, decoded with this tokenizer (dir or tokenizer.json)")
    p.add_argument("--vocab-size", type=int, default=None, help="token ids are drawn from [0, N) (no --tokenizer)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="ask for exactly max_tokens (vLLM extension field)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-e2e-ms", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench", help="directory for serve.json and serve_cdf.png")


def run_cli(args: argparse.Namespace) -> int:
    if (args.trace is None) == (args.rate is None):
        raise NanoforgeError("give either --trace FILE or --rate R (with --num-requests N)", param="trace")
    for name in ("num_requests", "input_len", "output_len", "max_input_len", "max_output_len", "max_concurrency",
                 "trace_block_tokens", "vocab_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise NanoforgeError(f"--{name.replace('_', '-')} must be >= 1, got {value}", param=name)
    tokenizer = None
    if args.tokenizer:
        from nanoforge.tokenizer import Tokenizer

        tokenizer = Tokenizer.load(args.tokenizer)
    vocab = Vocab(args.vocab_size, tokenizer)
    if args.trace:
        requests = trace_workload(read_trace(args.trace), vocab, length_scale=args.length_scale,
                                  time_scale=args.time_scale, max_input_len=args.max_input_len,
                                  max_output_len=args.max_output_len, num_requests=args.num_requests,
                                  block_tokens=args.trace_block_tokens, seed=args.seed)
    else:
        if args.num_requests is None:
            raise NanoforgeError("--rate needs --num-requests N", param="num_requests")
        requests = poisson_workload(args.num_requests, args.rate, args.input_len, args.output_len, vocab, args.seed)
    slo = {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms, "e2e": args.slo_e2e_ms}
    config = {k: v for k, v in vars(args).items() if k != "func"}
    report = bench_serve(args.base_url, args.model, requests, out_dir=Path(args.out), slo=slo,
                         temperature=args.temperature, ignore_eos=args.ignore_eos,
                         max_concurrency=args.max_concurrency, config=config)
    return 0 if report["summary"]["completed"] else 1
