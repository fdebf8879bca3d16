"""`nanoforge simulate profile`: measure a simulator profile on the real engine.

    nanoforge simulate profile (--model DIR | --model-preset NAME) [--device D] [--pool] [--frontend]
                               [--budget-s S] --out PROFILE.json

The engine (`LLMEngine`, the model's real forward passes, CUDA graphs for decode batches on a GPU) runs
prompts chosen to cover the grid the time model needs, and every `step()` is timed with the features of the
`SchedulerOutput` it ran:

- prefill: a prompt of `cached` tokens is run first (so its blocks are in the prefix cache), then the same
  prefix followed by `tokens` new ones: the timed steps compute `tokens` tokens after `cached` cached ones;
- decode: `batch` requests with prompts of `context` tokens are prefilled, then a run of steps where every one
  decodes is timed as a whole (no synchronization between its steps), so that on a GPU, where the engine
  schedules a step ahead, a step costs what it costs a server: its host work overlapped with the device's
  step before. Prefill steps are timed one at a time, synchronized.

Points run cheapest first (`--budget-s` leaves out the costliest, listed in the JSON). A new prefill chunk size
runs once more first (compilation, autotuning), decode once before its first point (its CUDA graphs are captured
when the engine starts); then each point runs `repeats` times, the median counts. The
forms of `profile.py` are fitted by least squares with non-negative coefficients; the fit's relative errors
and every sample are kept in the JSON. With `--pool`, the KV transfer is measured on the real Mooncake Store:
a `mooncake_master` on loopback, a second process holding the pool's memory (as a peer instance does), and
this one moving whole blocks (header + K and V of every layer, as the KV connector does) with one batched
`put_from` / `get_into` per size (the remote form), then a client holding a segment of its own putting blocks
into it, as a prefill instance saves (the local form); without it the transfer section is derived from
`--link-gbs` and says so.
With `--frontend`, what serving adds is measured through the real server (`measure_frontend`), and a
disaggregated decode instance's hand-over events on the engine's own outputs (`measure_stream`).
"""

from __future__ import annotations

import itertools
import random
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from nanoforge.errors import NanoforgeError
from nanoforge.sim.profile import Profile, pool_block_bytes

PREFILL_TOKENS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384)
PREFILL_CACHED = (0, 1024, 4096, 16384, 32768)
DECODE_BATCH = (1, 8, 32, 64, 128, 256)
DECODE_CONTEXT = (128, 1024, 4096, 16384)
DECODE_STEPS = 8
DECODE_MAX_TOKENS = 1 << 20  # a decode point prefills batch x context tokens first: at most this many
TRANSFER_BLOCKS = (1, 4, 16, 64, 256)


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0: drop the most negative one and solve again, until none is."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef


PREFILL_FEATURES = ("tokens", "pairs", "prefix", "prefix_pairs")  # profile.py's prefill form


def fit(samples: list[dict], features: tuple[str, ...]) -> tuple[list[float], dict]:
    """Coefficients of y = c0 + c1 * f1 + ... over `samples` ({features..., "seconds"}), relative errors."""
    x = np.array([[1.0] + [s[f] for f in features] for s in samples], dtype=np.float64)
    y = np.array([s["seconds"] for s in samples], dtype=np.float64)
    w = 1 / y  # relative errors count: short steps matter as much as long ones
    coef = _nnls(x * w[:, None], y * w)
    rel = np.abs(x @ coef - y) / y
    return [float(c) for c in coef], {"samples": len(samples), "mean_rel_error": float(rel.mean()),
                                      "max_rel_error": float(rel.max())}


class _Timer:
    """Times `engine.step()` and records what the scheduler put into each step."""

    def __init__(self, engine):
        self.engine = engine
        self.last = None
        self.cuda = engine.model.embed.weight.device.type == "cuda"
        schedule = engine.scheduler.schedule

        def recording():
            self.last = schedule()
            return self.last

        engine.scheduler.schedule = recording  # this measuring engine only

    def step(self) -> tuple[dict, float]:
        if self.cuda:
            torch.cuda.synchronize()  # nothing of an earlier step runs into this one
        start = time.perf_counter()
        self.engine.step()  # returns after the sampled tokens reached the host
        if self.cuda:
            torch.cuda.synchronize()  # and anything the step left queued (e.g. block copies) is done too
        return self._features(), time.perf_counter() - start

    def run(self, n: int) -> list[tuple[dict, float]]:
        """`n` steps timed as one run, the way a server takes them (with asynchronous scheduling, a step's host
        work overlaps the device's step before it): each step's features with the run's mean seconds a step."""
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        features = []
        for _ in range(n):
            self.engine.step()
            features.append(self._features())
        if self.cuda:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / n
        return [(f, seconds) for f in features]

    def _features(self) -> dict:
        tokens = pairs = prefix_pairs = prefix = batch = context = 0
        for s in self.last.scheduled:
            if s.is_decode:
                batch += 1
                context += s.start + 1
            else:
                tokens += s.num_tokens
                pairs += s.num_tokens * s.start + s.num_tokens * (s.num_tokens + 1) // 2
                prefix_pairs += s.num_tokens * s.start
                prefix += s.start
        return {"tokens": tokens + batch, "pairs": pairs, "prefix_pairs": prefix_pairs, "prefix": prefix,
                "batch": batch, "context": context, "prefill": tokens > 0}


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


class Budget:
    """Wall-clock seconds a section of the measurement may take (None: no limit). Points run cheapest first,
    so what a tight budget leaves out is the most expensive end of the grid; the profile lists what it skipped."""

    def __init__(self, seconds: float | None):
        self.end = None if seconds is None else time.perf_counter() + seconds

    def over(self) -> bool:
        return self.end is not None and time.perf_counter() > self.end


