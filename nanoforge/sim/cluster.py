"""The cluster on a discrete-event clock: the conductor, the instances and the KV pool.

A request's life, as the real conductor (`serve/disagg/conductor.py`) runs it, with the same `Router`:

    arrival      (+ Profile.request_time) the conductor checks it (`check_request`), computes its block keys,
                 asks the pool how many leading blocks it holds, and lets the Router choose the instances or
                 reject it early (its 429); `Router.prefill_started`. A single colocated instance has no
                 conductor: its own server is the front door, so the request is routed as it arrives and spends
                 its request time there, and the steps running on that instance meanwhile pay the server's work
                 on it (`SimInstance.take_request`). Behind a conductor (disaggregated, or `nanoforge serve --disagg
                 --colocated K` with K > 1) the instance's server takes that work when the request reaches it,
                 one hop after routing
    prefill      (+ frontend.handover_s) the prefill instance computes what neither its prefix cache nor the
                 pool holds and samples the first token, then saves the prompt's blocks to the pool and
                 answers once they are there (at most SAVE_TIMEOUT_S): the first token reaches the client;
                 `Router.prefill_done` with the instance's own prefill time and computed tokens
    decode       `Router.decode_started`; (+ handover_s) the decode instance loads the blocks from the pool,
                 computes the prompt's last partial block and generates the rest; `Router.decode_done` with
                 its first decode token's delay after the hand-over and the time per token after it

With colocated instances ("both", the vLLM-style baseline) the Router is built with `colocated=True`: one
instance runs the whole request, the first token leaves at the end of the step that sampled it, and the
pool, if any, is shared by every instance through its connector as in `nanoforge serve --role both --store`.
Either way every instance holds an equal segment of the pool (`--pool-gib` / instances), as every server
started with `--store` mounts its `--pool-memory`, and its saves go there first (`pool.py`).

A warm-up (`Simulation.warm_up`: the bench serve runs gpu_disagg.sh sends before the trace) runs through the
same cluster first and counts in no result; what it leaves behind stays, as on the real servers: its blocks in
the pool (leased from when they were written, so they take room until their leases run out), the router's
estimates, the instances' counters.

Time enters only here and in `Profile`: the scheduler, block manager and router are the engine's and the
conductor's code, driven at the simulated times at which the real ones would run.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field

from nanoforge.errors import NanoforgeError
from nanoforge.serve.bench_serve import Request, Result, TraceReplay
from nanoforge.serve.block_manager import prefix_block_hashes
from nanoforge.serve.disagg.handover import SAVE_TIMEOUT_S
from nanoforge.serve.disagg.router import POLICIES, Instance, Router
from nanoforge.serve.sampling_params import SamplingParams
from nanoforge.serve.scheduler import SchedulerConfig, check_request
from nanoforge.serve.sequence import SequenceGroup
from nanoforge.sim.instance import Shared, SimInstance
from nanoforge.sim.pool import LEASE_S, KVPool
from nanoforge.sim.profile import Profile, pool_block_bytes


class Clock:
    """Simulated seconds and the events still to happen, in time order (ties in the order they were set)."""

    def __init__(self):
        self.now = 0.0
        self._events: list = []
        self._order = itertools.count()

    def at(self, t: float, fn, *args) -> None:
        """Call fn(t, *args) at time t."""
        heapq.heappush(self._events, (t, next(self._order), fn, args))

    def run(self, stop=None) -> None:
        """Run events until none is left, or `stop()` is true after one."""
        events = self._events
        while events:
            t, _, fn, args = heapq.heappop(events)
            self.now = t
            fn(t, *args)
            if stop is not None and stop():
                return


@dataclass
class ClusterConfig:
    prefill: int = 0  # disaggregated: N prefill + M decode instances
    decode: int = 0
    colocated: int = 0  # or K instances that do both
    policy: str = "cache-aware"
    ttft_slo: float | None = None  # seconds; what goodput is measured against
    tpot_slo: float | None = None
    early_reject: bool = False  # the conductor rejects what it predicts would miss an SLO
    pool_gib: float = 0.0  # the KV pool's capacity; 0: no pool (disaggregated: blocks only go P -> D)
    pool_lease_s: float = LEASE_S  # an object in the pool cannot be evicted until this long after its last use
    staging_gib: float | None = None  # a connector's staging buffer (None: as large as needed)
    link_gbs: float | None = None  # the pool link's bandwidth per call (GB/s); None: the profile's
    block_size: int | None = None  # KV block size (tokens); None: the profile's engine's
    num_gpu_blocks: int | None = None  # per instance; None: the profile's
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # None: long enough for every request of the trace
    shared_gpu: bool = False  # every instance on one GPU, time-sliced: the steps on it share it equally
    # the pool's link: each connector runs `pool_workers` calls at once at most, which share its instance's link
    # equally, or with `shared_link` one link for every instance (one host). The engine's connector has 4 workers
    # (EngineConfig.kv_pool_workers), but one call at a time on a link of its own, at the profile's rate for one
    # call alone, is what validates against the H200 runs: 4 calls sharing a link put 1P+1D TTFT p50 at -32 to
    # -47% and its p90 +41% to -8% (docs/results/issue15/session16/analysis.md), where the runs' calls took 0.57
    # ms a block (puts) and 0.49 (gets), ~2x a call alone (`simulate validate` prints both)
    shared_link: bool = False
    pool_workers: int = 1
    schedule_ahead: bool | None = None  # asynchronous scheduling where the engine allows it; None: on a GPU profile
    seed: int = 0

    @property
    def disaggregated(self) -> bool:
        return not self.colocated

    @property
    def gpus(self) -> int:
        return 1 if self.shared_gpu else self.colocated or self.prefill + self.decode

    def label(self) -> str:
        shape = f"colocated {self.colocated}" if self.colocated else f"{self.prefill}P+{self.decode}D"
        extras = [self.policy, f"pool {self.pool_gib:g} GiB" if self.pool_gib else "no pool"]
        if self.early_reject:
            extras.append("early rejection")
        return f"{shape} ({', '.join(extras)})"

    def check(self) -> None:
        if bool(self.colocated) == bool(self.prefill or self.decode):
            raise NanoforgeError("give either --prefill N --decode M or --colocated K", param="colocated")
        if not self.colocated and (self.prefill < 1 or self.decode < 1):
            raise NanoforgeError(f"a disaggregated cluster needs --prefill >= 1 and --decode >= 1, got "
                                 f"{self.prefill} and {self.decode}", param="prefill")
        if self.colocated < 0:
            raise NanoforgeError(f"--colocated must be >= 1, got {self.colocated}", param="colocated")
        if self.policy not in POLICIES:
            raise NanoforgeError(f"--policy must be one of {', '.join(POLICIES)}, got {self.policy!r}",
                                 param="policy")
        for name in ("ttft_slo", "tpot_slo"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise NanoforgeError(f"--{name.replace('_', '-')} must be > 0, got {v}", param=name)
        if self.early_reject and self.ttft_slo is None and self.tpot_slo is None:
            raise NanoforgeError("--early-reject needs --ttft-slo or --tpot-slo", param="early_reject")
        if not self.pool_lease_s >= 0:
            raise NanoforgeError(f"--pool-lease-s must be >= 0, got {self.pool_lease_s}", param="pool_lease_s")
        if not self.pool_gib >= 0:
            raise NanoforgeError(f"--pool-gib must be >= 0, got {self.pool_gib}", param="pool_gib")
        for name in ("staging_gib", "link_gbs"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise NanoforgeError(f"--{name.replace('_', '-')} must be > 0, got {v}", param=name)
        if self.pool_workers < 1:
            raise NanoforgeError(f"--pool-workers must be >= 1, got {self.pool_workers}", param="pool_workers")
        for name in ("block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise NanoforgeError(f"--{name.replace('_', '-')} must be >= 1, got {v}", param=name)


@dataclass(eq=False)
class SimRequest:
    index: int
    arrival: float
    input_len: int
    output_len: int
    token: int  # what every generated token of this request is (not an end token)
    prompt: list[int] | None = None
    hashes: list[int] = field(default_factory=list)  # keys of the prompt's full blocks
    plan: object = None
    ahead: int = 0
    batch: int = 0
    prefill: SimInstance | None = None
    decode: SimInstance | None = None
    reached_prefill: float = 0.0
    reached_decode: float = 0.0
    engine_first_token: float | None = None  # on the instance that computed the prompt
    first_token: float | None = None  # at the client
    decode_start: float | None = None  # the conductor hands it to its decode instance (colocated: first token)
    decode_first: float | None = None  # that instance's first token
    finish: float | None = None
    answered: bool = False
    missed: bool = False  # counted as missing an SLO or failing
    save_job: object = None
    cached_tokens: int = 0  # prompt tokens the prefill (or colocated) instance did not compute
    pool_tokens: int = 0  # of those, tokens it loaded from the pool
    error: str | None = None
    warmup: bool = False  # a warm-up request: it counts in no result


class Simulation:
    """One run of a trace replay on one cluster. `run()` returns the report (`report.py` renders it)."""

    def __init__(self, replay: TraceReplay, config: ClusterConfig, profile: Profile):
        config.check()
        self.replay, self.config, self.profile = replay, config, profile
        self.clock = Clock()
        engine = profile.engine
        bs = config.block_size or engine["block_size"]
        num_blocks = config.num_gpu_blocks or engine["num_gpu_blocks"]
        longest = max(replay.input_len(i) + replay.output_len(i) for i in range(len(replay)))
        max_model_len = config.max_model_len or min(longest, num_blocks * bs)
        self.scheduler_config = SchedulerConfig(
            max_model_len=max_model_len, num_gpu_blocks=num_blocks, block_size=bs,
            max_num_seqs=config.max_num_seqs or engine["max_num_seqs"],
            max_num_batched_tokens=config.max_num_batched_tokens or engine["max_num_batched_tokens"])
        # a block in the pool: its KV at the simulated block size, plus the connector's header (as KVConnector)
        self.block_bytes = pool_block_bytes(profile.transfer["block_bytes"] * bs // engine["block_size"], bs)
        # a pool call: the profile's latency, and its time per block scaled to this block's bytes (or the link's)
        t = profile.transfer
        profile_block = pool_block_bytes(t["block_bytes"], engine["block_size"])
        if config.link_gbs:
            self.block_seconds = self.block_bytes / (config.link_gbs * 1e9)
        else:
            self.block_seconds = t["per_block_s"] * self.block_bytes / profile_block
        self.transfer_latency = t["latency_s"]
        # a put into the instance's own segment is a local copy, which crosses no link: the profile's local rate, as
        # its share of the remote one, so that a link set by `--link-gbs` scales both (the two were measured through
        # the same client; a local put at the measured rate beside a faster link would cost more than a remote one).
        # A profile without a local rate: the remote rate, as before there was one.
        self.local_block_seconds = self.block_seconds * profile.local_share
        self.local_latency = profile.transfer_time(0, local=True)
        staging = None if config.staging_gib is None else max(1, int(config.staging_gib * 2**30 // self.block_bytes))
        if config.colocated:
            roles = [(f"both{i}", "both") for i in range(config.colocated)]
        else:
            roles = [(f"prefill{i}", "prefill") for i in range(config.prefill)]
            roles += [(f"decode{i}", "decode") for i in range(config.decode)]
        if config.pool_gib:  # every instance mounts its share (the servers' --pool-memory): instance i, segment i
            self.pool = KVPool(int(config.pool_gib * 2**30 // self.block_bytes), lease_s=config.pool_lease_s,
                               segments=len(roles), seed=config.seed)
        elif config.disaggregated:
            self.pool = KVPool(None, cache=False)  # only the medium from prefill to decode instances
        else:
            self.pool = None
        gpu = Shared(self.clock) if config.shared_gpu else None
        self.link = Shared(self.clock) if config.shared_link else None  # None: each connector's calls run alone
        cfg = self.scheduler_config
        ahead = config.schedule_ahead
        if ahead is None:  # the engine's default: on a GPU
            ahead = str(profile.meta.get("device") or "cpu").lower() != "cpu"
        self.instances = [SimInstance(self, name, role, cfg, self.pool, staging, gpu, ahead=ahead, segment=i)
                          for i, (name, role) in enumerate(roles)]
        info = {"block_size": bs, "num_gpu_blocks": num_blocks,
                "kv_block_bytes": self.block_bytes if self.pool is not None else None}
        self.views = {inst.name: Instance(inst.name, "decode" if inst.role == "decode" else "prefill", dict(info))
                      for inst in self.instances}
        self.by_name = {inst.name: inst for inst in self.instances}
        prefill = [self.views[i.name] for i in self.instances if i.role != "decode"]
        decode = prefill if config.colocated else [self.views[i.name] for i in self.instances if i.role == "decode"]
        slos = (config.ttft_slo, config.tpot_slo) if config.early_reject else (None, None)
        # the conductor predicts transfers at the link's bandwidth (the real one's default: POOL_BANDWIDTH)
        self.router = Router(prefill, decode, config.policy, ttft_slo=slos[0], tpot_slo=slos[1], seed=config.seed,
                             pool_bandwidth=self.block_bytes / self.block_seconds, colocated=bool(config.colocated))
        self.requests: list[SimRequest] = []
        self.results: list[Result | None] = [None] * len(replay)
        self.done = self.failures = 0
        self.stop_after_failures: int | None = None
        self.on_progress = None  # called with each request that ends (the progress bar)
        self.t0 = 0.0  # when the trace starts (after the warm-up, if any)
        self._warmup: list[list[Request]] = []  # warm-up runs still to start
        self.warmup_gap_s = 0.0
        self._warmup_left = 0  # requests of the running warm-up run not ended yet
        self._warmup_count = 0

    def transfer_time(self, blocks: int, local: int = 0) -> float:
        """One pool call moving `blocks` blocks, `local` of them into the caller's own segment: the remote rate
        a block, less what a local copy saves, and one latency, the local one only if no block crosses the link
        (a profile without a local rate: exactly the remote cost, as before)."""
        latency = self.local_latency if local and local == blocks else self.transfer_latency
        return latency + self.block_seconds * blocks + (self.local_block_seconds - self.block_seconds) * local

    # --- running ---------------------------------------------------------------------------------------------

    def warm_up(self, runs: list[list[Request]], gap_s: float) -> None:
        """Send `runs` before the trace, one after another, as gpu_disagg.sh warms a server up with bench serve
        runs: each starts `gap_s` after the last request of the one before it ended (the client's turnaround:
        one bench serve process writes its report and exits, the next starts), the trace `gap_s` after the last.
        Call before `run()`."""
        if not gap_s >= 0:
            raise NanoforgeError(f"the warm-up's gap must be >= 0 s, got {gap_s}", param="warmup_gap_s")
        self._warmup = [list(r) for r in runs if r]
        self.warmup_gap_s = gap_s

    def run(self, *, stop_after_failures: int | None = None) -> bool:
        """Replay every request (after the warm-up, if any); False if it stopped early because more than
        `stop_after_failures` requests missed an SLO or failed (the rest count as failed)."""
        self.stop_after_failures = stop_after_failures
        self._next_run(0.0)
        stop = (lambda: self.failures > stop_after_failures) if stop_after_failures is not None else None
        self.clock.run(stop)
        complete = self.done == len(self.replay)
        if not complete:
            for i, r in enumerate(self.results):
                if r is None:
                    self.results[i] = Result(self.replay.arrival_s(i), self.replay.arrival_s(i),
                                             self.replay.input_len(i), 0, error="not simulated: the run stopped early")
        return complete

    def _next_run(self, now: float) -> None:
        """Start the next warm-up run at `now`, or the trace once none is left."""
        if not self._warmup:
            self.t0 = now
            if len(self.replay):
                self.clock.at(now + self.replay.arrival_s(0), self._arrive, 0)
            return
        run = self._warmup.pop(0)
        self._warmup_left = len(run)
        for q in run:
            self.clock.at(now + q.arrival_s, self._arrive_warmup, q)

    # --- the conductor -----------------------------------------------------------------------------------

    def _arrive(self, now: float, i: int) -> None:
        replay = self.replay
        if i + 1 < len(replay):
            self.clock.at(self.t0 + replay.arrival_s(i + 1), self._arrive, i + 1)
        req = SimRequest(i, now, replay.input_len(i), replay.output_len(i), token=1 + i % 250)
        self.requests.append(req)
        self._front_door(now, req)

    def _arrive_warmup(self, now: float, q: Request) -> None:
        self._warmup_count += 1
        k = self._warmup_count
        req = SimRequest(-k, now, q.input_len, q.output_len, token=1 + k % 250, prompt=list(q.prompt), warmup=True)
        self._front_door(now, req)

    @property
    def conducted(self) -> bool:
        """Whether a conductor stands in front of the instances (all but a single colocated one)."""
        return self.config.colocated != 1

    def _front_door(self, now: float, req: SimRequest) -> None:
        """The request's time from the client to an engine's queue (`Profile.request_time`): in the conductor,
        before it routes, or in a lone colocated instance, which takes it at once."""
        latency = self.profile.request_time(req.input_len)
        if self.conducted:
            self.clock.at(now + latency, self._route, req)
        else:
            self._route(now, req, latency)

    def _route(self, now: float, req: SimRequest, latency: float = 0.0) -> None:
        """Route `req`; `latency`: its front door's time still to come, in the chosen (colocated) instance."""
        cfg, bs = self.scheduler_config, self.scheduler_config.block_size
        if req.prompt is None:
            req.prompt = self.replay.request(req.index).prompt
        prompt = req.prompt
        req.input_len = len(prompt)
        req.hashes = prefix_block_hashes(prompt, bs)
        try:
            check_request(cfg, SequenceGroup(str(req.index), prompt, self._params(req, prefill=False), now))
            if len(prompt) > cfg.max_model_len - 1:
                raise NanoforgeError(f"prompt is {len(prompt)} tokens; the context is {cfg.max_model_len}")
            hashes = req.hashes[:(len(prompt) - 1) // bs]
            pool_blocks = self.pool.leading(hashes, now) if self.pool is not None else 0
            req.plan = self.router.plan(len(prompt), hashes, pool_blocks, req.output_len)
        except NanoforgeError as e:
            kind = "rejected" if e.status == 429 else "invalid"
            self._end(now, req, f"{kind}: {e}")
            return
        req.ahead = self.router.prefill_started(req.plan)
        req.prefill = self.by_name[req.plan.prefill.url]
        req.decode = self.by_name[req.plan.decode.url]
        if self.conducted:  # one hop to the chosen instance
            self.clock.at(now + self.profile.frontend["handover_s"], self._start_prefill, req)
        else:
            req.prefill.take_request(req.input_len)
            self.clock.at(now + latency, self._start_prefill, req)

    def _params(self, req: SimRequest, *, prefill: bool) -> SamplingParams:
        n = min(req.output_len, 1) if prefill else req.output_len
        return SamplingParams(max_tokens=n, ignore_eos=True)

    def _start_prefill(self, now: float, req: SimRequest) -> None:
        req.reached_prefill = now
        group = SequenceGroup(str(req.index), req.prompt, self._params(req, prefill=self.config.disaggregated), now)
        group.seqs[0].block_hashes = list(req.hashes)  # a pure function of the tokens: computed once, here
        if self.conducted:  # the request reaches the instance's server from the conductor
            req.prefill.take_request(req.input_len)
        req.prefill.add(now, group, req, req.hashes)

    def _start_decode(self, now: float, req: SimRequest) -> None:
        group = SequenceGroup(str(req.index), req.prompt, self._params(req, prefill=False), now,
                              outputs=[(0, [req.token], None)])
        group.seqs[0].block_hashes = list(req.hashes)
        req.reached_decode = now
        req.decode.take_request(req.input_len)
        req.decode.add(now, group, req, req.hashes)

    # --- what instances report ------------------------------------------------------------------------------

    def on_token(self, now: float, inst: SimInstance, req: SimRequest, seq) -> None:
        if req.engine_first_token is None and inst is req.prefill:
            req.engine_first_token = now
            inst.first_tokens.append(now - req.reached_prefill)
            req.cached_tokens = seq.num_cached_tokens
            if self.config.colocated:  # the token leaves at once, and the same instance goes on
                self._first_token(now, req)
                req.batch = self.router.decode_started(req.plan.decode)
                req.decode_start = now
        elif req.decode_first is None and req.decode_start is not None and inst is req.decode:
            req.decode_first = now
            inst.first_tokens.append(now - req.reached_decode)

    def on_finished(self, now: float, inst: SimInstance, req: SimRequest, group: SequenceGroup) -> None:
        if inst is req.prefill and self.config.disaggregated:  # the prompt is done: answer once it is saved
            job = req.save_job
            if job is None or job.done:
                self._answer(now, req)
            else:
                job.on_done.append(lambda t: self._answer(t, req))
                self.clock.at(now + SAVE_TIMEOUT_S, self._answer, req)
            return
        first = step = None
        if req.decode_first is not None:  # as the conductor sees the stream: the first decode token, then the rest
            first = req.decode_first - req.decode_start
            step = (now - req.decode_first) / (req.output_len - 2) if req.output_len > 2 else None
        self.router.decode_done(req.plan.decode, req.batch, first, step, req.input_len)
        req.finish = now
        self._end(now, req, None)

    def on_error(self, now: float, inst: SimInstance, req: SimRequest, error: str) -> None:
        """The instance's scheduler gave up on the request (it can never fit)."""
        if req.first_token is None:
            self.router.prefill_done(req.plan, req.ahead, None, None)
        else:
            self.router.decode_done(req.plan.decode, req.batch, None)
        self._end(now, req, f"error: {error}")

    def _answer(self, now: float, req: SimRequest) -> None:
        """The prefill instance answers the conductor (its save is done, or timed out)."""
        if req.answered:
            return
        req.answered = True
        self._first_token(now, req)
        if req.output_len <= 1 or req.input_len + 1 >= self.scheduler_config.max_model_len:
            req.finish = now
            self._end(now, req, None)
            return
        req.batch = self.router.decode_started(req.plan.decode)
        req.decode_start = now
        self.clock.at(now + self.profile.frontend["handover_s"], self._start_decode, req)

    def _first_token(self, now: float, req: SimRequest) -> None:
        req.first_token = now
        computed = req.input_len - req.cached_tokens
        self.router.prefill_done(req.plan, req.ahead, req.engine_first_token - req.reached_prefill, computed)
        if self.config.ttft_slo is not None and now - req.arrival > self.config.ttft_slo:
            self._missed(req)  # known now; the request still runs to its end

    def _tpot(self, now: float, req: SimRequest) -> float | None:
        return (now - req.first_token) / (req.output_len - 1) if req.output_len > 1 else None

    def _missed(self, req: SimRequest) -> None:
        """Count a request that will not meet its SLOs (once; a warm-up request never)."""
        if not req.missed and not req.warmup:
            req.missed = True
            self.failures += 1

    def _end(self, now: float, req: SimRequest, error: str | None) -> None:
        self._release_transit(req)
        if req.warmup:
            self._end_warmup(now, req)
            return
        ttft = tpot = e2e = None
        if error is None:
            ttft, e2e = (req.first_token - req.arrival) * 1000, (now - req.arrival) * 1000
            tpot = self._tpot(now, req)
            if tpot is not None:
                if self.config.tpot_slo is not None and tpot > self.config.tpot_slo:
                    self._missed(req)
                tpot *= 1000
        else:
            req.error = error
            self._missed(req)
        arrival = req.arrival - self.t0
        self.results[req.index] = Result(arrival, arrival, req.input_len,
                                         req.output_len if error is None else 0, ttft, tpot, e2e, error)
        req.prompt, req.hashes, req.plan, req.save_job = None, [], None, None  # instances hold their own copies
        self.done += 1
        if self.on_progress is not None:
            self.on_progress(req)

    def _release_transit(self, req: SimRequest) -> None:
        """A transit pool (no cache) drops the request's blocks once nobody needs them."""
        if self.pool is not None and not self.pool.cache and req.save_job is not None:
            job = req.save_job
            if job.done:
                self.pool.release(job.hashes)
            else:
                job.on_done.append(lambda t: self.pool.release(job.hashes))

    def _end_warmup(self, now: float, req: SimRequest) -> None:
        """A warm-up request ended; once its run's last one has, the next run (or the trace) starts after the
        client's turnaround."""
        req.prompt, req.hashes, req.plan, req.save_job = None, [], None, None
        self._warmup_left -= 1
        if not self._warmup_left:
            self.clock.at(now + self.warmup_gap_s, self._next_run)

    # --- what came out ---------------------------------------------------------------------------------------

    @property
    def makespan(self) -> float:
        """Seconds from the first arrival to the last request's end."""
        ends = [r.finish or r.first_token or r.arrival for r in self.requests]
        return max(ends) - self.t0 - self.replay.arrival_s(0) if ends else 0.0

    def pool_stats(self) -> dict:
        prompt = sum(r.input_len for r in self.requests if r.error is None)
        cached = sum(r.cached_tokens for r in self.requests if r.error is None)
        loaded = {"prefill": 0, "decode": 0}
        for inst in self.instances:
            if inst.connector is not None:
                loaded["decode" if inst.role == "decode" else "prefill"] += inst.connector.counters["loaded_blocks"]
        bs = self.scheduler_config.block_size
        stats = {"prompt_tokens": prompt, "cached_tokens": cached,
                 "prefix_hit_rate": cached / prompt if prompt else 0.0,
                 "pool_hit_rate": loaded["prefill"] * bs / prompt if prompt else 0.0,
                 "decode_loaded_tokens": loaded["decode"] * bs}
        if self.pool is not None:
            stats.update(pool_blocks_capacity=self.pool.capacity, pool_blocks_held=len(self.pool),
                         pool_block_bytes=self.block_bytes, **self.pool.counters)
        return stats

    def instance_stats(self) -> list[dict]:
        span = self.makespan or math.inf
        rows = []
        for inst in self.instances:
            s = inst.scheduler.stats()
            row = {"name": inst.name, "role": inst.role, "routed": self.views[inst.name].routed,
                   "busy": inst.busy_s / span, "steps": inst.steps, "prefill_steps": inst.prefill_steps,
                   "prefill_tokens": inst.prefill_tokens, "decode_tokens": inst.decode_tokens,
                   "tokens_per_step": (inst.prefill_tokens + inst.decode_tokens) / inst.steps if inst.steps else 0.0,
                   "step_ms": {k: 1000 * t / n for k, (n, t) in inst.turns.items() if n},
                   "ttft_ms": 1000 * sum(inst.first_tokens) / len(inst.first_tokens) if inst.first_tokens else None,
                   "peak_kv_blocks": inst.peak_blocks, "kv_blocks": inst.scheduler.config.num_gpu_blocks,
                   "preemptions": s["preemptions"], "prefix_cache_hit_rate": s["prefix_cache_hit_rate"]}
            if inst.connector is not None:
                row.update(link_busy=inst.connector.busy_s / span, **inst.connector.counters)
            rows.append(row)
        return rows
