"""The engine end to end: exactly the reference generator's tokens, under every scheduling regime."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from nanoforge import LLM, SamplingParams
from nanoforge.errors import NanoforgeError
from nanoforge.model.config import preset
from nanoforge.model.generate import generate
from nanoforge.model.transformer import Transformer
from nanoforge.serve.llm_engine import frozen_heap
from nanoforge.tokenizer import Tokenizer

TEXT = "the quick brown fox jumps over the lazy dog. PACK MY BOX WITH FIVE DOZEN LIQUOR JUGS! 0123456789,;:?'\n"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.char_level(TEXT)


def make_model(tok, name="tiny-llama", seed=0, **kw):
    torch.manual_seed(seed)
    m = Transformer(preset(name, vocab_size=tok.vocab_size, max_seq_len=256, **kw)).eval()
    with torch.no_grad():  # sharper distributions than the 0.02 init: no near-ties in greedy decoding
        for p in m.parameters():
            if p.dim() > 1:
                p.mul_(6.0)
    return m


def prompts(n, rng, lo=3, hi=60, vocab=60):
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def reference(model, ps, max_tokens):
    return [generate(model, p, max_new_tokens=max_tokens) for p in ps]


GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "tiny-qwen3"])
def test_greedy_matches_reference_generator(tok, name):
    model = make_model(tok, name)
    ps = prompts(7, random.Random(1))
    llm = LLM(model, tok, num_gpu_blocks=200)
    got = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY)]
    assert got == reference(model, ps, 20)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_exact_under_preemption_chunked_prefill_and_prefix_cache(tok, mode):
    model = make_model(tok)
    rng = random.Random(2)
    shared = [rng.randrange(60) for _ in range(40)]
    ps = prompts(6, rng) + [shared + p for p in prompts(4, rng, 1, 20)]
    ref = reference(model, ps, 24)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    # 30 blocks of 4 tokens hold one sequence of up to 84 tokens but not ten: preemption must happen.
    llm = LLM(model, tok, block_size=4, num_gpu_blocks=30, max_num_batched_tokens=16, preemption_mode=mode,
              swap_space=0 if mode == "recompute" else 1 << 20)
    got = [o.outputs[0].token_ids for o in llm.generate(ps, params)]
    assert got == ref
    stats = llm.engine.stats()
    assert stats["preemptions"] > 0
    if mode == "swap":
        assert stats["blocks_swapped_out"] > 0 and stats["blocks_swapped_in"] > 0
    assert stats["kv_blocks_used"] == 0  # everything returned


def test_shared_prefix_is_computed_once(tok):
    model = make_model(tok)
    rng = random.Random(3)
    prefix = [rng.randrange(60) for _ in range(64)]
    ps = [prefix + p for p in prompts(5, rng, 2, 9)]
    llm = LLM(model, tok, block_size=16, num_gpu_blocks=100)
    first = llm.generate(ps[:1], GREEDY)
    rest = llm.generate(ps[1:], GREEDY)
    assert all(o.num_cached_tokens == 64 for o in rest)
    assert [o.outputs[0].token_ids for o in first + rest] == reference(model, ps, 20)
    assert llm.engine.stats()["prefix_cache_hit_rate"] > 0.5


def test_step_stats_count_every_computed_token_by_step_kind(tok):
    """The engine's always-on step statistics (`/metrics`' nanoforge_engine_step_seconds): every prompt token it
    computed and every decode token are in exactly one step's count, by kind; the histograms are cumulative."""
    model = make_model(tok)
    rng = random.Random(4)
    ps = prompts(6, rng, 20, 50)
    llm = LLM(model, tok, block_size=16, num_gpu_blocks=100, max_num_batched_tokens=64)
    outs = llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    steps = llm.engine.stats()["steps"]
    computed = sum(len(p) - o.num_cached_tokens for p, o in zip(ps, outs)) + 4 * len(ps)  # the 1st token: prefill
    assert sum(k["tokens"] for k in steps.values()) == computed
    assert steps["prefill"]["steps"] > 0 and steps["decode"]["steps"] > 0
    for k in steps.values():
        assert k["buckets"] == sorted(k["buckets"]) and k["buckets"][-1] <= k["steps"]
        assert k["seconds"] >= 0 and (k["steps"] == 0) == (k["tokens"] == 0)


