"""The KV connector: whole KV blocks between the engine's paged cache and a cluster-wide pool.

It sits beside the block manager and is optional: an engine without one is the
colocated server, unchanged. With one (`LLMEngine(..., kv_pool=pool)`):

- **Load before scheduling.** A new request first takes what the local prefix
  cache holds (`BlockManager.match_prefix`); for the blocks after that, the
  connector asks the pool, one batched call for all of them. The request waits
  in the connector meanwhile, not in the scheduler, so requests already
  running are never held up. Blocks that came back are copied into free
  cache blocks and registered in the local prefix cache under their chained
  keys; the scheduler then finds them like any other cached prefix, and the
  request computes only the rest (`num_cached_tokens` counts them).
- **Save after prefill.** When a request's prompt has been computed, its full
  prompt blocks that the pool is not known to hold are copied out (one copy
  on the engine thread) and written with one batched call
  (`RequestOutput.kv_save` is a future for it: a prefill instance waits on it
  before handing the request over).

The pool is reached only from the connector's worker threads (each job, one
request's batched put or get, on one of them: Mooncake's transfers of
several requests at once go faster than one after another), through a
registered staging buffer (page-locked on a GPU): no call ever blocks the
engine thread, blocks move whole, never as Python objects per token. Each
pool object is one block: a header (magic, parent key, the block's token ids:
a hash collision is detected, never served) and the K and V of every layer.
Keys name the model and the cache layout before the block's chained hash,
`nanoforge/<model fingerprint>/<dtype>-bs<B>-kvh<H>-hd<D>-l<L>/<hash>`, so
different models or layouts never collide.

Failures never fail a request: a load that is not back by its deadline, or a
pool call that fails, counts as a miss and the request computes locally; a
full pool means "not cached". After a failure the pool is left alone for
`retry_s` seconds (its calls take seconds to fail when it is down), then
tried again.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

import torch

from nanoforge.serve.block_manager import BlockManager, prefix_block_hashes
from nanoforge.serve.sequence import Sequence, SequenceGroup

log = logging.getLogger("nanoforge.serve")

_MAGIC = int.from_bytes(b"NFKV0001", "little")  # a block written in this format
_STOP = 2  # the priority of a worker's stop: after every job queued before it (loads go first, then saves)


class PoolError(RuntimeError):
    """The pool did not answer (unreachable, timed out, an unexpected error code)."""


class Breaker:
    """After a failure, leave the pool alone for `retry_s` seconds: its calls take seconds to fail while it is
    down, and requests should not wait for that one after another. Not thread-safe: guard it."""

    def __init__(self, retry_s: float = 5.0):
        self.retry_s = retry_s
        self.until = 0.0
        self.failures = 0

    @property
    def up(self) -> bool:
        return time.monotonic() >= self.until

    def failed(self, why: str) -> None:
        if self.up:
            log.warning("KV pool: %s; not using it for the next %g s", why, self.retry_s)
        self.failures += 1
        self.until = time.monotonic() + self.retry_s


class KVPool(Protocol):
    """A cluster-wide store of whole KV blocks by key (`serve/disagg/mooncake_store.py`: Mooncake Store).

    Every call is bounded in time and raises PoolError when the pool does not answer."""

    def register_buffer(self, ptr: int, nbytes: int) -> None: ...

    def unregister_buffer(self, ptr: int) -> None: ...

    def put_from(self, keys: list[str], ptrs: list[int], nbytes: int) -> list[bool]:
        """Write `nbytes` from each address under its key; False where there was no room (not cached)."""

    def get_into(self, keys: list[str], ptrs: list[int], nbytes: int) -> list[bool]:
        """Read each key into its address; False where the pool does not hold it."""

    def contains(self, keys: list[str]) -> list[bool]: ...

    def close(self) -> None: ...


# --- naming blocks -----------------------------------------------------------------------------------

def model_fingerprint(model: torch.nn.Module) -> str:
    """16 hex digits that tell models apart: every parameter's name, shape and dtype, and up to 4,096 of its
    values, evenly spaced (hashing every weight of a large model would take seconds at start-up)."""
    h = hashlib.blake2b(digest_size=8)
    with torch.no_grad():
        for name, p in sorted(model.state_dict().items()):
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
            flat = p.reshape(-1)
            step = max(1, flat.numel() // 4096)
            h.update(flat[::step][:4096].float().cpu().numpy().tobytes())
    return h.hexdigest()


def cache_layout(cfg, block_size: int, dtype: torch.dtype) -> str:
    """What a block's bytes mean: dtype, tokens per block, KV heads, head size, layers."""
    return f"{str(dtype).removeprefix('torch.')}-bs{block_size}-kvh{cfg.n_kv_heads}-hd{cfg.head_dim}-l{cfg.n_layers}"


