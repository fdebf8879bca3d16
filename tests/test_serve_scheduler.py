"""Scheduler: continuous batching, chunked prefill, prefix sharing, fork/CoW, preemption, swap, bad input.

The stress tests drive the scheduler with `FakeRunner`, which keeps a
simulated KV cache (block id -> the token id written in each slot) and
executes the scheduler's swap and copy orders like the real runner. Before
every chunk it reads the sequence's context back through its block table and
checks that it equals the sequence's own tokens: this proves that prefix-cache
hits, copy-on-write and swaps never hand a sequence someone else's KV.
"""

import random
import zlib
from collections import Counter

import pytest

from nanoforge.errors import NanoforgeError
from nanoforge.serve.sampling_params import SamplingParams
from nanoforge.serve.scheduler import Scheduler, SchedulerConfig
from nanoforge.serve.sequence import SequenceGroup, SequenceStatus, check_stop

EOS = 0
VOCAB = 64


class FakeRunner:
    """Executes SchedulerOutputs on a simulated KV cache and samples deterministic pseudo-random tokens."""

    def __init__(self, scheduler: Scheduler):
        self.s = scheduler
        self.bs = scheduler.config.block_size
        self.kv: dict[int, list] = {}  # gpu block -> token id per slot (None: never written)
        self.cpu: dict[int, list] = {}
        self.max_batch_tokens = 0

    @staticmethod
    def token(seq, k: int) -> int:
        # a function of the request, the completion index and the history: identical whatever the schedule
        return zlib.crc32(repr((seq.request_id, seq.index + k, seq.num_tokens, seq.last_token_id)).encode()) % VOCAB

    def read(self, table: list[int], n: int) -> list:
        return [self.kv.get(table[p // self.bs], [None] * self.bs)[p % self.bs] for p in range(n)]

    def step(self, out) -> dict[int, list[int]]:
        bm, bs = self.s.block_manager, self.bs
        # the runner's order: swap out, swap in, copy, then the forward pass
        for g, c in out.blocks_to_swap_out.items():
            self.cpu[c] = list(self.kv[g])
        for c, g in out.blocks_to_swap_in.items():
            self.kv[g] = list(self.cpu[c])
        for src, dst in out.blocks_to_copy:
            self.kv[dst] = list(self.kv[src])
        assert out.num_batched_tokens <= self.s.config.max_num_batched_tokens
        assert len(out.scheduled) <= self.s.config.max_num_seqs
        assert len({item.seq.seq_id for item in out.scheduled}) == len(out.scheduled)
        self.max_batch_tokens = max(self.max_batch_tokens, out.num_batched_tokens)
        written = set()
        for item in out.scheduled:
            seq, table = item.seq, item.block_table
            assert seq.status is SequenceStatus.RUNNING
            assert item.end == seq.num_computed_tokens and 1 <= item.num_tokens  # schedule() counts it computed
            assert item.end <= seq.num_tokens <= self.s.config.max_model_len
            # sample exactly when the chunk reaches the last known token
            assert (item.num_samples >= 1) == (item.end == seq.num_tokens)
            assert len(table) == -(-item.end // bs)  # blocks for exactly the positions computed so far
            assert all(0 <= b < bm.num_blocks and bm.ref_counts[b] > 0 for b in table)
            # the KV this chunk attends to is this sequence's own history
            assert self.read(table, item.start) == seq.token_ids[:item.start], seq
            slots = item.slot_mapping(bs)
            for p, slot in zip(range(item.start, item.end), slots):
                block = table[p // bs]
                assert slot == block * bs + p % bs
                # (the chunk that forks n > 1 completions writes the prompt they share: forks happen at schedule())
                shared_ok = item.num_samples > 1 and bm.ref_counts[block] <= item.num_samples
                assert bm.ref_counts[block] == 1 or shared_ok, "write into a shared block: copy-on-write missing"
                assert slot not in written
                written.add(slot)
                self.kv.setdefault(block, [None] * bs)[p % bs] = seq.token_ids[p]
        return {item.seq.seq_id: [self.token(item.seq, k) for k in range(item.num_samples)]
                for item in out.scheduled if item.num_samples}


def check_invariants(s: Scheduler):
    bm = s.block_manager
    gpu, cpu = Counter(), Counter()
    for queue, status in ((s.running, SequenceStatus.RUNNING), (s.waiting, SequenceStatus.WAITING),
                          (s.swapped, SequenceStatus.SWAPPED)):
        for g in queue:
            assert not g.is_finished
            for seq in g.seqs:
                assert seq.status in (status, SequenceStatus.FINISHED)
                if seq.status is SequenceStatus.RUNNING:
                    gpu.update(seq.block_table)
                elif seq.status is SequenceStatus.SWAPPED:
                    cpu.update(seq.block_table)
                else:
                    assert seq.block_table == [] and (seq.is_finished or seq.num_computed_tokens == 0)
    assert sum(len(q) for q in (s.running, s.waiting, s.swapped)) == len(s._groups)
    assert [g.arrival_index for g in s.running] == sorted(g.arrival_index for g in s.running)
    # reference counts never negative and equal to the tables that hold each block
    assert bm.ref_counts == [gpu[b] for b in range(bm.num_blocks)]
    assert bm.cpu_ref_counts == [cpu[b] for b in range(bm.num_cpu_blocks)]
    # no block both free and in use, none lost
    assert bm.free_block_ids() == {b for b in range(bm.num_blocks) if not gpu[b]}
    assert bm.num_free_blocks == len(bm.free_block_ids())
    assert bm.free_cpu_block_ids() == {b for b in range(bm.num_cpu_blocks) if not cpu[b]}
    assert bm.num_free_cpu_blocks == len(bm.free_cpu_block_ids())


def run_to_completion(s: Scheduler, arrivals: dict[int, list[SequenceGroup]] | None = None,
                      aborts: dict[int, list[str]] | None = None, max_steps: int = 5000, on_step=None,
                      runner: FakeRunner | None = None):
    """Drive the scheduler to the end; return {request_id: group} of everything that finished."""
    runner = runner or FakeRunner(s)
    arrivals, aborts = arrivals or {}, aborts or {}
    last_arrival = max(arrivals, default=0)
    finished: dict[str, SequenceGroup] = {}

    def done(groups):
        for g in groups:
            assert g.request_id not in finished and g.is_finished
            finished[g.request_id] = g

    for step in range(max_steps):
        for g in arrivals.get(step, []):
            s.add(g)
        for rid in aborts.get(step, []):
            g = s.abort(rid)
            if g is not None:
                assert all(q.finish_reason == "abort" or q.finish_reason in ("stop", "length") for q in g.seqs)
                done([g])
        check_invariants(s)
        if not s.has_unfinished() and step > last_arrival:
            return finished, runner
        was_waiting, preemptions = {g.request_id for g in s.waiting}, s.stats()["preemptions"]
        out = s.schedule()
        done(out.finished)
        check_invariants(s)
        if s.stats()["preemptions"] > preemptions:  # a step that preempts admits nothing new
            assert not was_waiting & {g.request_id for g in s.running}
        sampled = runner.step(out)
        done(s.update(out, sampled))
        check_invariants(s)
        if on_step:
            on_step(s, out)
    raise AssertionError(f"no progress after {max_steps} steps: {s.stats()}")


def run_a_step_ahead(s: Scheduler, arrivals: dict[int, list[SequenceGroup]], aborts: dict[int, list[str]],
                     on_step, max_steps: int = 5000) -> dict[str, SequenceGroup]:
    """Drive the scheduler as the engine's asynchronous scheduling does: schedule step n + 1, then update step n
    (tokens a function of each sequence's history, as FakeRunner's). Returns {request_id: group} finished."""
    finished: dict[str, SequenceGroup] = {}
    in_flight: list = []
    last_arrival = max(arrivals, default=0)
    for step in range(max_steps):
        for g in arrivals.get(step, []):
            s.add(g)
        for rid in aborts.get(step, []):
            if (g := s.abort(rid)) is not None:
                finished[g.request_id] = g
        if not s.has_unfinished() and not in_flight and step > last_arrival:
            return finished
        out = s.schedule()
        finished.update((g.request_id, g) for g in out.finished)
        on_step(s, out)
        if not out.is_empty:
            in_flight.append(out)
        if len(in_flight) > 1 or (in_flight and out.is_empty):
            done = in_flight.pop(0)
            sampled = {item.seq.seq_id: [FakeRunner.token(item.seq, k) for k in range(item.num_samples)]
                       for item in done.scheduled if item.num_samples}
            finished.update((g.request_id, g) for g in s.update(done, sampled))
        check_invariants(s)
    raise AssertionError(f"no progress after {max_steps} steps: {s.stats()}")


def random_workload(seed: int, num_requests: int, max_model_len: int, with_aborts: bool):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(8, 30))] for _ in range(3)]
    arrivals: dict[int, list[SequenceGroup]] = {}
    aborts: dict[int, list[str]] = {}
    for i in range(num_requests):
        prompt = (rng.choice(prefixes) if rng.random() < 0.6 else []) + [
            rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 20))]
        prompt = prompt[:max_model_len - 1]
        params = SamplingParams(n=rng.choice([1, 1, 1, 2, 4]), max_tokens=rng.randrange(1, 30),
                                ignore_eos=rng.random() < 0.5, stop_token_ids=[5] if rng.random() < 0.2 else None)
        step = rng.randrange(0, 40)
        arrivals.setdefault(step, []).append(SequenceGroup(f"r{i}", prompt, params))
        if with_aborts and rng.random() < 0.15:
            aborts.setdefault(step + rng.randrange(0, 15), []).append(f"r{i}")
    return arrivals, aborts