def test_a_steps_turn_starts_when_the_step_before_it_is_read_back():
    """Hand-computed: step 1 launched at 0 and read back at 3 ms (turn 3 ms); step 2, launched at 1 ms while 1
    ran (asynchronous scheduling), read back at 4 ms (turn 1 ms, not 3); an idle engine's step 3, launched at
    10 ms, read back at 30 ms (turn 20 ms)."""
    from types import SimpleNamespace as NS

    from nanoforge.serve.step_profile import STEP_BUCKETS, StepStats, step_kind

    decode = NS(scheduled=[NS(num_tokens=1), NS(num_tokens=1)])
    prefill = NS(scheduled=[NS(num_tokens=7)])
    mixed = NS(scheduled=[NS(num_tokens=7), NS(num_tokens=1)])
    assert [step_kind([it.num_tokens for it in o.scheduled]) for o in (decode, prefill, mixed, NS(scheduled=[]))] \
        == ["decode", "prefill", "mixed", None]
    stats = StepStats()
    stats.record(prefill, 0.0, 0.003)
    stats.record(decode, 0.001, 0.004)
    stats.record(decode, 0.010, 0.030)
    d = stats.snapshot()["decode"]
    assert (d["steps"], d["tokens"], d["seconds"]) == (2, 4, pytest.approx(0.021))
    assert d["buckets"] == [int(0.001 <= b) + int(0.020 <= b) for b in STEP_BUCKETS]
    assert stats.snapshot()["prefill"]["buckets"] == [int(0.003 <= b) for b in STEP_BUCKETS]


def test_parallel_sampling_and_seeds(tok):
    model = make_model(tok)
    p = prompts(1, random.Random(4), 30, 30)[0]
    llm = LLM(model, tok, num_gpu_blocks=100)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=7, ignore_eos=True)
    out = llm.generate([p], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    samples = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(samples)) > 1  # the four completions diverge
    again = llm.generate([p], params)[0]
    assert [tuple(c.token_ids) for c in again.outputs] == samples  # reproducible
    # completion 0 with seed 7 is what the reference generator draws with seed 7
    ref = generate(model, p, max_new_tokens=16, temperature=1.0, seed=7)
    assert list(samples[0]) == ref


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_final_only_requests_report_once_with_what_cumulative_ones_report_last(tok, async_scheduling):
    """A "final_only" request is in no step's outputs but its last, and that output is a "cumulative" twin's
    last one (text, tokens, logprobs, stop), whatever else the batch holds; the cumulative twin reports every
    step that gave it a token."""
    model = make_model(tok)
    ps = prompts(4, random.Random(5), 5, 30)
    llm = LLM(model, tok, num_gpu_blocks=200, async_scheduling=async_scheduling)
    engine = llm.engine
    base = dict(n=2, temperature=1.0, seed=3, max_tokens=12, logprobs=2, stop=["o"])
    for i, p in enumerate(ps):
        for kind in ("cumulative", "final_only"):
            engine.add_request(p, SamplingParams(**base, output_kind=kind), request_id=f"{kind}-{i}")
    seen: dict[str, list] = {}
    with frozen_heap():
        assert gc.get_freeze_count() > 0  # the loop's heap is frozen while it runs
        while engine.has_unfinished():
            for out in engine.step():
                seen.setdefault(out.request_id, []).append(out)
    assert gc.get_freeze_count() == 0  # and handed back to the collector after
    for i in range(len(ps)):
        cumulative, final = seen[f"cumulative-{i}"], seen[f"final_only-{i}"]
        assert len(final) == 1 and final[0].finished and len(cumulative) > 1
        assert [o.finished for o in cumulative] == [False] * (len(cumulative) - 1) + [True]
        for c, f in zip(cumulative[-1].outputs, final[0].outputs):
            assert (c.text, c.token_ids, c.finish_reason, c.logprobs) == (f.text, f.token_ids, f.finish_reason,
                                                                          f.logprobs)
    with pytest.raises(NanoforgeError, match="output_kind"):
        SamplingParams(output_kind="delta")


