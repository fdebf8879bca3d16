"""The KV cache pool on Mooncake Store: a `KVPool` over `mooncake.store.MooncakeDistributedStore`.

Mooncake Store keeps objects in memory segments that its clients contribute (each
instance mounts `segment_bytes` of its own CPU memory into the cluster's pool)
and `mooncake_master` allocates and evicts them. We use it with the TCP
transport and `P2PHANDSHAKE` (no metadata server), through one registered
buffer per client and the batched calls `batch_put_from` / `batch_get_into`:
one call per request and direction, however many blocks. A client that holds
a segment writes into its own segment (Mooncake's `preferred_segment`): the
write is a local copy and only the reader's fetch crosses the link, as in
Mooncake, where a prefill node's KV stays in its own DRAM until a decode node
pulls it (over loopback TCP on a 2-core machine: 1.9 GB/s local against 0.3
GB/s remote puts). Codes, as Mooncake
0.3.13 returns them: a key that is missing, or not written for lack of room, is
a miss (`False`); RPC and transfer failures raise PoolError (the connector then
computes locally and leaves the pool alone for a while).

`MooncakeMaster` starts `mooncake_master` on loopback (RPC and metrics on
127.0.0.1, no HTTP metadata server: that one listens on every interface
whatever its host flag) and stops it; the launcher and the tests use it.

Network: Mooncake's transfer engine, inside every process with a store client,
listens on two ports of every interface (its handshake and TCP transport bind
INADDR_ANY in 0.3.13; no setting changes that); `MC_TCP_BIND_ADDRESS` only
chooses the address it advertises, which we set to `hostname` (127.0.0.1 by
default, so peers connect over loopback).

Warm segment: Mooncake 0.3.13 allocates a client's segment with `aligned_alloc` (a fresh anonymous mmap, no
MAP_POPULATE: only its MC_STORE_USE_HUGEPAGE path populates, and that needs reserved HugeTLB pages), so every
4 KiB page of it faults on its first write. On a VM whose free memory is handed back to the host (virtio-balloon
free page reporting), each of those faults also faults on the host: a first pass of saves over a multi-GiB
segment ran at 0.15-0.3 GB/s against ~14 GB/s once written. A client that holds a segment therefore pre-faults
it in a background thread as it joins (`_warm_segment`): the cost is paid once, off the request path (overlapping
the engine's model load), and the segment is resident memory from then on (RSS grows by `segment_bytes`: a
segment larger than the free memory now runs out of memory right after joining, not once the pool fills up).
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import logging
import mmap
import os
import subprocess
import sys
import threading
import time

from nanoforge.errors import NanoforgeError
from nanoforge.serve.disagg.process import free_port, spawn, stop, wait_for_port
from nanoforge.serve.kv_connector import PoolError

# Mooncake Store's error codes (mooncake-store/include/types.h) that mean "not there" or "no room", not "broken"
_MISSING = {-704, -703, -710, -712}  # OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY, REPLICA_NOT_FOUND, REPLICA_IS_GONE
_STORED = {0, -705}  # OK, OBJECT_ALREADY_EXISTS
_FAILED_BELOW = -800  # TRANSFER_FAIL, RPC_FAIL, RPC_TIMEOUT, HA errors ...
MIN_SEGMENT_BYTES = 16 << 20  # Mooncake refuses smaller segments
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in writable, as a write would, without writing them
_WARM_CHUNK = 64 << 20  # bytes per madvise call: close() waits for at most one

log = logging.getLogger("nanoforge.serve")


def _check_installed():
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise NanoforgeError(f"Mooncake Store is not importable ({e}); install it with pip install "
                             f"'nanoforge[disagg]' (mooncake-transfer-engine-non-cuda; on Debian also apt-get "
                             f"install libibverbs1)", param="store") from None
    return MooncakeDistributedStore


def _mappings() -> list[tuple[int, int, bool]]:
    """This process's memory mappings from /proc/self/maps, in address order: (start, end, anonymous), where
    anonymous means private, read-write and backed by no file (a mapping that names a path, [heap] and [stack]
    included, is not)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)  # range perms offset dev inode [path]
            start, end = (int(x, 16) for x in fields[0].split("-"))
            out.append((start, end, fields[1] == "rw-p" and fields[4] == "0" and len(fields) == 5))
    return out


