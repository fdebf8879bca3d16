"""Asynchronous scheduling: the engine schedules and launches step n + 1 before it reads step n's tokens back.

On the CPU the device work is synchronous, but the one-step lag (placeholder tokens filled on the device,
sequences that finish at step n while scheduled in n + 1, forks at schedule time) is the same bookkeeping as
on a GPU. Every test runs the async engine against the sync engine and, where it applies, the reference
generator, and checks that no KV block is left in use.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_serve_api import model  # noqa: F401  (the same fixture)
from test_serve_engine import make_model, prompts, reference, tok  # noqa: F401  (tests/ is on sys.path; tok: the fixture)

from nanoforge import LLM, SamplingParams
from nanoforge.model.generate import generate
from nanoforge.serve.llm_engine import EngineConfig, LLMEngine, check_async_scheduling


def summary(outs) -> list:
    """What a client sees, cache hits aside (under preemption the lag changes which blocks are still cached)
    and logprobs to 1e-5 (a batch of another size rounds fp32 matmuls differently)."""
    def approx(entries):
        return entries and [(e["token_id"], pytest.approx(e["logprob"], abs=1e-5),
                             [(t, pytest.approx(v, abs=1e-5)) for t, v in e["top"]]) if e else e for e in entries]
    return [(o.request_id, [(c.index, c.token_ids, c.text, c.finish_reason, approx(c.logprobs)) for c in o.outputs],
             approx(o.prompt_logprobs)) for o in outs]


def run(model, tok, ps, params, async_scheduling: bool, **kw):
    """Generate with one engine; check every block came back; return the outputs, the number of tokens
    that were sampled for a sequence already finished (discarded: the lag's extra step) and the LLM, whose
    `pending_preemptions` counts the groups preempted while a token of theirs was still on the device."""
    llm = LLM(model, tok, async_scheduling=async_scheduling, **kw)
    discarded = []
    update, preempt = llm.engine.scheduler.update, llm.engine.scheduler._preempt
    llm.pending_preemptions = 0

    def counting_preempt(group, out):
        llm.pending_preemptions += any(q.num_pending for q in group.unfinished_seqs())
        return preempt(group, out)

    llm.engine.scheduler._preempt = counting_preempt

    def counting_update(out, *a, **k):
        discarded.append(sum(i.num_samples for i in out.scheduled if i.seq.is_finished))
        return update(out, *a, **k)

    llm.engine.scheduler.update = counting_update
    outs = llm.generate(ps, params)
    assert llm.engine.stats()["kv_blocks_used"] == 0  # every block returned
    assert not llm.engine._in_flight
    return outs, sum(discarded), llm


def both(model, tok, ps, params, **kw):
    """Sync and async outputs (they must be equal) and the async run's discarded samples and LLM."""
    sync, sync_discarded, _ = run(model, tok, ps, params, False, **kw)
    assert sync_discarded == 0
    out, discarded, llm = run(model, tok, ps, params, True, **kw)
    assert summary(out) == summary(sync)
    return out, discarded, llm


def test_greedy_matches_sync_engine_and_reference(tok, model):
    ps = prompts(7, random.Random(1))
    out, _, _ = both(model, tok, ps, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                     num_gpu_blocks=200)
    assert [o.outputs[0].token_ids for o in out] == reference(model, ps, 20)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_exact_under_preemption_chunked_prefill_and_prefix_cache(tok, model, mode):
    rng = random.Random(2)
    shared = [rng.randrange(60) for _ in range(40)]
    ps = prompts(6, rng) + [shared + p for p in prompts(4, rng, 1, 20)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    out, _, llm = both(model, tok, ps, params, block_size=4, num_gpu_blocks=30, max_num_batched_tokens=16,
                       preemption_mode=mode, swap_space=0 if mode == "recompute" else 1 << 20)
    assert [o.outputs[0].token_ids for o in out] == reference(model, ps, 24)
    stats = llm.engine.stats()
    assert stats["preemptions"] > 0 and stats["cached_prompt_tokens"] > 0
    assert llm.pending_preemptions > 0  # preempted with its last token still to come from the device
    if mode == "swap":
        assert stats["blocks_swapped_out"] > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_seeded_sampling_under_preemption_matches_reference(tok, model, mode):
    ps = prompts(8, random.Random(9), 20, 40)
    params = [SamplingParams(temperature=0.9, top_k=15 if i % 2 else 0, max_tokens=24, seed=50 + i, ignore_eos=True)
              for i in range(len(ps))]
    out, _, llm = both(model, tok, ps, params, block_size=4, num_gpu_blocks=30, max_num_batched_tokens=16,
                       preemption_mode=mode, swap_space=0 if mode == "recompute" else 1 << 20)
    assert llm.engine.stats()["preemptions"] > 0
    assert [o.outputs[0].token_ids for o in out] == [
        generate(model, p, max_new_tokens=24, temperature=0.9, top_k=q.top_k, seed=q.seed) for p, q in zip(ps, params)]


def test_parallel_sampling_forks_at_schedule_time(tok, model):
    ps = prompts(3, random.Random(4), 20, 30)
    params = [SamplingParams(n=4, temperature=1.0, max_tokens=12 + i, seed=7 + i, ignore_eos=True) for i in range(3)]
    out, _, _ = both(model, tok, ps, params, num_gpu_blocks=100, block_size=8)
    assert all(len({tuple(c.token_ids) for c in o.outputs}) > 1 for o in out)
    assert out[0].outputs[0].token_ids == generate(model, ps[0], max_new_tokens=12, temperature=1.0, seed=7)


def test_stops_one_step_before_a_scheduled_step(tok, model):
    """Sequences that end at step n (stop string, stop token id, eos) were already scheduled in step n + 1:
    their extra token is dropped, their text, tokens and finish reasons are the sync engine's."""
    rng = random.Random(11)
    ps = [tok.encode(t) for t in ("the lazy dog", "quick brown", "PACK MY BOX", "five dozen")] + prompts(4, rng)
    full = [o.outputs[0] for o in LLM(model, tok, num_gpu_blocks=100).generate(
        ps, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))]
    params = []
    for i, c in enumerate(full):
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=30, stop=[c.text[5:7]], ignore_eos=True))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[c.token_ids[6]],
                                         ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0.7, max_tokens=30, seed=i, logprobs=2))
    eos_model = make_model(tok)
    eos_model.cfg.eos_token_id = full[2].token_ids[4]  # some greedy requests meet the eos token early
    out, discarded, _ = both(eos_model, tok, ps, params, num_gpu_blocks=100)
    reasons = [o.outputs[0].finish_reason for o in out]
    assert reasons.count("stop") >= 4 and "length" in reasons or reasons.count("stop") >= 5
    assert discarded > 0  # the lag did schedule finished sequences one more step