def prefill_points(cfg, tokens=PREFILL_TOKENS, cached=PREFILL_CACHED) -> list[tuple[int, int]]:
    """(new tokens, cached tokens) that fit the engine's step budget, context and cache, cheapest first."""
    bs = cfg.block_size
    points = [(n, c) for c in cached for n in tokens
              if n <= cfg.max_num_batched_tokens and c + n + 1 <= cfg.max_model_len and c % bs == 0
              and -(-(c + n + 1) // bs) <= cfg.num_gpu_blocks]
    return sorted(points, key=lambda p: (p[0] + 2 * p[1], p))


def decode_points(cfg, batches=DECODE_BATCH, contexts=DECODE_CONTEXT,
                  max_tokens: int = DECODE_MAX_TOKENS) -> list[tuple[int, int]]:
    """(batch, prompt tokens per sequence) that fit the engine, at most `max_tokens` prompt tokens in all (each
    point prefills all of them first), cheapest first."""
    bs, need = cfg.block_size, DECODE_STEPS + 4
    points = [(b, c) for c in contexts for b in batches
              if b <= cfg.max_num_seqs and c + need <= cfg.max_model_len and b * c <= max_tokens
              and b * -(-(c + need) // bs) <= cfg.num_gpu_blocks]
    return sorted(points, key=lambda p: (p[0] * p[1], p))


def measure_steps(engine, *, prefill_tokens=PREFILL_TOKENS, prefill_cached=PREFILL_CACHED, decode_batch=DECODE_BATCH,
                  decode_context=DECODE_CONTEXT, repeats: int = 3, budget_s: float | None = None,
                  progress=None) -> tuple[list[dict], list[dict], dict]:
    """Timed prefill steps and decode steps of `engine` over the grid that fits its context and cache, and the
    points a budget left out. Half of `budget_s` goes to each kind of step (what prefill leaves, decode gets)."""
    from nanoforge.serve.sampling_params import SamplingParams

    cfg = engine.scheduler.config
    vocab = engine.model.cfg.vocab_size
    rng = random.Random(0)
    timer = _Timer(engine)
    prefill, decode, skipped = [], [], {"prefill": [], "decode": []}
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    budget = Budget(None if budget_s is None else budget_s / 2)
    warm = set()
    for n, cached in prefill_points(cfg, prefill_tokens, prefill_cached):
        if budget.over():
            skipped["prefill"].append([n, cached])
            continue
        times = []
        first = n not in warm  # a new chunk shape runs once more first (compilation, autotuning)
        warm.add(n)
        for rep in range(repeats + first):
            prefix = _prompt(rng, cached, vocab)
            if cached:
                engine.add_request(prefix, one)
                while engine.has_unfinished():
                    engine.step()
            engine.add_request(prefix + _prompt(rng, n, vocab), one)
            features, seconds = timer.step()
            while engine.has_unfinished():
                engine.step()
            if rep >= first:
                times.append(seconds)
        prefill.append({**features, "cached": cached, "seconds": statistics.median(times)})
        if progress:
            progress(f"prefill {n} tokens after {cached} cached: {1000 * prefill[-1]['seconds']:.2f} ms")
    if budget_s is not None:
        budget = Budget(budget_s - (time.perf_counter() - start))
    warmed = False
    for batch, context in decode_points(cfg, decode_batch, decode_context):
        if budget.over():
            skipped["decode"].append([batch, context])
            continue
        steps = []
        # decode batches replay CUDA graphs captured when the engine started: one warm-up run, for the first point
        for rep in range(repeats + (not warmed)):
            params = SamplingParams(max_tokens=DECODE_STEPS + 4, ignore_eos=True)  # none ends in the run
            rids = [engine.add_request(_prompt(rng, context, vocab), params) for _ in range(batch)]
            while any(engine.scheduler.get_group(r) and engine.scheduler.get_group(r).seqs[0].num_output_tokens
                      == 0 for r in rids):
                engine.step()  # the prompts, and each one's first token
            timed = timer.run(DECODE_STEPS)
            while engine.has_unfinished():
                engine.step()
            if warmed or rep:
                steps += [(f, t) for f, t in timed if f["batch"] == batch and not f["prefill"]]
        warmed = True
        if not steps:
            continue
        decode.append({"batch": batch, "context": int(statistics.median(f["context"] for f, _ in steps)),
                       "prompt": context, "seconds": statistics.median(t for _, t in steps)})
        if progress:
            progress(f"decode batch {batch} at {context} tokens: {1000 * decode[-1]['seconds']:.2f} ms")
    if progress and (skipped["prefill"] or skipped["decode"]):
        progress(f"the budget left out {len(skipped['prefill'])} prefill and {len(skipped['decode'])} decode points "
                 f"(the most expensive ones)")
    return prefill, decode, skipped


# --- the KV pool's link --------------------------------------------------------------------------------------

_HOLDER = """
import sys, time
from nanoforge.serve.disagg.mooncake_store import MooncakeStore
store = MooncakeStore(sys.argv[1], segment_bytes=int(sys.argv[2]))
store.wait_warm()  # the transfers are timed into resident memory, as an instance's are once it serves
print("ready", flush=True)
sys.stdin.read()
store.close()
"""


def measure_transfer(block_bytes: int, *, blocks=TRANSFER_BLOCKS, repeats: int = 3, progress=None) -> list[dict]:
    """Seconds of one batched put and one batched get of n whole blocks, through Mooncake Store on loopback,
    the pool's memory in another process (kinds "put" and "get": remote, as a decode instance's gets are); then
    of one batched put of n blocks by a client that holds a segment of its own (kind "put_local"), which Mooncake
    places there (`preferred_segment`: a local copy, as a prefill instance's saves are while its segment has
    room). The local client joins after the remote calls are timed, so that those see the pool they always did:
    the holder's segment alone."""
    from nanoforge.serve.disagg.mooncake_store import MooncakeMaster, MooncakeStore

    need = max(blocks) * block_bytes
    # every timed call uses fresh keys (removed after it, once Mooncake's lease on them lets it): room for all of
    # them and half as much again, as a pool filled close to its size turns puts away (an H200 run with 64 MiB
    # to spare: a 256-block get after a 5 GB fill found half its keys missing); the local client's segment, room
    # for its own puts' keys and half as much again, so that none of them spills into the holder's
    keys_bytes = (repeats + 1) * sum(blocks) * block_bytes
    pool_bytes, local_bytes = 3 * keys_bytes + (64 << 20), 3 * keys_bytes // 2 + (64 << 20)
    samples = []

    def timed(store, kinds: tuple[str, ...], base: int, check=None, at: tuple | None = None) -> None:
        """Sample each of `kinds` at every size, in turn; `check(keys)` on the first call's keys of `at`, a
        (kind, blocks)."""
        for n in blocks:
            for kind in kinds:
                check_here = check if (kind, n) == at else None
                seconds = _time_calls(store, kind, n, base, block_bytes, repeats, check_here)
                samples.append({"kind": kind, "blocks": n, "seconds": seconds})
                if progress:
                    progress(f"{kind} of {n} blocks: {1000 * seconds:.2f} ms")

    with MooncakeMaster() as master:
        holder = subprocess.Popen([sys.executable, "-c", _HOLDER, master.address, str(pool_bytes)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            if holder.stdout.readline().strip() != "ready":
                raise NanoforgeError("the process holding the pool's memory did not start", param="pool")
            store = MooncakeStore(master.address, segment_bytes=0)
            clients = [store]
            buf = torch.zeros(need, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            base = buf.data_ptr()
            store.register_buffer(base, need)
            try:
                # where the holder's segment is (its transport endpoint), from the pool's only segment so far (a
                # block looked up stays leased: it outlives its call, one block of the room to spare)
                held = set()
                timed(store, ("put", "get"), base, lambda keys: held.update(store.segments(keys[0])),
                      at=("put", blocks[0]))
                local = MooncakeStore(master.address, segment_bytes=local_bytes)
                clients.append(local)
                local.wait_warm()  # timed into resident memory, as the holder's are
                local.register_buffer(base, need)

                def landed_locally(keys):
                    # the pool's segments are the holder's and the local client's: a block in no segment of the
                    # holder's is in the local one (the last block of the largest call: the first to spill over)
                    home = set(local.segments(keys[-1]))
                    if not home or home & held:
                        raise RuntimeError(f"a put by a client holding a segment landed in {sorted(home)}, the "
                                           f"holder's segment: not a local copy")

                timed(local, ("put_local",), base, landed_locally, at=("put_local", max(blocks)))
            finally:
                for client in reversed(clients):
                    client.unregister_buffer(base)
                    client.close()
        finally:
            holder.communicate("", timeout=60)
    return samples


def _time_calls(store, kind: str, n: int, base: int, block_bytes: int, repeats: int, check=None) -> float:
    """The median seconds of `repeats` batched calls of `kind` ("put", "get" or "put_local": a put by `store`,
    wherever it places it) moving n blocks from or into the registered buffer at `base`, after one to warm up;
    each call's keys are fresh, and removed after it. `check(keys)` runs once, on the first call's keys (not timed)."""
    ptrs = [base + i * block_bytes for i in range(n)]
    times = []
    for rep in range(repeats + 1):
        keys = [f"nanoforge-profile/{kind}/{n}/{rep}/{i}" for i in range(n)]  # fresh keys
        if kind == "get" and not all(store.put_from(keys, ptrs, block_bytes)):
            raise RuntimeError(f"the pool turned away some of the {n} blocks to get back")
        start = time.perf_counter()
        ok = (store.get_into if kind == "get" else store.put_from)(keys, ptrs, block_bytes)
        seconds = time.perf_counter() - start
        if all(ok) and check is not None and not rep:
            check(keys)
        store.remove(keys)
        if not all(ok):
            raise RuntimeError(f"a {kind} of {n} blocks: {n - sum(ok)} of them failed")
        if rep:
            times.append(seconds)
    return statistics.median(times)


# --- what serving adds: the front door, the server's work per token, the conductor's hop --------------------------

class _Server:
    """`nanoforge serve ARGS` in a child process on loopback, until `close()`; `url` once it answers."""

    def __init__(self, args: list[str], banner: str, timeout: float = 900.0):
        import threading
        import urllib.request

        self.proc = subprocess.Popen([sys.executable, "-m", "nanoforge.cli", "serve", "--port", "0", "--log-level",
                                      "warning", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.url, self.lines = None, []
        found = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.lines.append(line)
                if self.url is None and line.startswith(banner) and " at http://" in line:
                    self.url = line.split(" at ", 1)[1].split()[0].removesuffix("/v1")
                    found.set()
            found.set()

        threading.Thread(target=read, daemon=True).start()
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.proc.poll() is None:
            if found.wait(1.0) and self.url:
                try:
                    urllib.request.urlopen(self.url + "/health", timeout=5).read()
                    return
                except OSError:
                    time.sleep(0.5)
        self.close()
        raise RuntimeError(f"`nanoforge serve {' '.join(args)}` did not come up:\n{''.join(self.lines[-20:])}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _send(url: str, reqs: list) -> list:
    """bench serve's results for `reqs` (each sent at its arrival time)."""
    import asyncio

    from nanoforge.serve.bench_serve import run_requests

    results, _ = asyncio.run(run_requests(url, "m", reqs, ignore_eos=True))
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"a request to {url} failed: {bad[0]}")
    return results


def _latencies(url: str, vocab: int, prompt_len: int, output_len: int, k: int, rng: random.Random) -> list:
    """k requests sent at once (random prompts, nothing cached); their bench serve results."""
    from nanoforge.serve.bench_serve import Request

    return _send(url, [Request(0.0, _prompt(rng, prompt_len, vocab), prompt_len, output_len) for _ in range(k)])


def _arrivals(url: str, vocab: int, prompt_len: int, rng: random.Random, repeats: int, *, streams: int = 4,
              stream_prompt_len: int = 128, stream_output_len: int = 256, arrivals: int = 8) -> dict:
    """What requests arriving among running decodes cost the decodes: `streams` requests decoding at once, alone
    and while `arrivals` requests of `prompt_len` tokens (2 output tokens each) arrive, spread evenly over the
    first 80% of the decodes' time alone; their median TPOT either way. `frontend_section` takes the arrivals'
    prompt steps out of the difference: the rest is the server's host work on each request."""
    from nanoforge.serve.bench_serve import Request

    def run(gap_s: float | None) -> list:
        reqs = [Request(0.0, _prompt(rng, stream_prompt_len, vocab), stream_prompt_len, stream_output_len)
                for _ in range(streams)]
        if gap_s is not None:
            reqs += [Request((i + 0.5) * gap_s, _prompt(rng, prompt_len, vocab), prompt_len, 2)
                     for i in range(arrivals)]
        return _send(url, reqs)[:streams]

    base, loaded = [], []
    for _ in range(repeats):
        alone = run(None)
        took = statistics.median(r.ttft_ms + r.tpot_ms * (stream_output_len - 1) for r in alone) / 1000
        base += [r.tpot_ms / 1000 for r in alone]
        loaded += [r.tpot_ms / 1000 for r in run(0.8 * took / arrivals)]
    return {"prompt_len": prompt_len, "streams": streams, "stream_prompt_len": stream_prompt_len,
            "stream_output_len": stream_output_len, "arrivals": arrivals,
            "base_tpot_s": statistics.median(base), "tpot_s": statistics.median(loaded)}


def measure_frontend(model_dir: str, profile: Profile, *, vocab: int, serve_args: list[str], disagg: bool = True,
                     serve_len: int = 8192, prompt_len: int = 512, long_prompt_len: int | None = 4096, output_len: int = 32,
                     concurrency=(1, 4, 16), repeats: int = 3, stream: list | None = None,
                     progress=None) -> tuple[dict, dict]:
    """The frontend section of `profile` (whose engine sections are measured), from the real server on loopback:
    lone requests of `prompt_len` and `long_prompt_len` tokens (TTFT), k requests at once (TPOT), requests of
    128 and `prompt_len` tokens arriving among running decodes (`_arrivals`; `serve_len`: the server's
    context), and with `disagg` lone requests through `nanoforge serve --disagg --prefill 1 --decode 1`; `stream`, what
    `measure_stream` measured. `frontend_section` turns what was measured (the samples) into the section. Returns
    the section and the samples."""
    rng = random.Random(1)
    lone = max(9, 3 * repeats)  # lone requests (~10-30 ms each): their medians moved 25% between profiles of 3
    common = ["--model", model_dir, "--served-model-name", "m", *serve_args]
    samples: dict = {"prompt_len": prompt_len, "output_len": output_len, "stream": stream or []}
    server = _Server(common, "nanoforge serve:")
    try:
        _latencies(server.url, vocab, prompt_len, output_len, max(concurrency), rng)  # warm up
        ttft, tpot = [], {}
        for k in concurrency:
            got = [r for _ in range(lone if k == 1 else repeats)
                   for r in _latencies(server.url, vocab, prompt_len, output_len, k, rng)]
            tpot[k] = statistics.median(r.tpot_ms / 1000 for r in got)
            if k == 1:
                ttft = [r.ttft_ms / 1000 for r in got]
            if progress:
                progress(f"through the server, {k} at once: TPOT {1000 * tpot[k]:.2f} ms"
                         + (f", TTFT {1000 * statistics.median(ttft):.2f} ms" if k == 1 else ""))
        samples.update(ttft_s=statistics.median(ttft), tpot_s={str(k): v for k, v in tpot.items()})
        samples["arrivals"] = []
        for n in sorted({min(128, prompt_len), prompt_len}):  # short prompts: the host work is most of the loss
            a = _arrivals(server.url, vocab, n, rng, repeats, stream_prompt_len=min(128, serve_len // 4),
                          stream_output_len=min(256, serve_len - min(128, serve_len // 4) - 1))
            samples["arrivals"].append(a)
            if progress:
                progress(f"through the server, {a['arrivals']} requests of {n} tokens arriving among {a['streams']} "
                         f"decodes: their TPOT {1000 * a['tpot_s']:.2f} ms against {1000 * a['base_tpot_s']:.2f}")
        if long_prompt_len:
            _latencies(server.url, vocab, long_prompt_len, 2, 1, rng)  # its prefill shape, compiled outside the timing
            got = [r for _ in range(lone) for r in _latencies(server.url, vocab, long_prompt_len, 2, 1, rng)]
            samples.update(long_prompt_len=long_prompt_len,
                           long_ttft_s=statistics.median(r.ttft_ms / 1000 for r in got))
            if progress:
                progress(f"through the server, a {long_prompt_len}-token prompt: TTFT "
                         f"{1000 * samples['long_ttft_s']:.2f} ms")
    finally:
        server.close()
    if disagg:
        server = _Server([*common, "--disagg", "--prefill", "1", "--decode", "1", "--policy", "round-robin"],
                         "nanoforge conductor:")
        try:
            _latencies(server.url, vocab, prompt_len, output_len, 1, rng)
            got = [r for _ in range(lone) for r in _latencies(server.url, vocab, prompt_len, output_len, 1, rng)]
        finally:
            server.close()
        samples["disagg_ttft_s"] = statistics.median(r.ttft_ms / 1000 for r in got)
        if progress:
            progress(f"through the conductor (1 prefill + 1 decode): TTFT {1000 * samples['disagg_ttft_s']:.2f} ms")
    return frontend_section(profile, samples), samples


def measure_stream(engine, tokenizer, *, requests: int = 8, prompt_len: int = 64, output_len: int = 512,
                   every: int = 16, repeats: int = 3, progress=None) -> list[dict]:
    """What a disaggregated decode instance's hand-over stream costs per event, by the output tokens the request
    holds: the engine generates `requests` outputs of `output_len` tokens (random prompts, greedy, as a served
    benchmark), each is replayed as the decode route streams it (one cumulative RequestOutput per token with the
    tokenizer's text, through `OutputEncoder.event` and `json.dumps`), and every `every`-th event is timed.
    Returns samples {"tokens": output tokens before the event, "seconds": its cost, the mean over requests of
    each one's median over `repeats`}. Why: until session 12 the encoder found the text already sent with a
    character loop over the whole text, so an event's cost grew with the output (1.7 us a token held), which
    the colocated server's per-token cost (`per_token_s`, 32-token outputs) did not see; it is one `startswith`
    now, so the slope measured should be ~0, and this keeps it honest. It runs on the host, so it is measured on
    the machine that serves."""
    import json

    from nanoforge.serve.disagg.handover import OutputEncoder
    from nanoforge.serve.llm_engine import CompletionOutput, RequestOutput
    from nanoforge.serve.sampling_params import SamplingParams

    rng = random.Random(2)
    vocab = engine.model.cfg.vocab_size
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    ids = {engine.add_request(_prompt(rng, prompt_len, vocab), params): None for _ in range(requests)}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                ids[out.request_id] = list(out.outputs[0].token_ids)
    marks = range(every, output_len, every)
    per_request = []
    for tokens in ids.values():
        events = [RequestOutput("r", None, [], [CompletionOutput(0, tokenizer.decode(tokens[:k]), tokens[:k])], False)
                  for k in range(1, len(tokens) + 1)]
        times = {k: [] for k in marks if k < len(events)}
        for _ in range(repeats):
            encoder = OutputEncoder()
            for k, event in enumerate(events):  # event k holds k + 1 tokens; the text sent so far holds k
                t0 = time.perf_counter()
                json.dumps(encoder.event(event), separators=(",", ":"))
                if k in times:
                    times[k].append(time.perf_counter() - t0)
        per_request.append({k: statistics.median(v) for k, v in times.items()})
    samples = [{"tokens": k, "seconds": statistics.fmean(r[k] for r in per_request)} for k in per_request[0]]
    if progress and samples:
        progress(f"a decode instance's hand-over event: {1e6 * samples[0]['seconds']:.1f} us after "
                 f"{samples[0]['tokens']} tokens, {1e6 * samples[-1]['seconds']:.1f} us after {samples[-1]['tokens']}")
    return samples


def engine_prefill_s(profile: Profile, tokens: int) -> float:
    """The engine's step for a lone prompt of `tokens` tokens, nothing cached: as measured where the profile holds
    that step among its samples, else as its prefill form gives it."""
    for s in (profile.meta.get("samples") or {}).get("prefill") or []:
        if s["tokens"] == tokens and not s.get("cached") and not s.get("batch"):
            return s["seconds"] + profile.frontend.get("per_token_s", 0.0)
    return profile.prefill_time(tokens)


def frontend_section(profile: Profile, samples: dict) -> dict:
    """What serving adds, from `measure_frontend`'s samples and the profile's engine sections:

    - request_s + per_prompt_token_s * L: a lone request's TTFT through `nanoforge serve` less the engine's prefill
      step for its prompt of L tokens, a line through the two prompt lengths measured (the server's own work on a
      prompt: parsing, checks, block hashes, the prefix lookup; one length: per_prompt_token_s 0). The step is the
      measured one where the profile holds it (`engine_prefill_s`), so that the prefill form's error at that
      length is not taken for the server's work: session 15's form was 1.7 ms (7%) under the measured step at
      4,096 tokens, which made the line 1.0 us a prompt token, where the measured steps give 0.48;
    - per_token_s: k requests sent at once decode in lock-step, so each one's TPOT is a decode step of batch k plus
      the server's work for the k tokens it streams: fitted (through 0) to TPOT - decode_time(k, context) over k;
    - handover_s: a lone request's TTFT through the conductor (1 prefill + 1 decode) less the request's latency,
      the prefill step, the sampled token and saving the prompt's blocks to the pool (a put into the prefill
      instance's own segment, which has room for them);
    - stream_per_output_token_s: the slope of a decode instance's hand-over event cost over the output tokens
      its request holds (`measure_stream`; its intercept is the kind of work `per_token_s` already counts);
    - request_host_s + request_host_per_token_s * L: what each request of L tokens arriving among running
      decodes adds to their time (their TPOT's rise over their tokens, per arrival) beyond its prompt's chunk in
      their steps (`Profile.chunk_extra`) and its sampled tokens: the server's host work on it (`_arrivals`; a
      line through the prompt lengths measured, its slope at most `per_prompt_token_s`: the per-token part is the
      same work, parsing, checks and block hashes, that a lone request's latency measures per prompt token. Left
      free, the line took the prompt chunk's modelling error for host work: session 15's arrivals of 128 and 512
      tokens gave 8 us a token, 17 ms of host work at the validation trace's ~1,800-token prompts, where session
      14 had measured a flat ~6.5 ms from 512 to 4,096 tokens)."""
    n = samples["prompt_len"]
    short = samples["ttft_s"] - engine_prefill_s(profile, n)
    per_prompt_token_s = 0.0
    if samples.get("long_ttft_s") is not None:
        m = samples["long_prompt_len"]
        long = samples["long_ttft_s"] - engine_prefill_s(profile, m)
        per_prompt_token_s = max(0.0, (long - short) / (m - n))
    request_s = max(0.0, short - per_prompt_token_s * n)
    tpot = {int(k): v for k, v in samples["tpot_s"].items()}
    context = n + samples["output_len"] // 2  # per sequence, mid-way through its output
    num = sum(k * (tpot[k] - profile.decode_time(k, k * context)) for k in tpot)
    per_token_s = max(0.0, num / sum(k * k for k in tpot))
    section = {"request_s": request_s, "per_prompt_token_s": per_prompt_token_s, "handover_s": 0.0,
               "per_token_s": per_token_s, "stream_per_output_token_s": 0.0}
    if len(samples.get("stream") or []) >= 2:
        (_, section["stream_per_output_token_s"]), _ = fit(samples["stream"], ("tokens",))
    host = []  # (prompt tokens, seconds of host work per request)
    for a in samples.get("arrivals") or []:
        k, lost = a["streams"], (a["tpot_s"] - a["base_tpot_s"]) * (a["stream_output_len"] - 1) / a["arrivals"]
        context = k * (a["stream_prompt_len"] + a["stream_output_len"] // 2)
        device = profile.chunk_extra(a["prompt_len"], k, context) + profile.decode_time(k + 1, context) \
            - profile.decode_time(k, context)  # its chunk in a step, and its second token in the next
        host.append((a["prompt_len"], max(0.0, lost - device - 2 * per_token_s)))
    if host:
        (n0, h0), (n1, h1) = host[0], host[-1]
        slope = min(max(0.0, (h1 - h0) / (n1 - n0)) if n1 > n0 else 0.0, per_prompt_token_s)
        section.update(request_host_s=max(0.0, statistics.fmean(h - slope * m for m, h in host)),
                       request_host_per_token_s=slope)
    if samples.get("disagg_ttft_s") is not None:
        save = profile.transfer_time(n // profile.engine["block_size"], local=True)  # into the instance's segment
        section["handover_s"] = max(0.0, samples["disagg_ttft_s"] - request_s - per_prompt_token_s * n
                                    - profile.prefill_time(n) - per_token_s - save)
    return section


def fit_transfer(samples: list[dict]) -> tuple[dict, dict]:
    """The transfer section's forms fitted to `measure_transfer`'s samples, and each fit's residuals: latency_s +
    per_block_s x n to the remote puts and gets, local_latency_s + local_per_block_s x n to the puts into the
    client's own segment (samples without those leave the local fields out: the remote ones stand for them)."""
    local = [s for s in samples if s["kind"] == "put_local"]
    (a, b), remote_fit = fit([s for s in samples if s["kind"] != "put_local"], ("blocks",))
    section, fits = {"latency_s": a, "per_block_s": b}, {"transfer": remote_fit}
    if local:
        (a, b), fits["transfer_local"] = fit(local, ("blocks",))
        section.update(local_latency_s=a, local_per_block_s=b)
    return section, fits


def fit_steps(prefill: list[dict], decode: list[dict]) -> tuple[dict, dict, dict]:
    """The prefill and decode sections of a profile fitted to step samples, and each fit's residuals."""
    (pa, pt, pp, px, pq), prefill_fit = fit(prefill, PREFILL_FEATURES)
    decode_section, decode_fit = fit_decode(decode)
    return ({"a_s": pa, "per_token_s": pt, "per_pair_s": pp, "per_prefix_s": px, "per_prefix_pair_s": pq},
            decode_section,
            {"prefill": prefill_fit, "decode": decode_fit})


def fit_decode(decode: list[dict]) -> tuple[dict, dict]:
    """The decode section: a level per measured batch size (`batch_s`, non-decreasing: each a rise >= 0 over the
    one below, so noise cannot make a larger batch cheaper) and one per-context slope, fitted together (a step's
    cost is not linear in the batch: profile.py), and the line through the levels as `a_s`, `per_seq_s`. One
    batch size measured: the line alone."""
    batches = sorted({s["batch"] for s in decode})
    if len(batches) < 2:
        (da, db, dc), decode_fit = fit(decode, ("batch", "context"))
        return {"a_s": da, "per_seq_s": db, "per_context_s": dc}, decode_fit
    names = tuple(f"from_batch_{b}" for b in batches[1:])  # each a rise >= 0 from the level below: never cheaper
    rows = [{**s, **{n: float(s["batch"] >= b) for n, b in zip(names, batches[1:])}} for s in decode]  # for more
    (first, dc, *rises), decode_fit = fit(rows, ("context", *names))
    levels = list(itertools.accumulate(rises, initial=first))
    db, da = np.polyfit(batches, levels, 1, w=1 / np.array(levels))
    section = {"a_s": max(0.0, float(da)), "per_seq_s": max(0.0, float(db)), "per_context_s": dc,
               "batch_s": [[b, v] for b, v in zip(batches, levels)]}
    return section, decode_fit


def refit(profile: Profile) -> Profile:
    """`profile`'s time models fitted again from the samples it holds, in today's forms (a profile measured before a
    form gained a term gets the term; samples of prefill steps from before the prefix and prefix-pair features
    have them from their cached prefix: each was one chunk after `cached` tokens)."""
    samples = profile.meta["samples"]
    prefill = [{**s, "prefix": s.get("prefix", s["cached"]),
                "prefix_pairs": s.get("prefix_pairs", (s["tokens"] - s.get("batch", 0)) * s["cached"])}
               for s in samples["prefill"]]
    d = profile.to_dict()
    d["prefill"], d["decode"], fits = fit_steps(prefill, samples["decode"])
    d["samples"] = {**samples, "prefill": prefill}
    d["fit"] = {**d.get("fit", {}), **fits}
    d["frontend"] = {}  # the frontend is what the measured latencies add to the engine alone
    out = Profile.from_dict(d, profile.name)
    if samples.get("frontend"):
        out = Profile.from_dict({**d, "frontend": frontend_section(out, samples["frontend"])}, profile.name)
    return out


# --- the profile -------------------------------------------------------------------------------------------------

def measure_profile(engine, *, name: str, model: str, pool: bool = False, link_gbs: float = 1.0,
                    repeats: int = 3, grid: dict | None = None, budget_s: float | None = None,
                    progress=print) -> Profile:
    """Measure `engine` (an LLMEngine without a KV pool) and fit a profile."""
    from nanoforge.serve.model_runner import kv_bytes_per_block

    cfg = engine.scheduler.config
    dtype = engine.model.embed.weight.dtype
    kv_block = kv_bytes_per_block(engine.model, cfg.block_size, dtype)
    slot = pool_block_bytes(kv_block, cfg.block_size)
    prefill, decode, skipped = measure_steps(engine, repeats=repeats, budget_s=budget_s, progress=progress,
                                             **(grid or {}))
    if len(prefill) < 3 or len(decode) < 3:
        raise NanoforgeError(f"the engine's context ({cfg.max_model_len} tokens) or cache ({cfg.num_gpu_blocks} "
                             f"blocks) is too small to measure a profile: give --max-model-len or --num-gpu-blocks",
                             param="max_model_len")
    prefill_section, decode_section, fits = fit_steps(prefill, decode)
    if pool:
        transfer = measure_transfer(slot, repeats=repeats, progress=progress)
        transfer_section, transfer_fits = fit_transfer(transfer)
        transfer_section.update(block_bytes=kv_block, measured=True,
                                link="Mooncake Store over TCP on loopback, the pool's memory in another process "
                                     "(local: a put into the client's own segment)")
    else:
        transfer, transfer_fits = [], {"transfer": None}
        transfer_section = {"latency_s": 0.001, "per_block_s": slot / (link_gbs * 1e9), "block_bytes": kv_block,
                            "measured": False, "link": f"assumed {link_gbs:g} GB/s per pool call (no --pool)"}
    device = engine.model.embed.weight.device
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return Profile(
        name=name, status="measured",
        prefill=prefill_section, decode=decode_section,
        transfer=transfer_section,
        engine={"num_gpu_blocks": cfg.num_gpu_blocks, "block_size": cfg.block_size, "max_num_seqs": cfg.max_num_seqs,
                "max_num_batched_tokens": cfg.max_num_batched_tokens},
        meta={"source": f"nanoforge simulate profile on {device_name}: {model}, {str(dtype).removeprefix('torch.')}, "
                        f"CUDA graphs {'on' if getattr(engine.runner, 'graphs', None) else 'off'}; frontend latencies "
                        f"are not measured here (0)",
              "model": model, "device": device_name, "max_model_len": cfg.max_model_len,
              "fit": {**fits, **transfer_fits},
              "samples": {"prefill": prefill, "decode": decode, "transfer": transfer},
              "skipped_by_budget": skipped, "budget_s": budget_s})


# --- the command line ----------------------------------------------------------------------------------------------

def add_cli_arguments(p) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--model", metavar="DIR", help="a model directory (its weights are used as they are)")
    g.add_argument("--model-preset", metavar="NAME", help="a model preset's shape, random weights")
    g.add_argument("--refit", metavar="PROFILE.json",
                   help="measure nothing: fit a profile's time models again from the samples it holds, in today's "
                        "forms (a profile measured before a form gained a term), and write it to --out")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the engine's context (default: the model's, at most 40,960 tokens)")
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="KV blocks (default: sized from memory)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--pool", action="store_true",
                   help="measure the KV transfer through Mooncake Store (starts a mooncake_master on loopback)")
    p.add_argument("--frontend", action="store_true",
                   help="also measure what serving adds (needs --model DIR): the front door's latency and the "
                        "server's work per streamed token through `nanoforge serve`, and with --pool the conductor's "
                        "hop through `nanoforge serve --disagg` (1 prefill + 1 decode)")
    p.add_argument("--link-gbs", type=float, default=1.0, help="without --pool: the link's assumed GB/s")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point (after one to warm up)")
    p.add_argument("--quick", action="store_true", help="a coarse grid (a CPU test)")
    p.add_argument("--budget-s", type=float, default=None, metavar="S",
                   help="seconds the engine's steps may take in all (half prefill, half decode); points run cheapest "
                        "first and those past the budget are left out (listed in the profile). Default: no limit")
    p.add_argument("--name", default=None, help="the profile's name (default: the --out file's stem)")
    p.add_argument("--out", required=True, metavar="PROFILE.json")


QUICK_GRID = {"prefill_tokens": (16, 32, 64), "prefill_cached": (0, 32), "decode_batch": (1, 4, 16),
              "decode_context": (32, 64)}  # fits a 128-token context


def run_cli(args) -> int:
    from pathlib import Path

    if args.refit:
        old = Profile.load(args.refit)
        if not old.meta.get("samples", {}).get("prefill"):
            raise NanoforgeError(f"{args.refit} holds no samples to fit (a derived profile?)", param="refit")
        profile = refit(old)
        note = "refit by `nanoforge simulate profile --refit` from its samples"
        source = old.meta.get("source", "")
        profile.meta["source"] = source if source.endswith(note) else f"{source}; {note}".lstrip("; ")
        profile.save(args.out)
        _print_fits(profile)
        print(f"wrote {args.out}")
        return 0

    from nanoforge.model.config import preset
    from nanoforge.model.hf import load_model
    from nanoforge.model.transformer import Transformer
    from nanoforge.runtime import pick_device, pick_dtype
    from nanoforge.serve.llm_engine import EngineConfig, LLMEngine

    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_gpu_blocks",
                 "repeats"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise NanoforgeError(f"--{name.replace('_', '-')} must be >= 1, got {v}", param=name)
    if args.frontend and not args.model:
        raise NanoforgeError("--frontend starts `nanoforge serve --model DIR`: give --model DIR", param="frontend")
    if args.budget_s is not None and not args.budget_s > 0:
        raise NanoforgeError(f"--budget-s must be > 0, got {args.budget_s}", param="budget_s")
    if not args.link_gbs > 0:
        raise NanoforgeError(f"--link-gbs must be > 0, got {args.link_gbs}", param="link_gbs")
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    if args.model:
        model = load_model(args.model, device=device, dtype=dtype)
        what = f"{Path(args.model).name} ({args.model})"
    else:
        cfg = preset(args.model_preset)
        if not cfg.learned_positions and args.max_model_len and args.max_model_len > cfg.max_seq_len:
            cfg = cfg.replace(max_seq_len=args.max_model_len)  # RoPE: any length works
        torch.manual_seed(0)
        with torch.device(device):
            model = Transformer(cfg).to(dtype).eval()
        what = f"{args.model_preset} shape, random weights"
    max_len = min(args.max_model_len or 40960, model.cfg.max_seq_len)
    engine = LLMEngine(model, None, EngineConfig(
        block_size=args.block_size, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_len, num_gpu_blocks=args.num_gpu_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization, use_cuda_graphs=not args.no_cuda_graphs,
        device=str(device), dtype=str(dtype).removeprefix("torch.")))
    out = Path(args.out)
    print(f"measuring {what} on {device} ({engine.scheduler.config.num_gpu_blocks} KV blocks, context {max_len})",
          flush=True)
    profile = measure_profile(engine, name=args.name or out.stem, model=what, pool=args.pool, link_gbs=args.link_gbs,
                              repeats=args.repeats, grid=QUICK_GRID if args.quick else None, budget_s=args.budget_s,
                              progress=lambda line: print("  " + line, flush=True))
    if args.frontend:
        import gc

        from nanoforge.tokenizer import Tokenizer

        stream = measure_stream(engine, Tokenizer.load(args.model), output_len=min(512, max_len // 2),
                                prompt_len=min(64, max_len // 4), repeats=args.repeats,
                                progress=lambda line: print("  " + line, flush=True))
        vocab = model.cfg.vocab_size
        del engine, model  # the server gets the device's memory
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        serve_len = min(max_len, 8192)
        serve_args = ["--device", str(device), "--dtype", str(dtype).removeprefix("torch."), "--max-model-len",
                      str(serve_len), "--block-size", str(args.block_size), "--max-num-seqs",
                      str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                      "--gpu-memory-utilization", "0.5"]  # a few requests: any KV cache does; leave this process room
        output_len = min(32, max_len // 4)  # a 512-token prompt and 32 tokens, or what the context holds
        prompt_len = min(512, (max_len - output_len - 1) // args.block_size * args.block_size)
        long_len = min(4096, args.max_num_batched_tokens, (serve_len - 3) // args.block_size * args.block_size)
        frontend, samples = measure_frontend(args.model, profile, vocab=vocab, serve_args=serve_args,
                                             serve_len=serve_len, disagg=args.pool, repeats=args.repeats, prompt_len=prompt_len,
                                             long_prompt_len=long_len if long_len >= 2 * prompt_len else None,
                                             output_len=output_len, stream=stream,
                                             progress=lambda line: print("  " + line, flush=True))
        profile.frontend = frontend
        profile.meta["samples"]["frontend"] = samples
        profile.meta["source"] = profile.meta["source"].replace("frontend latencies are not measured here (0)",
                                                                "frontend latencies measured through nanoforge serve")
        profile = Profile.from_dict(profile.to_dict(), profile.name)  # the time models with the frontend in them
    profile.save(out)
    _print_fits(profile, frontend=args.frontend)
    print(f"wrote {out}")
    return 0


def _print_fits(profile: Profile, frontend: bool = True) -> None:
    fits = profile.meta["fit"]
    p = profile.prefill
    print(f"prefill step = {1000 * p['a_s']:.3f} ms + {1e6 * p['per_token_s']:.3f} us/token "
          f"+ {1e9 * p['per_pair_s']:.4f} ns/query-key pair (+ {1e9 * p.get('per_prefix_pair_s', 0.0):.4f} over the "
          f"prefix) + {1e9 * p['per_prefix_s']:.1f} ns/prefix token "
          f"(mean error "
          f"{100 * fits['prefill']['mean_rel_error']:.1f}%)")
    d = profile.decode
    by_batch = ("; at no context, by batch: " + ", ".join(f"{b} {1000 * v:.3f}" for b, v in d["batch_s"]) + " ms"
                if d.get("batch_s") else "")
    print(f"decode step = {1000 * d['a_s']:.3f} ms + {1e6 * d['per_seq_s']:.2f} us/seq "
          f"+ {1e9 * d['per_context_s']:.3f} ns/context token (mean error "
          f"{100 * fits['decode']['mean_rel_error']:.1f}%){by_batch}")
    t = profile.transfer
    local = (f"; a put into its own segment {1000 * t.get('local_latency_s', t['latency_s']):.3f} ms + "
             f"{1000 * t.get('local_per_block_s', t['per_block_s']):.3f} ms/block"
             if "local_latency_s" in t or "local_per_block_s" in t else "")
    print(f"KV transfer = {1000 * t['latency_s']:.3f} ms + {1000 * t['per_block_s']:.3f} ms/block "
          f"({'measured' if t.get('measured') else 'assumed'}){local}")
    f = profile.frontend
    print(f"frontend: request {1000 * f['request_s']:.2f} ms + {1e6 * f['per_prompt_token_s']:.2f} us per prompt "
          f"token, conductor hop {1000 * f['handover_s']:.2f} ms, {1e6 * f['per_token_s']:.1f} us per streamed token, "
          f"{1e9 * f['stream_per_output_token_s']:.0f} ns per output token held per hand-over event, "
          f"{1000 * f['request_host_s']:.2f} ms + {1e6 * f['request_host_per_token_s']:.2f} us per prompt token of "
          f"host work per request" + ("" if frontend else " (not measured: --frontend)"))
