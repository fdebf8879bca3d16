"""The KV connector on a GPU, for every model family: prompt blocks copied out of the device cache into the
page-locked staging buffer (asynchronously, slot by slot), through a real Mooncake Store, and into another
engine's device cache, which computes only the rest and schedules a step ahead (it only loads). Greedy tokens
equal the reference generator's in fp32, and the loaded blocks hold bit for bit what the first engine computed."""

from __future__ import annotations

import random

import pytest
import torch
from disagg_helpers import close_all, need_mooncake, run_engine
from test_serve_engine import make_model, prompts, tok  # noqa: F401  (tok: the fixture)

from nanoforge import SamplingParams
from nanoforge.model.generate import generate
from nanoforge.serve.llm_engine import EngineConfig, LLMEngine

pytestmark = pytest.mark.gpu
need_mooncake()

from nanoforge.serve.disagg.mooncake_store import MooncakeMaster, MooncakeStore  # noqa: E402

FAMILIES = ["tiny-gpt2", "tiny-llama", "tiny-qwen2", "tiny-qwen3"]
BS = 16


@pytest.fixture(scope="module")
def stores():
    with MooncakeMaster() as master:
        clients = [MooncakeStore(master.address, segment_bytes=256 << 20) for _ in range(2)]
        yield clients
        close_all(clients)


def run(engine: LLMEngine, ps, params):
    return run_engine(engine, ps, params, timeout=120)


@pytest.mark.parametrize("name", FAMILIES)
def test_gpu_blocks_through_the_pool_are_exact_and_bit_for_bit(tok, stores, name):
    model = make_model(tok, name).cuda()
    rng = random.Random(7)
    shared = prompts(2, rng, 70, 70)  # 4 full blocks each
    ps = [shared[i % 2] + p for i, p in enumerate(prompts(8, rng, 1, 40))] + prompts(4, rng, 3, 60)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    a = LLMEngine(model, tok, EngineConfig(num_gpu_blocks=64, block_size=BS), kv_pool=stores[0])
    b = LLMEngine(model, tok, EngineConfig(num_gpu_blocks=64, block_size=BS, kv_pool_save=False,
                                           async_scheduling=True), kv_pool=stores[1])
    try:
        for out in run(a, shared, params):
            assert out.kv_save.result(timeout=30) == 4
        got = [o.outputs[0].token_ids for o in run(b, ps, params)]
        assert got == [generate(model, p, max_new_tokens=12) for p in ps]
        stats = b.stats()
        assert stats["kv_pool"]["loaded_blocks"] >= 8 and stats["kv_blocks_used"] == 0
        torch.cuda.synchronize()
        cached_a = dict(a.scheduler.block_manager._cached)
        shared_keys = [k for k in b.scheduler.block_manager._cached if k in cached_a]
        assert len(shared_keys) >= 8
        for key in shared_keys:
            ia, ib = cached_a[key], b.scheduler.block_manager._cached[key]
            assert torch.equal(a.runner.k_cache[:, ia], b.runner.k_cache[:, ib])
            assert torch.equal(a.runner.v_cache[:, ia], b.runner.v_cache[:, ib])
    finally:
        a.close()
        b.close()
