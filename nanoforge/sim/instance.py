"""One simulated instance: the engine's real `Scheduler` and `BlockManager`, stepped on modelled time.

`LLMEngine.step()` without the model: take the requests whose pool loads are back (`SimConnector`), ask the
scheduler for the step (continuous batching, chunked prefill, prefix caching, preemption: all the engine's own
code), let the step take `Profile.step_parts(out)` seconds (its device part, then its host part: the server's
work for the tokens it streams, a decode instance's hand-over events included, and its work on the requests
its server took since the last step launched: `take_request`, `Profile.request_host_time`), then save the prompts it
finished to the pool and report one token per chunk that samples (`Scheduler.update`). The token is the
request's own non-end id, so a request runs to its `max_tokens`.

Instances that share a GPU (`gpu`, a `Shared` resource: processes on one GPU, which time-slices between them) share
it equally while more than one has a step's device part on it (processor sharing): a step of s seconds alone
takes 2s beside another instance's step for as long as both run. The host part holds no GPU (it is Python in the
instance's own process), so a decode instance streaming its tokens leaves the GPU to a prefill instance.

An instance that schedules a step ahead (`ahead`: the engine's asynchronous scheduling, on a GPU wherever no
pool saves block it: colocated without a pool, decode instances) keeps two steps in flight as the engine does:
when step n ends it schedules step n + 2, which runs after n + 1. A request that arrives during step n so
waits for n + 1 as well, and starts in n + 2; an idle instance starts a step at once and schedules the next
one behind it straight away.
"""

from __future__ import annotations

from collections import deque

from nanoforge.serve.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from nanoforge.serve.sequence import SequenceGroup
from nanoforge.serve.step_profile import KINDS, step_kind
from nanoforge.sim.pool import KVPool, SimConnector


class Shared:
    """One resource under jobs that share it equally (processor sharing): each of the k jobs running gets 1/k of
    it, so a job of s seconds alone takes 2s beside another for as long as both run. A GPU under the steps of the
    instances on it (each has at most one step on the device; a step scheduled ahead waits for the one before
    it), or a pool link under the KV connectors' calls in flight (`ClusterConfig.pool_workers`, `shared_link`)."""

    def __init__(self, clock):
        self.clock = clock
        self.running: dict = {}  # holder -> [seconds of the whole resource left, done(now)]
        self.t = 0.0  # when `running` was last brought up to date
        self.version = 0  # the planned completion event that is still valid

    def start(self, now: float, holder, seconds: float, done) -> None:
        """`holder`'s job needs `seconds` of the whole resource; `done(t)` when it has had them."""
        self._advance(now)
        self.running[holder] = [seconds, done]
        self._plan(now)

    def _advance(self, now: float) -> None:
        if self.running:
            share = (now - self.t) / len(self.running)
            for job in self.running.values():
                job[0] -= share
        self.t = now

    def _plan(self, now: float) -> None:
        """Set the event for the job that finishes first at today's shares (any earlier plan is void)."""
        self.version += 1
        if self.running:
            holder = min(self.running, key=lambda h: self.running[h][0])
            left = max(0.0, self.running[holder][0])
            self.clock.at(now + left * len(self.running), self._finish, holder, self.version)

    def _finish(self, now: float, holder, version: int) -> None:
        if version != self.version:
            return
        self._advance(now)
        _, done = self.running.pop(holder)
        self._plan(now)
        done(now)


