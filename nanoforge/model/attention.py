"""The attention backend interface: how a layer's q, k, v become its output.

The Transformer computes q, k, v (projected, normalised, rotated) and hands
them to a backend together with its layer index. The backend decides where K
and V live and which keys each query sees:

- `DenseAttention`: whole sequences at once (training, scoring). Causal, with
  optional document masking for packed sequences (`doc_ids`), through our
  flash kernels (their PyTorch reference off the GPU).
- `SDPAAttention`: the same masks through PyTorch SDPA and a dense mask, with
  optional dropout on the attention weights (the flash kernels have none).
- `ContextParallelAttention`: a rank's share of each sequence's tokens
  (context parallelism) against every token's keys, all-gathered across the
  ranks that share the sequence, with the same causal and document masks.
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
import torch.distributed as dist

from nanoforge.kernels.flash_attention import attention as flash_attention
from nanoforge.kernels.flash_attention import doc_bounds, document_mask, sdpa
from nanoforge.kernels.rope import apply_rope


class AttentionBackend:
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def attend_rotary(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope,
                      qk_norm=None) -> torch.Tensor:
        """`attend` after normalising each head of q and k by qk_norm = (q_norm, k_norm) (modules; None: no
        norm) and rotating q and k by rope = (cos, sin) (None: learned positions, no rotation). A backend that
        stores K may fuse the norms and the rotation into the store (the engine's paged cache does)."""
        if qk_norm is not None:
            q, k = qk_norm[0](q), qk_norm[1](k)
        if rope is not None:
            cos, sin = rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.attend(layer, q, k, v)

    def run_layers(self, x: torch.Tensor, rope):
        """Every layer of the model on the residual stream x at once, where the backend has a kernel that runs
        them (the engine's one-token decode steps, `serve/layer_kernel.py`): (x, the last MLP's output, which the
        final norm adds); None (the default) to have the model run them one by one."""
        return None


class DenseAttention(AttentionBackend):
    """Causal attention over whole sequences; `doc_ids` (B, T) keeps packed documents apart."""

    def __init__(self, doc_ids: torch.Tensor | None = None):
        self.doc_ids = doc_ids
        # the kernels' view of the documents, once for every layer; made here, not by the first layer: a layer
        # under activation checkpointing may not change what is outside it (torch.compile breaks its graph there)
        self.bounds = doc_bounds(doc_ids) if doc_ids is not None else None

    def attend(self, layer, q, k, v):
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


class _GatherTokens(torch.autograd.Function):
    """All-gather along the sequence (dim 1) over a process group, rank by rank; backward, each rank's
    slice of the gradients summed over the group (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        n, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        # One contiguous block per rank: gloo sums a non-contiguous gradient wrongly, and the CPU attention
        # backward hands one over.
        stacked = torch.stack(grad.chunk(n, dim=1)).contiguous()
        if grad.is_cuda:
            out = torch.empty_like(stacked[0])
            dist.reduce_scatter_tensor(out, stacked, group=ctx.group)
            return out, None
        dist.all_reduce(stacked, group=ctx.group)  # gloo has no reduce-scatter
        return stacked[rank], None


class ContextParallelAttention(AttentionBackend):
    """This rank's tokens of each row (context parallelism) attend to every token of the row: K and V are
    all-gathered over `group` (autograd sums their gradients back), so causality and documents (`doc_ids`,
    the whole (B, T) row; None: causal only) are exact wherever the chunks were cut. `q_index` holds the
    positions of the local tokens (contiguous chunks), `kv_index` those of the gathered keys in gather order.

    Each local chunk runs as a window of queries against the whole row's keys (`attention(..., q_offset=)`):
    our flash kernels on a GPU, which read only the key blocks that the chunk's documents and causality
    reach, and the SDPA reference elsewhere. With dropout (which the kernels lack), SDPA with the dense
    (B, 1, T_local, T) mask."""

    def __init__(self, doc_ids: torch.Tensor | None, q_index: torch.Tensor, kv_index: torch.Tensor, group,
                 dropout: float = 0.0):
        self.doc_ids, self.q_index, self.kv_index, self.group, self.p = doc_ids, q_index, kv_index, group, dropout
        breaks = (torch.nonzero(q_index[1:] != q_index[:-1] + 1).flatten() + 1).tolist()
        starts = [0, *breaks]
        self.chunks = [(start, end - start, int(q_index[start])) for start, end in
                       zip(starts, [*breaks, len(q_index)])]  # (local start, length, position in the row)
        self.order = torch.argsort(kv_index)  # gathered keys -> row order
        # the documents' bounds for the kernels, once for every layer (not by the first: see DenseAttention);
        # with dropout, SDPA's mask, on the device the first layer runs on
        self.bounds = doc_bounds(doc_ids) if doc_ids is not None and not dropout else None
        self.mask = None

    def attend(self, layer, q, k, v):
        keys, values = _GatherTokens.apply(k, self.group), _GatherTokens.apply(v, self.group)
        if self.p:
            if self.mask is None:
                rows, cols = self.q_index.to(q.device), self.kv_index.to(q.device)
                self.mask = (document_mask(self.doc_ids, rows=rows, cols=cols) if self.doc_ids is not None
                             else (cols[None, :] <= rows[:, None])[None, None])
            return sdpa(q, keys, values, mask=self.mask, dropout_p=self.p)
        order = self.order.to(q.device)
        keys, values = keys[:, order], values[:, order]
        return torch.cat([flash_attention(q[:, start : start + n], keys, values, doc_ids=self.doc_ids, causal=True,
                                          bounds=self.bounds, q_offset=offset) for start, n, offset in self.chunks],
                         dim=1)


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
