"""The cluster simulator (`nanoforge simulate`) against hand-computed timelines.

The profile is simple enough to compute by hand: a prefill step costs 10 ms + 1 ms per token, a decode step
5 ms + 1 ms per sequence, a pool call 2 ms + 1 ms per 16-token block; instances hold 1,000 blocks and batch at
most 512 tokens. Trace blocks are 64 tokens (4 KV blocks each)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from nanoforge.cli import main
from nanoforge.errors import NanoforgeError
from nanoforge.serve.bench_serve import TraceReplay
from nanoforge.serve.block_manager import prefix_block_hashes
from nanoforge.serve.sampling_params import SamplingParams
from nanoforge.serve.scheduler import ScheduledSeq, SchedulerOutput
from nanoforge.serve.sequence import Sequence
from nanoforge.sim.capacity import find_capacity, parse_spec
from nanoforge.sim.cluster import ClusterConfig, Simulation
from nanoforge.sim.commands import ByteVocab
from nanoforge.sim.profile import Profile

SIMPLE = {
    "name": "simple", "status": "derived",
    "prefill": {"a_s": 0.010, "per_token_s": 0.001, "per_pair_s": 0.0},
    "decode": {"a_s": 0.005, "per_seq_s": 0.001, "per_context_s": 0.0},
    "transfer": {"latency_s": 0.002, "per_block_s": 0.001, "block_bytes": 1024},
    "engine": {"num_gpu_blocks": 1000, "block_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 512},
    "frontend": {"request_s": 0.0, "handover_s": 0.0},
}


def profile(**frontend) -> Profile:
    return Profile.from_dict({**SIMPLE, "frontend": {**SIMPLE["frontend"], **frontend}})


def row(t_ms: int, n_in: int, n_out: int, hashes: list[int]) -> dict:
    return {"timestamp": t_ms, "input_length": n_in, "output_length": n_out, "hash_ids": hashes}


def run(rows: list[dict], prof: Profile | None = None, **config) -> Simulation:
    sim = Simulation(TraceReplay(rows, ByteVocab(), block_tokens=64), ClusterConfig(**config), prof or profile())
    assert sim.run()
    return sim


def ms(x: float) -> float:
    return pytest.approx(1000 * x, abs=1e-6)


# --- time models ---------------------------------------------------------------------------------------------

def test_step_time_of_prefill_decode_and_mixed_steps():
    p = Profile.from_dict({**SIMPLE, "prefill": {"a_s": 0.01, "per_token_s": 1e-3, "per_pair_s": 1e-6},
                           "decode": {"a_s": 0.005, "per_seq_s": 1e-4, "per_context_s": 1e-5}})
    params = SamplingParams()

    def chunk(start, n, samples=1):
        return ScheduledSeq(Sequence(list(range(start + n)), params), start, n, samples)

    # two decodes at positions 99 and 199: context 100 + 200
    assert p.step_time(SchedulerOutput([chunk(99, 1), chunk(199, 1)])) == pytest.approx(0.005 + 2e-4 + 300e-5)
    # a chunk of 10 tokens after 30 cached: 10 * 30 + 55 query-key pairs; the decode rides along
    mixed = SchedulerOutput([chunk(30, 10, samples=0), chunk(99, 1)])
    assert p.step_time(mixed) == pytest.approx(0.01 + 11e-3 + 355e-6 + 100e-5)
    assert p.prefill_time(10, cached=30) == pytest.approx(0.01 + 10e-3 + 355e-6)
    # the prefix term: each chunk's start (the context its attention walks), in both forms; older profiles lack it
    q = Profile.from_dict({**SIMPLE, "prefill": {**p.prefill, "per_prefix_s": 1e-4}, "decode": p.decode})
    assert q.step_time(mixed) == pytest.approx(0.01 + 11e-3 + 355e-6 + 30e-4 + 100e-5)
    assert q.prefill_time(10, cached=30) == pytest.approx(0.01 + 10e-3 + 355e-6 + 30e-4)
    # the prefix-pair term: the 10 x 30 pairs whose key is in the prefix cost more than the 55 within the chunk
    r = Profile.from_dict({**SIMPLE, "prefill": {**p.prefill, "per_prefix_pair_s": 2e-6}, "decode": p.decode})
    assert r.step_time(mixed) == pytest.approx(0.01 + 11e-3 + 355e-6 + 300 * 2e-6 + 100e-5)
    assert r.prefill_time(10, cached=30) == pytest.approx(0.01 + 10e-3 + 355e-6 + 300 * 2e-6)
    assert r.prefill_time(10) == p.prefill_time(10)  # nothing cached: no such pair


def test_decode_step_by_batch_is_linear_between_the_measured_batch_sizes():
    p = Profile.from_dict({**SIMPLE, "decode": {"a_s": 0.0, "per_seq_s": 0.0, "per_context_s": 1e-8,
                                                "batch_s": [[1, 0.001], [8, 0.0015], [32, 0.002]]}})
    params = SamplingParams()
    decodes = SchedulerOutput([ScheduledSeq(Sequence(list(range(100)), params), 99, 1, 1) for _ in range(4)])
    assert p.step_time(decodes) == pytest.approx(0.001 + 3 / 7 * 0.0005 + 400e-8)  # between batch 1 and 8
    assert p.decode_time(8, 1000) == pytest.approx(0.0015 + 1000e-8)  # a measured batch size
    assert p.decode_time(64, 0) == pytest.approx(0.002 + 32 * 0.0005 / 24)  # past the last: its segment, extended
    for bad in ([[1, 0.001]], [[8, 0.001], [1, 0.002]], [[0, 0.001], [8, 0.002]], [[1, -1.0], [8, 0.002]], "x"):
        with pytest.raises(NanoforgeError, match="decode.batch_s"):
            Profile.from_dict({**SIMPLE, "decode": {**SIMPLE["decode"], "batch_s": bad}})


# --- hand-computed timelines ----------------------------------------------------------------------------------

def test_one_request_colocated_and_disaggregated():
    rows = [row(0, 100, 5, [0, 1])]
    sim = run(rows, colocated=1)
    r = sim.results[0]
    # TTFT: one prefill step of 100 tokens; then 4 decode steps of one sequence
    assert (r.ttft_ms, r.tpot_ms, r.e2e_ms) == (ms(0.110), ms(0.006), ms(0.110 + 4 * 0.006))
    assert [v.routed for v in sim.views.values()] == [1]  # one request, counted once

    r = run(rows, prefill=1, decode=1).results[0]
    # prefill 0.110, then the prompt's 6 full blocks to the pool (2 + 6 ms) before the first token is answered;
    # decode: load the 6 blocks (8 ms), compute the last 4 prompt tokens and the first token (a 5-token chunk:
    # 15 ms), then 3 decodes of 6 ms
    ttft, decode = 0.110 + 0.008, 0.008 + 0.015 + 3 * 0.006
    assert (r.ttft_ms, r.tpot_ms, r.e2e_ms) == (ms(ttft), ms(decode / 4), ms(ttft + decode))

    # the front door's latency and the conductor's two hops add up where they happen
    r = run(rows, profile(request_s=0.002, handover_s=0.001), prefill=1, decode=1).results[0]
    assert (r.ttft_ms, r.e2e_ms) == (ms(0.002 + 0.001 + ttft), ms(0.002 + 0.001 + ttft + 0.001 + decode))
    # colocated instances behind a conductor (serve --disagg --colocated K) take one hop; a lone one, none
    for k, hop in ((1, 0.0), (2, 0.001)):
        r = run(rows, profile(request_s=0.002, handover_s=0.001), colocated=k).results[0]
        assert (r.ttft_ms, r.e2e_ms) == (ms(0.002 + hop + 0.110), ms(0.002 + hop + 0.110 + 4 * 0.006))

    # the server's work per streamed token lengthens every step that samples: 0.5 ms per sampled token
    r = run(rows, profile(per_token_s=0.0005), colocated=1).results[0]
    assert (r.ttft_ms, r.tpot_ms) == (ms(0.1105), ms(0.0065))

    # the server's work on a request that finds its instance idle is only its latency (request_s)
    r = run(rows, profile(request_host_s=0.002, request_host_per_token_s=1e-5), colocated=1).results[0]
    assert (r.ttft_ms, r.tpot_ms) == (ms(0.110), ms(0.006))


def test_a_request_arriving_at_a_busy_instance_lengthens_its_next_step_by_the_servers_work_on_it():
    """As test_scheduling_a_step_ahead_...'s first timeline, with the server's work on a request 2 ms + 10 us a
    prompt token: B (50 tokens) arrives during A's prompt step, so the next step (A's decode + B's prompt, 110-171)
    takes 2.5 ms more; A arrived at an idle instance and pays nothing."""
    rows = [row(0, 100, 3, [0, 1]), row(50, 50, 2, [2])]
    host = profile(request_host_s=0.002, request_host_per_token_s=1e-5)
    a, b = run(rows, host, colocated=1, schedule_ahead=False).results
    assert (a.ttft_ms, a.e2e_ms, b.ttft_ms, b.e2e_ms) == (ms(0.110), ms(0.1805), ms(0.1235), ms(0.1305))


def test_a_colocated_requests_server_work_falls_on_the_steps_running_while_it_is_in_the_front_door():
    """A colocated instance's server is the front door: a request is routed to it as it arrives and spends its
    request time (here 50 ms) there, and the steps running meanwhile pay the server's work on it (2.5 ms), not
    the step that later holds its prompt. A: 100 tokens at 0, 5 out; B: 50 tokens at 140 ms, 2 out."""
    rows = [row(0, 100, 5, [0, 1]), row(140, 50, 2, [2])]
    host = profile(request_s=0.05, request_host_s=0.002, request_host_per_token_s=1e-5)
    a, b = run(rows, host, colocated=1, schedule_ahead=False).results
    # A reaches the engine at 50; its prompt 50-160 is running when B arrives, so A's first decode, the next step,
    # takes 6 + 2.5 ms (160-168.5) and its three others 6 ms: A ends at 186.5 (at 184 had B's work fallen on the
    # step after B reached the engine, at 190: the engine is idle then, and an idle instance pays only the
    # latency); B's prompt 190-250, its decode 250-256
    assert (a.ttft_ms, a.e2e_ms) == (ms(0.160), ms(0.1865))
    assert (b.ttft_ms, b.e2e_ms) == (ms(0.050 + 0.060), ms(0.050 + 0.066))


def test_two_requests_queue_behind_each_other():
    # two 512-token prompts at once; the step budget is 512 tokens
    rows = [row(0, 512, 3, list(range(8))), row(0, 512, 1, list(range(8, 16)))]
    a, b = run(rows, colocated=1).results
    # step 1: A's prompt (0.522); step 2: A's decode + B's first 511 tokens (a 512-token prefill step, 0.522);
    # step 3: A's decode + B's last token: two one-token chunks, a decode step of 2 (0.007)
    assert (a.ttft_ms, a.e2e_ms, a.tpot_ms) == (ms(0.522), ms(1.051), ms((1.051 - 0.522) / 2))
    assert (b.ttft_ms, b.e2e_ms, b.tpot_ms) == (ms(1.051), ms(1.051), None)

    # disaggregated: B's prefill waits for A's on the prefill instance; each answer waits for its 32-block save
    rows = [row(0, 512, 1, list(range(8))), row(0, 512, 1, list(range(8, 16)))]
    a, b = run(rows, prefill=1, decode=1).results
    assert (a.ttft_ms, b.ttft_ms) == (ms(0.522 + 0.034), ms(2 * 0.522 + 0.034))


def test_scheduling_a_step_ahead_delays_a_new_request_by_the_step_in_line():
    """The engine's asynchronous scheduling (on a GPU): two steps in flight, so a request that arrives during step
    n starts in step n + 2. A: 100 tokens at 0, 3 out; B: 50 tokens at 50 ms, 2 out."""
    rows = [row(0, 100, 3, [0, 1]), row(50, 50, 2, [2])]
    # one step at a time: A's prompt 0-110 (0.010 + 100 x 0.001); A's decode + B's prompt 110-171 (a prefill step
    # of 51 tokens); A's and B's decodes 171-178 (0.005 + 2 x 0.001)
    a, b = run(rows, colocated=1, schedule_ahead=False).results
    assert (a.ttft_ms, a.e2e_ms, b.ttft_ms, b.e2e_ms) == (ms(0.110), ms(0.178), ms(0.121), ms(0.128))
    # a step ahead: A's first decode is scheduled behind its prompt at once (110-116); B, arriving during the
    # prompt, goes into the step scheduled when the prompt ends (A's last decode + B's prompt, 116-177), and its
    # decode into the one scheduled at 116 (177-183)
    a, b = run(rows, colocated=1, schedule_ahead=True).results
    assert (a.ttft_ms, a.e2e_ms, b.ttft_ms, b.e2e_ms) == (ms(0.110), ms(0.177), ms(0.127), ms(0.133))
    # the default follows the profile's device: this one names none, so one step at a time
    assert run(rows, colocated=1).results[1].ttft_ms == ms(0.121)


def test_a_pool_hit_computes_only_the_uncached_tokens_and_pays_the_transfer():
    # B shares A's first 3 trace blocks (192 tokens = 12 KV blocks) and goes to the other prefill instance
    rows = [row(0, 256, 2, [0, 1, 2, 3]), row(10_000, 256, 2, [0, 1, 2, 9])]
    sim = run(rows, prefill=2, decode=1, policy="round-robin", pool_gib=1)
    a, b = sim.results
    assert sim.requests[0].prefill is not sim.requests[1].prefill
    # A: a get that finds nothing (2 ms), 256 tokens (0.266), its 16 blocks to the pool (0.018)
    assert a.ttft_ms == ms(0.002 + 0.266 + 0.018)
    # B: a get of 15 blocks finds A's 12 (0.014), 64 tokens after 192 cached (0.074), saves the 4 new blocks
    # (its connector knows the 12 it loaded are there: 0.006)
    assert b.ttft_ms == ms(0.014 + 0.074 + 0.006)
    assert sim.requests[1].cached_tokens == 192
    # the decode instance loads A's 16 blocks (0.018) and computes the one token after them: a decode step
    assert a.tpot_ms == ms(0.018 + 0.006)
    assert sim.pool_stats()["pool_hit_rate"] == pytest.approx(192 / 512)

    # without a pool, B computes all of its prompt and saves all of it for its decode instance
    sim = run(rows, prefill=2, decode=1, policy="round-robin")
    assert sim.results[1].ttft_ms == ms(0.266 + 0.018)
    assert sim.requests[1].cached_tokens == 0


def test_a_decode_instance_pays_for_its_hand_over_events_by_the_output_it_holds():
    """stream_per_output_token_s 1 ms: each sampled chunk on a decode instance costs 1 ms more per output token its
    request holds before the step (the text `OutputEncoder` compares), as host time after the model's step.
    One request, 100 prompt tokens, 5 out, 1P+1D (the timeline of test_one_request_colocated_and_disaggregated):
    load 6 blocks 0.008; the 5-token chunk 0.015 + 1 token held (the hand-over's) 0.001; then 3 decodes of 0.006
    holding 2, 3 and 4 tokens: 0.008, 0.009, 0.010. Colocated instances stream no hand-over events."""
    rows = [row(0, 100, 5, [0, 1])]
    r = run(rows, profile(stream_per_output_token_s=0.001), prefill=1, decode=1).results[0]
    ttft, decode = 0.110 + 0.008, 0.008 + 0.016 + 0.008 + 0.009 + 0.010
    assert (r.ttft_ms, r.tpot_ms, r.e2e_ms) == (ms(ttft), ms(decode / 4), ms(ttft + decode))
    r = run(rows, profile(stream_per_output_token_s=0.001), colocated=1).results[0]
    assert (r.ttft_ms, r.tpot_ms) == (ms(0.110), ms(0.006))


def test_a_steps_host_part_leaves_the_shared_gpu_to_others():
    """X's step: 4 ms on the device, then 10 ms of host work; Y's: 10 ms on the device; both start at 0 on one GPU.
    0-8 ms both device parts share it (4 ms each): X's is done at 8, its host work runs 8-18 off the GPU, and Y has
    the GPU alone for its last 6 ms: done at 14. (Were X's host work on the GPU: Y done at 20, X at 24.)"""
    from collections import deque

    from nanoforge.sim.cluster import Clock
    from nanoforge.sim.instance import Shared, SimInstance

    clock, ends = Clock(), {}

    class Inst:
        def __init__(self, name, device, host):
            self.name, self.sim, self.in_flight = name, type("S", (), {"clock": clock}), deque([(None, device, host)])

        def _device_done(self, now, out):
            SimInstance._device_done(self, now, out)

        def _end_step(self, now, out):
            ends[self.name] = now

    gpu = Shared(clock)
    for inst in (Inst("X", 0.004, 0.010), Inst("Y", 0.010, 0.0)):
        gpu.start(0.0, inst, inst.in_flight[0][1], lambda t, inst=inst: inst._device_done(t, None))
    clock.run()
    assert ends == {"X": pytest.approx(0.018), "Y": pytest.approx(0.014)}


def test_calls_share_the_connectors_staging_buffer():
    """As KVConnector._reserve: a call holds its blocks' staging slots until it is done. 10 slots; three prompts of
    8 full blocks saved at once: A takes 8 (its put 0-10 ms), B the 2 left (cut short: its 2 leading blocks,
    10-14 ms; "skipped"), C none (not saved; the hand-over does not wait for it). Once A is done its 8 slots are
    free again: D's 8 blocks go (14-24 ms, behind B)."""
    from types import SimpleNamespace

    from nanoforge.sim.cluster import Clock
    from nanoforge.sim.pool import KVPool, SimConnector

    sim = SimpleNamespace(clock=Clock(), transfer_time=lambda n, local=0: 0.002 + 0.001 * n)
    conn = SimConnector(sim, KVPool(None), SimpleNamespace(block_size=16), load=False, save=True, staging_blocks=10,
                        on_ready=None)

    def prompt(first):
        return SimpleNamespace(num_prompt_tokens=128, block_hashes=list(range(first, first + 8)))

    a, b, c = conn.save_prompt(prompt(0)), conn.save_prompt(prompt(10)), conn.save_prompt(prompt(20))
    assert (len(a.hashes), b.hashes, c) == (8, [10, 11], None) and conn.counters["skipped"] == 2
    done = {}
    a.on_done.append(lambda now: done.setdefault("D", conn.save_prompt(prompt(30))))
    sim.clock.run()
    d = done["D"]
    assert (b.done, len(d.hashes), conn.free_slots, conn.busy_s) == (True, 8, 10, pytest.approx(0.024))


def test_the_connector_runs_loads_ahead_of_queued_saves():
    """As the engine's connector: a load that arrives while saves wait goes next (a load holds a request up
    before its prefill, a save only its hand-over). Two 10-block puts and a get submitted at once: the first
    put runs (0.012 s), then the get (nothing found: 0.002), then the second put (0.012)."""
    from types import SimpleNamespace

    from nanoforge.sim.cluster import Clock
    from nanoforge.sim.pool import Job, KVPool, SimConnector

    sim = SimpleNamespace(clock=Clock(), transfer_time=lambda n, local=0: 0.002 + 0.001 * n)
    back = []
    conn = SimConnector(sim, KVPool(None), None, load=True, save=True, staging_blocks=None,
                        on_ready=lambda now: back.append(now))
    done = {}
    jobs = {"put A": Job("put", list(range(10))), "put B": Job("put", list(range(10, 20))),
            "get C": Job("get", list(range(100, 105)))}
    for name, job in jobs.items():
        job.on_done.append(lambda now, name=name: done.setdefault(name, now))
        conn._submit(job)
    sim.clock.run()
    assert done == {"put A": pytest.approx(0.012), "get C": pytest.approx(0.014), "put B": pytest.approx(0.026)}
    assert back == [pytest.approx(0.014)] and conn.busy_s == pytest.approx(0.026)


def test_calls_in_flight_share_their_link():
    """A connector with 2 workers on a link it shares with another connector (one host: `shared_link`): its two
    10-block puts (12 ms each alone) and the other's 4-block get (6 ms alone) start at 0, each with a third of the
    link: the get is done at 18 ms, the puts (6 ms left each) then share it by two: both done at 30. One worker on
    a link of its own: 12 and 24 ms, as before links were shared."""
    from types import SimpleNamespace

    from nanoforge.sim.cluster import Clock
    from nanoforge.sim.instance import Shared
    from nanoforge.sim.pool import Job, KVPool, SimConnector

    clock = Clock()
    sim = SimpleNamespace(clock=clock, transfer_time=lambda n, local=0: 0.002 + 0.001 * n)
    link, done = Shared(clock), {}
    pool = KVPool(None)
    pool.get = lambda hashes, now: len(hashes)  # every block found
    puts = SimConnector(sim, pool, None, load=False, save=True, staging_blocks=None, on_ready=None, link=link,
                        workers=2)
    gets = SimConnector(sim, pool, None, load=True, save=False, staging_blocks=None, on_ready=lambda now: None,
                        link=link)
    for conn, name, job in ((puts, "A", Job("put", list(range(10)))), (puts, "B", Job("put", list(range(10, 20)))),
                            (gets, "C", Job("get", list(range(100, 104))))):
        job.on_done.append(lambda now, name=name: done.setdefault(name, now))
        conn._submit(job)
    clock.run()
    assert done == {"A": pytest.approx(0.030), "B": pytest.approx(0.030), "C": pytest.approx(0.018)}
    assert puts.busy_s == pytest.approx(0.030) and puts.counters["put_call_s"] == pytest.approx(0.060)
    assert gets.counters["get_job_s"] == pytest.approx(0.018)

    alone = SimConnector(sim, KVPool(None), None, load=False, save=True, staging_blocks=None, on_ready=None,
                         link=Shared(clock))
    done.clear()
    for name, job in (("A", Job("put", list(range(10)))), ("B", Job("put", list(range(10, 20))))):
        job.on_done.append(lambda now, name=name: done.setdefault(name, now))
        alone._submit(job)
    start = clock.now
    clock.run()
    assert {k: v - start for k, v in done.items()} == {"A": pytest.approx(0.012), "B": pytest.approx(0.024)}
    assert alone.counters["put_job_s"] == pytest.approx(0.012 + 0.024)  # B waited 12 ms for the worker

    # from the command line: the flags reach the cluster
    from nanoforge.cli import build_parser
    from nanoforge.sim.commands import config_from_args

    args = build_parser().parse_args(["simulate", "--trace", "t", "--prefill", "1", "--decode", "1",
                                      "--pool-workers", "4", "--shared-link"])
    config = config_from_args(args)
    assert (config.pool_workers, config.shared_link) == (4, True)


def test_the_pool_admits_and_evicts_as_mooncake_does():
    """Hand-computed (LEASE_S 10 s; one eviction per round: 5% of 4, at least 1; rounds when a put finds the pool
    full and after a put that leaves it over 90%). A put grants no lease, a lookup or a read one of 10 s:
    - t=0: blocks 0-3 fill the pool, unread; not readable until their put ends. A lookup of 1 (t=0.5) and a read
      of 2 (t=0.6) lease them to 10.5 and 10.6.
    - t=1: a put of 9 finds the pool full: block 0 goes (unread: its "lease" ended with its put), and after it,
      over 90%, block 3 (unread too); 2 is held already (no transfer, no lease). 9 is read at t=2 (leased to 12).
    - t=3: 7 fits; 8 finds the pool full of leased blocks and is turned away. 7 is never read.
    - t=4: 5 takes the room of 7 (unread), not of any leased block; looked up at 4.5 (leased to 14.5).
    - t=10.55: 6 takes 1's room (its lease ended at 10.5), not 2's (10.6)."""
    from nanoforge.sim.pool import KVPool

    pool = KVPool(4)
    written, held, _ = pool.start_put([0, 1, 2, 3], 0.0)
    assert (written, held) == ([0, 1, 2, 3], []) and pool.get([0], 0.0) == 0  # pending until the put ends
    pool.end_put(written, 0.0)
    assert pool.leading([1], 0.5) == 1 and pool.get([2], 0.6) == 1
    assert pool.start_put([9], 1.0) == ([9], [], 0) and sorted(pool._blocks) == [1, 2, 9]
    assert pool.start_put([2], 1.0) == ([], [2], 0)  # held already: no transfer
    pool.end_put([9], 1.0)
    assert pool.get([9], 2.0) == 1
    assert pool.start_put([7, 8], 3.0) == ([7], [], 0) and pool.counters["turned_away"] == 1
    pool.end_put([7], 3.0)
    assert pool.start_put([5], 4.0) == ([5], [], 0) and sorted(pool._blocks) == [1, 2, 5, 9]
    pool.end_put([5], 4.0)
    assert pool.leading([5], 4.5) == 1
    assert pool.start_put([6], 10.55) == ([6], [], 0) and sorted(pool._blocks) == [2, 5, 6, 9]
    assert pool.counters["evictions"] == 4 and pool.counters["turned_away"] == 1


LOCAL = {**SIMPLE["transfer"], "local_latency_s": 0.001, "local_per_block_s": 0.00025}  # a put into one's segment


def test_a_save_into_the_instances_own_segment_costs_the_local_rate_and_its_overflow_the_remote_one():
    """1P+1D, one 64-token prompt (4 full blocks, 1 output token): the prefill instance asks the pool for its first 3
    blocks (none there: a get, at the remote rate, 2 ms), prefills 2-76 ms (10 + 64 x 1) and answers once its put
    is done. A 16-block pool is two 8-block segments, the prefill instance's first: its 4 blocks fit its own, a local
    copy, 1 + 4 x 0.25 = 2 ms: TTFT 78 ms. A 5-block pool's segments are 3 and 2 blocks: 3 go into its own, the
    4th into the decode instance's, so the call crosses the link: the remote latency, 2 + 1 x 1 + 3 x 0.25 = 3.75 ms,
    TTFT 79.75 ms. A profile without a local rate: 2 + 4 x 1 = 6 ms, TTFT 82 ms, whatever the segments. A link set
    to 2 ms a block (`link_gbs`) scales the local rate with the remote one: 0.25 of it, 1 + 4 x 0.5 = 3 ms, TTFT 79."""
    local = Profile.from_dict({**SIMPLE, "transfer": LOCAL})

    def save(prof, blocks, **link):
        sim = run([row(0, 64, 1, [0])], prof, prefill=1, decode=1, pool_gib=blocks * (1024 + 192) / 2**30, **link)
        assert sim.pool.capacity == blocks
        return sim.results[0].ttft_ms, sim.pool.counters["local_put_blocks"], sim.pool._free

    assert save(local, 16) == (ms(0.078), 4, [4, 8])
    assert save(local, 5) == (ms(0.07975), 3, [0, 1])
    assert save(profile(), 16)[0] == save(profile(), 5)[0] == ms(0.082)
    assert save(local, 16, link_gbs=(1024 + 192) / 0.002 / 1e9) == (ms(0.079), 4, [4, 8])


def test_eviction_frees_room_in_the_evicted_blocks_segment():
    """A 4-block pool of two 2-block segments (instance 0's, instance 1's), leases of 10 s from each block's read.
    At t=0 instance 0 puts blocks 0-2: 0 and 1 into its own segment, 2 into the other (the only one with room);
    block 3 goes there too, and the pool is full; all four are read at once. At t=5 instance 1's put is turned
    away (every lease live). At t=10.5 the leases are out:
    instance 0's put of block 5 evicts block 0 (the least recently touched, in its segment) and takes its room, a
    local copy; the pool is then over its high watermark (4 > 3.6) and evicts block 1 too, from the same segment,
    whose room instance 1's next block takes (its own segment is full: a remote put), which evicts block 2 from
    instance 1's segment."""
    from nanoforge.sim.pool import KVPool

    pool = KVPool(4, segments=2)
    written, held, local = pool.start_put([0, 1, 2], 0.0, segment=0)
    assert (written, held, local, pool._free) == ([0, 1, 2], [], 2, [0, 1])
    pool.end_put(written, 0.0)
    assert pool.get(written, 0.0) == 3
    assert pool.start_put([3], 0.0, segment=0) == ([3], [], 0) and pool._free == [0, 0]
    pool.end_put([3], 0.0)
    assert pool.get([3], 0.0) == 1
    assert pool.start_put([4], 5.0, segment=1) == ([], [], 0) and pool.counters["turned_away"] == 1
    assert pool.start_put([5], 10.5, segment=0) == ([5], [], 1)
    assert sorted(pool._blocks) == [2, 3, 5] and pool._free == [1, 0]
    assert pool.start_put([6], 10.5, segment=1) == ([6], [], 0)
    assert sorted(pool._blocks) == [3, 5, 6] and pool._free == [0, 1] and pool.counters["evictions"] == 3
    assert pool.counters["local_put_blocks"] == 3 and pool._home == {3: 1, 5: 0, 6: 0}


def test_profile_local_transfer_fields_round_trip_and_default_to_the_remote_ones(tmp_path):
    for transfer in (SIMPLE["transfer"], LOCAL):
        path = tmp_path / "p.json"
        Profile.from_dict({**SIMPLE, "transfer": transfer}).save(path)
        p = Profile.load(path)
        assert p.transfer == transfer  # an older profile is written back without the local fields
        remote = 0.002 + 4 * 0.001
        assert p.transfer_time(4) == pytest.approx(remote)
        assert p.transfer_time(4, local=True) == pytest.approx(0.002 if transfer is LOCAL else remote)
    with pytest.raises(NanoforgeError, match=r"transfer.local_per_block_s must be a number >= 0, got -1"):
        Profile.from_dict({**SIMPLE, "transfer": {**LOCAL, "local_per_block_s": -1}})


def test_the_transfer_fit_gives_the_local_form_from_the_local_puts():
    from nanoforge.sim.measure import fit_transfer

    remote = [{"kind": k, "blocks": n, "seconds": 0.002 + 0.001 * n} for k in ("put", "get") for n in (1, 16, 256)]
    local = [{"kind": "put_local", "blocks": n, "seconds": 0.001 + 0.00025 * n} for n in (1, 16, 256)]
    section, fits = fit_transfer(remote + local)
    assert section == pytest.approx({k: v for k, v in LOCAL.items() if k != "block_bytes"}, rel=1e-6)
    assert set(fits) == {"transfer", "transfer_local"} and fits["transfer_local"]["samples"] == 3
    section, fits = fit_transfer(remote)  # samples measured before the local puts were: no local form
    assert section == pytest.approx({"latency_s": 0.002, "per_block_s": 0.001}, rel=1e-6) and set(fits) == {"transfer"}


def test_transfer_measured_through_mooncake_times_local_puts_into_the_clients_own_segment(monkeypatch):
    """`measure_transfer` on a real Mooncake Store on loopback (small blocks): remote puts and gets, then puts by a
    client holding a segment, checked once to have landed there (not in the holder's segment)."""
    from disagg_helpers import need_mooncake

    need_mooncake()
    from nanoforge.serve.disagg.mooncake_store import MooncakeStore
    from nanoforge.sim.measure import fit_transfer, measure_transfer

    looked_up = []
    segments = MooncakeStore.segments
    monkeypatch.setattr(MooncakeStore, "segments", lambda self, key: looked_up.append(key) or segments(self, key))
    lines = []
    samples = measure_transfer(1 << 16, blocks=(1, 8), repeats=1, progress=lines.append)
    assert [(s["kind"], s["blocks"]) for s in samples] == [("put", 1), ("get", 1), ("put", 8), ("get", 8),
                                                           ("put_local", 1), ("put_local", 8)]
    assert all(s["seconds"] > 0 for s in samples) and lines[-1].startswith("put_local of 8 blocks: ")
    # once where the holder's segment is (the first remote put), once where the largest local put's last block is
    assert looked_up == ["nanoforge-profile/put/1/0/0", "nanoforge-profile/put_local/8/0/7"]
    section, _ = fit_transfer(samples)
    assert set(section) == {"latency_s", "per_block_s", "local_latency_s", "local_per_block_s"}


def test_a_warm_up_runs_first_and_its_blocks_hold_pool_room_once_read():
    """Simulation.warm_up, as gpu_disagg.sh warms a server up before the trace. A 4-block pool (1P+1D); the warm-up
    is one run of one 64-token prompt (4 full blocks) at 0: the prefill instance asks the pool for its first 3
    blocks (none there: the call's 2 ms), prefills 2-76 ms (10 + 64 x 1), puts its 4 blocks 76-82 ms (2 + 4 x 1)
    and answers at 82 ms. The trace starts 1 s after the warm-up ends with its own 64-token prompt: get 2 ms,
    prefill 74 ms, then its put.
    - A warm-up of one output token ends there (t0 = 1.082): no decode instance reads its blocks, so they hold no
      lease, and the trace's put evicts them and writes its 4: TTFT 82 ms, as without a warm-up.
    - With two output tokens the decode instance loads them (a read: leased for 10 s), and the trace's put finds
      the pool full of leased blocks: turned away, the call's latency only (2 ms), TTFT 78 ms; with a lease
      shorter than the gap (0.5 s) they ran out: 82 ms.
    - Two one-token warm-up runs, the second 1 s after the first ended (its put evicts the first's unread blocks:
      answered at 1.082 + 0.082): the trace 1 s after that, t0 = 2.164.
    Warm-up requests count in no result."""
    from nanoforge.serve.bench_serve import Request

    def warm(first, output=1):
        return [Request(0.0, list(range(first, first + 64)), 64, output)]

    rows = [row(0, 64, 1, [0])]
    cfg = {"prefill": 1, "decode": 1, "pool_gib": 4 * (1024 + 192) / 2**30}

    def trace_ttft(runs, **extra):
        sim = Simulation(TraceReplay(rows, ByteVocab(), block_tokens=64), ClusterConfig(**cfg, **extra), profile())
        assert sim.pool.capacity == 4
        sim.warm_up(runs, 1.0)
        assert sim.run() and len(sim.results) == 1 and sim.results[0].arrival_s == 0.0
        return sim, sim.results[0].ttft_ms

    sim, ttft = trace_ttft([warm(0)])
    assert (sim.t0, ttft, sim.pool.counters["turned_away"]) == (pytest.approx(1.082), ms(0.082), 0)
    assert sim.pool.counters["evictions"] == 4 and sim.makespan == pytest.approx(0.082)
    assert trace_ttft([])[1] == ms(0.082)
    sim, ttft = trace_ttft([warm(0, output=2)], max_model_len=512)  # room for a token after the prompt
    assert sim.t0 > 1.082 and (ttft, sim.pool.counters["turned_away"]) == (ms(0.078), 4)
    assert trace_ttft([warm(0, output=2)], max_model_len=512, pool_lease_s=0.5)[1] == ms(0.082)
    sim, ttft = trace_ttft([warm(0), warm(100)])
    assert (sim.t0, ttft) == (pytest.approx(2.164), ms(0.082))


def test_early_rejection_when_the_predicted_ttft_is_over_the_slo():
    # three requests teach the conductor's cost model prefill = 10 ms + 1 ms/token (exactly: no queueing);
    # then a 2,000-token prompt is predicted at 2.01 s, over the 1 s objective, and a 500-token one at 0.51 s
    rows = [row(0, 100, 1, [0, 1]), row(10_000, 200, 1, [2, 3, 4, 5]), row(20_000, 300, 1, list(range(6, 11))),
            row(30_000, 2000, 1, list(range(100, 132))), row(40_000, 500, 1, list(range(200, 208)))]
    sim = run(rows, colocated=1, ttft_slo=1.0, early_reject=True)
    big, small = sim.results[3:]
    assert big.error.startswith("rejected") and "2.01 s" in big.error
    assert small.error is None and small.ttft_ms == ms(0.510)
    assert sim.router.rejected == {"ttft": 1, "tpot": 0}
    # without early rejection it is served, late: 4 chunks of 512, 512, 512 and 464 tokens
    sim = run(rows, colocated=1, ttft_slo=1.0)
    assert sim.results[3].ttft_ms == ms(3 * 0.522 + 0.474)


def test_the_real_scheduler_preempts_when_the_cache_is_small():
    rows = [row(0, 200, 40, [i, 100 + i, 200 + i, 300 + i]) for i in range(6)]
    sim = run(rows, colocated=1, num_gpu_blocks=40)
    assert all(r.ok and r.output_len == 40 for r in sim.results)
    assert sum(i["preemptions"] for i in sim.instance_stats()) > 0


def test_block_keys_are_the_engines():
    rows = [row(0, 300, 2, [0, 1, 2, 3, 4])]
    sim = run(rows, colocated=1)
    prompt = TraceReplay(rows, ByteVocab(), block_tokens=64).request(0).prompt
    inst = sim.instances[0]
    assert sim.views[inst.name].cache == dict.fromkeys(prefix_block_hashes(prompt, 16, 299 // 16))
    # what the instance's prefix cache holds after the request are exactly those blocks, verified by content
    assert len(inst.scheduler.block_manager.match_prefix(Sequence(prompt + [7], SamplingParams()))) == 300 // 16


# --- capacity ----------------------------------------------------------------------------------------------------

def test_capacity_search_brackets_the_threshold():
    calls = []

    def probe(config, speedup):
        calls.append(speedup)
        return {"speedup": speedup, "ok": speedup <= 3.3, "complete": True, "slo_attainment": None}

    r = find_capacity(probe, ClusterConfig(colocated=1), precision=0.05)
    assert 3.3 / 1.05 <= r["capacity_speedup"] <= 3.3 < r["first_failing_speedup"] <= 3.3 * 1.05
    assert calls[:3] == [1, 2, 4]
    r = find_capacity(lambda c, s: {"speedup": s, "ok": s <= 0.3, "complete": True}, ClusterConfig(colocated=1))
    assert 0.3 / 1.05 <= r["capacity_speedup"] <= 0.3


def test_configuration_specs():
    base = ClusterConfig(colocated=1, ttft_slo=1, tpot_slo=0.1, pool_gib=0)
    c = parse_spec("4+4:pool=800,reject,policy=round-robin", base)
    assert (c.prefill, c.decode, c.colocated, c.pool_gib, c.early_reject, c.policy) == \
        (4, 4, 0, 800, True, "round-robin")
    assert parse_spec("8", base).colocated == 8
    for bad in ("4+", "x", "8:pool", "8:fast", "0+4"):
        with pytest.raises(NanoforgeError):
            parse_spec(bad, base)


# --- the command line -------------------------------------------------------------------------------------------

def write_trace(path, n=40, seed=0):
    import random

    rng = random.Random(seed)
    rows = [row(int(i * 150), rng.randint(100, 900), rng.randint(1, 30),
                [rng.randrange(6) if j == 0 else rng.randrange(10**6) for j in range(14)]) for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_cli_runs_colocated_and_disaggregated_deterministically(tmp_path, capsys):
    trace = write_trace(tmp_path / "t.jsonl")
    prof = tmp_path / "simple.json"
    prof.write_text(json.dumps(SIMPLE))
    base = ["simulate", "--trace", str(trace), "--profile", str(prof), "--trace-block-tokens", "64",
            "--ttft-slo", "1", "--tpot-slo", "0.05", "--quiet"]
    runs = {}
    for name, extra in (("colocated", ["--colocated", "2"]), ("disagg", ["--prefill", "1", "--decode", "1",
                                                                           "--pool-gib", "1"]),
                        ("again", ["--prefill", "1", "--decode", "1", "--pool-gib", "1"]),
                        ("random", ["--prefill", "2", "--decode", "2", "--policy", "random", "--seed", "3"]),
                        ("random-again", ["--prefill", "2", "--decode", "2", "--policy", "random", "--seed", "3"]),
                        ("random-other", ["--prefill", "2", "--decode", "2", "--policy", "random", "--seed", "4"])):
        assert main([*base, *extra, "--out", str(tmp_path / name)]) == 0
        runs[name] = (tmp_path / name / "sim.json").read_text()
        assert (tmp_path / name / "sim_cdf.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "colocated 2 (cache-aware, no pool)" in out and "1P+1D (cache-aware, pool 1 GiB)" in out
    assert "goodput" in out and "prefill0" in out and "decode0" in out and "both1" in out
    assert runs["disagg"] == runs["again"] and runs["random"] == runs["random-again"]
    assert runs["random"] != runs["random-other"]
    report = json.loads(runs["disagg"])
    assert report["summary"]["completed"] == 40 and report["complete"]
    assert len(report["requests"]) == 40 and report["profile"] == {"name": "simple", "status": "derived"}


def test_cli_capacity_and_sweep(tmp_path, capsys):
    trace = write_trace(tmp_path / "t.jsonl", n=20)
    prof = tmp_path / "simple.json"
    prof.write_text(json.dumps(SIMPLE))
    base = ["--trace", str(trace), "--profile", str(prof), "--trace-block-tokens", "64", "--ttft-slo", "1",
            "--tpot-slo", "0.05", "--quiet", "--precision", "0.25"]
    assert main(["simulate", "capacity", *base, "--configs", "2", "1+1:pool=1", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "capacity.json").read_text())["results"]
    for r in results:  # the bracket: the capacity met the target, the next probe up did not
        ok = next(p for p in r["probes"] if p["speedup"] == r["capacity_speedup"])
        bad = next(p for p in r["probes"] if p["speedup"] == r["first_failing_speedup"])
        assert ok["ok"] and ok["slo_attainment"] >= 0.9 and not bad["ok"]
        assert r["first_failing_speedup"] / r["capacity_speedup"] <= 1.25
    assert (tmp_path / "capacity.png").stat().st_size > 0
    assert main(["simulate", "sweep", *base, "--gpus", "3", "--out", str(tmp_path)]) == 0
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert [r["label"].split()[0] for r in sweep["results"]] == ["1P+2D", "2P+1D"]
    assert "best split for 3 GPUs" in capsys.readouterr().out and (tmp_path / "sweep.png").exists()


@pytest.mark.parametrize("argv, message", [
    (["simulate", "--colocated", "1"], "give --trace FILE"),
    (["simulate", "--trace", "missing.jsonl", "--colocated", "1"], "trace file not found"),
    (["simulate", "--trace", "{trace}", "--prefill", "2"], "--prefill >= 1 and --decode >= 1"),
    (["simulate", "--trace", "{trace}", "--colocated", "1", "--prefill", "1", "--decode", "1"], "either"),
    (["simulate", "--trace", "{trace}", "--colocated", "1", "--profile", "nope"], "no profile 'nope'"),
    (["simulate", "--trace", "{trace}", "--colocated", "1", "--profile", "{bad_profile}"], "decode.per_seq_s"),
    (["simulate", "--trace", "{trace}", "--colocated", "1", "--speedup", "0"], "--speedup"),
    (["simulate", "--trace", "{trace}", "--colocated", "1", "--early-reject"], "--early-reject needs"),
    (["simulate", "--trace", "{trace}", "--colocated", "1", "--pool-workers", "0"], "--pool-workers"),
    (["simulate", "capacity", "--trace", "{trace}", "--colocated", "1"], "both SLOs"),
    (["simulate", "capacity", "--trace", "{trace}", "--ttft-slo", "1", "--tpot-slo", "1", "--configs", "4+"],
     "a configuration is"),
    (["simulate", "sweep", "--trace", "{trace}", "--ttft-slo", "1", "--tpot-slo", "1", "--gpus", "1"], "--gpus"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    trace = write_trace(tmp_path / "t.jsonl", n=3)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**SIMPLE, "decode": {**SIMPLE["decode"], "per_seq_s": -1}}))
    argv = [a.format(trace=trace, bad_profile=bad) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("nanoforge simulate: error:") and message in err, err


def test_bad_input_from_the_shell(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "nanoforge", "simulate", "--trace", "missing.jsonl", "--colocated",
                           "1"], capture_output=True, text=True, cwd=tmp_path, check=False)
    assert proc.returncode == 2 and proc.stderr == "nanoforge simulate: error: trace file not found: missing.jsonl\n"


def test_profile_verbs_flags_are_not_taken_for_abbreviations_of_the_run_flags():
    """`simulate profile --pool` (gpu_sim_profile.sh's flag): --pool is a prefix of the run's --pool-gib and
    --pool-lease-s, which Python 3.11's argparse called ambiguous before the verb got to parse it."""
    from nanoforge.cli import build_parser

    args = build_parser().parse_args(["simulate", "profile", "--pool", "--model-preset", "tiny-qwen3", "--out", "p.json"])
    assert args.sim_verb == "profile" and args.pool is True


def test_profile_measured_on_the_cpu_engine(tmp_path):
    from test_serve_api import one_torch_thread

    out = tmp_path / "tiny.json"
    with one_torch_thread():
        assert main(["simulate", "profile", "--model-preset", "tiny-qwen3", "--max-model-len", "512", "--quick",
                     "--repeats", "1", "--out", str(out)]) == 0
    p = Profile.load(out)
    assert p.status == "measured" and p.engine["max_num_batched_tokens"] == 8192 and not p.transfer["measured"]
    samples = p.meta["samples"]
    assert len(samples["prefill"]) == 6 and len(samples["decode"]) == 6
    # the fitted forms reproduce what they were fitted to (a CPU is noisy: loosely)
    for s in samples["decode"]:
        assert p.decode_time(s["batch"], s["context"]) == pytest.approx(s["seconds"], rel=0.6)
    assert math.isfinite(p.step_time(SchedulerOutput()))


def test_refit_recovers_the_forms_from_the_samples_and_the_frontend_line(tmp_path, capsys):
    """`simulate profile --refit`: samples made from known coefficients (prefill samples of an older profile,
    without the prefix and prefix-pair features, which come from `cached`) give those coefficients back, and the frontend's
    request latency is the line through the two prompt lengths' TTFT less their prefill steps."""
    pre = {"a_s": 0.002, "per_token_s": 3e-6, "per_pair_s": 5e-10, "per_prefix_s": 1e-6, "per_prefix_pair_s": 2e-10}
    dec = {"a_s": 0.0015, "per_seq_s": 4e-6, "per_context_s": 2e-8}
    truth = Profile.from_dict({**SIMPLE, "prefill": pre, "decode": dec})
    prefill = [{"tokens": n, "pairs": n * c + n * (n + 1) // 2, "cached": c,
                "seconds": truth.prefill_time(n, cached=c)} for n in (16, 256, 2048) for c in (0, 1024, 8192)]
    decode = [{"batch": b, "context": b * c, "seconds": truth.decode_time(b, b * c)}
              for b in (1, 8, 64) for c in (128, 2048)]
    frontend = {"prompt_len": 512, "output_len": 32, "long_prompt_len": 4096,
                "ttft_s": 0.004 + 512e-6 + truth.prefill_time(512),  # request 4 ms + 1 us a prompt token
                "long_ttft_s": 0.004 + 4096e-6 + truth.prefill_time(4096),
                "tpot_s": {str(k): truth.decode_time(k, k * 528) + k * 5e-6 for k in (1, 4, 16)}}  # 5 us a token

    # 8 requests of n tokens among 4 decodes; the server's work on each: 1 ms + `per_token` a token
    def arrivals(n, per_token=2e-7):
        k, context, base = 4, 4 * (128 + 128), 0.002
        lost = (truth.chunk_extra(n, k, context) + truth.decode_time(k + 1, context) - truth.decode_time(k, context)
                + 2 * 5e-6 + 0.001 + per_token * n)
        return {"prompt_len": n, "streams": k, "stream_prompt_len": 128, "stream_output_len": 256, "arrivals": 8,
                "base_tpot_s": base, "tpot_s": base + lost * 8 / 255}

    frontend["arrivals"] = [arrivals(512), arrivals(4096)]
    old = {**SIMPLE, "status": "measured", "prefill": {**pre, "per_prefix_s": 0.0, "per_prefix_pair_s": 0.0}, "decode": dec,
           "samples": {"prefill": prefill, "decode": decode, "frontend": frontend}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    assert main(["simulate", "profile", "--refit", str(path), "--out", str(tmp_path / "new.json")]) == 0
    p = Profile.load(tmp_path / "new.json")
    for k, v in {**pre}.items():
        assert p.prefill[k] == pytest.approx(v, rel=1e-6), k
    for k, v in dec.items():
        assert p.decode[k] == pytest.approx(v, rel=1e-6), k
    assert p.frontend["request_s"] == pytest.approx(0.004, rel=1e-6)
    assert p.frontend["per_prompt_token_s"] == pytest.approx(1e-6, rel=1e-6)
    assert p.frontend["per_token_s"] == pytest.approx(5e-6, rel=1e-6)
    assert p.request_time(1000) == pytest.approx(0.005)
    assert p.frontend["request_host_s"] == pytest.approx(0.001, rel=1e-6)
    assert p.frontend["request_host_per_token_s"] == pytest.approx(2e-7, rel=1e-6)
    assert "refit" in p.meta["source"] and "wrote" in capsys.readouterr().out

    # arrivals steeper than a lone request's latency per prompt token (1 us): the per-token host work is that same
    # work, so the slope stops there and the per-request part is the mean of what is left at each length
    frontend["arrivals"] = [arrivals(128, 5e-6), arrivals(512, 5e-6)]
    path.write_text(json.dumps(old))
    assert main(["simulate", "profile", "--refit", str(path), "--out", str(tmp_path / "new.json")]) == 0
    p = Profile.load(tmp_path / "new.json")
    assert p.frontend["request_host_per_token_s"] == pytest.approx(1e-6, rel=1e-6)
    assert p.frontend["request_host_s"] == pytest.approx(0.001 + 4e-6 * (128 + 512) / 2, rel=1e-6)
    frontend["arrivals"] = [arrivals(512), arrivals(4096)]

    # a step's cost by batch size, not a line (as on a GPU, where batch 1 runs the skinny matmul): the levels and
    # the per-context slope come back, and the line through the levels is the summary
    levels = {1: 0.001, 8: 0.0014, 32: 0.0018, 64: 0.0019}
    old["samples"]["decode"] = [{"batch": b, "context": b * c, "seconds": v + 2e-8 * b * c}
                                for b, v in levels.items() for c in (128, 2048)]
    path.write_text(json.dumps(old))
    assert main(["simulate", "profile", "--refit", str(path), "--out", str(tmp_path / "new.json")]) == 0
    p = Profile.load(tmp_path / "new.json")
    assert [b for b, _ in p.decode["batch_s"]] == list(levels)
    assert [v for _, v in p.decode["batch_s"]] == pytest.approx(list(levels.values()), rel=1e-6)
    assert p.decode["per_context_s"] == pytest.approx(2e-8, rel=1e-6)
    assert 0.001 < p.decode["a_s"] + p.decode["per_seq_s"] * 16 < 0.0019
    assert "by batch: 1 1.000, 8 1.400, 32 1.800, 64 1.900 ms" in capsys.readouterr().out


def test_the_frontend_is_the_latency_less_the_measured_step_where_the_profile_holds_it():
    """A lone request's TTFT less the engine's step for its prompt: the step as measured where the profile holds a
    sample of that length (nothing cached, alone), so that the form's error there is not taken for the server's
    work; elsewhere the form's. Here the form is 1 ms under the measured 4,096-token step."""
    from nanoforge.sim.measure import engine_prefill_s, frontend_section

    form = Profile.from_dict(SIMPLE)
    measured = form.prefill_time(4096) + 0.001
    samples = [{"tokens": 4096, "cached": 0, "batch": 0, "seconds": measured},
               {"tokens": 512, "cached": 1024, "batch": 0, "seconds": 1.0},  # cached: not the lone step
               {"tokens": 512, "cached": 0, "batch": 4, "seconds": 1.0}]  # beside decodes: not alone
    prof = Profile.from_dict({**SIMPLE, "samples": {"prefill": samples}})
    assert engine_prefill_s(prof, 4096) == measured and engine_prefill_s(prof, 512) == form.prefill_time(512)
    frontend = {"prompt_len": 512, "output_len": 32, "long_prompt_len": 4096, "tpot_s": {"1": 0.006},
                "ttft_s": 0.004 + 512e-6 + form.prefill_time(512), "long_ttft_s": 0.004 + 4096e-6 + measured}
    f = frontend_section(prof, frontend)
    assert (f["request_s"], f["per_prompt_token_s"]) == (pytest.approx(0.004), pytest.approx(1e-6))
    f = frontend_section(form, frontend)  # without the sample the form's missing 1 ms counts as the server's
    assert f["per_prompt_token_s"] == pytest.approx(1e-6 + 0.001 / (4096 - 512))


def test_decode_steps_are_timed_as_a_run():
    """A run of steps gets its mean time a step (on a GPU, where a step's host work overlaps the device's step
    before, only a run sees that), each step with the features of what it scheduled."""
    import time as _time
    from types import SimpleNamespace

    import torch

    from nanoforge.sim.measure import _Timer

    sleeps = iter([0.0, 0.0, 0.0, 0.04])
    batches = iter([3, 3, 3, 2])

    def schedule():
        seqs = [ScheduledSeq(Sequence([1, 2, 3, 4], SamplingParams()), 3, 1, 1) for _ in range(next(batches))]
        return SchedulerOutput(scheduled=seqs)

    engine = SimpleNamespace(scheduler=SimpleNamespace(schedule=schedule),
                             model=SimpleNamespace(embed=SimpleNamespace(weight=torch.zeros(1))))
    timer = _Timer(engine)
    engine.step = lambda: (engine.scheduler.schedule(), _time.sleep(next(sleeps)))
    timed = timer.run(4)
    assert [f["batch"] for f, _ in timed] == [3, 3, 3, 2] and all(f["context"] == 3 * 4 for f, _ in timed[:3])
    assert not any(f["prefill"] for f, _ in timed)
    assert len({t for _, t in timed}) == 1 and 0.01 <= timed[0][1] < 0.02  # 40 ms over 4 steps


def test_profile_budget_leaves_out_the_most_expensive_points():
    from nanoforge.model.config import preset
    from nanoforge.model.transformer import Transformer
    from nanoforge.serve.llm_engine import EngineConfig, LLMEngine
    from nanoforge.sim.measure import decode_points, measure_steps, prefill_points

    engine = LLMEngine(Transformer(preset("tiny-qwen3")).eval(), None,
                       EngineConfig(num_gpu_blocks=64, max_model_len=128, device="cpu", dtype="float32"))
    cfg = engine.scheduler.config
    points = prefill_points(cfg, (16, 64, 256), (0, 32, 100))
    # 256 tokens and 100 cached (not a block multiple) never fit; the rest cheapest first
    assert points == [(16, 0), (64, 0), (16, 32), (64, 32)]
    # 16 sequences of 64 + 6 tokens need 80 blocks of the 64
    assert decode_points(cfg, (1, 4, 16), (32, 64)) == [(1, 32), (1, 64), (4, 32), (4, 64), (16, 32)]
    prefill, decode, skipped = measure_steps(engine, prefill_tokens=(16,), prefill_cached=(0,), decode_batch=(1,),
                                             decode_context=(32,), budget_s=1e-9)
    assert (prefill, decode, skipped) == ([], [], {"prefill": [[16, 0]], "decode": [[1, 32]]})


def test_the_hand_over_stream_is_measured_on_the_engines_outputs():
    """`measure_stream` on the CPU engine: every 32nd hand-over event of the engine's own outputs is timed, and
    `frontend_section` keeps the slope over the output held as stream_per_output_token_s (the line through two
    points; its growth is not asserted: one character a token is within a CPU's noise)."""
    from nanoforge.model.config import preset
    from nanoforge.model.transformer import Transformer
    from nanoforge.serve.llm_engine import EngineConfig, LLMEngine
    from nanoforge.sim.measure import frontend_section, measure_stream
    from nanoforge.tokenizer import Tokenizer

    tok = Tokenizer.char_level("abcdefghijklmnopqrstuvwxyz ")
    engine = LLMEngine(Transformer(preset("tiny-qwen3", vocab_size=tok.vocab_size)).eval(), None,
                       EngineConfig(num_gpu_blocks=64, max_model_len=512, device="cpu", dtype="float32"))
    samples = measure_stream(engine, tok, requests=2, prompt_len=8, output_len=96, every=32, repeats=3)
    assert [s["tokens"] for s in samples] == [32, 64]
    frontend = {"prompt_len": 512, "output_len": 32, "ttft_s": 0.01, "tpot_s": {"1": 0.01}, "stream": samples}
    slope = frontend_section(profile(), frontend)["stream_per_output_token_s"]
    assert slope == pytest.approx(max(0.0, (samples[1]["seconds"] - samples[0]["seconds"]) / 32))


def test_validate_replays_the_runs_requests(tmp_path):
    """A run directory laid out as gpu_disagg.sh writes it, whose 'measurements' are a simulation of the same
    cluster on the workload bench serve's recorded settings describe: validation predicts them exactly (a setting
    read wrongly, e.g. the time scale, would not)."""
    import dataclasses

    from nanoforge.serve.bench_serve import summarize
    from nanoforge.sim.validate import cluster_of, table, validate

    trace = write_trace(tmp_path / "trace.jsonl", n=30)
    settings = {"trace": str(trace), "length_scale": 0.5, "time_scale": 0.3, "max_input_len": 400,
                "max_output_len": 12, "trace_block_tokens": 128, "vocab_size": 1000, "seed": 5, "tokenizer": None,
                "num_requests": None, "slo_ttft_ms": 500.0, "slo_tpot_ms": 30.0}
    replay = TraceReplay(json_rows(trace), ByteVocab(), length_scale=0.5, time_scale=0.3, max_input_len=400,
                         max_output_len=12, block_tokens=128, seed=5)
    for name, n in (("colocated", 1), ("2p1d-ca-slo", 3)):
        log = "".join("nanoforge serve: m at http://127.0.0.1:1 (context 512 tokens, 300 KV blocks)\n"
                      for _ in range(n))
        config = cluster_of(name, {"config": settings}, log, pool_memory=0.01, device="cpu")
        assert (config.max_model_len, config.num_gpu_blocks, config.shared_gpu) == (512, 300, True)
        sim = Simulation(replay, dataclasses.replace(config), profile())
        sim.run()
        slo = {"ttft": 500.0, "tpot": 30.0}
        d = tmp_path / "run" / name
        d.mkdir(parents=True)
        (d / "server.log").write_text(log)
        (d / "serve.json").write_text(json.dumps({"config": settings, "summary": summarize(sim.results, sim.makespan,
                                                                                            slo)}))
        loaded = sum(i.get("loaded_blocks", 0) for i in sim.instance_stats() if i["role"] == "decode")
        decoder = next(i for i in sim.instance_stats() if i["role"] != "prefill")
        steps = (f'nanoforge_engine_step_seconds_count{{kind="decode"}} 4.0\n'
                 f'nanoforge_engine_step_seconds_sum{{kind="decode"}} {4 * decoder["step_ms"]["decode"] / 1000!r}\n')
        if name != "colocated":  # the decode instance's /metrics at the end of the run
            (d / "metrics-decode1.txt").write_text(f"nanoforge_kv_pool_loaded_blocks_total {loaded}.0\n" + steps)
        else:
            (d / "metrics.txt").write_text(steps)
    report = validate(tmp_path / "run", profile(), pool_memory=0.01, device="cpu", progress=False)
    assert [r["config"] for r in report["rows"]] == ["colocated", "2p1d-ca-slo"] and report["ok"]
    loads = report["rows"][1]["decode_pool_loaded_blocks"]
    assert loads["measured"] == loads["predicted"] > 0 and report["rows"][0]["decode_pool_loaded_blocks"] == {
        "measured": None, "predicted": None}
    assert f"pool blocks loaded  {loaded:>10}{loaded:>11}" in table(report)
    for r in report["rows"]:  # the decoding instance's mean decode step, from its step histogram
        step = r["decode_step_ms"]
        assert step["predicted"] > 0 and step["measured"] == pytest.approx(step["predicted"])
    assert table(report).count("decode step (ms)") == 2
    for r in report["rows"]:
        for v in r["metrics"].values():
            assert v["rel_error"] == pytest.approx(0, abs=1e-9)
    assert "8 of 8 within 15%" in table(report)
    # repeats of the run: judged by the medians, the measured range beside them. A second run measuring every
    # TTFT 30% higher: the median (of two, their mean) is 15% higher, which the same prediction meets at 15%
    import shutil

    shutil.copytree(tmp_path / "run", tmp_path / "again" / "run")
    shutil.copy(trace, tmp_path / "again" / "trace.jsonl")
    for name in ("colocated", "2p1d-ca-slo"):
        path = tmp_path / "again" / "run" / name / "serve.json"
        run = json.loads(path.read_text())
        run["summary"]["ttft_ms"] = {k: 1.3 * v for k, v in run["summary"]["ttft_ms"].items()}
        path.write_text(json.dumps(run))
    both = validate([tmp_path / "run", tmp_path / "again" / "run"], profile(), pool_memory=0.01, device="cpu",
                    progress=False)
    ttft = both["rows"][0]["metrics"]["TTFT p50 (ms)"]
    one = report["rows"][0]["metrics"]["TTFT p50 (ms)"]["measured"]
    assert both["rows"][0]["runs"] == 2 and ttft["measured_runs"] == pytest.approx([one, 1.3 * one])
    assert ttft["measured"] == pytest.approx(1.15 * one) and ttft["rel_error"] == pytest.approx(1 / 1.15 - 1)
    assert ttft["predicted_runs"] == pytest.approx([one, one]) and ttft["ok"]  # -13%
    assert both["rows"][0]["metrics"]["TPOT p50 (ms)"]["rel_error"] == pytest.approx(0, abs=1e-9)
    assert f"{one:.2f}-{1.3 * one:.2f} (26%)" in table(both) and "2 runs:" in table(both)
    # a different time scale is a different workload: the check would see it
    settings["time_scale"] = 3.0
    for name in ("colocated", "2p1d-ca-slo"):
        path = tmp_path / "run" / name / "serve.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "config": settings}))
    assert not validate(tmp_path / "run", profile(), pool_memory=0.01, device="cpu", progress=False)["ok"]


def json_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_validate_reads_the_pool_calls_ms_per_block_from_the_instances_metrics(tmp_path):
    from nanoforge.sim.validate import measured_call_ms, measured_ttft_ms, predicted_call_ms

    for i, (s, b) in enumerate(((0.5, 1000), (0.3, 1000))):  # two prefill instances: 0.8 s over 2,000 blocks
        (tmp_path / f"metrics-prefill{i + 1}.txt").write_text(
            f'nanoforge_kv_pool_call_seconds_total{{kind="put"}} {s}\n'
            f'nanoforge_kv_pool_call_blocks_total{{kind="put"}} {b}\n'
            f'nanoforge_kv_pool_call_blocks_total{{kind="get"}} 0.0\n')
    assert measured_call_ms(tmp_path, "prefill", "put") == pytest.approx(0.4)
    assert measured_call_ms(tmp_path, "prefill", "get") is None  # no call made
    assert measured_call_ms(tmp_path, "decode", "get") is None  # no such instance's metrics (runs before session 16)
    sim = run([row(0, 512, 2, list(range(8)))], prefill=1, decode=1)
    stats = sim.instance_stats()
    # the prefill instance's save: one put of the prompt's 32 blocks (2 + 32 ms); the decode instance's load of
    # all 32 (the first token follows them): the same
    assert predicted_call_ms(stats, "prefill", "put") == pytest.approx(34 / 32)
    assert predicted_call_ms(stats, "decode", "get") == pytest.approx(34 / 32)
    assert predicted_call_ms(stats, "prefill", "put", "job", "calls") == pytest.approx(34)  # no wait: 34 ms a call
    # each instance's own TTFT, as its server's histogram has it: the prefill instance's 512-token step (522 ms);
    # the decode instance's load (34 ms), then its first token, a one-token step (6 ms)
    by_role = {i["role"]: i["ttft_ms"] for i in stats}
    assert by_role == {"prefill": pytest.approx(522), "decode": pytest.approx(40)}
    (tmp_path / "metrics-decode1.txt").write_text("nanoforge_time_to_first_token_seconds_sum 3.0\n"
                                                  "nanoforge_time_to_first_token_seconds_count 60.0\n")
    assert measured_ttft_ms(tmp_path, "decode") == pytest.approx(50.0)


def test_validate_builds_the_cluster_the_script_started():
    """gpu_disagg.sh's configurations as the simulator's clusters: one GPU shared unless the run gave each
    instance its own (DEVICES: devices.txt), the pool behind every --disagg configuration."""
    from nanoforge.sim.validate import cluster_of

    run = {"config": {"slo_ttft_ms": 2000, "slo_tpot_ms": 50}}
    log = "context 8192 tokens, 34817 KV blocks\ncontext 8192 tokens, 35159 KV blocks\n"
    one = cluster_of("colocated", run, "context 8192 tokens, 70000 KV blocks", pool_memory=8, device="cuda")
    assert (one.colocated, one.pool_gib, one.shared_gpu, one.num_gpu_blocks) == (1, 0.0, True, 70000)
    pd = cluster_of("1p1d", run, log, pool_memory=8, device="cuda", own_gpus=True)
    assert (pd.prefill, pd.decode, pd.pool_gib, pd.shared_gpu, pd.num_gpu_blocks) == (1, 1, 16.0, False, 34817)
    two = cluster_of("colocated2", run, log, pool_memory=8, device="cuda")
    assert (two.colocated, two.policy, two.pool_gib, two.shared_gpu, two.ttft_slo) == (2, "cache-aware", 16.0, True, 2.0)


def test_early_rejection_on_tpot_never_locks_an_idle_cluster_out():
    # long prompts with 2 output tokens first: their TPOT is all hand-over (the KV load from the pool), 133 ms
    # against an objective of 10 ms; then short prompts with 20 tokens, whose TPOT is ~7 ms. The conductor's cost
    # model keeps the two parts apart, so it rejects none of the short ones (a single fit of TPOT against load
    # predicted 133 ms for everything after the long ones, and an idle decode instance was all that let them in)
    rows = [row(i * 1000, 2000, 2, list(range(100 * i, 100 * i + 32))) for i in range(3)]
    rows += [row(10_000 + i * 1000, 100, 20, [1000 + i, 2000 + i]) for i in range(10)]
    sim = run(rows, profile(), prefill=1, decode=1, tpot_slo=0.01, early_reject=True)
    assert all(r.error is None for r in sim.results) and sim.router.rejected["tpot"] == 0
    router, decode = sim.router, sim.router.decode[0]
    assert (router.handover_fit.n, router.step_fit.n) == (13, 10)  # every first decode token; every later run
    # what each kind of request is predicted, and what it measured
    measured = [r.tpot_ms / 1000 for r in sim.results]
    assert router.predict_tpot(decode, 2000, 2) == pytest.approx(measured[0], rel=1e-6)  # over the objective
    assert router.predict_tpot(decode, 100, 20) == pytest.approx(measured[-1], rel=1e-6)  # under it


def test_the_warm_ups_gap_is_read_from_the_runs_wall_clocks(tmp_path):
    """bench serve records its start's wall clock: the trace's start less the last warm-up's start and duration
    is the gap validation replays the warm-up with (runs that recorded no clock get no warm-up)."""
    import json

    from nanoforge.sim.validate import recorded_gap_s

    (tmp_path / "warmup").mkdir()
    (tmp_path / "warmup" / "serve.json").write_text(json.dumps({"started_unix": 1000.0,
                                                                "summary": {"duration_s": 12.5}}))
    assert recorded_gap_s(tmp_path, {"started_unix": 1014.0}) == pytest.approx(1.5)
    assert recorded_gap_s(tmp_path, {}) is None  # a run from before session 12
    (tmp_path / "warmup" / "serve.json").write_text(json.dumps({"summary": {"duration_s": 12.5}}))
    assert recorded_gap_s(tmp_path, {"started_unix": 1014.0}) is None


@pytest.mark.parametrize("recorded_seed,per_length", [(4096, True), (0, False)])
def test_the_warm_up_is_replayed_with_the_seeds_gpu_disagg_sent(tmp_path, recorded_seed, per_length):
    """validate's `warmup_of`: the script's three warm-up runs, rebuilt from the last one's record. Since session 50
    gpu_disagg.sh seeds each length's run with the length (the record: a seed equal to its length), so no warm-up
    prompt begins with another's tokens; older runs used one seed, and the 1,024-token run's first prompt began
    with the 128-token run's."""
    from nanoforge.serve.bench_serve import Vocab, poisson_workload
    from nanoforge.sim.validate import warmup_of

    (tmp_path / "warmup").mkdir()
    config = {"input_len": 4096, "seed": recorded_seed, "num_requests": 2, "rate": 20.0, "output_len": 8,
              "vocab_size": 1000}
    (tmp_path / "warmup" / "serve.json").write_text(json.dumps({"config": config}))
    (tmp_path / "metrics.txt").write_text(f"nanoforge_prompt_tokens_total {500 + 2 * (128 + 1024 + 4096)}\n")
    runs = warmup_of(tmp_path, trace_tokens=500)
    assert [len(r[0].prompt) for r in runs] == [128, 1024, 4096]
    for n, run in zip((128, 1024, 4096), runs):
        want = poisson_workload(2, 20.0, n, 8, Vocab(1000), n if per_length else 0)
        assert [r.prompt for r in run] == [r.prompt for r in want]
    assert (runs[1][0].prompt[:128] == runs[0][0].prompt) is not per_length
