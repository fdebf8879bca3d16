"""The engine on a GPU, for every model family it serves: its CUDA path (Triton paged attention, fused RoPE + KV
write, SwiGLU and add + RMSNorm, sampling inside the CUDA-graphed decode step, the persistent batch) against
the reference generator on the same GPU, step by step and with asynchronous scheduling (one step in flight,
which only a GPU really runs ahead), under preemption and prefix-cache hits.

fp32 for exactness (the engine and the reference differ by kernel rounding only, ~1e-6, below the gaps of
these sharpened models); bf16, the serving dtype, allowed to part from the reference only at a near-tie of
the fp32 model.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_serve_engine import make_model, prompts, tok  # noqa: F401  (tests/ is on sys.path; tok: the fixture)

from nanoforge import LLM, SamplingParams
from nanoforge.model.generate import generate

pytestmark = pytest.mark.gpu
FAMILIES = ["tiny-gpt2", "tiny-llama", "tiny-qwen2", "tiny-qwen3"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def workload(seed: int) -> list[list[int]]:
    """24 prompts, half of them behind one of two shared 40-token prefixes (prefix-cache hits)."""
    rng = random.Random(seed)
    shared = prompts(2, rng, 40, 40)
    return [shared[i % 2] + p if i % 4 < 2 else p for i, p in enumerate(prompts(24, rng, 3, 50))]


def engine_tokens(model, tok, ps, params, *, async_scheduling: bool, **kw) -> tuple[list[list[int]], dict]:
    # few KV blocks and sequences: requests are preempted and recomputed
    llm = LLM(model, tok, num_gpu_blocks=kw.pop("num_gpu_blocks", 48), max_num_seqs=kw.pop("max_num_seqs", 12),
              async_scheduling=async_scheduling, **kw)
    outs = llm.generate(ps, params)
    stats = llm.engine.stats()
    assert stats["kv_blocks_used"] == 0  # every block came back
    return [o.outputs[0].token_ids for o in outs], stats


def near_tie(model32, prompt: list[int], tokens: list[int], at: int) -> bool:
    """Whether the fp32 model's two best next tokens after prompt + tokens[:at] are within bf16 rounding."""
    with torch.no_grad():
        logits = model32(torch.tensor([prompt + tokens[:at]], device="cuda"))[0, -1].float()
    top2 = logits.topk(2).values
    return (top2[0] - top2[1]).item() < 0.1


