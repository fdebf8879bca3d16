"""Turning logits into tokens: greedy, temperature, top-k, top-p, per-row seeds.

One implementation serves the reference generator and the serving engine.
Each row of a batch carries its own settings; a row with temperature 0 is
greedy. Random rows draw with the Gumbel-max trick (argmax of
log p + Gumbel noise, written as p / Exp(1)), the noise coming from the row's
own `torch.Generator` when it has a seed, so a seeded request gives the same
tokens whatever else is in the batch.
"""

from __future__ import annotations

import torch


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
        mass_before = probs.cumsum(dim=-1) - probs
        remove |= mass_before >= top_p[:, None]
    remove[:, 0] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None = None,
           top_p: torch.Tensor | None = None, generators: list[torch.Generator | None] | None = None) -> torch.Tensor:
    """Next token per row: logits (B, V), temperature (B,) (0 = greedy). Returns (B,) int64."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    if bool((temperature == 0).all()):
        return greedy
    t = torch.where(temperature > 0, temperature, 1.0)
    probs = filter_logits(logits / t[:, None], top_k, top_p).softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_()  # one launch for every unseeded row
    for i, g in enumerate(generators or ()):
        if g is not None:  # seeded rows redraw from their own generator
            noise[i].exponential_(generator=g)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(temperature > 0, sampled, greedy)


def make_generator(seed: int | None, device) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g
