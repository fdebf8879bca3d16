"""FSDP2 (`fully_shard`): weights, gradients and optimizer state sharded over the data-parallel ranks.

Each transformer block is one FSDP unit: before its forward (and again before its backward) the block's
weights are all-gathered from the shards, and after its backward its gradients are reduce-scattered back
to them, so at any moment a rank holds its 1/N of the model plus one or two whole blocks. The embedding,
final norm and LM head form the root unit. With `dp_replicate` > 1 the mesh is 2-D (HSDP): shards within a
replica group, gradients all-reduced across the groups.

The FSDP mesh is `dp_shard` x `cp` flattened, as in torchtitan: context-parallel ranks hold the same
weights and see other tokens of the same sequences, so their gradients are reduced (and their weights
sharded) together with the data-parallel ranks'.

Mixed precision (`MixedPrecisionPolicy`): with bf16 the gathered weights are bf16 for the matmuls while
the sharded master weights, the gradients' reduction and the optimizer stay fp32.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from nanoforge.model.transformer import Transformer


def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh, *, param_dtype: torch.dtype | None,
               reduce_dtype: torch.dtype | None = torch.float32, stages: list[nn.Module] | None = None) -> None:
    """fully_shard each block (present on this rank), then the root: the whole model, or with pipelining
    each of this rank's `stages` (a stage never calls the model's own forward; its modules are the model's).

    Pipelined, a block also keeps its gathered weights from its forward to its backward
    (`reshard_after_forward=False`): several micro-batches' forwards run before their backwards, and
    gathering again for each would cost more than it saves."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype if param_dtype else None)
    common = dict(mesh=dp_mesh, mp_policy=mp, reshard_after_forward=stages is None)
    for block in model.layers:
        if block is not None:
            fully_shard(block, **common)
    for root in stages or [model]:
        fully_shard(root, **common)