def check_finished_groups(finished, expected_ids, max_model_len, allow_abort=True):
    assert set(finished) == set(expected_ids)  # every admitted request finishes
    for g in finished.values():
        assert len(g.seqs) == g.sampling_params.n or any(q.finish_reason == "abort" for q in g.seqs)
        for q in g.seqs:
            assert q.status is SequenceStatus.FINISHED and q.block_table == []
            assert q.num_output_tokens <= g.sampling_params.max_tokens and q.num_tokens <= max_model_len
            if q.finish_reason == "stop":
                assert q.last_token_id == EOS and not g.sampling_params.ignore_eos or q.last_token_id in (
                    g.sampling_params.stop_token_ids or [])
            elif q.finish_reason == "length":
                assert q.num_output_tokens == g.sampling_params.max_tokens or q.num_tokens == max_model_len
            else:
                assert allow_abort and q.finish_reason == "abort"


def assert_all_blocks_returned(s: Scheduler):
    bm = s.block_manager
    assert all(r == 0 for r in bm.ref_counts) and bm.num_free_blocks == bm.num_blocks
    assert all(r == 0 for r in bm.cpu_ref_counts) and bm.num_free_cpu_blocks == bm.num_cpu_blocks


def config(**kw):
    base = dict(max_model_len=64, num_gpu_blocks=64, block_size=4, max_num_batched_tokens=48, max_num_seqs=16,
                eos_token_ids=(EOS,), vocab_size=VOCAB)
    base.update(kw)
    return SchedulerConfig(**base)


