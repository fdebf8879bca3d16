"""kernels/prefetch.py: which bytes a decode layer asks L2 for ahead of its projections, the switch, where the
model calls it, and that it launches nothing where it cannot run. The kernel's PTX is checked in
test_kernels_inspect.py, where it is compiled for sm_90; its effect on the engine's tokens is checked by
test_serve_gpu.py on a GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import interpreter

from nanoforge.errors import NanoforgeError
from nanoforge.kernels import prefetch as pf

MiB = 1 << 20


def llama_1b_mlp_weights():
    """Llama-3.2-1B's attention-out, gate-and-up and down weights (bf16), shapes only."""
    return tuple(torch.empty(shape, dtype=torch.bfloat16, device="meta")
                 for shape in ((2048, 2048), (16384, 2048), (2048, 8192)))


def test_the_budget_takes_whole_weights_in_order_then_the_start_of_the_next():
    wo, w_in, w_out = llama_1b_mlp_weights()  # 8, 64 and 32 MiB
    assert [(w.shape, n) for w, n in pf.plan((wo, w_in, w_out), 32 * MiB)] == [(wo.shape, 8 * MiB),
                                                                                (w_in.shape, 24 * MiB)]
    assert [n for _, n in pf.plan((wo, w_in, w_out), 200 * MiB)] == [8 * MiB, 64 * MiB, 32 * MiB]
    assert [n for _, n in pf.plan((wo, w_in, w_out), 4 * MiB + 5)] == [4 * MiB]  # multiples of 16 bytes
    assert [n for _, n in pf.plan((wo, w_in, w_out), 8 * MiB + 100)] == [8 * MiB, 96]
    assert pf.plan((wo, w_in, w_out), 15) == [] and pf.plan((wo,), 0) == []
    # a weight that is not one dense range ends the list (its bytes from data_ptr are not its elements)
    assert [n for _, n in pf.plan((wo, w_in.t(), w_out), 200 * MiB)] == [8 * MiB]
    assert pf.plan((torch.zeros(64, dtype=torch.bfloat16)[1:],), MiB) == []  # 2-byte aligned


def test_the_switch_is_a_number_of_mib_off_by_default(monkeypatch):
    monkeypatch.delenv("NANOFORGE_PREFETCH_AHEAD_MB", raising=False)
    assert pf.ahead_bytes() == 0
    monkeypatch.setenv("NANOFORGE_PREFETCH_AHEAD_MB", "32")
    assert pf.ahead_bytes() == 32 * MiB
    monkeypatch.setenv("NANOFORGE_PREFETCH_AHEAD_MB", "0.5")
    assert pf.ahead_bytes() == MiB // 2
    monkeypatch.setenv("NANOFORGE_PREFETCH_AHEAD_MB", "-4")
    assert pf.ahead_bytes() == 0
    monkeypatch.setenv("NANOFORGE_PREFETCH_AHEAD_MB", "lots")
    with pytest.raises(NanoforgeError, match="^NANOFORGE_PREFETCH_AHEAD_MB must be a number of MiB, not 'lots'$"):
        pf.ahead_bytes()


class _NoLaunch:
    def __getitem__(self, grid):
        raise AssertionError("the prefetch kernel was launched")


def test_nothing_launches_where_the_bulk_prefetch_cannot_run(monkeypatch):
    """CPU tensors, the interpreter, or the switch at 0: a no-op."""
    monkeypatch.setattr(pf, "_prefetch_kernel", _NoLaunch())
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    monkeypatch.setenv("NANOFORGE_PREFETCH_AHEAD_MB", "32")
    assert pf.prefetch_ahead(w, w) is None
    monkeypatch.setenv("NANOFORGE_PREFETCH_AHEAD_MB", "0")
    assert pf.prefetch_ahead(w) is None


@interpreter
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-gpt2"])
def test_a_decode_layer_asks_for_the_weights_it_reads_after_attention(monkeypatch, name):
    """The fused decode path of every SwiGLU block calls prefetch_ahead once, after its Q/K/V projection, with
    attention-out, gate-and-up and down, in that order, and the logits do not change. GPT-2's blocks (GELU)
    take the unfused path and never call it; more rows than the skinny matmul takes never do."""
    from nanoforge.model import transformer
    from nanoforge.model.config import preset

    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")
    monkeypatch.setenv("NANOFORGE_GEMV", "1")
    calls = []
    monkeypatch.setattr(transformer, "prefetch_ahead", lambda *ws: calls.append(ws))
    torch.manual_seed(0)
    model = transformer.Transformer(preset(name)).eval()
    ids = torch.randint(0, model.cfg.vocab_size, (1, 5))
    with torch.no_grad():
        got = model(ids)
        if name == "tiny-gpt2":
            assert calls == []
            return
        assert [tuple(map(id, ws)) for ws in calls] == [
            (id(b.attn.wo.weight), id(b.mlp.w_in.weight), id(b.mlp.w_out.weight)) for b in model.layers]
        calls.clear()
        monkeypatch.setattr(transformer, "prefetch_ahead", pf.prefetch_ahead)
        monkeypatch.setenv("NANOFORGE_PREFETCH_AHEAD_MB", "64")
        torch.testing.assert_close(model(ids), got, rtol=0, atol=0)
        monkeypatch.setattr(transformer, "prefetch_ahead", lambda *ws: calls.append(ws))
        model(torch.randint(0, model.cfg.vocab_size, (2, 9)))  # 18 rows: a prefill's path
    assert calls == []


def test_a_launch_passes_each_range_and_pads_the_unused_slots_with_no_bytes(monkeypatch):
    """On a Hopper GPU (stood in for here) one launch of PROGRAMS programs takes (weight, bytes) per slot:
    the plan's ranges, then empty slots."""
    launches = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **meta: launches.append((grid, args, meta))

    monkeypatch.setattr(pf, "_prefetch_kernel", Kernel())
    monkeypatch.setattr(pf, "interpreting", lambda: False)
    monkeypatch.setattr(pf.pdl, "hopper", lambda device: True)
    monkeypatch.setattr(pf.pdl, "enabled", lambda t: 1)
    monkeypatch.setenv("NANOFORGE_PREFETCH_AHEAD_MB", "32")
    wo, w_in, w_out = llama_1b_mlp_weights()
    pf.prefetch_ahead(wo, w_in, w_out)
    (grid, args, meta), = launches
    assert grid == (pf.PROGRAMS,) and meta["PDL"] == 1 and meta["launch_pdl"] is True
    assert [a if isinstance(a, int) else a.shape for a in args] == [wo.shape, 8 * MiB, w_in.shape, 24 * MiB,
                                                                    wo.shape, 0]