def _new_memory(before: list[tuple[int, int, bool]], after: list[tuple[int, int, bool]],
                min_bytes: int) -> list[tuple[int, int]]:
    """The anonymous read-write memory of `after` that no mapping of `before` covered, as (start, end) pieces of
    at least `min_bytes`. The kernel merges a new mapping with an adjacent one of the same kind, so a mapping of
    `after` may hold older memory: only its new part counts."""
    old = sorted((start, end) for start, end, _ in before)  # mappings never overlap
    starts = [start for start, _ in old]
    pieces = []
    for start, end, anonymous in after:
        if not anonymous:
            continue
        at, i = start, max(bisect.bisect_right(starts, start) - 1, 0)
        while at < end and i < len(old) and old[i][0] < end:
            if old[i][1] > at:
                if old[i][0] > at:
                    pieces.append((at, old[i][0]))
                at = old[i][1]
            i += 1
        if at < end:
            pieces.append((at, end))
    return [(start, end) for start, end in pieces if end - start >= min_bytes]


def _warm_segment(pieces: list[tuple[int, int]], stop: threading.Event) -> None:
    """Pre-fault `pieces` (page-aligned address ranges of this process) with madvise(MADV_POPULATE_WRITE), one
    `_WARM_CHUNK` at a time until done or `stop` is set. It never writes, so it is safe while Mooncake writes
    into the same memory; ctypes lets go of the GIL during each call."""
    total = sum(end - start for start, end in pieces)
    began, done = time.monotonic(), 0
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
        for start, end in pieces:
            for at in range(start, end, _WARM_CHUNK):
                if stop.is_set():
                    return
                n = min(_WARM_CHUNK, end - at)
                if madvise(at, n, _MADV_POPULATE_WRITE) != 0:  # EINVAL before Linux 5.14
                    err = ctypes.get_errno()
                    log.info("could not pre-fault the KV pool segment (madvise: %s) after %.2f of %.2f GiB; its "
                             "pages fault on their first write", os.strerror(err), done / 2**30, total / 2**30)
                    return
                done += n
        log.info("pre-faulted the KV pool segment: %.2f GiB in %.1f s", total / 2**30, time.monotonic() - began)
    except Exception as e:  # never take the client down over a warm-up
        log.info("could not pre-fault the KV pool segment (%s); its pages fault on their first write", e)


