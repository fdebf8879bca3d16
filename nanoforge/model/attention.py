"""The attention backend interface: how a layer's q, k, v become its output.

The Transformer computes q, k, v (projected, normalised, rotated) and hands
them to a backend together with its layer index. The backend decides where K
and V live and which keys each query sees:

- `DenseAttention`: whole sequences at once (training, scoring). Causal, with
  optional document masking for packed sequences (`doc_ids`), through our
  flash kernels (their PyTorch reference off the GPU).
- `SDPAAttention`: the same masks through PyTorch SDPA and a dense mask, with
  optional dropout on the attention weights (the flash kernels have none).
- `KVCache`: a contiguous per-layer cache for the reference generator: each
  call appends the new tokens' K/V at `self.length` and attends over all
  cached keys (causal within the new chunk).
- The serving engine's paged backend (`nanoforge.serve.model_runner`)
  implements the same one method over block tables.

Every backend ends in one SDPA reference, `kernels.flash_attention.sdpa`, or in
the flash kernels that it defines the results of.

Each backend is an explicit argument to `Transformer.forward`; there is no
hidden global attention state.

Shapes: q (B, T, Hq, D); k, v (B, T, Hkv, D); the result (B, T, Hq, D).
"""

from __future__ import annotations

import torch

from nanoforge.kernels.flash_attention import attention as flash_attention
from nanoforge.kernels.flash_attention import doc_bounds, document_mask, sdpa


class AttentionBackend:
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class DenseAttention(AttentionBackend):
    """Causal attention over whole sequences; `doc_ids` (B, T) keeps packed documents apart."""

    def __init__(self, doc_ids: torch.Tensor | None = None):
        self.doc_ids = doc_ids
        self.bounds = None  # the kernels' view of the documents: computed by the first layer, reused by the rest

    def attend(self, layer, q, k, v):
        if self.doc_ids is not None and self.bounds is None:
            self.bounds = doc_bounds(self.doc_ids)
        return flash_attention(q, k, v, doc_ids=self.doc_ids, causal=True, bounds=self.bounds)


class SDPAAttention(AttentionBackend):
    """DenseAttention's masks (causal, documents apart) through PyTorch SDPA, optionally with dropout on the
    attention weights as nanoGPT trains its dropout models (the flash kernels have no dropout). With
    documents, SDPA gets the dense mask, built once per batch."""

    def __init__(self, doc_ids: torch.Tensor | None = None, dropout: float = 0.0):
        self.doc_ids, self.p = doc_ids, dropout
        self.mask = None if doc_ids is None else document_mask(doc_ids)  # (B, 1, T, T)

    def attend(self, layer, q, k, v):
        return sdpa(q, k, v, mask=self.mask, causal=self.mask is None, dropout_p=self.p)


class KVCache(AttentionBackend):
    """A preallocated contiguous KV cache (batch, max_len) per layer, for the reference generator.

    The generator calls the model with the new tokens, then `advance(T)`.
    All rows of the batch share one length (the generator runs prompts of equal
    length, or one prompt at a time).
    """

    def __init__(self, n_layers: int, batch_size: int, max_len: int, n_kv_heads: int, head_dim: int,
                 device=None, dtype=torch.float32):
        shape = (n_layers, batch_size, max_len, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.length = 0

    def attend(self, layer, q, k, v):
        T = q.shape[1]
        start, end = self.length, self.length + T
        if end > self.max_len:
            raise RuntimeError(f"KV cache overflow: {end} tokens > {self.max_len}")
        self.k[layer, :, start:end] = k
        self.v[layer, :, start:end] = v
        keys, values = self.k[layer, :, :end], self.v[layer, :, :end]
        # Query i (absolute position start+i) sees keys 0..start+i: bottom-right aligned causal.
        mask = None
        if T > 1:
            qpos = torch.arange(start, end, device=q.device)[:, None]
            mask = torch.arange(end, device=q.device)[None, :] <= qpos
        return sdpa(q, keys, values, mask=mask)

    def advance(self, n: int) -> None:
        self.length += n
