"""Turning logits into tokens: greedy, temperature, top-k, top-p, per-row seeds.

One implementation serves the reference generator and the serving engine.
Each row of a batch carries its own settings; a row with temperature 0 is
greedy. Random rows draw with the Gumbel-max trick from counter-based Philox
noise keyed by the row's seed and draw index (`kernels.sampling`): a row's
k-th draw with seed s is the same whatever else is in the batch, so a seeded
request gives the same tokens in the engine (completion i of a request seeded
s draws with seed s + i) as in `nanoforge generate --seed s` (which draws with
seed s), and an unseeded one takes a seed from torch's global generator.
"""

from __future__ import annotations

import torch

from nanoforge.kernels.sampling import SEED_MOD, sample_tokens  # noqa: F401 (SEED_MOD: this module's users import it)


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k and top-p nucleus.

    logits (B, V) float; top_k (B,) int with 0 meaning "no limit"; top_p (B,) float in (0, 1].
    """
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    V = logits.shape[-1]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, V).clamp(max=V)
        remove |= torch.arange(V, device=logits.device)[None, :] >= k[:, None]
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        # keep the smallest prefix whose mass reaches top_p: drop a token if the mass *before* it already does
        # (a row with top_p = 1 keeps everything: a float cumsum may reach 1 before the tail)
        mass_before = probs.cumsum(dim=-1) - probs
        remove |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    remove[:, 0] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None = None,
           top_p: torch.Tensor | None = None, seeds: torch.Tensor | None = None,
           draws: torch.Tensor | None = None) -> torch.Tensor:
    """Next token per row: logits (B, V), temperature (B,) (0 = greedy), seeds and draw indices (B,) int64
    (the row's noise; needed unless every row is greedy). Returns (B,) int64."""
    logits = logits.float()
    if top_k is not None or top_p is not None:
        t = torch.where(temperature > 0, temperature, 1.0)
        kept = filter_logits(logits / t[:, None], top_k, top_p)  # the nucleus of the tempered distribution
        logits = logits.masked_fill(kept == float("-inf"), float("-inf"))
    if seeds is None:
        if bool((temperature > 0).any()):
            raise ValueError("sample: rows with temperature > 0 need seeds and draw indices")
        seeds = draws = torch.zeros(len(logits), dtype=torch.int64, device=logits.device)
    return sample_tokens(logits, temperature, seeds, draws)


def random_seed() -> int:
    """A seed for an unseeded request, from torch's global generator (so torch.manual_seed makes runs repeat)."""
    return int(torch.randint(0, SEED_MOD - 1, (), dtype=torch.int64).item())