@pytest.mark.parametrize("name", FAMILIES)
def test_gpu_engine_greedy_equals_the_reference_fp32(tok, name):
    model = make_model(tok, name).cuda()
    ps = workload(1)
    want = [generate(model, p, max_new_tokens=24) for p in ps]
    for async_scheduling, graph_prefill in ((False, False), (True, False), (False, True), (True, True)):
        got, stats = engine_tokens(model, tok, ps, GREEDY, async_scheduling=async_scheduling,
                                   graph_prefill=graph_prefill,  # graphed: more slots than the 16-token bucket
                                   max_num_seqs=24 if graph_prefill else 12)
        assert got == want, f"{name}, async_scheduling={async_scheduling}, graph_prefill={graph_prefill}"
        assert stats["preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0


@pytest.mark.parametrize("name", FAMILIES)
def test_gpu_engine_with_the_skinny_matmul_equals_the_reference_fp32(tok, name, monkeypatch):
    """NANOFORGE_GEMV=1 (kernels/gemv.py for the decode-sized projections, SwiGLU in MLP-down's prologue):
    the same tokens as the reference generator run without it, with async scheduling and graphed prefill."""
    model = make_model(tok, name).cuda()
    ps = workload(3)
    want = [generate(model, p, max_new_tokens=24) for p in ps]
    monkeypatch.setenv("NANOFORGE_GEMV", "1")
    got, _ = engine_tokens(model, tok, ps, GREEDY, async_scheduling=True, graph_prefill=True, max_num_seqs=24)
    assert got == want, name


@pytest.mark.parametrize("name", FAMILIES)
def test_gpu_engine_with_other_prefill_tiles_equals_the_reference_fp32(tok, name, monkeypatch):
    """NANOFORGE_ATTN_PREFILL_TILE (prefill and mixed steps' attention tile, the lever of gpu_engine.py
    --prefill-variants): the same tokens as the reference generator, graphed steps a step ahead, under preemption
    and prefix hits (chunks after cached prefixes)."""
    model = make_model(tok, name).cuda()
    ps = workload(6)
    want = [generate(model, p, max_new_tokens=24) for p in ps]
    for tile in ("128x64w8s3", "128x128w8s2"):
        monkeypatch.setenv("NANOFORGE_ATTN_PREFILL_TILE", tile)
        got, stats = engine_tokens(model, tok, ps, GREEDY, async_scheduling=True, graph_prefill=True, max_num_seqs=24)
        assert got == want, f"{name}, {tile}"
        assert stats["preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0


@pytest.mark.parametrize("name", FAMILIES)
def test_gpu_engine_greedy_in_bf16_parts_from_the_reference_only_at_near_ties(tok, name, monkeypatch):
    """bf16, the serving dtype, step by step and a step ahead; and with NANOFORGE_SWIGLU_EPILOGUE=1 (a prefill's
    gate-and-up and SwiGLU in one GEMM, `kernels.matmul`'s persistent schedule, at any row count, where the
    default takes it from 1,024 rows; GPT-2's GELU MLP keeps its way)."""
    model32 = make_model(tok, name).cuda()
    model = make_model(tok, name).cuda().to(torch.bfloat16)
    ps = workload(2)
    want = [generate(model, p, max_new_tokens=24) for p in ps]
    for async_scheduling, epilogue in ((False, "0"), (True, "0"), (True, "1")):
        monkeypatch.setenv("NANOFORGE_SWIGLU_EPILOGUE", epilogue)
        got, _ = engine_tokens(model, tok, ps, GREEDY, async_scheduling=async_scheduling)
        for p, g, w in zip(ps, got, want):
            at = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None)
            assert at is None or near_tie(model32, p, w, at), f"{name}: diverged at token {at} without a near-tie"


@pytest.mark.parametrize("name", FAMILIES)
def test_gpu_seeded_sampling_equals_the_reference_in_any_batch(tok, name):
    """Seeded rows (plain, top-k, top-p) drawn in the decode graph: the reference generator's tokens for the same
    seed, in a batch under preemption, alone, and a step ahead."""
    model = make_model(tok, name).cuda()
    ps = workload(3)[:12]
    params = [SamplingParams(temperature=0.8, top_k=(0, 20, 0)[i % 3], top_p=(1.0, 1.0, 0.9)[i % 3], seed=100 + i,
                             max_tokens=16, ignore_eos=True) for i in range(len(ps))]
    want = [generate(model, p, max_new_tokens=16, temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p,
                     seed=sp.seed) for p, sp in zip(ps, params)]
    for async_scheduling in (False, True):
        got, _ = engine_tokens(model, tok, ps, params, async_scheduling=async_scheduling)
        assert got == want, f"{name}, async_scheduling={async_scheduling}"
    alone, _ = engine_tokens(model, tok, ps[:1], params[:1], async_scheduling=True, num_gpu_blocks=400)
    assert alone == want[:1]


def test_gpu_an_engine_after_another_sizes_its_cache_from_the_whole_budget(tok):
    """A second engine in the process gets the memory the first one had (its cache and graph pools held by
    PyTorch's allocator, which the driver counts as used): about as many KV blocks, not next to none."""
    model = make_model(tok, "tiny-llama").cuda()
    first = LLM(model, tok, gpu_memory_utilization=0.3)
    blocks = first.engine.scheduler.config.num_gpu_blocks
    first.generate(prompts(2, random.Random(4)), GREEDY)
    del first
    second = LLM(model, tok, gpu_memory_utilization=0.3)
    assert second.engine.scheduler.config.num_gpu_blocks >= 0.95 * blocks
