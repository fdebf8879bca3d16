"""A client that holds a pool segment pre-faults it as it joins: Mooncake maps the segment lazily, and the first
write into each of its pages used to fault (slowly on a VM that hands free memory back to its host), so the
first pass of KV saves over a fresh segment ran at a fraction of the warm rate. Checked on the memory itself,
not on timings: right after joining, the segment's pages are resident (mincore) and a first put into it takes
next to no page faults."""

from __future__ import annotations

import ctypes
import mmap
import resource
import sys

import pytest
import torch
from disagg_helpers import need_mooncake

from nanoforge.serve.disagg import mooncake_store
from nanoforge.serve.disagg.mooncake_store import MooncakeMaster, MooncakeStore, _new_memory

MiB = 1 << 20
SEGMENT = 128 * MiB  # pre-faulted in well under a second, even where the host has to fault the pages in too
BLOCK, BLOCKS = 2 * MiB, 32  # a first put of 64 MiB into the segment


def test_new_memory_is_what_setup_mapped():
    """Only memory that was not mapped before counts, also where the kernel merged a new mapping with an old
    neighbour; file mappings and pieces under the size asked for do not."""
    before = [(0x1000, 0x3000, True), (0x10000, 0x11000, False)]
    after = [(0x1000, 0x9000, True),  # an old anonymous mapping grown by 0x6000 (merged with a new one)
             (0x10000, 0x11000, False),
             (0x20000, 0x30000, False),  # a new file mapping
             (0x40000, 0x41000, True),  # a new but small anonymous mapping
             (0x50000, 0x60000, True)]  # a new anonymous mapping
    assert _new_memory(before, after, 0x2000) == [(0x3000, 0x9000), (0x50000, 0x60000)]
    assert _new_memory(before, after, 0x8000) == [(0x50000, 0x60000)]
    # a new mapping with an old one inside it (not something setup does, but the arithmetic must hold)
    assert _new_memory([(0x5000, 0x6000, True)], [(0x1000, 0x9000, True)], 1) == [(0x1000, 0x5000),
                                                                                  (0x6000, 0x9000)]


@pytest.fixture(scope="module")
def master():
    need_mooncake()
    with MooncakeMaster() as m:
        yield m


def resident_fraction(address: int, nbytes: int) -> float:
    """The fraction of the pages of [address, address + nbytes) that are in memory (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    start = address - address % mmap.PAGESIZE
    pages = (address + nbytes - start + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(start, pages * mmap.PAGESIZE, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) / pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pre-faulting the segment is Linux-only")
def test_segment_is_resident_after_joining(master):
    store = MooncakeStore(master.address, segment_bytes=SEGMENT)
    try:
        assert store._warmer is not None, "no warm-up started"
        store.wait_warm()
        assert not store._warmer.is_alive()
        # where our segment is: the address of an object put into it (the first, so at its start)
        assert store.store.put("where", b"x", store.put_config) == 0
        replica = store.store.get_replica_desc("where")[0]
        address = replica.get_memory_descriptor().buffer_descriptor.buffer_address
        resident = resident_fraction(address, SEGMENT)
        assert resident > 0.99, f"only {resident:.1%} of the segment's pages are resident after joining"

        src = torch.randint(0, 256, (BLOCKS * BLOCK,), dtype=torch.uint8)  # written: its pages are in
        store.register_buffer(src.data_ptr(), src.numel())
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt  # all threads: Mooncake's copy included
        assert all(store.put_from([f"block{i}" for i in range(BLOCKS)],
                                  [src.data_ptr() + i * BLOCK for i in range(BLOCKS)], BLOCK))
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        pages = BLOCKS * BLOCK // mmap.PAGESIZE
        assert faults < pages // 10, f"a first put of {pages} pages into the segment took {faults} page faults"
        store.unregister_buffer(src.data_ptr())
    finally:
        store.close()


def test_warm_up_fails_quietly(master, monkeypatch, caplog):
    """Where madvise refuses (a kernel before 5.14 has no MADV_POPULATE_WRITE), the warm-up logs one line and
    the client works as before."""
    monkeypatch.setattr(mooncake_store, "_MADV_POPULATE_WRITE", -1)  # EINVAL everywhere
    with caplog.at_level("INFO", logger="nanoforge.serve"):  # the thread logs: wait for it inside
        store = MooncakeStore(master.address, segment_bytes=16 * MiB)
        store.wait_warm()
    try:
        assert any("could not pre-fault" in r.getMessage() for r in caplog.records)
        buf = torch.zeros(2, 4096, dtype=torch.uint8)
        buf[0] = torch.randint(0, 256, (4096,), dtype=torch.uint8)
        store.register_buffer(buf.data_ptr(), buf.numel())
        assert store.put_from(["k"], [buf[0].data_ptr()], 4096) == [True]
        assert store.get_into(["k"], [buf[1].data_ptr()], 4096) == [True]
        assert torch.equal(buf[0], buf[1])
        store.unregister_buffer(buf.data_ptr())
    finally:
        store.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pre-faulting the segment is Linux-only")
def test_a_segment_in_reused_memory_is_found_by_its_probe(master, monkeypatch):
    """A small segment can come from memory the process had mapped before (the C allocator reuses freed memory
    below its mmap threshold; it happened in CI): no new mapping, yet the probe object's address says where the
    segment is, and that range is pre-faulted."""
    monkeypatch.setattr(mooncake_store, "_new_memory", lambda *args: [])  # as if setup had mapped nothing new
    store = MooncakeStore(master.address, segment_bytes=16 * MiB)
    try:
        assert store._warmer is not None, "no warm-up started"
        store.wait_warm()
        assert store.store.put("where", b"x", store.put_config) == 0
        replica = store.store.get_replica_desc("where")[0]
        address = replica.get_memory_descriptor().buffer_descriptor.buffer_address
        store.store.remove("where", True)
        assert resident_fraction(address, 16 * MiB) > 0.99
    finally:
        store.close()