# ---- stress -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_tiny_cache(mode, seed):
    """Tiny cache, random arrivals, n up to 4, shared prefixes, aborts: invariants hold, KV content is right."""
    # 64 blocks of 4 tokens hold any single group (max_model_len 64 = 16 blocks, n <= 4): nobody may fail
    s = Scheduler(config(preemption_mode=mode, num_cpu_blocks=40 if mode == "swap" else 0))
    arrivals, aborts = random_workload(seed, 40, 64, with_aborts=True)
    finished, _ = run_to_completion(s, arrivals, aborts)
    check_finished_groups(finished, [g.request_id for gs in arrivals.values() for g in gs], 64)
    assert_all_blocks_returned(s)
    st = s.stats()
    assert st["preemptions"] > 0 and st["blocks_copied"] > 0 and st["cached_prompt_tokens"] > 0
    if mode == "swap":
        assert st["swap_outs"] > 0 and st["blocks_swapped_in"] > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_work_gives_the_same_tokens(mode):
    """Without aborts, outputs under heavy preemption equal those of a run whose cache never runs out."""
    results = {}
    for name, kw in (("roomy", dict(num_gpu_blocks=2000, max_num_seqs=64)),
                     ("tiny", dict(num_gpu_blocks=48, preemption_mode=mode, num_cpu_blocks=16, max_num_batched_tokens=64,
                                   enable_chunked_prefill=mode == "swap"))):
        s = Scheduler(config(**kw))
        arrivals, _ = random_workload(7, 30, 64, with_aborts=False)
        finished, _ = run_to_completion(s, arrivals)
        check_finished_groups(finished, [g.request_id for gs in arrivals.values() for g in gs], 64, allow_abort=False)
        assert_all_blocks_returned(s)
        # each prompt counted once, however often it was recomputed
        assert s.stats()["prompt_tokens"] == sum(len(g.prompt_token_ids) for g in finished.values())
        results[name] = ({rid: [q.token_ids for q in g.seqs] for rid, g in finished.items()}, s.stats())
    assert results["roomy"][1]["preemptions"] == 0 and results["tiny"][1]["preemptions"] > 0
    assert results["tiny"][0] == results["roomy"][0]


