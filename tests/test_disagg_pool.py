"""The KV connector over a real Mooncake Store (`mooncake_master` on loopback): blocks go to the pool after a
prefill and come back bit for bit in another engine, which then computes only what the pool did not hold;
a full pool, a dead master, a hash collision and an aborted load all end in a correct, locally computed answer."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from disagg_helpers import SEGMENT, close_all, need_mooncake, run_engine
from test_serve_api import model, tok  # noqa: F401  (the same fixtures)
from test_serve_engine import reference

from nanoforge import SamplingParams
from nanoforge.errors import NanoforgeError
from nanoforge.serve.llm_engine import EngineConfig, LLMEngine

need_mooncake()

from nanoforge.serve.disagg.mooncake_store import MooncakeMaster, MooncakeStore  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BS = 16


class Leaving:
    """Mooncake clients and masters that tests are done with, shut down when the module ends: the clients first
    (~1.5-2 s each to leave their pools, while their masters still answer; one at a time, as the binding holds
    the GIL), then every master at once (~1 s each to stop, which the tests would otherwise wait out one after
    another)."""

    def __init__(self):
        self.clients: list[MooncakeStore] = []
        self.masters: list[MooncakeMaster] = []

    def client(self, store: MooncakeStore) -> MooncakeStore:
        self.clients.append(store)
        return store

    def master(self, master: MooncakeMaster) -> MooncakeMaster:
        self.masters.append(master)
        return master

    def close(self) -> None:
        close_all(self.clients)
        threads = [threading.Thread(target=m.stop) for m in self.masters]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


@pytest.fixture(scope="module")
def leaving():
    later = Leaving()
    try:
        yield later
    finally:
        later.close()


@pytest.fixture(scope="module")
def master(leaving):
    return leaving.master(MooncakeMaster().start())


@pytest.fixture(scope="module")
def stores(master, leaving):
    """Two clients of the pool, each holding a segment of it (joining takes ms, leaving ~2 s: shared by tests)."""
    return [leaving.client(MooncakeStore(master.address, segment_bytes=SEGMENT)) for _ in range(2)]


def engine(model, tok, store, **kw) -> LLMEngine:
    return LLMEngine(model, tok, EngineConfig(num_gpu_blocks=64, block_size=BS, **kw), kv_pool=store)


def run(engine: LLMEngine, prompts, params=GREEDY):
    return run_engine(engine, prompts, params)


def wait_saved(outs):
    for out in outs:
        if out.kv_save is not None:
            out.kv_save.result(timeout=10)


def test_blocks_round_trip_and_a_second_engine_computes_only_the_rest(model, tok, stores):
    rng = random.Random(0)
    prompt = [rng.randrange(60) for _ in range(70)]  # 4 full blocks and 6 tokens
    a, b = engine(model, tok, stores[0]), engine(model, tok, stores[1])
    try:
        out_a = run(a, [prompt])
        assert out_a[0].kv_save.result(timeout=10) == 4  # the 4 full prompt blocks
        pool_a = a.stats()["kv_pool"]
        assert pool_a["saved_blocks"] == 4
        # the pool calls themselves, counted for /metrics: a get of the 4 blocks before the prefill (none there
        # yet), then one put of them, timed
        assert (pool_a["get_calls"], pool_a["get_call_blocks"], pool_a["loaded_blocks"]) == (1, 4, 0)
        assert (pool_a["put_calls"], pool_a["put_call_blocks"]) == (1, 4)
        assert pool_a["put_call_s"] > 0
        from nanoforge.serve.api.metrics import EngineCollector

        collector = EngineCollector()
        collector.stats = a.stats()
        exposed = {(m.name, smp.labels.get("kind")): smp.value for m in collector.collect() for smp in m.samples}
        assert exposed[("nanoforge_kv_pool_call_blocks", "put")] == 4
        assert exposed[("nanoforge_kv_pool_call_seconds", "put")] == pool_a["put_call_s"]
        before = b.stats()["computed_tokens"]
        out_b = run(b, [prompt + [1, 2]])  # the same 4 blocks, then 8 tokens of its own
        assert out_b[0].num_cached_tokens == 64
        assert b.stats()["computed_tokens"] - before == 8 + 5  # the uncached prompt tokens, then 5 decodes
        assert b.stats()["kv_pool"]["loaded_blocks"] == 4
        assert (b.stats()["kv_pool"]["get_calls"], b.stats()["kv_pool"]["get_call_blocks"]) == (1, 4)
        assert [o.outputs[0].token_ids for o in out_b] == reference(model, [prompt + [1, 2]], 6)
        # bit for bit: the blocks B loaded hold what A computed
        table_a = sorted(a.scheduler.block_manager._cached.items())
        table_b = dict(b.scheduler.block_manager._cached)
        shared = [(key, blk) for key, blk in table_a if key in table_b]
        assert len(shared) >= 4
        for key, blk in shared:
            assert torch.equal(a.runner.k_cache[:, blk], b.runner.k_cache[:, table_b[key]])
            assert torch.equal(a.runner.v_cache[:, blk], b.runner.v_cache[:, table_b[key]])
        assert a.stats()["kv_blocks_used"] == b.stats()["kv_blocks_used"] == 0
    finally:
        a.close()
        b.close()


def test_a_client_writes_into_its_own_segment_and_another_reads_it(stores):
    """Puts land in the writer's own segment (a local copy, as a prefill node keeps its KV in its own DRAM);
    the other client reads them across the link, byte for byte."""
    nbytes, n = 1 << 16, 8
    homes = []
    bufs = [torch.randint(0, 256, (n * nbytes,), dtype=torch.uint8) for _ in stores]
    for store, buf in zip(stores, bufs):
        store.register_buffer(buf.data_ptr(), buf.numel())
    try:
        for w, (writer, reader) in enumerate((stores, stores[::-1])):
            src, dst = bufs[w], bufs[1 - w]
            keys = [f"own-segment/{w}/{i}" for i in range(n)]
            assert writer.put_from(keys, [src.data_ptr() + i * nbytes for i in range(n)], nbytes) == [True] * n
            homes.append({tuple(writer.segments(k)) for k in keys})
            expected = src.clone()
            dst.zero_()
            assert reader.get_into(keys, [dst.data_ptr() + i * nbytes for i in range(n)], nbytes) == [True] * n
            assert torch.equal(dst, expected)
        # each writer's blocks all sit in one segment, and not the same one (Mooncake's default placement is
        # random over the segments: 8 blocks in one place would be a 1-in-128 chance)
        assert [len(h) for h in homes] == [1, 1] and homes[0] != homes[1]
    finally:
        for store, buf in zip(stores, bufs):
            store.unregister_buffer(buf.data_ptr())


def test_mixed_prompts_with_and_without_hits_are_exact(model, tok, stores):
    """Several prompts at once, some sharing a prefix with what the pool holds, some not, one shorter than a
    block, n > 1 and a seeded sample: the same tokens as an engine without a pool."""
    rng = random.Random(1)
    shared = [rng.randrange(60) for _ in range(40)]
    prompts = [shared + [rng.randrange(60) for _ in range(rng.randint(1, 30))] for _ in range(4)]
    prompts += [[rng.randrange(60) for _ in range(rng.randint(3, 50))] for _ in range(3)] + [[5, 6, 7]]
    a, b = engine(model, tok, stores[0]), engine(model, tok, stores[1])
    plain = LLMEngine(model, tok, EngineConfig(num_gpu_blocks=64, block_size=BS))
    try:
        wait_saved(run(a, prompts[:2]))
        sampled = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=5)
        got = [o.outputs for o in run(b, prompts) + run(b, prompts[:3], sampled)]
        want = [o.outputs for o in run(plain, prompts) + run(plain, prompts[:3], sampled)]
        assert [[c.token_ids for c in cs] for cs in got] == [[c.token_ids for c in cs] for cs in want]
        assert b.stats()["kv_pool"]["loaded_blocks"] >= 2
        assert b.stats()["kv_blocks_used"] == 0
    finally:
        a.close()
        b.close()


def test_an_engine_that_only_loads_schedules_a_step_ahead_and_stays_exact(model, tok, stores):
    """A decode instance's engine (loads, never saves) schedules a step ahead by default on a GPU; one that saves
    does when asked. Its loads land before the steps that read them: the same tokens as step by step without a
    pool."""
    rng = random.Random(2)
    shared = [rng.randrange(60) for _ in range(50)]
    prompts = [shared + [rng.randrange(60) for _ in range(rng.randint(1, 20))] for _ in range(5)]
    a = engine(model, tok, stores[0])
    b = engine(model, tok, stores[1], kv_pool_save=False, async_scheduling=True)
    plain = LLMEngine(model, tok, EngineConfig(num_gpu_blocks=64, block_size=BS))
    try:
        assert b.async_scheduling and not a.async_scheduling
        wait_saved(run(a, prompts[:1]))
        got = [o.outputs[0].token_ids for o in run(b, prompts)]
        assert got == [o.outputs[0].token_ids for o in run(plain, prompts)]
        assert b.stats()["kv_pool"]["loaded_blocks"] >= 3  # the shared 3 full blocks came from the pool
        assert b.stats()["kv_blocks_used"] == 0
    finally:
        a.close()
        b.close()


def test_an_engine_that_saves_a_step_ahead_stays_exact_and_what_it_saved_loads_elsewhere(model, tok, stores):
    """A prefill or colocated instance asked to schedule a step ahead (`--async-scheduling`) reads a prompt's
    blocks for the pool after the step ahead was launched. With a cache too small for the batch, that step
    preempts sequences whose prompts the step before had just finished: they are not saved then (their blocks
    are gone) but after their recomputation. Every output is the step-by-step engine's, every block comes back,
    and a second engine loads what was saved bit for bit.

    The saving engine does not look in the pool: a request that does waits for its lookup on the connector's
    thread, so the order in which requests join the batch, and whether the case happens, would follow that
    thread's timing (a clean-clone CI run once missed it; so did one run in ~6 here). Without lookups the steps
    are the same every run, and this workload (seed 105, 10 blocks) has the step ahead preempt two such
    sequences."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLMEngine(model, tok, EngineConfig(num_gpu_blocks=64, block_size=BS))
    rng = random.Random(105)  # (prompts no other test has)
    prompts = [[rng.randrange(60) for _ in range(rng.randint(33, 60))] for _ in range(8)]
    a = LLMEngine(model, tok, EngineConfig(num_gpu_blocks=10, block_size=BS, async_scheduling=True),
                  kv_pool=stores[0])
    a.connector.start_load = lambda group: False  # saves only
    b = engine(model, tok, stores[1], kv_pool_save=False)
    skipped = []
    _save_prompts = a._save_prompts

    def watched(out):  # the prompts the step ahead took back
        skipped.extend(item for item in out.scheduled if item.seq.status.name != "RUNNING"
                       and item.start < item.seq.num_prompt_tokens <= item.end)
        _save_prompts(out)

    a._save_prompts = watched
    try:
        assert a.async_scheduling
        outs = run(a, prompts, params)
        wait_saved(outs)
        assert skipped, "the step ahead preempted no sequence whose prompt had just finished: pick another workload"
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in run(plain, prompts, params)]
        assert a.stats()["kv_blocks_used"] == 0
        assert a.stats()["kv_pool"]["saved_blocks"] >= 2 * len(prompts)  # every prompt's 2-3 full blocks
        again = [p + [1] for p in prompts]
        got = run(b, again, params)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in run(plain, again, params)]
        assert b.stats()["kv_pool"]["loaded_blocks"] >= 2 * len(prompts)
        assert all(o.num_cached_tokens >= 2 * BS for o in got)
    finally:
        a.close()
        b.close()


