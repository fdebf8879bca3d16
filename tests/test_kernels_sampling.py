"""Sampling kernel (kernels/sampling.py): the PyTorch Philox equals Triton's bit for bit; the Triton sampler
(interpreter) draws the reference's tokens; draws follow softmax(logits / T); a row's draw depends only on
its seed and draw index."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from conftest import interpreter

from nanoforge.kernels import sampling
from nanoforge.kernels.sampling import philox_uniform_ref, sample_tokens, sample_tokens_ref

SEEDS = torch.tensor([0, 7, 2**62 + 12345, 2**63 - 1, 123456789012345, -5], dtype=torch.int64)
DRAWS = torch.tensor([0, 3, 1000, 2**31 + 5, 17, 2**32 - 1], dtype=torch.int64)


@triton.jit
def _rand_rows(SEEDS, DRAWS, OUT, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    counter = (tl.load(DRAWS + row) << 32) | offs.to(tl.int64)
    tl.store(OUT + row * BLOCK + offs, tl.rand(tl.load(SEEDS + row), counter))


@interpreter
def test_reference_philox_is_tritons_bit_for_bit():
    out = torch.empty(len(SEEDS), 128)
    _rand_rows[(len(SEEDS),)](SEEDS, DRAWS, out, BLOCK=128)
    ref = philox_uniform_ref(SEEDS, DRAWS, 128)
    assert torch.equal(out, ref)
    assert ref.min() >= 0 and ref.max() < 1 and len(set(ref[:, 0].tolist())) == len(SEEDS)


@interpreter
@pytest.mark.parametrize("vocab", [1, 37, 160])
def test_triton_sampler_draws_the_references_tokens(vocab, monkeypatch):
    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(len(SEEDS), vocab, generator=gen) * 3
    logits[0, vocab // 2:] = logits[0].max()  # a greedy row with a tie: the first largest wins
    temperature = torch.tensor([0.0, 1.0, 0.6, 2.0, 0.0, 1.3])
    if vocab > 1:
        logits[2, ::2] = float("-inf")  # a filtered row never draws a removed token
    got = sample_tokens(logits, temperature, SEEDS, DRAWS)
    want = sample_tokens_ref(logits, temperature, SEEDS, DRAWS)
    assert torch.equal(got, want)
    assert got[0] == logits[0].argmax() and (vocab == 1 or got[2] % 2 == 1)
    out = torch.full((len(SEEDS),), -1)
    assert sample_tokens(logits, temperature, SEEDS, DRAWS, out=out) is out and torch.equal(out, want)


@interpreter
def test_triton_sampler_gathers_each_rows_temperature_and_seed_from_its_slot(monkeypatch):
    """`slots`: the per-slot tables gathered in the kernel, as the engine's indexing did them before."""
    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 70, generator=gen) * 2
    slot_temperature = torch.tensor([0.9, 0.0, 1.7, 0.5, 1.0, 0.0, 2.0, 0.0])
    slot_seed = torch.tensor([11, 2**63 - 2, 5, -1, 77, 0, 2**62, 9], dtype=torch.int64)
    slots = torch.tensor([6, 1, 3, 6])
    offsets = torch.tensor([0, 4, 3, 5])  # (a fork's completions: one slot, seeds s + i; 2**63 - 2 + 4 wraps)
    draws = torch.tensor([2, 0, 9, 2])
    seeds = torch.tensor([(int(slot_seed[k]) + int(o)) % 2**63 for k, o in zip(slots, offsets)])
    want = sample_tokens_ref(logits, slot_temperature[slots], seeds, draws)
    got = sample_tokens(logits, slot_temperature, slot_seed, draws, slots=slots, seed_offsets=offsets)
    monkeypatch.setenv("NANOFORGE_KERNELS", "torch")
    assert torch.equal(got, want)
    assert torch.equal(sample_tokens(logits, slot_temperature, slot_seed, draws, slots=slots, seed_offsets=offsets),
                       want)