class SimInstance:
    def __init__(self, sim, name: str, role: str, config: SchedulerConfig, pool: KVPool | None,
                 staging_blocks: int | None, gpu: Shared | None = None, ahead: bool = False,
                 segment: int | None = None):
        """`segment`: the instance's own segment of `pool` (None: it holds none)."""
        self.sim, self.name, self.role = sim, name, role
        self.scheduler = Scheduler(config)
        self.connector = None
        if pool is not None:  # a decode instance loads and never saves; a prefill instance loads only from a cache
            self.connector = SimConnector(sim, pool, self.scheduler.block_manager,
                                          load=role == "decode" or pool.cache, save=role != "decode",
                                          staging_blocks=staging_blocks, on_ready=self.kick, segment=segment,
                                          link=sim.link or (Shared(sim.clock) if sim.config.pool_workers > 1 else None),
                                          workers=sim.config.pool_workers)  # one call at a time: none to share with
        self.gpu = gpu
        self.in_flight: deque[tuple[SchedulerOutput, float, float]] = deque()  # launched, not collected (+ device
        # and host seconds)
        self.depth = 1 + (ahead and (pool is None or role == "decode"))  # steps in flight at most
        self.requests: dict[str, object] = {}  # request id -> the simulator's request state
        self.busy_s = 0.0
        self.first_tokens: list[float] = []  # each request's first token here, from the engine taking it (warm-ups too)
        self.host_due = 0.0  # the server's work on requests taken while busy, for the next step (request_host_time)
        self.turns = {k: [0, 0.0] for k in KINDS}  # per step kind: steps, seconds from going on the device to done
        self._on_device_at = 0.0
        self.steps = self.prefill_steps = self.prefill_tokens = self.decode_tokens = self.peak_blocks = 0

    # --- requests ----------------------------------------------------------------------------------------

    def take_request(self, prompt_tokens: int) -> None:
        """The instance's server takes a request of `prompt_tokens` tokens: its work on it takes the GIL from the
        steps running (the next one to launch pays it); an idle instance pays only its latency."""
        if self.in_flight:
            self.host_due += self.sim.profile.request_host_time(prompt_tokens)

    def add(self, now: float, group: SequenceGroup, req, hashes: list[int]) -> None:
        """LLMEngine.add_request after its checks: look in the pool first, else queue."""
        self.requests[group.request_id] = req
        if self.connector is None or not self.connector.start_load(group, hashes):
            self.scheduler.enqueue(group)
        self.kick(now)

    def kick(self, now: float) -> None:
        """Start a step if idle and there is work (a new request, a load back); a busy engine takes it up when
        its step ends."""
        if not self.in_flight:
            self._step(now)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    # --- the step ------------------------------------------------------------------------------------------

    def _step(self, now: float) -> None:
        """Launch steps until `depth` are in flight or there is nothing to schedule."""
        while len(self.in_flight) < self.depth and self._launch(now):
            pass

    def _launch(self, now: float) -> bool:
        connector = self.connector
        if connector is not None and connector.ready:  # KVConnector.ready_loads
            for job in connector.ready:
                connector.finish_load(job)
                self.scheduler.enqueue(job.group)
            connector.ready.clear()
        out = self.scheduler.schedule()
        for group in out.finished:  # can never fit: finished with reason "error"
            self.sim.on_error(now, self, self.requests.pop(group.request_id), group.error)
        if out.is_empty:
            return False
        device, host = self.sim.profile.step_parts(out, stream=self.role == "decode")  # hand-over events
        host, self.host_due = host + self.host_due, 0.0  # the requests taken meanwhile: the server's work on them
        self.in_flight.append((out, device, host))
        if len(self.in_flight) == 1:  # else it starts when the step ahead of it ends
            self._run(now)
        self.busy_s += device + host
        self.steps += 1
        used = self.scheduler.block_manager.num_used_blocks
        self.peak_blocks = max(self.peak_blocks, used)
        return True

    def _run(self, now: float) -> None:
        """The oldest step in flight goes onto the device."""
        out, device, host = self.in_flight[0]
        self._on_device_at = now
        if self.gpu is None:
            self.sim.clock.at(now + device + host, self._end_step, out)
        else:
            self.gpu.start(now, self, device, lambda t: self._device_done(t, out))

    def _device_done(self, now: float, out: SchedulerOutput) -> None:
        """The shared GPU has run the step's device part; its host part follows, off the GPU."""
        host = self.in_flight[0][2]
        if host:
            self.sim.clock.at(now + host, self._end_step, out)
        else:
            self._end_step(now, out)

    def _end_step(self, now: float, out: SchedulerOutput) -> None:
        self.in_flight.popleft()
        turn = self.turns[step_kind([it.num_tokens for it in out.scheduled])]  # as the engine's StepStats: the step's time on the (shared) device
        turn[0] += 1
        turn[1] += now - self._on_device_at
        if self.in_flight:  # the step scheduled ahead runs on as this one's results come back
            self._run(now)
        sampled = {}
        prefill = False
        for item in out.scheduled:
            seq = item.seq
            if item.num_tokens == 1 and item.num_samples == 1:
                self.decode_tokens += 1
            else:
                prefill = True
                self.prefill_tokens += item.num_tokens
            if item.num_samples:
                sampled[seq.seq_id] = self.requests[seq.request_id].token
            if self.connector is not None and item.start < seq.num_prompt_tokens <= item.end:  # _save_prompts
                job = self.connector.save_prompt(seq)
                if job is not None:
                    self.requests[seq.request_id].save_job = job
        self.prefill_steps += prefill
        finished = self.scheduler.update(out, sampled)
        sim = self.sim
        for item in out.scheduled:
            if item.num_samples:
                req = self.requests.get(item.seq.request_id)
                if req is not None:
                    sim.on_token(now, self, req, item.seq)
        for group in finished:
            sim.on_finished(now, self, self.requests.pop(group.request_id), group)
        self._step(now)
