"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`) against an independent reference: `transformers`,
loaded from the same saved folder and run in float64, under chunked prefill, the prefix cache, preemption, and
`max_tokens=0` (score the prompt, generate nothing)."""

from __future__ import annotations

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_serve_engine import TEXT, make_model  # noqa: E402  (tests/ is on sys.path under pytest)

from nanoforge import LLM, SamplingParams  # noqa: E402
from nanoforge.model.hf import save_model  # noqa: E402
from nanoforge.serve import model_runner  # noqa: E402
from nanoforge.tokenizer import Tokenizer  # noqa: E402

TOP = 3


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.char_level(TEXT)


@pytest.fixture(scope="module", params=["tiny-gpt2", "tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def saved(request, tok, tmp_path_factory):
    """(folder, float64 transformers model) for one family: the same checkpoint for both sides."""
    folder = tmp_path_factory.mktemp(request.param)
    save_model(make_model(tok, request.param), folder)
    tok.save(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    return folder, hf


def reference(hf, ids: list[int]) -> torch.Tensor:
    """float64 log-softmax of transformers' logits over the prompt: row i scores token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)


def check(hf, ids: list[int], got: list, k: int = TOP) -> None:
    assert len(got) == len(ids) and got[0] is None  # nothing predicts the first token
    ref = reference(hf, ids)
    for i in range(1, len(ids)):
        entry, row = got[i], ref[i - 1]
        assert entry["token_id"] == ids[i]
        assert entry["logprob"] == pytest.approx(row[ids[i]].item(), abs=1e-4), i
        assert [t for t, _ in entry["top"]] == row.topk(k).indices.tolist()
        assert [v for _, v in entry["top"]] == pytest.approx(row.topk(k).values.tolist(), abs=1e-4)


def random_prompts(rng: random.Random, n: int, lo: int, hi: int) -> list[list[int]]:
    return [[rng.randrange(60) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_prompt_logprobs_equal_transformers_under_chunked_prefill(saved, tok, monkeypatch):
    folder, hf = saved
    monkeypatch.setattr(model_runner, "SCORE_ROWS", 4)  # a step's prompt positions go through lm_head in slices
    rng = random.Random(0)
    ps = [[7]] + random_prompts(rng, 5, 2, 45)
    # chunks of at most 7 tokens: every long prompt is scored over several steps, beside other requests
    llm = LLM(str(folder), block_size=4, num_gpu_blocks=200, max_num_batched_tokens=7, device="cpu",
              dtype="float32")
    with_lp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=1, prompt_logprobs=TOP)
    without = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = llm.generate(ps, [with_lp, without] * 3)
    for p, out in zip(ps[::2], outs[::2]):
        check(hf, p, out.prompt_logprobs)
        assert len(out.outputs[0].token_ids) == 3  # generation goes on after the prompt
    assert all(out.prompt_logprobs is None for out in outs[1::2])
    # the sampled tokens' logprobs come from the same routine and agree with the reference too
    p, out = ps[2], outs[2]
    full = p + out.outputs[0].token_ids
    ref = reference(hf, full)
    for j, entry in enumerate(out.outputs[0].logprobs):
        assert entry["logprob"] == pytest.approx(ref[len(p) - 1 + j, full[len(p) + j]].item(), abs=1e-4)


def test_prefix_cache_never_skips_a_scored_prompt_token(saved, tok):
    folder, hf = saved
    rng = random.Random(1)
    prefix = random_prompts(rng, 1, 24, 24)[0]  # six full blocks of 4
    a, b = prefix + [3, 1, 4], prefix + [1, 5, 9, 2]
    llm = LLM(str(folder), block_size=4, num_gpu_blocks=200, device="cpu", dtype="float32")
    plain = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    scored = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=TOP)
    llm.generate([a], plain)
    assert llm.generate([b], plain)[0].num_cached_tokens == 24  # the prefix is in the cache ...
    out = llm.generate([b], scored)[0]
    assert out.num_cached_tokens == 0  # ... but a request that scores its prompt computes it all
    check(hf, b, out.prompt_logprobs)
    assert out.outputs[0].token_ids == llm.generate([b], plain)[0].outputs[0].token_ids


def test_prompt_logprobs_survive_preemption(tok):
    """Requests preempted (recomputed) while scoring their prompts: every entry once, all correct."""
    model = make_model(tok)
    rng = random.Random(2)
    ps = random_prompts(rng, 8, 30, 60)
    # 30 blocks of 4 tokens hold at most two of these at once: the later ones are preempted and recomputed
    llm = LLM(model, tok, block_size=4, num_gpu_blocks=30, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate(ps, params)
    assert llm.engine.stats()["preemptions"] > 0
    alone = LLM(model, tok, num_gpu_blocks=200).generate(ps, params)
    for out, ref in zip(outs, alone):
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ref.prompt_logprobs)
        for e, r in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
            assert e["token_id"] == r["token_id"] and e["logprob"] == pytest.approx(r["logprob"], abs=1e-5)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert llm.engine.stats()["kv_blocks_used"] == 0


def test_max_tokens_zero_scores_the_prompt_only(saved, tok):
    folder, hf = saved
    llm = LLM(str(folder), block_size=4, num_gpu_blocks=200, max_num_batched_tokens=5, device="cpu",
              dtype="float32")
    context = llm.engine.max_model_len
    p = random_prompts(random.Random(3), 1, context, context)[0]  # the whole context: nothing has to follow
    out = llm.generate([p], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    c = out.outputs[0]
    assert out.finished and c.token_ids == [] and c.text == "" and c.finish_reason == "length"
    check(hf, p, out.prompt_logprobs, k=0)
    assert all(e["top"] == [] for e in out.prompt_logprobs[1:])
    assert llm.engine.stats()["kv_blocks_used"] == 0


@pytest.mark.gpu
def test_prompt_logprobs_on_the_gpu_equal_transformers(saved, tok):
    """On CUDA the engine prefills through our Triton paged-attention kernels (several chunks per prompt
    here): its fp32 prompt logprobs still match float64 transformers, to the kernels' fp32-on-tensor-core
    rounding (top alternatives compared by value: near-ties may swap places)."""
    folder, hf = saved
    ps = random_prompts(random.Random(1), 4, 2, 45)
    llm = LLM(str(folder), num_gpu_blocks=200, max_num_batched_tokens=32, device="cuda", dtype="float32")
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=TOP))
    for p, out in zip(ps, outs):
        got, ref = out.prompt_logprobs, reference(hf, p)
        assert len(got) == len(p) and got[0] is None
        for i in range(1, len(p)):
            assert got[i]["logprob"] == pytest.approx(ref[i - 1, p[i]].item(), abs=5e-3), i
            assert [v for _, v in got[i]["top"]] == pytest.approx(ref[i - 1].topk(TOP).values.tolist(), abs=5e-3)