def test_draws_follow_the_tempered_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.2])
    t, n = 0.7, 6000
    draws = torch.arange(n)
    tokens = sample_tokens_ref(logits.expand(n, -1), torch.full((n,), t), torch.full((n,), 42), draws)
    freq = torch.bincount(tokens, minlength=8).double() / n
    p = torch.softmax(logits.double() / t, dim=0)
    # 5 standard deviations of a binomial frequency
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / n).sqrt() + 1e-3).all(), (freq, p)
    # float64 logits: the same noise, computed in float64, the same tokens here
    again = sample_tokens_ref(logits.double().expand(n, -1), torch.full((n,), t), torch.full((n,), 42), draws)
    assert (again == tokens).float().mean() > 0.999


def test_a_rows_draw_depends_only_on_its_seed_and_draw_index():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=gen)
    temperature = torch.ones(5)
    seeds, draws = torch.tensor([3, 3, 4, 3, 9]), torch.tensor([0, 1, 0, 0, 2])
    batch = sample_tokens_ref(logits, temperature, seeds, draws)
    alone = [sample_tokens_ref(logits[i:i + 1], temperature[:1], seeds[i:i + 1], draws[i:i + 1]).item()
             for i in range(5)]
    assert batch.tolist() == alone
    # same logits, seed and draw: same token; another draw index or seed: other noise
    same = sample_tokens_ref(logits[[0, 0, 0]], temperature[:3], torch.tensor([3, 3, 4]), torch.tensor([0, 1, 0]))
    u = philox_uniform_ref(torch.tensor([3, 3, 4]), torch.tensor([0, 1, 0]), 50)
    assert same[0] == batch[0] and not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])


def test_bad_shapes_are_a_bug_not_bad_input():
    from conftest import raises_bug

    with raises_bug("sample_tokens"):
        sample_tokens(torch.zeros(2, 5), torch.zeros(3), torch.zeros(2, dtype=torch.long), torch.zeros(2))
    assert math.isclose(sampling._UNIFORM_SCALE * (2**31 - 1), 1.0, rel_tol=1e-6)


def test_filter_logits_keeps_the_top_k_and_the_nucleus():
    from nanoforge.model.sampling import filter_logits

    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0, -1.0], [0.0, 0.0, 5.0, 4.9, -40.0], [60.0, 0.0, -60.0, 1.0, 2.0]])
    top_k = torch.tensor([2, 0, 0])
    top_p = torch.tensor([1.0, 0.9, 1.0])
    kept = filter_logits(logits, top_k, top_p) > float("-inf")
    # naive: row 0 the two largest; row 1 the smallest set of largest-first tokens whose mass reaches 0.9;
    # row 2 everything (top_p = 1 keeps even tokens whose probability rounds the cumulative mass to 1)
    p1 = torch.softmax(logits[1].double(), 0)
    order = p1.argsort(descending=True)
    need = int((p1[order].cumsum(0) < 0.9).sum()) + 1
    want1 = torch.zeros(5, dtype=torch.bool)
    want1[order[:need]] = True
    assert kept[0].tolist() == [True, False, True, False, False]
    assert torch.equal(kept[1], want1) and need == 2
    assert kept[2].all()


@pytest.mark.gpu
def test_gpu_sampler_draws_the_references_tokens_at_full_vocabulary():
    """Compiled Triton (not the interpreter): Philox bits and the block-split argmax at Qwen3's vocabulary."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(len(SEEDS), 151936, generator=gen) * 2).to("cuda", torch.bfloat16)
    temperature = torch.tensor([0.0, 1.0, 0.6, 2.0, 0.0, 1.3], device="cuda")
    got = sample_tokens(logits, temperature, SEEDS.cuda(), DRAWS.cuda())
    assert torch.equal(got.cpu(), sample_tokens_ref(logits.cpu(), temperature.cpu(), SEEDS, DRAWS))
    slots = torch.tensor([5, 4, 3, 2, 1, 0], device="cuda")  # the tables by slot, gathered in the kernel
    got = sample_tokens(logits, temperature.flip(0), SEEDS.flip(0).cuda(), DRAWS.cuda(), slots=slots,
                        seed_offsets=torch.ones_like(slots))
    seeds = torch.tensor([(int(s) + 1) % 2**63 for s in SEEDS])  # (slot seed + offset) mod 2**63: -5 wraps
    assert torch.equal(got.cpu(), sample_tokens_ref(logits.cpu(), temperature.cpu(), seeds, DRAWS))
