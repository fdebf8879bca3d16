"""The conductor's decisions, without HTTP: which prefill and decode instance take a request, and whether to
take it at all.

Policies (`--policy`):

    random         any healthy instance
    round-robin    each in turn
    least-loaded   the one with the fewest requests in flight (prefill: the fewest tokens still to compute)
    cache-aware    Mooncake's: the prefill instance with the smallest predicted time to first token,
                   TTFT_i = prefill(tokens queued on i + tokens i would compute) + transfer(blocks i would load),
                   where i computes what neither its own prefix cache nor the pool holds, and loads from the pool
                   what the pool holds beyond its own cache; the decode instance with the fewest requests

With `colocated=True` (the cluster simulator's vLLM-style baseline, `sim/`), every instance both prefills and
decodes: a request's decode instance is its prefill instance, and its TPOT is predicted there.

The conductor knows each prefill instance's prefix cache approximately, as the
block keys of the prompts it sent there (as many as the instance has blocks,
least recently used forgotten), and the pool's exactly, by asking it.

Time is predicted by `CostModel`, fitted online from what instances report:
the seconds a prefill instance took from arrival to first token against the
tokens it had to compute (its own, and those queued before it); and a request's
time per output token in its two parts, as a decode instance delivers them: the
first decode token's delay (the hand-over: loading the prompt's KV from the
pool, the instance's first step), against the prompt's length, and the time
per token after it, against the decode instance's requests in flight. A
request of n tokens is predicted TPOT = (delay + (n - 2) x per-token) / (n - 1)
with n its max_tokens: a short answer to a long prompt has a high TPOT because
of its hand-over, not because the decode instance is busy (a single fit of
TPOT against load mistook the one for the other and turned away requests that
met their SLOs). A cost model that has seen fewer than `MIN_OBSERVATIONS`
requests predicts nothing, so **early rejection** (`--ttft-slo`, `--tpot-slo`:
answer 429 at once when the predicted TTFT or TPOT of the best choice exceeds
its objective) starts once the model has data. A request whose decode instance
is idle is never rejected for TPOT (a cost model misled by a few slow requests
would otherwise reject everything after them, and, seeing nothing more, never
recover: the cluster simulator found this).
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from dataclasses import dataclass, field

from nanoforge.errors import NanoforgeError

POLICIES = ("random", "round-robin", "least-loaded", "cache-aware")
MIN_OBSERVATIONS = 3
POOL_BANDWIDTH = 1e9  # bytes/s the transfer of a cached block is predicted at (Mooncake over TCP, one stream)


@dataclass
class Instance:
    """One instance as the conductor sees it."""

    url: str
    role: str  # what the conductor uses it for: "prefill" or "decode"
    info: dict = field(default_factory=dict)  # its GET /disagg/info
    healthy: bool = True
    running: int = 0  # requests this conductor has in flight on it
    queued_tokens: int = 0  # prefill: tokens still to compute of those, as predicted
    routed: int = 0
    cache: OrderedDict = field(default_factory=OrderedDict)  # prefill: block keys of its prefix cache (approx)

    def cached_prefix(self, hashes: list[int]) -> int:
        """How many leading blocks of `hashes` its prefix cache holds, as far as we know."""
        n = 0
        while n < len(hashes) and hashes[n] in self.cache:
            n += 1
        return n

    def remember(self, hashes: list[int]) -> None:
        for h in hashes:
            self.cache[h] = None
            self.cache.move_to_end(h)
        while len(self.cache) > max(1, self.info.get("num_gpu_blocks", 1 << 16)):
            self.cache.popitem(last=False)


class LinearFit:
    """y ~ a + b x by least squares over exponentially decayed observations (recent ones count most)."""

    def __init__(self, decay: float = 0.95):
        self.decay = decay
        self.n = 0
        self.s = [0.0] * 5  # sums of w, wx, wy, wxx, wxy

    def observe(self, x: float, y: float) -> None:
        self.s = [v * self.decay for v in self.s]
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            self.s[i] += v
        self.n += 1

    def predict(self, x: float) -> float | None:
        if self.n < MIN_OBSERVATIONS:
            return None
        w, sx, sy, sxx, sxy = self.s
        var = w * sxx - sx * sx
        if var <= 1e-9 * max(1.0, w * sxx):  # every x alike: the mean, scaled through the origin
            return sy / sx * x if sx > 0 else sy / w
        b = max(0.0, (w * sxy - sx * sy) / var)
        a = max(0.0, (sy - b * sx) / w)
        return a + b * x


@dataclass
class Plan:
    """Where one prompt goes, and what that is predicted to cost."""

    prefill: Instance
    decode: Instance
    hashes: list[int]  # the prompt's full-block keys (those a cache could hold)
    cached_blocks: int  # blocks the prefill instance is expected to find (its cache or the pool)
    uncached_tokens: int  # tokens it is expected to compute
    ttft_s: float | None  # predicted; None before the cost model has data
    tpot_s: float | None


class Router:
    def __init__(self, prefill: list[Instance], decode: list[Instance], policy: str = "cache-aware", *,
                 ttft_slo: float | None = None, tpot_slo: float | None = None, seed: int = 0,
                 pool_bandwidth: float = POOL_BANDWIDTH, colocated: bool = False):
        if policy not in POLICIES:
            raise NanoforgeError(f"--policy must be one of {', '.join(POLICIES)}, got {policy!r}", param="policy")
        self.prefill, self.decode, self.policy = prefill, decode, policy
        self.ttft_slo, self.tpot_slo = ttft_slo, tpot_slo
        self.rng = random.Random(seed)
        self.turn = {"prefill": 0, "decode": 0}
        self.prefill_fit = LinearFit()
        self.handover_fit, self.step_fit = LinearFit(), LinearFit()  # first decode token vs prompt; then vs batch
        self.pool_bandwidth = pool_bandwidth
        self.rejected = {"ttft": 0, "tpot": 0}
        self.colocated = colocated

    # --- choosing ---------------------------------------------------------------------------------

    def plan(self, prompt_len: int, hashes: list[int], pool_blocks: int, max_tokens: int | None = None) -> Plan:
        """Instances for a prompt of `prompt_len` tokens whose first `pool_blocks` blocks the pool holds, and at
        most `max_tokens` tokens out (None: unknown, TPOT taken as its per-token part); NanoforgeError 503 if no
        instance is up, 429 (with Retry-After) if an SLO cannot be met."""
        prefill = self.choose_prefill(prompt_len, hashes, pool_blocks)
        decode = prefill if self.colocated else self.choose_decode()
        cached = max(prefill.cached_prefix(hashes), pool_blocks)
        uncached = prompt_len - cached * prefill.info.get("block_size", 16)
        plan = Plan(prefill, decode, hashes, cached, uncached,
                    self.predict_ttft(prefill, hashes, pool_blocks, prompt_len),
                    self.predict_tpot(decode, prompt_len, max_tokens))
        if self.ttft_slo is not None and plan.ttft_s is not None and plan.ttft_s > self.ttft_slo:
            self.rejected["ttft"] += 1
            raise NanoforgeError(f"the cluster is busy: the predicted time to first token, {plan.ttft_s:.3g} s, is "
                                 f"over the objective of {self.ttft_slo:g} s (--ttft-slo); retry later",
                                 status=429, retry_after=max(1, math.ceil(plan.ttft_s - self.ttft_slo)))
        # TPOT is a matter of load: an idle decode instance is not turned away (and what it serves keeps the cost
        # model learning; otherwise a few slow early requests could lock every later one out)
        if self.tpot_slo is not None and plan.tpot_s is not None and plan.tpot_s > self.tpot_slo \
                and plan.decode.running > 0:
            self.rejected["tpot"] += 1
            raise NanoforgeError(f"the cluster is busy: the predicted time per output token, {plan.tpot_s:.3g} s, "
                                 f"is over the objective of {self.tpot_slo:g} s (--tpot-slo); retry later",
                                 status=429)
        return plan

    def choose_prefill(self, prompt_len: int, hashes: list[int], pool_blocks: int,
                       exclude: tuple[Instance, ...] = ()) -> Instance:
        up = self._up(self.prefill, exclude)
        if self.policy == "cache-aware":
            return min(up, key=lambda i: (self.predict_ttft(i, hashes, pool_blocks, prompt_len, default=True),
                                          i.running))
        if self.policy == "least-loaded":
            return min(up, key=lambda i: (i.queued_tokens, i.running, self.rng.random()))
        return self._plain(up, "prefill")

    def choose_decode(self, exclude: tuple[Instance, ...] = ()) -> Instance:
        up = self._up(self.decode, exclude)
        if self.policy in ("least-loaded", "cache-aware"):
            return min(up, key=lambda i: (i.running, self.rng.random()))
        return self._plain(up, "decode")

    def _up(self, instances: list[Instance], exclude) -> list[Instance]:
        up = [i for i in instances if i.healthy and i not in exclude]
        if not up:
            role = instances[0].role if instances else "?"
            raise NanoforgeError(f"no {role} instance is up ({', '.join(i.url for i in instances)}); retry later",
                                 status=503)
        return up

    def _plain(self, up: list[Instance], role: str) -> Instance:
        if self.policy == "random":
            return self.rng.choice(up)
        self.turn[role] += 1
        return up[self.turn[role] % len(up)]

    def reroute_prefill(self, plan: Plan, prompt_len: int, pool_blocks: int, exclude: tuple[Instance, ...]) -> None:
        """plan.prefill failed: another one (NanoforgeError 503 if none is left)."""
        plan.prefill = self.choose_prefill(prompt_len, plan.hashes, pool_blocks, exclude)
        plan.cached_blocks = max(plan.prefill.cached_prefix(plan.hashes), pool_blocks)
        plan.uncached_tokens = prompt_len - plan.cached_blocks * plan.prefill.info.get("block_size", 16)

    # --- predicting -------------------------------------------------------------------------------

    def predict_ttft(self, inst: Instance, hashes: list[int], pool_blocks: int, prompt_len: int, *,
                     default: bool = False) -> float | None:
        """Queueing + computing the uncached part + loading the part only the pool holds, on `inst`. With
        `default`, an uncalibrated model still ranks instances (1 ms per 1,000 tokens)."""
        local = inst.cached_prefix(hashes)
        cached = max(local, pool_blocks)
        uncached = prompt_len - cached * inst.info.get("block_size", 16)
        compute = self.prefill_fit.predict(inst.queued_tokens + uncached)
        if compute is None:
            if not default:
                return None
            compute = 1e-6 * (inst.queued_tokens + uncached)
        transfer = max(0, pool_blocks - local) * (inst.info.get("kv_block_bytes") or 0) / self.pool_bandwidth
        return compute + transfer

    def predict_tpot(self, inst: Instance, prompt_len: int = 0, max_tokens: int | None = None) -> float | None:
        """A request's time per output token on `inst`: its first decode token's delay for a prompt of
        `prompt_len` tokens, then `max_tokens` - 2 tokens at the per-token time of `inst` with one more request."""
        step = self.step_fit.predict(inst.running + 1)
        if max_tokens is None or step is None:
            return step
        if max_tokens < 2:
            return None  # one token: no TPOT
        first = self.handover_fit.predict(prompt_len)
        if first is None:
            return step
        return (first + (max_tokens - 2) * step) / (max_tokens - 1)

    # --- bookkeeping --------------------------------------------------------------------------------

    def prefill_started(self, plan: Plan) -> int:
        """The request goes to plan.prefill; returns the tokens queued before it (for `prefill_done`)."""
        inst = plan.prefill
        ahead = inst.queued_tokens
        inst.running += 1
        inst.routed += 1
        inst.queued_tokens += plan.uncached_tokens
        return ahead

    def prefill_done(self, plan: Plan, ahead: int, seconds: float | None, computed_tokens: int | None) -> None:
        """It answered (seconds and computed_tokens as it reported them) or failed (None)."""
        inst = plan.prefill
        inst.running -= 1
        inst.queued_tokens -= plan.uncached_tokens
        if seconds is not None:
            inst.remember(plan.hashes)  # its prefix cache holds the prompt's blocks now
            self.prefill_fit.observe(ahead + computed_tokens, seconds)

    def decode_started(self, inst: Instance) -> int:
        inst.running += 1
        if not self.colocated:  # colocated: the request was counted once, when its prefill went there
            inst.routed += 1
        return inst.running

    def decode_done(self, inst: Instance, batch: int, first_s: float | None = None, step_s: float | None = None,
                    prompt_len: int = 0) -> None:
        """It finished (or failed: nothing observed): its first decode token came `first_s` after the hand-over
        (None: it made none), the later ones `step_s` apart on average (None: fewer than two)."""
        inst.running -= 1
        if first_s is not None:
            self.handover_fit.observe(prompt_len, first_s)
        if step_s is not None:
            self.step_fit.observe(batch, step_s)
