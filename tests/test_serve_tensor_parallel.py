"""Tensor-parallel inference on the CPU: 2 processes over gloo on loopback give the same tokens as one process
(greedy, seeded sampling, n > 1, preemption by recomputation and by swapping, prefix hits), for Llama and Qwen3
shapes; a model whose heads do not split is refused in one line."""

from __future__ import annotations

import random

import pytest
import torch

from test_serve_engine import TEXT, make_model, prompts  # noqa: E402  (tests/ is on sys.path under pytest)

from nanoforge import LLM, SamplingParams
from nanoforge.cli import main
from nanoforge.errors import NanoforgeError
from nanoforge.model.generate import generate
from nanoforge.serve.tensor_parallel import shard_model
from nanoforge.tokenizer import Tokenizer


def workload(rng):
    shared = [rng.randrange(60) for _ in range(24)]
    ps = prompts(4, rng, 5, 40) + [shared + p for p in prompts(3, rng, 1, 10)]
    greedy = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    seeded = SamplingParams(n=2, temperature=1.0, top_k=8, max_tokens=10, seed=11, ignore_eos=True)
    return ps, [seeded if i % 3 == 1 else greedy for i in range(len(ps))]


def completions(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("name, kw, async_scheduling", [("tiny-llama", {}, False), ("tiny-qwen3", {"n_kv_heads": 2}, False),
                                                       ("tiny-llama", {}, True)])
@pytest.mark.parametrize("graph_prefill", [False, True])
def test_two_ranks_generate_what_one_process_does(name, kw, async_scheduling, graph_prefill):
    """async_scheduling: each step launched before the one before it is read back; the second rank reads the
    pending tokens from its copy of the sampled ones, which the first broadcasts after each step. graph_prefill:
    prefill and mixed steps padded to a token bucket on both ranks (on a GPU, a CUDA graph each, the all-reduces
    inside; on the CPU run eagerly)."""
    tok = Tokenizer.char_level(TEXT)
    model = make_model(tok, name, **kw)
    ps, params = workload(random.Random(0))
    # a cache too small for the whole batch: preemption (swapping here) happens on both ranks alike
    engine_kw = dict(block_size=4, num_gpu_blocks=36, max_num_batched_tokens=24, preemption_mode="swap",
                     swap_space=1 << 20)
    one = completions(LLM(model, tok, **engine_kw).generate(ps, params))
    llm = LLM(model, tok, tensor_parallel_size=2, async_scheduling=async_scheduling, graph_prefill=graph_prefill,
              **engine_kw)
    try:
        two = completions(llm.generate(ps, params))
        stats = llm.engine.stats()
        padded = [t for decode, t in llm.engine.runner.graph_replays if not decode]  # prefill steps at a bucket
        assert bool(padded) == graph_prefill
    finally:
        llm.engine.close()
    assert two == one
    assert stats["preemptions"] > 0 and stats["cached_prompt_tokens"] > 0
    assert one[0][0] == generate(model, ps[0], max_new_tokens=14)  # and both are the reference generator's
    assert llm.engine.model.layers[0].attn.n_heads == model.cfg.n_heads // 2  # the engine ran a shard
    assert llm.engine.async_scheduling == async_scheduling


def test_a_shard_holds_its_heads_and_sums_to_the_whole_layer():
    """Rank r's q/k/v rows are its heads' rows of the whole projection, and the two ranks' partial outputs of
    wo add up to the unsplit layer's (checked without a process group: the all-reduce is the sum)."""
    tok = Tokenizer.char_level(TEXT)
    model = make_model(tok, "tiny-llama")
    cfg = model.cfg
    x = torch.randn(3, cfg.q_dim)
    whole = model.layers[0].attn.wo(x)
    parts = []
    for rank in range(2):
        import copy

        shard = copy.deepcopy(model)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.distributed, "all_reduce", lambda t, group=None: None)
            shard_model(shard, rank, 2, group=None)
            half = cfg.q_dim // 2
            parts.append(shard.layers[0].attn.wo(x[:, rank * half:(rank + 1) * half]))
        hd = cfg.head_dim
        w = model.layers[0].attn.wqkv.weight
        rows = shard.layers[0].attn.wqkv.weight
        q = slice(rank * cfg.n_heads // 2 * hd, (rank + 1) * cfg.n_heads // 2 * hd)
        kv = cfg.n_kv_heads // 2 * hd
        assert torch.equal(rows[:q.stop - q.start], w[q])
        assert torch.equal(rows[q.stop - q.start:][:kv], w[cfg.q_dim + rank * kv:cfg.q_dim + (rank + 1) * kv])
    torch.testing.assert_close(parts[0] + parts[1], whole)


def test_heads_that_do_not_split_are_one_line():
    tok = Tokenizer.char_level(TEXT)
    model = make_model(tok, "tiny-llama")  # 4 query heads, 2 KV heads
    with pytest.raises(NanoforgeError, match="--tensor-parallel-size 3 must divide"):
        LLM(model, tok, tensor_parallel_size=3)
    with pytest.raises(NanoforgeError, match="--tensor-parallel-size 4 must divide"):
        LLM(model, tok, tensor_parallel_size=4)


def test_cli_refuses_a_split_that_does_not_divide(capsys):
    rc = main(["bench", "throughput", "--device", "cpu", "--model-preset", "tiny-qwen3", "--num-requests", "1",
               "--tensor-parallel-size", "2", "--no-baseline"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--tensor-parallel-size 2 must divide" in err[0]
