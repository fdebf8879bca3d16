"""A step's input gathers in one kernel (kernels/gather.py): the Triton kernel (interpreter; compiled on a GPU)
gives what PyTorch's indexing gives, for RoPE models and learned positions, sampled and given tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import interpreter

from nanoforge.kernels.gather import gather_step_inputs, gather_step_inputs_ref


def case(device, dtype, d=24, head_dim=8, learned=False, n=5, s=3, width=6):
    gen = torch.Generator().manual_seed(d + n)
    embed = torch.randn(50, d, generator=gen).to(device, dtype)
    pos_embed = torch.randn(40, d, generator=gen).to(device, dtype) if learned else None
    rope = None if learned else torch.randn(40, 2, head_dim, generator=gen).to(device, dtype)
    sampled = torch.tensor([31, 7, 44, 2], device=device)
    src = torch.tensor([-1, 2, -1, 0, -1, 3, -1][:n], device=device)
    ids = torch.tensor([5, 0, 49, 0, 12, 0, 3][:n], device=device)
    positions = torch.tensor([0, 17, 39, 3, 4, 8, 1][:n], device=device)
    table = torch.randint(0, 1000, (8, 10), generator=gen, dtype=torch.int32).to(device)
    row_slot = torch.tensor([7, 0, 3, 3][:s], device=device)
    return src, sampled, ids, positions, embed, pos_embed, rope, row_slot, table, width


def naive(src, sampled, ids, positions, embed, pos_embed, rope, row_slot, table, width):
    """Row by row in Python (an independent reference for the PyTorch one)."""
    tokens = [int(sampled[j]) if j >= 0 else int(i) for j, i in zip(src.tolist(), ids.tolist())]
    x = torch.stack([embed[t].float() + (pos_embed[p].float() if pos_embed is not None else 0)
                     for t, p in zip(tokens, positions.tolist())]).to(embed.dtype)
    cs = torch.stack([rope[p] for p in positions.tolist()]) if rope is not None else None
    tables = torch.stack([table[r, :width] for r in row_slot.tolist()])
    return torch.tensor(tokens), x, cs, tables


def check(got, want):
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            assert g.dtype == w.dtype and torch.equal(g.cpu(), w.cpu()), (g, w)


@pytest.mark.parametrize("learned", [False, True])
def test_the_reference_is_the_naive_gathers(learned):
    args = case("cpu", torch.float32, learned=learned)
    check(gather_step_inputs_ref(*args), naive(*args))


@interpreter
@pytest.mark.parametrize("learned,n,s,width,d", [(False, 5, 3, 6, 24), (True, 7, 4, 10, 40), (False, 1, 1, 1, 16)])
def test_triton_gathers_equal_pytorchs(learned, n, s, width, d, monkeypatch):
    """Several column blocks (d 24 and 40 against the interpreter's 16; a table row of 10), one-token steps."""
    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")
    args = case("cpu", torch.float32, d=d, learned=learned, n=n, s=s, width=width)
    got = gather_step_inputs(*args)
    check(got, naive(*args))
    assert got[1].shape == (n, d) and got[3].shape == (s, width) and got[3].is_contiguous()


@pytest.mark.gpu
@pytest.mark.parametrize("learned", [False, True])
def test_gpu_gathers_equal_pytorchs(learned):
    """Compiled (bf16, a Llama-like width and a long table row): the same bits as PyTorch's ops."""
    args = case("cuda", torch.bfloat16, d=2048, head_dim=64, learned=learned, width=10)
    check(gather_step_inputs(*args), gather_step_inputs_ref(*args))
