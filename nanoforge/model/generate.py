"""The reference generator: a plain KV cache, one prompt, token by token.

This is the definition of correct generation that the serving engine is
tested against; it favours clarity over speed.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from nanoforge.errors import NanoforgeError
from nanoforge.model.attention import KVCache
from nanoforge.model.sampling import SEED_MOD, random_seed, sample
from nanoforge.model.transformer import Transformer


@torch.inference_mode()
def generate_stream(model: Transformer, prompt_ids: list[int], *, max_new_tokens: int, temperature: float = 0.0,
                    top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                    stop_ids: set[int] | frozenset[int] = frozenset()) -> Iterator[int]:
    """Yield new token ids one at a time; stops after a token in `stop_ids` (which is yielded) or the budget."""
    cfg = model.cfg
    if not prompt_ids:
        raise NanoforgeError("the prompt is empty", param="prompt")
    if max_new_tokens <= 0:
        raise NanoforgeError(f"max_tokens must be positive, got {max_new_tokens}", param="max_tokens")
    if len(prompt_ids) >= cfg.max_seq_len:
        raise NanoforgeError(f"the prompt is {len(prompt_ids)} tokens; the model's context is {cfg.max_seq_len}",
                             param="prompt")
    bad = [t for t in prompt_ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise NanoforgeError(f"token id {bad[0]} is outside the vocabulary (size {cfg.vocab_size})", param="prompt")
    device = model.embed.weight.device
    # Every token, generated ones included, needs a position inside the context.
    budget = min(max_new_tokens, cfg.max_seq_len - len(prompt_ids))
    cache = KVCache(cfg.n_layers, 1, len(prompt_ids) + budget - 1, cfg.n_kv_heads, cfg.head_dim, device=device,
                    dtype=model.embed.weight.dtype)
    # the i-th token is draw i of the seed's Philox noise, as the engine draws completion 0 of a request seeded so
    seeds = torch.tensor([random_seed() if seed is None else seed % SEED_MOD], device=device)
    temp = torch.tensor([temperature], device=device)
    tk = torch.tensor([top_k], device=device) if top_k > 0 else None
    tp = torch.tensor([top_p], device=device) if top_p < 1.0 else None

    tokens = torch.tensor([prompt_ids], device=device)
    for i in range(budget):
        positions = torch.arange(cache.length, cache.length + tokens.shape[1], device=device)[None]
        logits = model(tokens, positions, cache)[:, -1]
        cache.advance(tokens.shape[1])
        nxt = int(sample(logits, temp, tk, tp, seeds, torch.tensor([i], device=device))[0])
        yield nxt
        if nxt in stop_ids:
            return
        tokens = torch.tensor([[nxt]], device=device)


def generate(model: Transformer, prompt_ids: list[int], **kw) -> list[int]:
    return list(generate_stream(model, prompt_ids, **kw))
