"""The KV cache pool and each instance's KV connector, on modelled time.

`KVPool` stands for Mooncake Store: whole KV blocks keyed by the block manager's chained prefix hashes, a
capacity in blocks, admitted and evicted the way `mooncake_master` 0.3.13 does it. A put allocates its blocks
when it starts (they count against the capacity, and are not readable until it ends). An object is leased by
a read or a lookup (`BatchGetReplicaList`, `BatchExistKey`: `default_kv_lease_ttl`, 10 s from then), never by
its put: `PutEnd` grants a lease of 0, so an object nobody has read since it was written can be evicted at once.
Only objects whose lease has run out can be evicted. Once usage is over the high watermark (90%) the master
evicts up to 5% of the capacity (`eviction_ratio`) of those, the earliest lease end first (an unread object's
"lease" ends when its put did); a put that finds no room and nothing to evict is turned away, block by block (the
connector's "not cached": the blocks are computed where they are needed). So a pool fills with what decode
instances read and lookups found, and turns saves away while all of that was touched in the last 10 s, while
blocks saved and never read make room for new ones. Seen on loopback with the real master
(`tests/test_disagg_pool.py::test_a_put_grants_no_lease_a_read_or_lookup_does`): objects written one after
another into a segment that holds half of them are all admitted when nothing reads them, and once it is full every
later one is turned away when each is read or looked up right after its put. (Before session 13 the model leased objects on their put too; then
the simulated 1P+1D pool turned away 6,660 blocks that the real one admitted, mostly blocks the decode instance
had in its own prefix cache and so never read.)
With `cache=False` it is only the medium that carries a prompt's blocks from its prefill instance to its
decode instance ("no pool" in a disaggregated cluster): nobody looks anything up, and a block is dropped once
no request in flight still needs it.

The capacity is split into segments, one an instance (each server mounts `--pool-memory` of its own memory),
and a block lives in one of them. A put by an instance places each block as Mooncake's RandomAllocationStrategy
does with `preferred_segment` set to the writer (`MooncakeStore`): in the writer's own segment while it has
room, else in a random segment that has some (a remote transfer). So a prefill instance's saves are local
copies until its segment is full, and cost `local_per_block_s` a block, the rest the remote rate (one call, one
latency: the remote one if any block of it crosses the link; `Simulation.transfer_time`). Admission and
eviction stay the whole pool's, as the master's are (its watermark is of the whole capacity; an evicted block
frees room in its own segment). Gets are costed at the remote rate: a decode instance reads a prefill
instance's segment (a colocated instance reading its own segment would be faster; not modelled).

`SimConnector` mirrors the engine's `KVConnector` (`serve/kv_connector.py`) decision for decision, with
the pool calls replaced by modelled transfers:

- `start_load`: a new request whose prompt blocks after its local prefix hit the pool may hold asks for
  them in one batched get (at most the free blocks, at most the staging slots free now) and waits outside the
  scheduler until it is back; `finish_load` then registers the leading blocks found in the block manager's
  prefix cache (`BlockManager.add_cached_block`), so the scheduler finds them like any hit;
- `save_prompt`: once a prompt is computed, its full blocks that the connector does not know the pool to
  hold go to the pool in one batched put (the leading ones that fit in the staging slots free now);
- the staging buffer is shared: every call holds its blocks' slots from its submission until it is done (a
  get's until the engine takes it up), as `KVConnector._reserve` does, so while calls queue on the link a new
  save gets fewer slots or none: it is cut short or skipped ("skipped"), and the hand-over does not wait for
  what it left out (the decode instance computes it);
- the calls go one after another by default, loads ahead of saves, as in the engine's connector (its worker
  threads take loads first; they are several, but Mooncake's rate did not grow with calls at once on the H200's
  host: `benchmarks/pool_transfer.py`, so the link is modelled as one): a call starts when the one before it is
  done, and takes `Simulation.transfer_time(blocks moved, of them into its own segment)` (the profile's). With
  `ClusterConfig.pool_workers` > 1 up to that many calls run at once and share the connector's link equally
  (`Shared`), or with `shared_link` every connector's calls share one link (one host); not the default, which is
  what validates (`docs/results/issue15/session16/analysis.md`). Each call's time on the link and each job's
  from its submission are counted as the engine's connector counts them (`*_call_s`, `*_job_s`).
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from nanoforge.serve.block_manager import BlockManager
from nanoforge.serve.sequence import Sequence, SequenceGroup

KNOWN_KEYS = 1 << 16  # keys a connector remembers as saved or loaded (KVConnector._remember)


LEASE_S = 10.0  # mooncake_master's default_kv_lease_ttl
HIGH_WATERMARK = 0.9  # eviction_high_watermark_ratio
EVICTION_RATIO = 0.05  # eviction_ratio: of the capacity, at most, per eviction


class KVPool:
    def __init__(self, capacity_blocks: int | None, *, cache: bool = True, lease_s: float = LEASE_S,
                 segments: int = 1, seed: int = 0):
        """`segments`: how many equal segments the capacity is split into (segment i: instance i's; where they
        do not divide it, the first ones take a block more). An unbounded pool has none: every put is remote."""
        self.capacity = capacity_blocks  # None: unbounded
        self.cache = cache
        self.lease_s = lease_s
        self._blocks: dict[int, int] = {}  # key -> requests holding it (transit mode only)
        self._ends: dict[int, float] = {}  # key -> when its lease ends (an unread one's: when its put did)
        # the readable keys in the order their leases end, in two runs that are each in that order: unread since
        # their put (by the put's end), and leased by a read or lookup (by the last one)
        self._unread: OrderedDict[int, None] = OrderedDict()
        self._leased: OrderedDict[int, None] = OrderedDict()
        self._pending: set[int] = set()  # allocated by a put still in flight: not readable yet
        # each segment's free blocks (their sum: the capacity less the blocks held), and each block's segment
        self._free = None if capacity_blocks is None else \
            [capacity_blocks // segments + (i < capacity_blocks % segments) for i in range(segments)]
        self._home: dict[int, int] = {}
        self._rng = random.Random(seed)  # where a block that finds its writer's segment full goes
        self.counters = dict.fromkeys(("lookups", "lookup_hit_blocks", "put_blocks", "local_put_blocks",
                                       "get_blocks", "got_blocks", "evictions", "turned_away"), 0)

    def __len__(self) -> int:
        return len(self._blocks)

    def _lease(self, h: int, now: float) -> None:
        """A read or lookup of readable block `h`: leased until `lease_s` from now."""
        self._unread.pop(h, None)
        self._leased[h] = None
        self._leased.move_to_end(h)
        self._ends[h] = max(self._ends.get(h, now), now + self.lease_s)

    def _found(self, hashes: list[int], now: float) -> int:
        """How many leading `hashes` are readable; their leases are renewed."""
        n = 0
        for h in hashes:
            if h not in self._blocks or h in self._pending:
                break
            self._lease(h, now)
            n += 1
        return n

    def leading(self, hashes: list[int], now: float) -> int:
        """How many leading blocks of `hashes` the pool holds (the conductor's lookup, which renews leases)."""
        if not self.cache:
            return 0
        self.counters["lookups"] += 1
        n = self._found(hashes, now)
        self.counters["lookup_hit_blocks"] += n
        return n

    def get(self, hashes: list[int], now: float) -> int:
        """Read `hashes`: the number of leading ones found."""
        n = self._found(hashes, now)
        self.counters["get_blocks"] += len(hashes)
        self.counters["got_blocks"] += n
        return n

    def start_put(self, hashes: list[int], now: float, segment: int | None = None) -> tuple[list[int], list[int], int]:
        """A put by the holder of `segment` (None: a client without one) starts: (the blocks it writes, the blocks
        the pool already holds, how many of those it writes land in `segment`); the rest are turned away."""
        blocks, written, held, local = self._blocks, [], [], 0
        for h in hashes:
            if h in blocks:
                if self.cache:  # already there (PutStart's OBJECT_ALREADY_EXISTS: no lease either)
                    held.append(h)
                    continue
                blocks[h] += 1  # transit: one more request holds it (and it is written again)
            elif self.capacity is not None and len(blocks) >= self.capacity and not self._evict(now):
                self.counters["turned_away"] += 1
                continue
            else:
                blocks[h] = 1
                if self._free is not None:
                    local += self._place(h, segment)
            self._pending.add(h)
            written.append(h)
        self.counters["put_blocks"] += len(written)
        self.counters["local_put_blocks"] += local
        if self.capacity is not None and len(blocks) > HIGH_WATERMARK * self.capacity:
            self._evict(now)
        return written, held, local

    def _place(self, h: int, segment: int | None) -> bool:
        """Give new block `h` room in `segment` if it has some, else in a random segment that has (there is one:
        the pool is not full); True if it is `segment`."""
        free = self._free
        if segment is None or not free[segment]:
            room = [i for i, n in enumerate(free) if n]
            where = room[0] if len(room) == 1 else self._rng.choice(room)
        else:
            where = segment
        free[where] -= 1
        self._home[h] = where
        return where == segment

    def end_put(self, written: list[int], now: float) -> None:
        """The put's blocks are readable now, with no lease (PutEnd's lease of 0): evictable at once. A block
        written again (transit mode) keeps the lease a read gave it."""
        for h in written:
            if h in self._pending:
                self._pending.discard(h)
                if h not in self._leased:
                    self._unread[h] = None
                    self._unread.move_to_end(h)
                    self._ends[h] = now

    def _evict(self, now: float) -> int:
        """Evict up to EVICTION_RATIO of the capacity among objects whose lease has run out, the earliest lease
        end first; the number evicted."""
        n, limit = 0, max(1, int(EVICTION_RATIO * self.capacity))
        while n < limit:
            best = None
            for run in (self._unread, self._leased):  # each in lease-end order: its first is its earliest
                h = next(iter(run), None)
                if h is not None and self._ends[h] <= now and (best is None or self._ends[h] < self._ends[best]):
                    best = h
            if best is None:
                break  # both earliest still leased: so is everything after them
            self._drop(best)
            n += 1
        self.counters["evictions"] += n
        return n

    def release(self, hashes: list[int]) -> None:
        """Transit mode: a request no longer needs the blocks it put; drop those nobody else needs."""
        if self.cache:
            return
        for h in hashes:
            left = self._blocks.get(h)
            if left is None:
                continue
            if left <= 1:
                self._drop(h)
            else:
                self._blocks[h] = left - 1

    def _drop(self, h: int) -> None:
        """Forget block `h`, and free its room in its segment."""
        del self._blocks[h]
        self._ends.pop(h, None)
        self._unread.pop(h, None)
        self._leased.pop(h, None)
        self._pending.discard(h)
        if self._free is not None:
            self._free[self._home.pop(h)] += 1


@dataclass(eq=False)
class Job:
    """One batched pool call: a get for a waiting request, or a put of a computed prompt's blocks."""

    kind: str  # "get" or "put"
    hashes: list[int]
    group: SequenceGroup | None = None  # get: the request waiting for it
    first: int = 0  # get: index of the first block asked for
    found: int = 0  # get: leading blocks found
    done: bool = False
    on_done: list = field(default_factory=list)  # callbacks(now) once it is done
    written: list[int] = field(default_factory=list)  # put: the blocks it writes (the pool had room for them)
    local: int = 0  # put: how many of those went into the instance's own segment
    stored: list[int] = field(default_factory=list)  # put: those and the ones the pool held already
    submitted: float = 0.0  # when it was handed to the connector's workers
    started: float = 0.0  # when its call went on the link


class SimConnector:
    """An instance's KV connector (see the module's docstring): up to `workers` calls at once on `link`."""

    def __init__(self, sim, pool: KVPool, bm: BlockManager, *, load: bool, save: bool,
                 staging_blocks: int | None, on_ready, segment: int | None = None, link=None, workers: int = 1):
        self.sim, self.pool, self.bm = sim, pool, bm
        self.link = link  # the `Shared` link its calls run on (None: each call alone, at the profile's time)
        self.workers = workers  # calls in flight at most (the KV connector's worker threads)
        self.running = 0
        self._since = 0.0  # when its first call in flight started
        self.segment = segment  # the instance's own segment of the pool (None: it holds none)
        self.on_ready = on_ready  # on_ready(now): a get is back (the instance steps if it was idle)
        self.load_enabled, self.save_enabled = load, save
        self.free_slots = staging_blocks  # staging slots not held by a call in flight (None: unbounded)
        self.known: OrderedDict[int, None] = OrderedDict()
        self.queue: deque[Job] = deque()  # saves wait here; loads in self.loads, which go first
        self.loads: deque[Job] = deque()
        self.busy_s = 0.0
        self.ready: list[Job] = []  # gets that are back: the instance takes them at its next step
        self.counters = dict.fromkeys(("loads", "loaded_blocks", "load_misses", "saves", "saved_blocks", "skipped",
                                       "put_calls", "put_call_blocks", "put_call_s", "put_job_s", "get_calls",
                                       "get_call_blocks", "get_call_s", "get_job_s"), 0)  # as the KV connector's

    # --- loading (engine thread) -----------------------------------------------------------------------

    def start_load(self, group: SequenceGroup, hashes: list[int]) -> bool:
        """KVConnector.start_load: True if `group` now waits for a get of the blocks after its local prefix."""
        if not self.load_enabled or not self.bm.enable_prefix_caching:
            return False
        seq = group.seqs[0]
        first = len(self.bm.match_prefix(seq))
        last = (seq.num_tokens - 1) // self.bm.block_size  # the last token is always computed
        want = self._reserve(min(last - first, self.bm.num_free_blocks))
        if want <= 0:
            return False
        self.counters["loads"] += 1
        self._submit(Job("get", hashes[first:first + want], group, first))
        return True

    def finish_load(self, job: Job) -> None:
        """KVConnector._finish_load: register the leading blocks found, as long as blocks are free (and hand its
        staging slots back)."""
        self._release(len(job.hashes))
        seq, bs, bm = job.group.seqs[0], self.bm.block_size, self.bm
        hashes = seq.block_hashes
        added = 0
        for i in range(job.found):
            b = job.first + i
            if bm.add_cached_block(hashes[b], hashes[b - 1] if b else None, seq.token_ids[b * bs:(b + 1) * bs]) \
                    is None:
                break  # cached here already, or no free block: the rest is computed
            added += 1
        self._remember(job.hashes[:added])
        self.counters["loaded_blocks"] += added
        self.counters["load_misses"] += not added

    # --- saving ------------------------------------------------------------------------------------------

    def save_prompt(self, seq: Sequence) -> Job | None:
        """KVConnector.save_prompt: a put of the prompt's full blocks not known to be in the pool, or None."""
        if not self.save_enabled:
            return None
        n_full = seq.num_prompt_tokens // self.bm.block_size
        hashes = seq.block_hashes
        known = self.known if self.pool.cache else {}  # a transit pool forgets: every block goes each time
        todo = [hashes[i] for i in range(n_full) if hashes[i] not in known]
        todo = todo[:self._reserve(len(todo))]  # none to save reserves nothing
        if not todo:
            return None
        self.counters["saves"] += 1
        job = Job("put", todo)
        self._submit(job)
        return job

    # --- the staging buffer ---------------------------------------------------------------------------------

    def _reserve(self, want: int) -> int:
        """KVConnector._reserve: up to `want` staging slots for a call (0: none free); a short one is "skipped"."""
        if want <= 0:
            return 0
        if self.free_slots is None:
            return want
        got = min(want, self.free_slots)
        self.free_slots -= got
        self.counters["skipped"] += got < want
        return got

    def _release(self, n: int) -> None:
        if self.free_slots is not None:
            self.free_slots += n

    # --- the worker ----------------------------------------------------------------------------------------

    def _submit(self, job: Job) -> None:
        job.submitted = self.sim.clock.now
        (self.loads if job.kind == "get" else self.queue).append(job)
        self._next(self.sim.clock.now)

    def _next(self, now: float) -> None:
        """Start calls, loads first, while a worker is free."""
        while self.running < self.workers and (self.loads or self.queue):
            job = (self.loads or self.queue).popleft()
            if job.kind == "get":
                job.found = self.pool.get(job.hashes, now)
                seconds = self.sim.transfer_time(job.found)
            else:  # what the pool turns away costs no transfer
                job.written, held, job.local = self.pool.start_put(job.hashes, now, self.segment)
                job.stored = job.written + held
                seconds = self.sim.transfer_time(len(job.written), job.local)
            job.started = now
            if not self.running:
                self._since = now
            self.running += 1
            if self.link is None:
                self.sim.clock.at(now + seconds, self._done, job)
            else:  # beside the other calls on its link
                self.link.start(now, job, seconds, lambda t, job=job: self._done(t, job))

    def _done(self, now: float, job: Job) -> None:
        job.done = True
        self.running -= 1
        c = self.counters  # as the KV connector counts its calls
        c[f"{job.kind}_calls"] += 1
        c[f"{job.kind}_call_blocks"] += len(job.hashes)
        c[f"{job.kind}_call_s"] += now - job.started
        c[f"{job.kind}_job_s"] += now - job.submitted
        if not self.running:  # the link was busy for this connector from `_since` to now
            self.busy_s += now - self._since
        if job.kind == "put":  # what was turned away is not remembered: a later save tries it again
            self._release(len(job.hashes))
            self.pool.end_put(job.written, now)
            self._remember(job.stored)
            self.counters["saved_blocks"] += len(job.stored)
        else:
            self.ready.append(job)
            self.on_ready(now)
        for callback in job.on_done:
            callback(now)
        self._next(now)

    def _remember(self, hashes: list[int]) -> None:
        known = self.known
        for h in hashes:
            known[h] = None
            known.move_to_end(h)
        while len(known) > KNOWN_KEYS:
            known.popitem(last=False)
