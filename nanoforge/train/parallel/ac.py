"""Activation checkpointing (torchtitan's `apply_ac`): a block keeps only its input for the backward and runs its
forward again there, one more forward pass (~1/3 more compute) for the activations of every block but one.

`--ac full` checkpoints every block, `--ac N` every N-th (torchtitan's layer-selective mode; each checkpointed
block saves its share of the activations). It is applied from outside the unchanged model, after tensor
parallelism and before torch.compile and FSDP2, as torchtitan orders them: each block's `forward` is replaced by
one that runs the original under `torch.utils.checkpoint` (non-reentrant). The module tree, the parameter names
(checkpoints, DCP, the optimizer's groups) and the hooks on the block (FSDP2's gathers, tensor parallelism's
redistributions, which the recomputation runs again inside the block) stay as they were. Dropout draws the same
masks in the recomputation (the RNG state is saved with the input). Without gradients (evaluation) a block runs
plainly.

The planner (`plan.py`) assumes full checkpointing wherever a layout's activations would not fit.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from nanoforge.errors import NanoforgeError

MODES = "none, full or a number N (every N-th block)"


def ac_every(mode: str) -> int:
    """Every how many blocks `mode` checkpoints: 0 (none), 1 (full), N; one line naming the problem otherwise."""
    text = str(mode).strip().lower()
    if text in ("none", "0"):
        return 0
    if text in ("full", "1"):
        return 1
    if text.isdigit() and int(text) > 1:
        return int(text)
    raise NanoforgeError(f"ac must be {MODES}, not {mode!r}", param="ac")


def apply_ac(model: torch.nn.Module, mode: str) -> int:
    """Checkpoint the blocks of `model.layers` that `mode` picks (blocks 0, N, 2N, ...; a pipeline stage's absent
    blocks, None, keep their places in the count), in place. Returns how many were."""
    every = ac_every(mode)
    if not every:
        return 0
    picked = [block for i, block in enumerate(model.layers) if block is not None and i % every == 0]
    for block in picked:
        block.forward = functools.partial(_recomputed, block.forward)
    return len(picked)


def checkpointed(model: torch.nn.Module) -> list[int]:
    """The indices of the blocks of `model.layers` (this rank's) that `apply_ac` checkpointed."""
    return [i for i, block in enumerate(model.layers) if block is not None
            and getattr(block.__dict__.get("forward"), "func", None) is _recomputed]


def _recomputed(forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