def test_kv_utilisation_on_throughput_workload():
    """16-token blocks taken lazily: >= 96% of the slots in allocated blocks hold a token's KV."""
    rng = random.Random(3)
    s = Scheduler(SchedulerConfig(max_model_len=1024, num_gpu_blocks=600, block_size=16, max_num_seqs=64,
                                  max_num_batched_tokens=2048, eos_token_ids=(EOS,)))
    for i in range(80):
        s.add(SequenceGroup(f"r{i}", [rng.randrange(1, VOCAB) for _ in range(rng.randrange(150, 500))],
                            SamplingParams(max_tokens=rng.randrange(50, 250), ignore_eos=True)))
    samples = []

    def measure(sched, out):
        if sched.block_manager.num_used_blocks > 0.5 * sched.block_manager.num_blocks:
            samples.append(sched.kv_utilization())

    run_to_completion(s, on_step=measure)
    assert len(samples) > 50
    assert sum(samples) / len(samples) >= 0.96, sum(samples) / len(samples)
    assert s.stats()["preemptions"] > 0  # the cache really was the bottleneck


# ---- chunked prefill, budgets -----------------------------------------------------------------------------

def test_chunked_prefill_runs_alongside_decodes():
    s = Scheduler(config(max_num_batched_tokens=16, num_gpu_blocks=64))
    s.add(SequenceGroup("short", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True)))
    runner = FakeRunner(s)
    out = s.schedule()
    s.update(out, runner.step(out))
    s.add(SequenceGroup("long", list(range(1, 51)), SamplingParams(max_tokens=2, ignore_eos=True)))
    chunks = []
    for _ in range(5):
        out = s.schedule()
        by_id = {i.seq.request_id: i for i in out.scheduled}
        assert by_id["short"].num_tokens == 1  # the decode keeps going every step
        if "long" in by_id:
            chunks.append((by_id["long"].start, by_id["long"].num_tokens, by_id["long"].num_samples))
        s.update(out, runner.step(out))
    # 50 tokens in chunks of 15 (the older decode takes its token first), sampling only after the last
    assert chunks == [(0, 15, 0), (15, 15, 0), (30, 15, 0), (45, 5, 1), (50, 1, 1)]


def test_without_chunked_prefill_a_prompt_is_computed_whole():
    s = Scheduler(config(max_num_batched_tokens=64, enable_chunked_prefill=False))
    s.add(SequenceGroup("a", list(range(1, 41)), SamplingParams(max_tokens=3)))
    s.add(SequenceGroup("b", list(range(1, 31)), SamplingParams(max_tokens=3)))
    out = s.schedule()
    assert [(i.seq.request_id, i.num_tokens) for i in out.scheduled] == [("a", 40)]  # b does not fit: waits whole