def test_frozen_heap_nests_and_thaws_only_at_the_outermost_exit(monkeypatch):
    """The outermost entry freezes and its exit thaws; a nested one does neither. (Counted by the calls: the
    frozen count itself falls whenever a frozen object dies, which another thread can make happen any time.)"""
    with frozen_heap():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    calls = []
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
    with frozen_heap():
        with frozen_heap():
            assert calls == ["freeze"]
        assert calls == ["freeze"]
    assert calls == ["freeze", "unfreeze"]


def test_seeded_request_is_independent_of_batch(tok):
    model = make_model(tok)
    ps = prompts(5, random.Random(5))
    seeded = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=12, seed=123, ignore_eos=True)
    alone = LLM(model, tok, num_gpu_blocks=100).generate([ps[0]], seeded)[0].outputs[0].token_ids
    noisy = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batch = LLM(model, tok, num_gpu_blocks=100).generate(ps, [seeded] + [noisy] * 4)
    assert batch[0].outputs[0].token_ids == alone
    assert alone == generate(model, ps[0], max_new_tokens=12, temperature=0.8, top_k=20, top_p=0.9, seed=123)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_seeded_sampling_survives_preemption(tok, mode):
    """A preempted seeded request continues its draws where it stopped: the tokens of an unpressured run,
    which are the reference generator's."""
    model = make_model(tok)
    ps = prompts(8, random.Random(9), 20, 40)
    params = [SamplingParams(temperature=0.9, top_k=15 if i % 2 else 0, max_tokens=24, seed=50 + i, ignore_eos=True)
              for i in range(len(ps))]
    llm = LLM(model, tok, block_size=4, num_gpu_blocks=30, max_num_batched_tokens=16, preemption_mode=mode,
              swap_space=0 if mode == "recompute" else 1 << 20)
    got = [o.outputs[0].token_ids for o in llm.generate(ps, params)]
    assert llm.engine.stats()["preemptions"] > 0
    assert got == [generate(model, p, max_new_tokens=24, temperature=0.9, top_k=q.top_k, seed=q.seed)
                   for p, q in zip(ps, params)]


def test_stop_strings_stop_ids_and_logprobs(tok):
    model = make_model(tok)
    p = tok.encode("the lazy dog")
    llm = LLM(model, tok, num_gpu_blocks=50)
    full = llm.generate([p], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    text = full.text
    assert len(text) > 6
    stop = text[4:6]
    cut = llm.generate([p], SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True))[0].outputs[0]
    assert cut.text == text[:text.find(stop)] and cut.finish_reason == "stop"
    stop_id = full.token_ids[3]
    by_id = llm.generate([p], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id],
                                             ignore_eos=True))[0].outputs[0]
    assert by_id.token_ids == full.token_ids[:full.token_ids.index(stop_id) + 1]
    assert by_id.finish_reason == "stop"
    lp = llm.generate([p], SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True))[0].outputs[0]
    with torch.no_grad():
        logits = model(torch.tensor([p + lp.token_ids]))[0, len(p) - 1:-1].double()
    ref = torch.log_softmax(logits, dim=-1)
    for i, entry in enumerate(lp.logprobs):
        assert entry["token_id"] == lp.token_ids[i]
        assert abs(entry["logprob"] - ref[i, entry["token_id"]].item()) < 1e-4
        assert [t for t, _ in entry["top"]] == ref[i].topk(3).indices.tolist()


