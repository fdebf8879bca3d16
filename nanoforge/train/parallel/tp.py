"""Tensor parallelism (+ sequence parallelism), applied to the unchanged Transformer from outside.

Megatron's layout, as torchtitan writes it with `torch.distributed.tensor.parallel`:

    embedding        vocabulary-parallel (rows of the table): each rank looks up its share of the
                     vocabulary and the partial embeddings are reduce-scattered along the sequence
    norms, dropout   sequence-parallel: each rank normalises 1/tp of the tokens (weights replicated,
                     their gradients summed)
    attention, MLP   the input is all-gathered along the sequence; q, k, v and gate, up are split by
                     columns (whole heads per rank: query heads h*Hq/tp.., KV heads h*Hkv/tp.., so each
                     rank keeps whole groups of grouped-query heads); the output projections by rows,
                     their partial sums reduce-scattered back along the sequence
    LM head          split by vocabulary; the loss runs on the vocabulary shards (`loss_parallel`), so the
                     whole logits never exist on one rank

So each transformer block costs two all-gathers and two reduce-scatters of the activations, forward
and backward, over the `tp` group, the innermost (fastest-linked) dimension of the mesh.

The model fuses q, k, v into one matrix (and gate, up into another) for speed on one device. Split by
columns as one matrix, the first rank would get all of q and the last all of v; so every parallel layout
first turns each fused projection into a `SplitLinear`: one weight per part (named `wqkv.q.weight`, ...,
the checkpoints' names), multiplied together as one matrix. Each part is then split by itself.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from nanoforge.model.transformer import Transformer


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor weight (autograd goes through), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_input(x: torch.Tensor) -> torch.Tensor:
    """A replicated input of a column-parallel matmul as a plain tensor. Its gradient on this rank covers only
    this rank's columns, so autograd must sum it over the ranks (Partial) before it goes further back."""
    return x.to_local(grad_placements=[Partial()]) if isinstance(x, DTensor) else x


class SplitLinear(nn.Module):
    """A fused projection held as one nn.Linear per part (`q`, `k`, `v` or `gate`, `up`), multiplied as one:
    y = x @ cat(parts).T, the same numbers as the fused matrix. Under tensor parallelism each part is sharded
    by rows, and this rank's output is the concatenation of its shard of each part."""

    def __init__(self, fused: nn.Linear, parts: list[tuple[str, int]]):
        super().__init__()
        self.names = [name for name, _ in parts]
        start = 0
        for name, rows in parts:
            part = nn.Linear(fused.in_features, rows, bias=fused.bias is not None, device=fused.weight.device,
                             dtype=fused.weight.dtype)
            with torch.no_grad():
                part.weight.copy_(fused.weight[start : start + rows])
                if fused.bias is not None:
                    part.bias.copy_(fused.bias[start : start + rows])
            self.add_module(name, part)
            start += rows

    def forward(self, x):
        parts = [getattr(self, name) for name in self.names]
        weight = torch.cat([local(p.weight) for p in parts])
        bias = torch.cat([local(p.bias) for p in parts]) if parts[0].bias is not None else None
        return F.linear(local_input(x), weight, bias)


def split_fused_projections(model: Transformer) -> None:
    """Every fused projection of every block (present on this rank) becomes a SplitLinear, in place."""
    for block in model.layers:
        if block is None:
            continue
        for path, parts in model.cfg.fused_parts().items():
            parent_name, name = path.split(".")
            parent = getattr(block, parent_name)
            setattr(parent, name, SplitLinear(getattr(parent, name), parts))


def _shard_rows(module: SplitLinear, mesh: DeviceMesh) -> None:
    for name in module.names:
        part = getattr(module, name)
        for pname, p in list(part.named_parameters(recurse=False)):
            part.register_parameter(pname, nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)])))


def apply_tp(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Shard the model's weights over `tp_mesh` (in place), sequence-parallel between the blocks. The model's
    fused projections must already be SplitLinears. After this the model returns this rank's vocabulary
    shard of the logits, (B, T, V / tp): `vocab_parallel_loss` turns them into the loss."""
    tp = tp_mesh.size()
    root = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "pos_embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(use_local_output=True),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=True)}
    parallelize_module(model, tp_mesh, {k: v for k, v in root.items() if getattr(model, k, None) is not None})
    if model.cfg.tie_embeddings and model.embed is not None and model.lm_head is not None:
        model.lm_head.weight = model.embed.weight  # both vocabulary-sharded by rows: the same DTensor
    for block in model.layers:
        if block is None:
            continue
        plan = {"attn_norm": SequenceParallel(use_local_output=True),
                "mlp_norm": SequenceParallel(use_local_output=True),
                "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                           desired_input_layouts=(Replicate(), None, None)),
                "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "mlp.w_out": RowwiseParallel(output_layouts=Shard(1))}
        if block.attn.q_norm is not None:  # Qwen3: RMSNorm over each head of q and k, heads sharded
            plan["attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        if not isinstance(block.mlp.w_in, SplitLinear):  # GPT-2's GELU MLP: one plain input projection
            plan["mlp.w_in"] = ColwiseParallel()
        parallelize_module(block, tp_mesh, plan)
        for module in (block.attn.wqkv, block.mlp.w_in):
            if isinstance(module, SplitLinear):
                _shard_rows(module, tp_mesh)
        attn = block.attn  # this rank's heads: what the reshapes inside attention see
        attn.n_heads, attn.n_kv_heads = attn.n_heads // tp, attn.n_kv_heads // tp
        attn.split = tuple(n // tp for n in attn.split)


def vocab_parallel_logits(logits: torch.Tensor, tp_mesh: DeviceMesh) -> DTensor:
    """This rank's vocabulary shard of the logits as the DTensor that `loss_parallel` computes the loss of."""
    return DTensor.from_local(logits, tp_mesh, [Shard(logits.dim() - 1)], run_check=False)