def test_max_num_seqs_counts_future_forks():
    s = Scheduler(config(max_num_seqs=5))
    s.add(SequenceGroup("a", [1, 2, 3], SamplingParams(n=4)))
    s.add(SequenceGroup("b", [1, 2, 3], SamplingParams(n=2)))
    out = s.schedule()
    assert [i.seq.request_id for i in out.scheduled] == ["a"]  # 4 + 2 > 5


# ---- prefix sharing, n > 1 -------------------------------------------------------------------------------

def test_shared_prefix_is_computed_once():
    s = Scheduler(config(block_size=16, num_gpu_blocks=64, max_model_len=256, max_num_batched_tokens=512))
    runner = FakeRunner(s)
    prefix = [random.Random(0).randrange(1, VOCAB) for _ in range(100)]
    s.add(SequenceGroup("a", prefix + [1, 2], SamplingParams(max_tokens=2, ignore_eos=True)))
    out = s.schedule()
    s.update(out, runner.step(out))
    for i in range(3):
        s.add(SequenceGroup(f"b{i}", prefix + [3 + i] * 10, SamplingParams(max_tokens=2, ignore_eos=True)))
    out = s.schedule()
    news = {i.seq.request_id: (i.start, i.num_tokens) for i in out.scheduled}
    assert news == {"a": (102, 1), "b0": (96, 14), "b1": (96, 14), "b2": (96, 14)}  # 6 cached blocks each
    s.update(out, runner.step(out))
    st = s.stats()
    assert st["prompt_tokens"] == 102 + 3 * 110 and st["cached_prompt_tokens"] == 3 * 96
    assert st["prefix_cache_hit_rate"] == pytest.approx(288 / 432)
    seqs = [g.seqs[0] for g in s.running]
    assert all(seq.block_table[:6] == seqs[0].block_table[:6] for seq in seqs)