class MooncakeStore:
    """A Mooncake Store client: joins the pool of the master at `master` ("host:port"), contributing
    `segment_bytes` of this process's memory to it (0: use the pool, hold none of it)."""

    def __init__(self, master: str, *, segment_bytes: int = 0, hostname: str = "127.0.0.1",
                 local_buffer_bytes: int = 16 << 20, wait_s: float = 30.0):
        """Waits up to `wait_s` for the master to listen (it may still be starting): Mooncake's own setup retries
        for over a minute before it gives up on an address where nothing answers."""
        if segment_bytes and segment_bytes < MIN_SEGMENT_BYTES:
            raise NanoforgeError(f"the pool segment must be 0 or at least {MIN_SEGMENT_BYTES >> 20} MiB, got "
                                 f"{segment_bytes} bytes", param="pool_memory")
        host, _, port = master.rpartition(":")
        if not host or not port.isdigit():
            raise NanoforgeError(f"--store must be the master's HOST:PORT, got {master!r}", param="store")
        try:
            wait_for_port(host, int(port), wait_s)
        except NanoforgeError:
            raise NanoforgeError(f"no mooncake_master answers at {master} (waited {wait_s:g} s)",
                                 param="store") from None
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", hostname)  # the address peers are told to connect to
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # read when the library loads
        store_class = _check_installed()
        self.master = master
        self.store = store_class()
        before = self._maps_if_linux() if segment_bytes else None
        code = self.store.setup(hostname, "P2PHANDSHAKE", segment_bytes, local_buffer_bytes, "tcp", "", master)
        if code != 0:
            raise NanoforgeError(f"cannot join the Mooncake Store of the master at {master} (setup returned {code}): "
                                 f"is mooncake_master running there?", param="store")
        self.put_config = None  # Mooncake's default placement
        if segment_bytes:  # write into our own segment: a local copy, not a transfer
            from mooncake.store import ReplicateConfig
            self.put_config = ReplicateConfig()
            self.put_config.preferred_segment = self.store.get_hostname()
        self._stop_warm = threading.Event()
        self._warmer = None
        if before is not None:
            self._start_warming(before, segment_bytes)

    @staticmethod
    def _maps_if_linux():
        """This process's mappings before setup, for `_start_warming`; None where there is no /proc/self/maps."""
        if sys.platform.startswith("linux"):
            try:
                return _mappings()
            except OSError as e:
                log.info("cannot read /proc/self/maps (%s): the KV pool segment will not be pre-faulted", e)
        else:
            log.info("pre-faulting the KV pool segment needs Linux: its pages fault on their first write")
        return None

    def _start_warming(self, before, segment_bytes: int) -> None:
        """Pre-fault our segment in the background. Setup mapped it as one new piece of memory of at least
        `segment_bytes` (one `aligned_alloc`: the TCP transport does not split segments), which the kernel may have
        merged with the few tens of MiB of buffers Mooncake mapped next to it; a probe object put into the segment
        tells where in that piece the segment starts, so only the segment itself is pre-faulted (the whole piece
        where the probe fails). A small segment may instead come from memory the process had mapped already (the
        C allocator reuses freed memory below its mmap threshold, 32 MiB at most): then the probe's address alone
        says where it is."""
        try:
            pieces = _new_memory(before, _mappings(), segment_bytes)
        except OSError as e:
            log.info("cannot read /proc/self/maps (%s): the KV pool segment is not pre-faulted", e)
            return
        start = self._segment_start()
        if start is not None:
            start -= start % mmap.PAGESIZE
            inside = [(start, min(end, start + segment_bytes)) for begin, end in pieces if begin <= start < end]
            pieces = inside or pieces or [(start, start + segment_bytes)]
        if not pieces:
            log.info("found no new mapping of %d bytes after joining the pool and no probe of it: the segment is "
                     "not pre-faulted", segment_bytes)
            return
        self._warmer = threading.Thread(target=_warm_segment, args=(pieces, self._stop_warm),
                                        name="nanoforge-pool-warm", daemon=True)
        self._warmer.start()

    def _segment_start(self) -> int | None:
        """The address of a 1-byte probe object put into our fresh segment, which Mooncake 0.3.13's allocator
        places at the segment's start; None if that fails. The probe is removed at once (forced: looking up its
        replica leased it)."""
        key = f"nanoforge/segment-probe/{self.store.get_hostname()}/{os.getpid()}"
        try:
            if self.store.put(key, b"\0", self.put_config) != 0:
                return None
            replicas = [r for r in self.store.get_replica_desc(key) if r.is_memory_replica()]
            return replicas[0].get_memory_descriptor().buffer_descriptor.buffer_address if replicas else None
        except Exception:  # no probe, no harm: pre-fault the whole piece
            return None
        finally:
            self.store.remove(key, True)

    def wait_warm(self) -> float:
        """Wait until the segment is pre-faulted (at once if it is not being pre-faulted); the seconds waited. An
        instance calls it once its model is loaded, before it takes requests: saves into a segment still cold
        ran at 0.26 GB/s here."""
        t0 = time.monotonic()
        if self._warmer is not None:
            self._warmer.join()
        return time.monotonic() - t0

    def register_buffer(self, ptr: int, nbytes: int) -> None:
        code = self.store.register_buffer(ptr, nbytes)
        if code != 0:
            raise RuntimeError(f"Mooncake register_buffer({nbytes} bytes) returned {code}")

    def unregister_buffer(self, ptr: int) -> None:
        self.store.unregister_buffer(ptr)

    def put_from(self, keys: list[str], ptrs: list[int], nbytes: int) -> list[bool]:
        sizes = [nbytes] * len(keys)
        if self.put_config is None:
            codes = self.store.batch_put_from(keys, ptrs, sizes)
        else:
            codes = self.store.batch_put_from(keys, ptrs, sizes, self.put_config)
        self._raise_on_failure("put", codes)
        return [c in _STORED for c in codes]

    def get_into(self, keys: list[str], ptrs: list[int], nbytes: int) -> list[bool]:
        codes = self.store.batch_get_into(keys, ptrs, [nbytes] * len(keys))
        first_miss = next((c for c in codes if c != nbytes), None)
        if first_miss is not None and first_miss not in _MISSING:
            self._raise_on_failure("get", [first_miss])
        return [c == nbytes for c in codes]

    def remove(self, keys: list[str]) -> None:
        """Drop keys from the pool (missing ones are no error)."""
        self.store.batch_remove(keys)

    def segments(self, key: str) -> list[str]:
        """The segments (clients' hostnames) holding replicas of `key`."""
        return [r.get_memory_descriptor().buffer_descriptor.transport_endpoint
                for r in self.store.get_replica_desc(key) if r.is_memory_replica()]

    def contains(self, keys: list[str]) -> list[bool]:
        codes = self.store.batch_is_exist(keys)
        self._raise_on_failure("lookup", codes)
        return [c == 1 for c in codes]

    def close(self) -> None:
        """Leave the pool: the master unmounts this client's segment (and forgets what it held). Takes ~2 s."""
        self._stop_warm.set()  # and wait for the warm-up's current madvise: the segment is freed next
        if self._warmer is not None:
            self._warmer.join()
        self.store.close()

    def _raise_on_failure(self, what: str, codes: list[int]) -> None:
        bad = [c for c in codes if c <= _FAILED_BELOW or c == -1]
        if bad:
            raise PoolError(f"Mooncake {what} of {len(codes)} keys failed with code {bad[0]} (master {self.master})")