def block_key(namespace: str, block_hash: int) -> str:
    """The pool key of a block: its namespace (model / layout) and its chained prefix hash."""
    return f"{namespace}/{block_hash:016x}"


# --- the staging buffer ------------------------------------------------------------------------------

class _Ranges:
    """First-fit allocation of slot ranges in the staging buffer."""

    def __init__(self, n: int):
        self.free: list[tuple[int, int]] = [(0, n)] if n else []  # (start, length), sorted by start

    def alloc(self, want: int) -> tuple[int, int]:
        """The largest run of up to `want` slots at the first place that has one: (start, length), length may be 0."""
        best = None
        for i, (start, length) in enumerate(self.free):
            if length >= want:
                best = i
                break
            if best is None or length > self.free[best][1]:
                best = i
        if best is None:
            return 0, 0
        start, length = self.free[best]
        take = min(want, length)
        if take == length:
            del self.free[best]
        else:
            self.free[best] = (start + take, length - take)
        return start, take

    def release(self, start: int, length: int) -> None:
        if not length:
            return
        self.free.append((start, length))
        self.free.sort()
        merged = [self.free[0]]
        for s, n in self.free[1:]:
            if merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((s, n))
        self.free = merged


@dataclass
class _Job:
    kind: str  # "get" or "put"
    keys: list[str]
    slots: tuple[int, int]  # staging range (start, length)
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    copied: object = None  # a put's device-to-staging copy: an event the worker waits on (None: done already)
    done: bool = False  # the worker is finished with its slots (set under the connector's lock)
    abandoned: bool = False  # the engine gave up on it: its slots come back when the worker is done
    submitted: float = 0.0  # perf_counter when it was handed to the workers


@dataclass
class _Load:
    group: SequenceGroup
    first: int  # index of the first block asked for (the ones before it are in the local prefix cache)
    hashes: list[int]  # chained keys of the blocks asked for
    job: _Job
    started: float
    deadline: float


