"""One token per row of logits: greedy, or a Gumbel-max draw from counter-based Philox noise (Triton and PyTorch).

A row with temperature T > 0 draws argmax_j (logits_j / T + g_j) with g_j = -log(-log u_j), which is a draw
from softmax(logits / T) (filtered logits are -inf and never win). The uniforms u_j come from Philox-4x32-10
keyed by the row's 64-bit seed, at the counter (j, draw): `draw` numbers the row's draws (a sequence's
output tokens so far). The noise of a draw is thus a pure function of (seed, draw): the same whatever else
shares the batch, whichever step or device runs it, with no generator state to carry (a CUDA graph replays
it; an engine resuming another's request continues at its draw). A row with temperature 0 takes the first
largest logit, as `torch.argmax`.

Both implementations draw the same uniforms: Triton's `tl.rand(seed, (draw << 32) | j)` (Philox with
counter (j, draw, 0, 0) and key (seed low, seed high); the first output word made a float in [0, 1) the
way Triton does), and the reference, which runs the same rounds in int64 arithmetic on any device, float64
logits included. The Triton kernel cuts each row's vocabulary into blocks, one program each, and a second
small kernel picks the best block's winner: a row of 150k logits is read by ~40 programs at once, so
batch 1 is not one program's loop.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from nanoforge.kernels import pdl
from nanoforge.kernels.dispatch import interpreting, use_fast

_M32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57  # Philox-4x32 multipliers
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85  # and Weyl key increments
_ROUNDS = 10
_UNIFORM_SCALE = 4.6566127342e-10  # Triton's: the largest x with (2**31 - 1) * x < 1 in float32
SEED_MOD = 1 << 63  # seeds are taken modulo this (an int64 on the device)



# --------------------------------------------------------------------------- reference


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of the 64-bit product of the constant a and b (< 2**32), in int64 arithmetic."""
    lo16, hi16 = b & 0xFFFF, b >> 16
    x, y = a * lo16, a * hi16  # each < 2**48
    z = x + ((y & 0xFFFF) << 16)  # the low 48 bits of the product, plus a carry
    return ((y >> 16) + (z >> 32)) & _M32, z & _M32


def philox_uniform_ref(seeds: torch.Tensor, draws: torch.Tensor, n: int) -> torch.Tensor:
    """(rows, n) float32 uniforms in [0, 1): row i, column j is Philox(seed_i) at counter (j, draw_i), as
    Triton's `tl.rand(seed, (draw << 32) | j)` computes it."""
    seeds, draws = seeds.long()[:, None], draws.long()[:, None]
    c0 = torch.arange(n, device=seeds.device, dtype=torch.int64).expand(len(seeds), n)
    c1 = (draws & _M32).expand_as(c0)
    c2 = c3 = torch.zeros_like(c0)
    k0, k1 = seeds & _M32, (seeds >> 32) & _M32
    for _ in range(_ROUNDS):
        hi_b, lo_b = _mulhilo(_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    x = torch.where(c0 >= 1 << 31, c0 - (1 << 32), c0)  # the word as int32
    x = torch.where(x < 0, -x - 1, x)
    return x.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32)


def sample_tokens_ref(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                      draws: torch.Tensor) -> torch.Tensor:
    """The definition of correct (logits of any float dtype; float64 computes in float64)."""
    x = logits if logits.dtype == torch.float64 else logits.float()
    tokens = x.argmax(dim=-1)
    rows = (temperature > 0).nonzero()[:, 0]
    if len(rows):
        u = philox_uniform_ref(seeds[rows], draws[rows], x.shape[-1]).to(x.dtype)
        scores = x[rows] / temperature[rows, None].to(x.dtype) - torch.log(-torch.log(u))
        tokens[rows] = scores.argmax(dim=-1)
    return tokens