class MooncakeMaster:
    """`mooncake_master` on loopback: RPC on `port` (0: a free one), metrics on a free port, no HTTP metadata
    server (clients use P2PHANDSHAKE). A context manager; `address` is "127.0.0.1:port". Its output goes to
    `log` (a file) where given; otherwise it is read and dropped, its last lines kept for the error a master that
    exits before listening raises (a flag it does not know, a port taken)."""

    def __init__(self, port: int = 0, *, host: str = "127.0.0.1", log=None, extra: list[str] = ()):
        self.host, self.port = host, port or free_port(host)
        self.metrics_port = free_port(host)
        self.log = log
        self.extra = list(extra)
        self.proc: subprocess.Popen | None = None
        self.last_lines: collections.deque[str] = collections.deque(maxlen=5)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> MooncakeMaster:
        cmd = ["mooncake_master", f"-rpc_address={self.host}", f"-rpc_port={self.port}",
               "-enable_http_metadata_server=false", f"-metrics_host={self.host}",
               f"-metrics_port={self.metrics_port}", "-enable_metric_reporting=false", *self.extra]
        self.proc = spawn(cmd, stdout=self.log or subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        reader = None
        if self.log is None:  # drained for as long as it runs (a full pipe would stall it), the last lines kept
            reader = threading.Thread(target=self._keep_last_lines, daemon=True, name="mooncake-master-output")
            reader.start()
        try:
            wait_for_port(self.host, self.port, timeout, self.proc)
        except NanoforgeError as e:
            stop(self.proc)
            if reader is not None:
                reader.join(2.0)
            said = " | ".join(line for line in self.last_lines if line)[-400:]
            raise NanoforgeError(f"{e}{'; it said: ' + said if said else ''}") from None
        return self

    def _keep_last_lines(self) -> None:
        for line in self.proc.stdout:
            self.last_lines.append(line.decode(errors="replace").strip())

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc, grace=5.0)

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