def test_a_full_pool_means_not_cached(model, tok, leaving):
    """The only segment is filled with other objects, each looked up once so that Mooncake holds a lease on it and
    cannot evict it yet (without the lookups the save stores its blocks: the master evicts for them): the
    prefill's save finds no room, and another engine computes the whole prompt, correctly."""
    small = leaving.master(MooncakeMaster().start())
    filler = leaving.client(MooncakeStore(small.address, segment_bytes=SEGMENT))
    junk = torch.zeros(1 << 20, dtype=torch.uint8)
    filler.register_buffer(junk.data_ptr(), junk.numel())
    batch = 0
    for size in (1 << 20, 1 << 14, 1 << 10):  # big objects first, then whatever room is left
        for _ in range(8):  # until a batch finds no room: what the master evicted before its lookup is refilled
            keys = [f"junk/{size}/{batch}/{i}" for i in range(SEGMENT // size)]
            batch += 1
            stored = filler.put_from(keys, [junk.data_ptr()] * len(keys), size)
            filler.contains([k for k, ok in zip(keys, stored) if ok])  # a lookup grants the lease
            if not any(stored):
                break
    users = [leaving.client(MooncakeStore(small.address)) for _ in range(2)]  # holding no segment of the pool
    a, b = (LLMEngine(model, tok, EngineConfig(num_gpu_blocks=64), kv_pool=store) for store in users)
    try:
        prompt = list(range(2, 52))
        assert run(a, [prompt])[0].kv_save.result(timeout=10) == 0  # nothing stored
        out = run(b, [prompt])[0]
        assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == reference(model, [prompt], 6)[0]
        pool = a.stats()["kv_pool"]
        assert pool["failures"] == 0 and pool["saved_blocks"] == 0  # no room is not a failure
        assert pool["refused_blocks"] == len(prompt) // a.config.block_size  # but counted: its full blocks
    finally:
        a.close()
        b.close()
        filler.unregister_buffer(junk.data_ptr())


def test_a_full_pool_turns_puts_away_until_leases_run_out(leaving):
    """What the simulator's pool assumes of Mooncake (`sim/pool.py`): a full pool evicts nothing touched within
    its lease (the master's default_kv_lease_ttl, 1 s here) and turns new puts away; once the leases have run
    out it evicts the least recently touched and takes puts again."""
    size = 1 << 20
    small = leaving.master(MooncakeMaster(extra=["-default_kv_lease_ttl=1000"]).start())
    store = leaving.client(MooncakeStore(small.address, segment_bytes=SEGMENT))
    buf = torch.zeros(size, dtype=torch.uint8)
    store.register_buffer(buf.data_ptr(), buf.numel())
    try:
        put = (lambda key: store.put_from([key], [buf.data_ptr()], size)[0])
        held, tried = [], 0
        while tried < 4 * SEGMENT // size:  # one at a time, until the pool, all of it leased, turns one away
            tried += 1
            if put(f"old/{tried}"):
                held.append(f"old/{tried}")
                continue
            # a lookup renews every lease (a put grants none: on a busy 2-core box the master may have evicted
            # some, or their leases run out, before it: their room is filled again)
            here = store.contains(held)
            if all(here):
                break
            held = [k for k, ok in zip(held, here) if ok]
        assert len(held) >= SEGMENT // size // 2
        assert not put("new/0") and all(store.contains(held))  # leased: nothing evicted for the newcomer
        time.sleep(1.5)
        assert put("new/1") and store.contains(["new/1"]) == [True]
        assert not all(store.contains(held))  # the leases ran out: old objects made room
    finally:
        store.unregister_buffer(buf.data_ptr())


@pytest.mark.parametrize("touch", ["nothing", "get", "contains"])
def test_a_put_grants_no_lease_a_read_or_lookup_does(touch, leaving):
    """What the simulator's pool assumes of Mooncake (`sim/pool.py`): PutEnd grants no lease, a read
    (batch_get_into) or a lookup (batch_is_exist) one of default_kv_lease_ttl (10 s). Objects are written one at
    a time, 20 ms apart (the master's eviction thread runs every 10 ms once usage is over 90%), into a segment
    that holds half of them: written only, every one is admitted (the master evicts the unread ones behind them;
    a put refused before its eviction thread ran is put again, up to 0.5 s later);
    each read or looked up right after its put, the pool fills and turns every later put away. (A put's object has
    no lease until that read: on a loaded box the eviction thread can take it first, and the read misses; it
    freed its room, so the test goes on.)"""
    size = 1 << 20
    m = leaving.master(MooncakeMaster().start())
    store = leaving.client(MooncakeStore(m.address, segment_bytes=SEGMENT))
    buf = torch.zeros(size, dtype=torch.uint8)
    store.register_buffer(buf.data_ptr(), buf.numel())
    try:
        keys = [f"k/{i}" for i in range(2 * SEGMENT // size)]
        admitted, leased = [], []
        for key in keys:
            admitted += store.put_from([key], [buf.data_ptr()], size)
            retries = 10 if touch == "nothing" else 0  # (refused before the eviction thread ran, on a loaded
            while not admitted[-1] and retries:  # box: unleased objects are its to take, so it makes room)
                retries -= 1
                time.sleep(0.05)
                admitted[-1] = store.put_from([key], [buf.data_ptr()], size)[0]
            if admitted[-1] and touch != "nothing":
                touched = store.get_into([key], [buf.data_ptr()], size) if touch == "get" else store.contains([key])
                if touched[0]:  # (missed: evicted before it, see above)
                    leased.append(key)
            time.sleep(0.02)
        if touch == "nothing":
            assert all(admitted) and not all(store.contains(keys))  # the oldest made room
        else:
            first = admitted.index(False)
            assert len(leased) >= SEGMENT // size // 2 and not any(admitted[first:])
            assert all(store.contains(leased))
    finally:
        store.unregister_buffer(buf.data_ptr())


def test_collisions_are_detected_and_aborted_loads_free_everything(model, tok, stores):
    a, b = engine(model, tok, stores[0]), engine(model, tok, stores[1])
    try:
        prompt = list(range(3, 60))
        wait_saved(run(a, [prompt]))
        # another engine whose blocks hash the same but hold other tokens: the stored header tells them apart
        real = b.connector._header_matches
        b.connector._header_matches = lambda slot, parent, tokens: real(slot, parent, [t + 1 for t in tokens])
        out = run(b, [prompt])[0]
        b.connector._header_matches = real
        assert out.num_cached_tokens == 0 and b.stats()["kv_pool"]["collisions"] == 1
        assert out.outputs[0].token_ids == reference(model, [prompt], 6)[0]
        # a request aborted while its blocks load: nothing is left behind
        other = list(range(10, 60))
        wait_saved(run(a, [other]))
        rid = b.add_request(other + [9, 9], GREEDY)
        assert b.connector.num_pending == 1 and b.abort(rid)
        deadline = time.monotonic() + 10
        while b.connector._backlog and time.monotonic() < deadline:
            time.sleep(0.01)
        b.step()
        assert not b.has_unfinished() and b.stats()["kv_blocks_used"] == 0
        assert b.connector._ranges.free == [(0, b.connector.num_slots)]  # every staging slot is back
    finally:
        a.close()
        b.close()


def test_a_dead_master_means_computing_locally_then_the_pool_again(model, tok, leaving):
    master = leaving.master(MooncakeMaster().start())
    store = leaving.client(MooncakeStore(master.address, segment_bytes=SEGMENT))
    a = engine(model, tok, store, kv_pool_timeout=0.3)
    try:
        prompt = list(range(4, 50))
        wait_saved(run(a, [prompt]))
        master.stop()
        a.scheduler.block_manager.__init__(64, BS)  # forget the local prefix cache: only the pool could help
        t0 = time.monotonic()
        out = run(a, [prompt])[0]
        assert out.outputs[0].token_ids == reference(model, [prompt], 6)[0] and out.num_cached_tokens == 0
        assert time.monotonic() - t0 < 3  # bounded: not the 4 s Mooncake takes to fail a read
        assert a.stats()["kv_pool"]["up"] == 0
        # while the pool is down, requests do not even try it
        assert run(a, [list(range(5, 45))])[0].num_cached_tokens == 0
        master = leaving.master(MooncakeMaster(master.port).start())  # restarts empty, on the same port
        a.connector.breaker.until = 0.0  # (instead of waiting out retry_s)
        deadline = time.monotonic() + 20
        while True:  # the client remounts its segment within a few seconds; then saves work again
            a.scheduler.block_manager.__init__(64, BS)
            outs = run(a, [list(range(6, 60))])
            if outs[0].kv_save is not None and outs[0].kv_save.result(timeout=10):
                break
            assert time.monotonic() < deadline, "the pool did not come back"
            a.connector.breaker.until = 0.0
            a.connector._known.clear()
            time.sleep(0.5)
        a.scheduler.block_manager.__init__(64, BS)
        assert run(a, [list(range(6, 60))])[0].num_cached_tokens == 48
    finally:
        a.close()


def test_the_copy_stream_switch_is_checked_at_start_up(model, tok, monkeypatch):
    """NANOFORGE_KV_COPY_STREAM (where the connector's host copies run on a GPU) is read when the engine is built:
    a bad value is one line naming it, before anything is served."""
    monkeypatch.setenv("NANOFORGE_KV_COPY_STREAM", "side")
    with pytest.raises(NanoforgeError, match="NANOFORGE_KV_COPY_STREAM must be 1 or 0, not 'side'"):
        LLMEngine(model, tok, EngineConfig(num_gpu_blocks=8, block_size=BS))


def test_a_master_that_exits_before_listening_says_what_it_said():
    """A master that cannot start (here a flag it does not know) fails in one line that carries its own last
    words, not just its exit status (session 52's GPU run had only the status to go on)."""
    with pytest.raises(NanoforgeError, match=r"mooncake_master exited with status \d+ before listening on "
                                             r"127\.0\.0\.1:\d+; it said: .*no_such_flag"):
        MooncakeMaster(extra=["-no_such_flag=1"]).start()