# --------------------------------------------------------------------------- public API


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, draws: torch.Tensor,
                  out: torch.Tensor | None = None, slots: torch.Tensor | None = None,
                  seed_offsets: torch.Tensor | None = None) -> torch.Tensor:
    """(rows,) int64 tokens for logits (rows, vocab): per row its temperature (0: greedy), 64-bit seed (int64)
    and draw index. `out`, if given, receives them (a CUDA graph's static buffer). With `slots` (and
    `seed_offsets`, both (rows,) int64), temperature and seeds are tables by slot: row i takes temperature[slots[i]]
    and seed (seeds[slots[i]] + seed_offsets[i]) mod 2**63, gathered inside the kernel (a decode step's graph then
    runs no small gather kernels before it)."""
    rows = logits.shape[0]
    per_row = (draws,) if slots is not None else (temperature, seeds, draws)
    if slots is not None and (seed_offsets is None or slots.shape != (rows,) or seed_offsets.shape != (rows,)
                              or temperature.dim() != 1 or seeds.shape != temperature.shape):
        raise ValueError(f"sample_tokens: slots and seed_offsets must be ({rows},) and the temperature and seed "
                         f"tables one-dimensional, got {tuple(slots.shape)}, "
                         f"{None if seed_offsets is None else tuple(seed_offsets.shape)}, {tuple(temperature.shape)}, "
                         f"{tuple(seeds.shape)}")
    if logits.dim() != 2 or any(t.shape != (rows,) for t in per_row):
        raise ValueError(f"sample_tokens: logits {tuple(logits.shape)} must be (rows, vocab) with temperature, seeds "
                         f"and draws (rows,), got {tuple(temperature.shape)}, {tuple(seeds.shape)}, "
                         f"{tuple(draws.shape)}")
    if use_fast(logits) and logits.dtype != torch.float64 and rows and logits.shape[1]:
        return _sample_triton(logits, temperature, seeds, draws, out, slots, seed_offsets)
    if slots is not None:
        temperature, seeds = temperature[slots], (seeds[slots] + seed_offsets) & (SEED_MOD - 1)
    tokens = sample_tokens_ref(logits, temperature, seeds, draws)
    return tokens if out is None else out.copy_(tokens)


# --------------------------------------------------------------------------- Triton


@triton.jit
def _gumbel_max_blocks(LOGITS, stride, TEMP, SEEDS, DRAWS, SLOTS, OFFSETS, BEST, WHERE, V, num_blocks,
                       BLOCK: tl.constexpr, GATHER: tl.constexpr, PDL: tl.constexpr):
    """Program (row, b): the best score of vocabulary block b of the row, and where it is (GATHER: the row's
    temperature and seed from its slot's, `sample_tokens`)."""
    pdl.enter(PDL)
    row = tl.program_id(0)
    b = tl.program_id(1)
    at = tl.load(SLOTS + row) if GATHER else row
    t = tl.load(TEMP + at)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    score = tl.load(LOGITS + row.to(tl.int64) * stride + offs, mask=ok, other=float("-inf")).to(tl.float32)
    if t > 0:
        seed = tl.load(SEEDS + at)
        if GATHER:
            seed = (seed + tl.load(OFFSETS + row)) & 0x7FFFFFFFFFFFFFFF
        counter = (tl.load(DRAWS + row) << 32) | offs.to(tl.int64)
        u = tl.rand(seed, counter)
        score = score / t - tl.log(-tl.log(u))
    score = tl.where(ok, score, float("-inf"))
    tl.store(BEST + row * num_blocks + b, tl.max(score, 0))
    tl.store(WHERE + row * num_blocks + b, b * BLOCK + tl.argmax(score, 0))


@triton.jit
def _pick_block(BEST, WHERE, OUT, num_blocks, BLOCKS_P2: tl.constexpr, PDL: tl.constexpr):
    """The row's token: the winner of its best block (the first one, on a tie: the smallest index)."""
    pdl.enter(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCKS_P2)
    ok = offs < num_blocks
    best = tl.load(BEST + row * num_blocks + offs, mask=ok, other=float("-inf"))
    where = tl.load(WHERE + row * num_blocks + offs, mask=ok, other=0)
    k = tl.argmax(best, 0)
    tl.store(OUT + row, tl.sum(tl.where(offs == k, where, 0), 0).to(tl.int64))


def _sample_triton(logits, temperature, seeds, draws, out=None, slots=None, seed_offsets=None) -> torch.Tensor:
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block = 16 if interpreting() else 4096
    num_blocks = triton.cdiv(vocab, block)
    best = torch.empty(rows, num_blocks, device=logits.device, dtype=torch.float32)
    where = torch.empty(rows, num_blocks, device=logits.device, dtype=torch.int32)
    direct = out is not None and out.dtype == torch.int64 and out.is_contiguous()  # write the tokens in place
    dst = out if direct else torch.empty(rows, device=logits.device, dtype=torch.int64)
    on = pdl.enabled(logits)
    gather = slots is not None
    _gumbel_max_blocks[(rows, num_blocks)](logits, logits.stride(0), temperature.float().contiguous(),
                                           seeds.long().contiguous(), draws.long().contiguous(),
                                           slots.long().contiguous() if gather else draws,
                                           seed_offsets.long().contiguous() if gather else draws, best, where, vocab,
                                           num_blocks, BLOCK=block, GATHER=gather, PDL=on,
                                           num_warps=1 if interpreting() else 8, launch_pdl=bool(on))
    _pick_block[(rows,)](best, where, dst, num_blocks, BLOCKS_P2=max(2, triton.next_power_of_2(num_blocks)), PDL=on,
                         launch_pdl=bool(on))
    return dst if direct or out is None else out.copy_(dst)