@pytest.mark.parametrize("prompt_len", [37, 32])
def test_n4_keeps_one_copy_of_the_prompt_until_a_write_splits_it(prompt_len):
    s = Scheduler(config(block_size=16, num_gpu_blocks=64, max_model_len=128, max_num_batched_tokens=256))
    runner = FakeRunner(s)
    s.add(SequenceGroup("a", list(range(1, prompt_len + 1)), SamplingParams(n=4, max_tokens=5, ignore_eos=True)))
    out = s.schedule()
    assert out.scheduled[0].num_samples == 4
    s.update(out, runner.step(out))
    group = s.running[0]
    assert len(group.seqs) == 4 and len({tuple(q.output_token_ids) for q in group.seqs}) == 4
    prompt_blocks = -(-prompt_len // 16)
    bm = s.block_manager
    assert bm.num_used_blocks == prompt_blocks  # one copy for four sequences
    assert all(q.block_table == group.seqs[0].block_table for q in group.seqs)
    last_prompt_block = group.seqs[0].block_table[-1]
    out = s.schedule()  # the first decode writes position prompt_len in each sequence
    if prompt_len % 16:  # into the shared partial block: three copies, the fourth writer keeps it
        assert [src for src, _ in out.blocks_to_copy] == [last_prompt_block] * 3
        assert bm.num_used_blocks == prompt_blocks + 3
    else:  # into fresh blocks: nothing to copy
        assert out.blocks_to_copy == [] and bm.num_used_blocks == prompt_blocks + 4
    full = prompt_len // 16
    assert all(q.block_table[:full] == group.seqs[0].block_table[:full] for q in group.seqs)
    assert all(bm.ref_counts[b] == 4 for b in group.seqs[0].block_table[:full])
    s.update(out, runner.step(out))
    finished, _ = run_to_completion(s, runner=runner)
    assert finished["a"].seqs[0].num_output_tokens == 5
    assert_all_blocks_returned(s)


# ---- preemption ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempts_the_latest_group_whole(mode):
    # 10 blocks of 4 tokens; two groups grow until the cache runs out
    s = Scheduler(config(num_gpu_blocks=10, preemption_mode=mode, num_cpu_blocks=10 if mode == "swap" else 0))
    runner = FakeRunner(s)
    s.add(SequenceGroup("old", [1, 2, 3, 4, 5], SamplingParams(max_tokens=20, ignore_eos=True)))
    s.add(SequenceGroup("new", [6, 7, 8, 9, 10], SamplingParams(n=2, max_tokens=12, ignore_eos=True)))
    preempted = None
    for _ in range(30):
        out = s.schedule()
        if s.waiting or s.swapped:
            preempted = (s.waiting or s.swapped)[0]
            break
        s.update(out, runner.step(out))
    assert preempted is not None and preempted.request_id == "new"
    status = SequenceStatus.SWAPPED if mode == "swap" else SequenceStatus.WAITING
    assert len(preempted.seqs) == 2 and all(q.status is status for q in preempted.seqs)
    if mode == "swap":
        assert out.blocks_to_swap_out and all(q.block_table for q in preempted.seqs)
    else:
        assert all(q.num_computed_tokens == 0 and q.block_table == [] for q in preempted.seqs)
    assert [i.seq.request_id for i in out.scheduled] == ["old"]
    s.update(out, runner.step(out))
    finished, _ = run_to_completion(s, runner=runner)
    assert {q.finish_reason for g in finished.values() for q in g.seqs} == {"length"}
    assert_all_blocks_returned(s)


def test_recomputed_siblings_prefill_one_at_a_time():
    """After a recompute preemption, a forked group's second sequence waits for the first one's prompt blocks."""
    s = Scheduler(config(num_gpu_blocks=10))
    runner = FakeRunner(s)
    s.add(SequenceGroup("old", [1, 2, 3, 4, 5], SamplingParams(max_tokens=20, ignore_eos=True)))
    s.add(SequenceGroup("new", [6, 7, 8, 9, 10], SamplingParams(n=2, max_tokens=12, ignore_eos=True)))
    new = s.get_group("new")
    schedules = []
    while s.has_unfinished():
        out = s.schedule()
        schedules.append((new.num_preemptions, [(i.seq.index, i.start, i.num_tokens) for i in out.scheduled
                                                if i.seq.request_id == "new"]))
        s.update(out, runner.step(out))
    resumed = [dict((index, (start, n)) for index, start, n in chunks)
               for preemptions, chunks in schedules if preemptions and chunks]
    assert new.num_preemptions > 0 and resumed
    for chunks in resumed:  # never both siblings while sibling 0 is still prefilling
        assert not (1 in chunks and 0 in chunks and chunks[0][1] > 1)
    # sibling 1's recomputation starts after the cached block it shares with sibling 0
    assert [chunks[1][0] for chunks in resumed if 1 in chunks][0] >= 4
    assert all(q.finish_reason == "length" for q in new.seqs)


def test_a_request_that_can_never_fit_fails_and_others_go_on():
    s = Scheduler(config(num_gpu_blocks=6))  # 24 token slots
    s.add(SequenceGroup("huge", [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=40, ignore_eos=True)))
    s.add(SequenceGroup("fine", [9, 10, 11], SamplingParams(max_tokens=4, ignore_eos=True)))
    finished, _ = run_to_completion(s)
    huge = finished["huge"]
    assert huge.seqs[0].finish_reason == "error" and "KV-cache blocks" in huge.error
    assert huge.seqs[0].num_tokens <= 6 * 4 + 1
    assert finished["fine"].seqs[0].finish_reason == "length" and finished["fine"].seqs[0].num_output_tokens == 4
    assert_all_blocks_returned(s)


@pytest.mark.parametrize("where", ["waiting", "running", "swapped"])
def test_abort_frees_everything(where):
    s = Scheduler(config(num_gpu_blocks=8, preemption_mode="swap", num_cpu_blocks=16))
    runner = FakeRunner(s)
    s.add(SequenceGroup("a", list(range(1, 10)), SamplingParams(max_tokens=30, ignore_eos=True)))
    s.add(SequenceGroup("b", list(range(11, 20)), SamplingParams(n=2, max_tokens=30, ignore_eos=True)))
    for _ in range(40):
        if where == "waiting" or (where == "running" and len(s.running) == 2) or (where == "swapped" and s.swapped):
            break
        out = s.schedule()
        s.update(out, runner.step(out))
    group = s.get_group("b")
    assert group in getattr(s, where)
    assert s.abort("b") is group and s.abort("b") is None
    assert all(q.finish_reason == "abort" and q.block_table == [] for q in group.seqs)
    check_invariants(s)
    s.abort("a")
    assert not s.has_unfinished()
    assert_all_blocks_returned(s)


def test_abort_between_schedule_and_update():
    s = Scheduler(config())
    runner = FakeRunner(s)
    s.add(SequenceGroup("a", [1, 2, 3], SamplingParams(max_tokens=5)))
    s.add(SequenceGroup("b", [4, 5, 6], SamplingParams(max_tokens=5, ignore_eos=True)))
    out = s.schedule()
    sampled = runner.step(out)
    s.abort("a")
    assert [g.request_id for g in s.update(out, sampled)] == []
    finished, _ = run_to_completion(s, runner=runner)
    assert finished["b"].seqs[0].num_output_tokens == 5
    assert_all_blocks_returned(s)


def test_finish_seq_for_stop_strings():
    s = Scheduler(config())
    runner = FakeRunner(s)
    s.add(SequenceGroup("a", [1, 2, 3], SamplingParams(n=2, max_tokens=10, ignore_eos=True)))
    out = s.schedule()
    s.update(out, runner.step(out))
    first, second = s.get_group("a").seqs
    assert s.finish_seq(first) is None and first.finish_reason == "stop" and first.block_table == []
    assert s.finish_seq(second).request_id == "a" and not s.has_unfinished()
    assert_all_blocks_returned(s)


# ---- stop conditions and bad input -----------------------------------------------------------------------

def test_check_stop():
    from nanoforge.serve.sequence import Sequence
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=3, stop_token_ids=[7]))
    seq.append_token(4)
    assert check_stop(seq, (EOS,), 100) is None
    seq.append_token(EOS)
    assert check_stop(seq, (EOS,), 100) == "stop"
    seq.token_ids[-1] = 7
    assert check_stop(seq, (EOS,), 100) == "stop"
    seq.token_ids[-1] = 4
    assert check_stop(seq, (EOS,), 5) == "length"  # context full
    seq.append_token(9)
    assert check_stop(seq, (EOS,), 100) == "length"  # max_tokens
    ignoring = Sequence([1], SamplingParams(ignore_eos=True))
    ignoring.append_token(EOS)
    assert check_stop(ignoring, (EOS,), 100) is None