class KVConnector:
    """Moves whole KV blocks between one engine's cache (`runner.k_cache`, `runner.v_cache`) and a KVPool.

    The public methods run on the engine thread; the pool calls on the connector's `workers` threads. `_lock`
    guards what they touch: the staging ranges, the known keys, the counters and the pool's state."""

    def __init__(self, pool: KVPool, runner, block_manager: BlockManager, namespace: str, *, save: bool = True,
                 staging_bytes: int = 64 << 20, timeout_s: float = 2.0, retry_s: float = 5.0,
                 min_bandwidth: float = 100e6, max_backlog: int = 64, workers: int = 1):
        self.pool = pool
        self.runner = runner
        self.bm = block_manager
        self.namespace = namespace
        self.save_enabled = save
        self.timeout_s, self.min_bandwidth, self.max_backlog = timeout_s, min_bandwidth, max_backlog
        bs = self.block_size = block_manager.block_size
        k = runner.k_cache
        self.layers, self.kv_shape, self.dtype = k.shape[0], tuple(k.shape[2:]), k.dtype  # (block_size, heads, dim)
        self.header_bytes = -(-(24 + 8 * bs) // 64) * 64  # magic, has-parent, parent key, token ids; 64-aligned
        self.slot_bytes = self.header_bytes + 2 * k[:, 0].numel() * k.element_size()
        self.num_slots = max(1, staging_bytes // self.slot_bytes)
        self.staging = torch.zeros(self.num_slots * self.slot_bytes, dtype=torch.uint8,
                                   pin_memory=k.device.type == "cuda")
        self._bytes = self.staging.numpy()  # the same memory, for the headers
        self._base = self.staging.data_ptr()
        self.pool.register_buffer(self._base, self.staging.numel())
        self._kv = (self.staging.view(self.num_slots, self.slot_bytes)[:, self.header_bytes:]
                    .view(self.dtype).view(self.num_slots, 2, self.layers, *self.kv_shape))
        self._lock = threading.Lock()
        self._ranges = _Ranges(self.num_slots)
        self._known: OrderedDict[int, None] = OrderedDict()  # block keys saved or loaded lately: not saved again
        self.breaker = Breaker(retry_s)
        self._backlog = 0  # jobs submitted and not done
        self.counters = dict.fromkeys(("loaded_blocks", "saved_blocks", "refused_blocks", "load_misses", "skipped",
                                       "collisions", "put_calls", "put_call_blocks", "put_call_s", "put_job_s",
                                       "get_calls", "get_call_blocks", "get_call_s", "get_job_s"), 0)
        # *_call_*: the pool calls themselves; *_job_s: from the job's submission to its call's end (the wait for a
        # worker and, for a put, for its device-to-staging copy, then the call)
        self._pending: dict[str, _Load] = {}  # request id -> its load (engine thread only)
        self._done = threading.Event()  # set by the worker after each job
        # loads before saves: a load holds up a request before its prefill, a save only the hand-over after it
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = 0  # FIFO within a priority
        self._copying: list[tuple[object, tuple[int, int]]] = []  # (event, slots) of loaded blocks in transit
        self._workers = [threading.Thread(target=self._work, name=f"nanoforge-kv-pool-{i}", daemon=True)
                         for i in range(max(1, workers))]
        for w in self._workers:
            w.start()

    # --- loading ---------------------------------------------------------------------------------

    def start_load(self, group: SequenceGroup) -> bool:
        """If the pool may hold prompt blocks of `group` after its local prefix, ask for them and return True:
        the group then waits here until `ready_loads` gives it back. False: schedule it as it is."""
        if group.sampling_params.prompt_logprobs is not None or not self.bm.enable_prefix_caching:
            return False  # prompt logprobs need the logits of every prompt position: cached blocks are no use
        seq = group.seqs[0]
        first = len(self.bm.match_prefix(seq))
        last = (seq.num_tokens - 1) // self.block_size  # the last token is always computed (its logits sample)
        want = min(last - first, self.bm.num_free_blocks)
        if want <= 0:
            return False
        slots = self._reserve(want)
        if not slots[1]:
            return False
        hashes = prefix_block_hashes(seq.token_ids, self.block_size, first + slots[1], seq.block_hashes)
        hashes = hashes[first:first + slots[1]]
        job = _Job("get", [block_key(self.namespace, h) for h in hashes], slots)
        now = time.monotonic()
        self._pending[group.request_id] = _Load(group, first, hashes, job, now, now + self._time_bound(slots[1]))
        self._submit(job)
        return True

    def ready_loads(self, wait: float = 0.0) -> list[SequenceGroup]:
        """Groups whose loads are done (their blocks now in the local prefix cache) or were given up on; waits up
        to `wait` seconds for one when none is ready."""
        if not self._pending:
            return []
        if wait > 0 and not any(load.job.future.done() for load in self._pending.values()):
            soonest = min(load.deadline for load in self._pending.values())
            self._done.wait(max(0.0, min(wait, soonest - time.monotonic())))
        self._done.clear()
        ready, now = [], time.monotonic()
        for rid, load in list(self._pending.items()):
            if load.job.future.done():
                del self._pending[rid]
                self._finish_load(load)
                ready.append(load.group)
            elif now > load.deadline:
                del self._pending[rid]
                self._failed(f"reading {len(load.hashes)} blocks took more than {now - load.started:.1f} s")
                self._abandon(load.job)
                ready.append(load.group)
        return ready

    def cancel(self, request_id: str) -> SequenceGroup | None:
        """Forget the load of an aborted request; its group, or None if it has none."""
        load = self._pending.pop(request_id, None)
        if load is None:
            return None
        self._abandon(load.job)
        return load.group

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def _finish_load(self, load: _Load) -> None:
        try:
            found = load.job.future.result()
        except PoolError as e:
            self._failed(str(e))
            found = []
        seq, bs = load.group.seqs[0], self.block_size
        start = load.job.slots[0]
        blocks = []
        for i, ok in enumerate(found):  # the leading blocks that came back, checked against their tokens
            b = load.first + i
            parent, tokens = seq.block_hashes[b - 1] if b else None, seq.token_ids[b * bs:(b + 1) * bs]
            if not ok:
                break
            if not self._header_matches(start + i, parent, tokens):
                with self._lock:
                    self.counters["collisions"] += 1
                break
            block = self.bm.add_cached_block(load.hashes[i], parent, tokens)
            if block is None:  # cached here already, or no free block: the rest is computed
                break
            blocks.append(block)
        copied = self.runner.write_blocks(blocks, self._kv[start:start + len(blocks)]) if blocks else None
        with self._lock:
            for h in load.hashes[:len(blocks)]:
                self._remember(h)
            self.counters["loaded_blocks"] += len(blocks)
            self.counters["load_misses"] += not blocks
            if copied is None:
                self._ranges.release(*load.job.slots)
        if copied is not None:  # the staging slots come back once the copy into the cache has run
            self._copying.append((copied, load.job.slots))

    def _reclaim(self) -> None:
        """Release the staging slots of loads whose copy into the cache has run (engine thread)."""
        if not self._copying:
            return
        done, waiting = [], []
        for c in self._copying:
            (done if c[0].query() else waiting).append(c)  # one query each: an event may finish meanwhile
        self._copying = waiting
        with self._lock:
            for _, slots in done:
                self._ranges.release(*slots)

    # --- saving ----------------------------------------------------------------------------------------

    def save_prompt(self, seq: Sequence) -> concurrent.futures.Future | None:
        """Write the full prompt blocks of `seq` that the pool is not known to hold; a future of how many were
        stored, or None if nothing was sent. Call once the step that computed the end of the prompt has been
        launched (the read of the blocks follows it, and any step launched after it, in stream order), while
        `seq.block_table` still holds its blocks and no step launched since writes them."""
        if not self.save_enabled:
            return None
        bs = self.block_size
        n_full = seq.num_prompt_tokens // bs
        hashes = prefix_block_hashes(seq.token_ids, bs, n_full, seq.block_hashes)[:n_full]
        with self._lock:
            todo = [i for i in range(n_full) if hashes[i] not in self._known]
        if not todo:
            return None
        slots = self._reserve(len(todo))
        todo = todo[:slots[1]]  # the leading ones, if the staging buffer is short
        if not todo:
            return None
        start = slots[0]
        for j, i in enumerate(todo):
            self._write_header(start + j, hashes[i - 1] if i else None, seq.token_ids[i * bs:(i + 1) * bs])
        copied = self.runner.read_blocks([seq.block_table[i] for i in todo], self._kv[start:start + len(todo)])
        job = _Job("put", [block_key(self.namespace, hashes[i]) for i in todo], slots, copied=copied)
        stored: concurrent.futures.Future = concurrent.futures.Future()

        def done(f: concurrent.futures.Future):  # on the worker thread
            try:
                ok = f.result()
            except PoolError as e:
                self._failed(str(e))
                ok = []
            with self._lock:
                for i, good in zip(todo, ok):
                    if good:
                        self._remember(hashes[i])
                self.counters["saved_blocks"] += sum(ok)
                self.counters["refused_blocks"] += len(ok) - sum(ok)  # no room in the pool: not cached
            stored.set_result(sum(ok))

        job.future.add_done_callback(done)
        self._submit(job)
        return stored

    # --- state ---------------------------------------------------------------------------------------

    def stats(self) -> dict:
        with self._lock:
            return {"up": int(self.breaker.up), "pending_loads": len(self._pending), "staging_slots": self.num_slots,
                    "failures": self.breaker.failures, **self.counters}

    def close(self) -> None:
        """Stop the workers (after the jobs in hand) and hand the staging buffer back; the pool stays open."""
        for i, _ in enumerate(self._workers):
            self._jobs.put((_STOP, i, None))
        deadline = time.monotonic() + 10
        for w in self._workers:
            w.join(timeout=max(0.0, deadline - time.monotonic()))
        for copied, _ in self._copying:
            copied.synchronize()
        if not any(w.is_alive() for w in self._workers):
            self.pool.unregister_buffer(self._base)

    def _reserve(self, want: int) -> tuple[int, int]:
        """Staging slots for a job of up to `want` blocks, or (0, 0) when the pool is down or busy."""
        self._reclaim()
        with self._lock:
            if not self.breaker.up or self._backlog >= self.max_backlog:
                self.counters["skipped"] += 1
                return 0, 0
            slots = self._ranges.alloc(want)
            if slots[1] < want:
                self.counters["skipped"] += 1
            return slots

    def _failed(self, why: str) -> None:
        with self._lock:
            self.breaker.failed(why)

    def _time_bound(self, num_blocks: int) -> float:
        return self.timeout_s + num_blocks * self.slot_bytes / self.min_bandwidth

    def _remember(self, block_hash: int) -> None:  # with _lock held
        self._known[block_hash] = None
        self._known.move_to_end(block_hash)
        while len(self._known) > 1 << 16:
            self._known.popitem(last=False)

    def _abandon(self, job: _Job) -> None:
        with self._lock:
            if job.done:
                self._ranges.release(*job.slots)
            else:
                job.abandoned = True

    # --- headers -------------------------------------------------------------------------------------

    def _write_header(self, slot: int, parent: int | None, tokens: Seq[int]) -> None:
        struct.pack_into(f"<QQQ{len(tokens)}q", self._bytes, slot * self.slot_bytes, _MAGIC, parent is not None,
                         parent or 0, *tokens)

    def _header_matches(self, slot: int, parent: int | None, tokens: Seq[int]) -> bool:
        magic, has_parent, stored_parent, *stored = struct.unpack_from(f"<QQQ{len(tokens)}q", self._bytes,
                                                                       slot * self.slot_bytes)
        return (magic == _MAGIC and bool(has_parent) == (parent is not None) and stored_parent == (parent or 0)
                and stored == list(tokens))

    # --- the worker thread ------------------------------------------------------------------------------

    def _submit(self, job: _Job) -> None:
        job.submitted = time.perf_counter()
        with self._lock:
            self._backlog += 1
            self._seq += 1
            self._jobs.put((job.kind != "get", self._seq, job))

    def _work(self) -> None:
        while (job := self._jobs.get()[2]) is not None:
            start, n = job.slots
            ptrs = [self._base + (start + i) * self.slot_bytes for i in range(n)]
            try:
                if job.copied is not None:
                    job.copied.synchronize()  # the blocks are in the staging slots
                call = self.pool.get_into if job.kind == "get" else self.pool.put_from
                began = time.perf_counter()
                result, error = call(job.keys, ptrs, self.slot_bytes), None
                ended = time.perf_counter()
                with self._lock:  # what one call costs, as the simulator's profile times it (measure_transfer)
                    c = self.counters
                    c[f"{job.kind}_calls"] += 1
                    c[f"{job.kind}_call_blocks"] += n
                    c[f"{job.kind}_call_s"] += ended - began
                    c[f"{job.kind}_job_s"] += ended - job.submitted
            except PoolError as e:
                result, error = None, e
            except Exception as e:  # a bug: keep its traceback in the log, keep serving
                log.exception("KV pool %s of %d blocks failed", job.kind, n)
                result, error = None, PoolError(f"{type(e).__name__}: {e}")
            with self._lock:
                self._backlog -= 1
                job.done = True
                if job.kind == "put" or job.abandoned:  # nobody reads these slots any more
                    self._ranges.release(*job.slots)
            if error is None:
                job.future.set_result(result)
            else:
                job.future.set_exception(error)
            self._done.set()
