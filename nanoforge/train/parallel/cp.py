"""Context parallelism: each of the cp ranks holds 1/cp of every sequence's tokens.

The sequence is cut into 2 x cp equal chunks and rank i holds chunks i and 2cp - 1 - i. Under a causal
mask the work of a query grows with its position, so a rank with one early and one late chunk does as
much as any other (rank 0 of cp 4 holds chunks 0 and 7, rank 3 chunks 3 and 4).

Attention is the only place where tokens meet. There, as in Llama 3, each rank all-gathers K and V from
the cp group (one all-gather per layer forward, a reduce-scatter of their gradients backward) and attends
its local queries to every key (`model.attention.ContextParallelAttention`): each local chunk is a window of
queries for our flash kernels (`attention(..., q_offset=)`), whose document masks compare each query's
document with each key's by their positions in the full row. Because the keys are whole, documents that
cross chunk (and rank) boundaries stay exact, and a chunk reads only the key blocks its documents reach. Every
other op (embeddings, norms, MLPs, the loss) is per token and runs on the local tokens unchanged; the
gradients of the weights are reduced over cp together with data parallelism (FSDP's mesh is dp_shard x cp).
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from nanoforge.data.loader import Batch
from nanoforge.model.attention import AttentionBackend, ContextParallelAttention


def chunk_index(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The token positions (int64) that cp rank `rank` holds: chunks rank and 2cp - 1 - rank of 2cp."""
    c = seq_len // (2 * cp)
    first, second = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c), torch.arange(second, second + c)])


def gathered_index(seq_len: int, cp: int) -> torch.Tensor:
    """The positions of the keys after an all-gather over the cp group: rank 0's tokens, then rank 1's, ..."""
    return torch.cat([chunk_index(seq_len, cp, r) for r in range(cp)])


def shard_batch(batch: Batch, index: torch.Tensor) -> Batch:
    """This rank's tokens of every row. `doc_ids` stays whole: the mask compares local queries with all keys."""
    def take(t):
        return None if t is None else t[:, index].contiguous()
    return Batch(take(batch.input_ids), take(batch.targets), batch.doc_ids, take(batch.positions),
                 take(batch.loss_mask))


def cp_attention(base: AttentionBackend, q_index: torch.Tensor, kv_index: torch.Tensor,
                 group: ProcessGroup) -> ContextParallelAttention:
    """The context-parallel counterpart of a dense backend (documents or causal only, dropout or not)."""
    return ContextParallelAttention(base.doc_ids, q_index, kv_index, group, dropout=getattr(base, "p", 0.0))