@pytest.mark.parametrize("field, value", [
    ("max_tokens", -1), ("max_tokens", -3), ("prompt_logprobs", -1), ("top_p", 0.0), ("top_p", 1.5), ("temperature", -0.1),
    ("temperature", float("nan")), ("n", 0), ("top_k", -2), ("logprobs", -1), ("stop", [""]),
    ("stop_token_ids", [-1]), ("seed", -1), ("n", 1.5)])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(NanoforgeError, match=field) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field and isinstance(err.value, ValueError)


def test_sampling_params_defaults_and_vocab_checks():
    p = SamplingParams(top_k=0, stop="###")
    assert p.stop == ["###"] and p.top_k == 0  # -1 and 0 both mean "no top-k"
    assert SamplingParams(temperature=0).greedy
    with pytest.raises(NanoforgeError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[VOCAB]).validate(VOCAB)


@pytest.mark.parametrize("prompt, params, match", [
    ([], SamplingParams(), "prompt is empty"),
    (list(range(1, 66)), SamplingParams(), "max_model_len"),
    ([1, VOCAB], SamplingParams(), "vocabulary"),
    ([1, -1], SamplingParams(), "vocabulary"),
    ([1, 2], SamplingParams(n=17), "max_num_seqs"),
    ([1, 2], SamplingParams(stop_token_ids=[VOCAB + 1]), "stop_token_ids"),
])
def test_bad_requests_are_rejected_and_the_engine_keeps_serving(prompt, params, match):
    s = Scheduler(config())
    s.add(SequenceGroup("ok", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)))
    with pytest.raises(NanoforgeError, match=match):
        s.add(SequenceGroup("bad", prompt, params))
    with pytest.raises(NanoforgeError, match="already in use"):
        s.add(SequenceGroup("ok", [1], SamplingParams()))
    finished, _ = run_to_completion(s)
    assert set(finished) == {"ok"} and finished["ok"].seqs[0].num_output_tokens == 3