def test_bad_requests_are_rejected_and_engine_keeps_serving(tok):
    model = make_model(tok)
    llm = LLM(model, tok, num_gpu_blocks=100)
    eng = llm.engine
    good = eng.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    cases = [([], {}, "prompt"), ([1] * 300, {}, "prompt"), ([1, 10_000], {}, "prompt"),
             ([1], {"max_tokens": -1}, "max_tokens"), ([1], {"max_tokens": 0, "n": 2}, "n"),
             ([1], {"prompt_logprobs": -1}, "prompt_logprobs"), ([1], {"prompt_logprobs": 10_000}, "prompt_logprobs"),
             ([1], {"top_p": 1.5}, "top_p"), ([1], {"top_p": 0}, "top_p")]
    for prompt, kw, field in cases:
        with pytest.raises(NanoforgeError) as e:
            eng.add_request(prompt, SamplingParams(**kw) if kw else SamplingParams())
        assert e.value.param == field or field in str(e.value)
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    assert outs[good].finished and len(outs[good].outputs[0].token_ids) == 5


def test_abort_frees_blocks(tok):
    model = make_model(tok)
    llm = LLM(model, tok, num_gpu_blocks=100)
    eng = llm.engine
    ids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
           for p in prompts(4, random.Random(6))]
    eng.step()
    eng.step()
    assert eng.stats()["kv_blocks_used"] > 0
    for rid in ids[:2]:
        assert eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    assert eng.stats()["kv_blocks_used"] == 0


def test_throughput_benchmark_counts_what_it_generated():
    from nanoforge.serve.bench_throughput import make_workload, run_engine

    torch.manual_seed(0)
    model = Transformer(preset("tiny-qwen3", max_seq_len=512)).eval()
    prompts, outputs = make_workload(5, 120, 110, vocab=200, seed=3)
    assert all(100 <= len(p) <= 120 for p in prompts) and all(100 <= o <= 110 for o in outputs)
    r, ids = run_engine(model, prompts, outputs, max_num_seqs=4)  # 4 slots for 5 requests: continuous batching
    assert r["output_tokens"] == sum(outputs)  # ignore_eos: every request runs to its max_tokens
    assert [len(t) for t in ids] == outputs  # in the order the requests were given
    assert r["output_tok_s"] == pytest.approx(r["output_tokens"] / r["seconds"])
    assert 0.9 < r["kv_utilization_mean"] <= 1.0