def test_prompt_logprobs_and_max_tokens_zero(tok, model):
    ps = prompts(4, random.Random(12), 20, 50)
    params = [SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=1),
              SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=0)]
    out, _, _ = both(model, tok, ps, params, num_gpu_blocks=100, max_num_batched_tokens=16, block_size=4)
    assert out[1].finished and out[1].outputs[0].token_ids == [] and len(out[1].prompt_logprobs) == len(ps[1])


def test_shared_prefix_hits_the_cache(tok, model):
    rng = random.Random(3)
    prefix = [rng.randrange(60) for _ in range(64)]
    ps = [prefix + p for p in prompts(5, rng, 2, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    llm = LLM(model, tok, num_gpu_blocks=100, async_scheduling=True)
    first = llm.generate(ps[:1], params)
    rest = llm.generate(ps[1:], params)
    assert all(o.num_cached_tokens == 64 for o in rest)
    assert [o.outputs[0].token_ids for o in first + rest] == reference(model, ps, 20)
    assert llm.engine.stats()["kv_blocks_used"] == 0


def test_abort_mid_stream(tok, model):
    ps = prompts(5, random.Random(6))
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    eng = LLMEngine(model, tok, EngineConfig(num_gpu_blocks=100, async_scheduling=True))
    ids = [eng.add_request(p, params) for p in ps]
    final = {}
    for i in range(200):
        if not eng.has_unfinished():
            break
        if i == 4:
            assert eng._in_flight  # a step is in flight while its requests are aborted
            for rid in ids[:2]:
                assert eng.abort(rid)
        for o in eng.step():
            final[o.request_id] = o
            assert not o.finished or o.request_id not in ids[:2]
    assert eng.stats()["kv_blocks_used"] == 0
    assert [final[r].outputs[0].token_ids for r in ids[2:]] == reference(model, ps[2:], 30)


def test_default_and_unsupported_combinations():
    assert check_async_scheduling(EngineConfig(), torch.device("cpu"), None) is False
    assert check_async_scheduling(EngineConfig(), torch.device("cuda"), None) is True  # the GPU default
    assert check_async_scheduling(EngineConfig(async_scheduling=True), torch.device("cuda"), None) is True
    # tensor parallelism: every rank holds the sampled tokens (test_serve_tensor_parallel.py runs it a step ahead)
    assert check_async_scheduling(EngineConfig(tensor_parallel_size=2), torch.device("cuda"), None) is True
    # saving to a pool: when asked (test_disagg_pool.py runs it), not by default until a GPU has measured it
    assert check_async_scheduling(EngineConfig(), torch.device("cuda"), object()) is False
    assert check_async_scheduling(EngineConfig(async_scheduling=True), torch.device("cuda"), object()) is True
    assert check_async_scheduling(EngineConfig(kv_pool_save=False), torch.device("cuda"), object()) is True


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_logprobs_of_scattered_rows_are_each_requests_own(tok, model, async_scheduling):
    """Rows 1 and 3 of 4 ask for logprobs (the runner keeps the span of rows 1-3 past the step): each gets
    the entries it gets alone."""
    ps = prompts(4, random.Random(3))
    lp = SamplingParams(temperature=0, max_tokens=5, logprobs=2, ignore_eos=True)
    plain = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    batch = LLM(model, tok, num_gpu_blocks=100, async_scheduling=async_scheduling).generate(ps, [plain, lp, plain, lp])
    for i in (1, 3):
        alone = LLM(model, tok, num_gpu_blocks=100).generate([ps[i]], lp)[0].outputs[0].logprobs
        got = batch[i].outputs[0].logprobs
        assert [e["token_id"] for e in got] == [e["token_id"] for e in alone]
        assert [e["logprob"] for e in got] == pytest.approx([e["logprob"] for e in alone], abs=1e-5)
    assert batch[0].outputs[0].logprobs is None