def test_prompt_larger_than_the_cache_is_rejected():
    s = Scheduler(config(num_gpu_blocks=4))
    with pytest.raises(NanoforgeError, match="holds 4") as err:
        s.add(SequenceGroup("big", list(range(1, 20)), SamplingParams()))
    assert err.value.param == "prompt"


@pytest.mark.parametrize("kw, match", [
    (dict(preemption_mode="drop"), "preemption_mode"), (dict(preemption_mode="swap"), "num_cpu_blocks"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=32), "max_num_batched_tokens"),
    (dict(num_gpu_blocks=0), "num_gpu_blocks")])
def test_bad_config(kw, match):
    with pytest.raises(NanoforgeError, match=match):
        config(**kw)


@pytest.mark.parametrize("seed", [0, 1])
def test_decode_fast_path_repeats_exactly_what_the_full_pass_builds(seed, monkeypatch):
    """Reusing the last step's decodes gives the schedules (and so the tokens) of a run that plans every step
    in full, through arrivals, aborts, forks, stops, block boundaries and preemptions; and it does fire."""
    runs = {}
    for fast in (True, False):
        s = Scheduler(config(block_size=8, num_gpu_blocks=24, num_cpu_blocks=8,
                             preemption_mode="swap" if seed else "recompute"))
        hits = []
        if not fast:
            monkeypatch.setattr(s, "_repeat_decodes", lambda: None)
        else:
            full = s._repeat_decodes
            monkeypatch.setattr(s, "_repeat_decodes", lambda: hits.append(full()) or hits[-1])
        schedules = []
        arrivals, aborts = random_workload(seed, 30, 64, with_aborts=True)
        finished, _ = run_to_completion(s, arrivals, aborts, on_step=lambda s, out: schedules.append(
            [(i.seq.request_id, i.seq.index, i.start, i.num_tokens, i.num_samples) for i in out.scheduled]))
        assert_all_blocks_returned(s)
        runs[fast] = (schedules, {rid: [q.token_ids for q in g.seqs] for rid, g in finished.items()},
                      s.stats()["preemptions"])
        if fast:
            assert sum(h is not None for h in hits) >= 8
    assert runs[True] == runs[False]


@pytest.mark.parametrize("seed", [0, 1])
def test_decode_fast_path_a_step_ahead_repeats_what_the_full_pass_builds(seed, monkeypatch):
    """Scheduled a step ahead (asynchronous scheduling), the fast path leaves out a sequence whose token still
    on the device is its last, as the full pass does, and goes on with the others: the same schedules and
    tokens as planning every step in full; and it fires on such steps."""
    runs = {}
    for fast in (True, False):
        s = Scheduler(config(block_size=8, num_gpu_blocks=24, num_cpu_blocks=8,
                             preemption_mode="swap" if seed else "recompute"))
        hits, ending_hits = [], []
        if not fast:
            monkeypatch.setattr(s, "_repeat_decodes", lambda: None)
        else:
            fast_path = s._repeat_decodes

            def counted(fast_path=fast_path, s=s, hits=hits, ending_hits=ending_hits):
                ending = any(q.num_pending and s._ends_by_length(q) for q in s._decoding)
                out = fast_path()
                hits.append(out is not None)
                ending_hits.append(out is not None and ending)
                return out

            monkeypatch.setattr(s, "_repeat_decodes", counted)
        schedules = []
        arrivals, aborts = random_workload(seed, 30, 64, with_aborts=True)
        finished = run_a_step_ahead(s, arrivals, aborts, on_step=lambda s, out: schedules.append(
            [(i.seq.request_id, i.seq.index, i.start, i.num_tokens, i.num_samples) for i in out.scheduled]))
        assert_all_blocks_returned(s)
        runs[fast] = (schedules, {rid: [q.token_ids for q in g.seqs] for rid, g in finished.items()},
                      s.stats()["preemptions"])
        if fast:
            assert sum(hits) >= 8 and sum(ending_hits) >= 1
    assert runs[True] == runs[False]