@pytest.mark.skipif(__import__("os").environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")
@pytest.mark.parametrize("name,rope", [("tiny-qwen3", "kernel"), ("tiny-qwen3", "fused"), ("tiny-llama", "fused")])
def test_engine_on_every_triton_kernel_decodes_the_reference_tokens(tok, monkeypatch, name, rope):
    """The engine's GPU path on the CPU (interpreted): RoPE fused with the KV write (in its own kernel, or with
    NANOFORGE_ATTN_ROPE=fused in decode's attention kernel), paged attention, the fused residual add + RMSNorm
    and sampling in Triton give the reference generator's tokens, greedy and seeded."""
    monkeypatch.setenv("NANOFORGE_ATTN_ROPE", rope)
    model = make_model(tok, name)
    ps = prompts(3, random.Random(11), 5, 20)
    seeded = SamplingParams(temperature=0.8, max_tokens=8, seed=5, ignore_eos=True)
    want = [generate(model, p, max_new_tokens=8) for p in ps] + \
        [generate(model, ps[0], max_new_tokens=8, temperature=0.8, seed=5)]
    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")
    llm = LLM(model, tok, num_gpu_blocks=40)
    got = [o.outputs[0].token_ids for o in llm.generate(ps + ps[:1], [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * 3 + [seeded])]
    assert got == want


@pytest.mark.parametrize("max_num_seqs", [6, 20])  # 20: more sequence slots than the smallest bucket's tokens
@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-qwen3"])
def test_graphed_prefill_steps_padded_to_their_bucket_decode_the_reference_tokens(tok, name, max_num_seqs):
    """graph_prefill: prefill and mixed steps packed at a token bucket and every sequence slot (padding tokens
    and zero-length padding sequences), what a CUDA graph replays; on the CPU the same padded step runs
    eagerly, after a warm-up on the idle inputs a graph is captured with. Chunked prompts, prefix hits,
    preemption and seeded rows give the reference generator's tokens."""
    model = make_model(tok, name)
    rng = random.Random(5)
    shared = prompts(1, rng, 40, 40)[0]
    ps = [shared + p if i % 2 else p for i, p in enumerate(prompts(10, rng, 3, 60))]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 8 + \
        [SamplingParams(temperature=0.9, top_k=20, max_tokens=12, seed=7 + i, ignore_eos=True) for i in range(2)]
    want = [generate(model, p, max_new_tokens=12) for p in ps[:8]] + \
        [generate(model, p, max_new_tokens=12, temperature=0.9, top_k=20, seed=7 + i) for i, p in enumerate(ps[8:])]
    llm = LLM(model, tok, num_gpu_blocks=20, max_num_seqs=max_num_seqs, max_num_batched_tokens=48,
              graph_prefill=True)
    runner = llm.engine.runner
    assert runner.batch.prefill_buckets == [16, 32, 48]
    got = [o.outputs[0].token_ids for o in llm.generate(ps, params)]
    assert got == want
    stats = llm.engine.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0
    assert {t for decode, t in runner.graphs if not decode} == {16, 32, 48}  # every bucket captured at start
    assert {t for decode, t in runner.graph_replays if not decode} == {16, 32, 48}  # and used


def test_graphed_prefill_steps_with_the_triton_kernels_decode_the_reference_tokens(tok, monkeypatch):
    """The GPU's default path, interpreted: every step packed at a bucket (the CPU has no decode graphs, so decode
    steps too), with the Triton kernels (paged attention with Qwen3's q/k norms and fused RoPE + KV write, add +
    RMSNorm, the gathers, the sampler; ~11 s a family, so one here: the GPU tests run all four). Padding rows stay
    finite where they are sampled (a NaN there stops the interpreted sampler)."""
    model = make_model(tok, "tiny-qwen3")
    ps = prompts(4, random.Random(9), 3, 30)
    want = [generate(model, p, max_new_tokens=6) for p in ps]
    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")
    llm = LLM(model, tok, num_gpu_blocks=30, max_num_seqs=6, max_num_batched_tokens=32, graph_prefill=True)
    got = [o.outputs[0].token_ids for o in llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=6,
                                                                            ignore_eos=True))]
    assert got == want
    assert sum(llm.engine.runner.graph_replays.values()) > 0


def test_eager_prefill_warm_up_writes_only_the_scratch_block(tok):
    """The GPU runner's start-up warm-up (idle eager steps of 16 tokens and of a full step, to compile the
    attention kernel's prefill variants before any request) leaves every real KV block as it was."""
    from nanoforge.serve.model_runner import ModelRunner

    model = make_model(tok, "tiny-qwen3")
    runner = ModelRunner(model, block_size=16, num_gpu_blocks=32, max_model_len=128, max_num_batched_tokens=64,
                         max_num_seqs=4)
    runner.k_cache[:, :-1].normal_()
    k, v = runner.k_cache[:, :-1].clone(), runner.v_cache[:, :-1].clone()
    runner._warm_up_eager_prefill()
    assert torch.equal(k, runner.k_cache[:, :-1]) and torch.equal(v, runner.v_cache[:, :-1])
    assert runner.k_cache[:, -1].abs().sum() > 0  # it did run: the scratch block was written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_runners_rope_table_holds_the_models_own_angles(tok, dtype):
    """The engine reads RoPE's cos and sin from a table by position (one gather a step): every row is, bit for
    bit, what the model computes for that position; learned positions (GPT-2) have no table."""
    model = make_model(tok, "tiny-llama").to(dtype)
    table = model.rope_table(model.cfg.max_seq_len, dtype)
    positions = torch.tensor([[0, 1, 5, 17, model.cfg.max_seq_len - 1]])
    cos, sin = model.rope(positions, dtype)
    assert table.dtype == dtype and torch.equal(table[positions[0], 0], cos[0, :, 0])
    assert torch.equal(table[positions[0], 1], sin[0, :, 0])
    assert make_model(tok, "tiny-gpt2").rope_table(8, dtype) is None
