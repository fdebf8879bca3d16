"""AdamW with decay and no-decay parameter groups, and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch

from nanoforge.train.config import TrainConfig


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, capturable: bool = False,
                   device: torch.device | str = "cpu") -> torch.optim.AdamW:
    """AdamW where matrices and embeddings decay and biases and norm gains do not (nanoGPT's rule: dim >= 2).

    Fused into one kernel on CUDA (the `device` the weights are on); the multi-tensor (foreach) path
    elsewhere. Tied weights appear once. `capturable`: its step can be recorded in a CUDA graph (step counts
    and learning rate on the device). Sharded (DTensor) weights get the same optimizer, shard by shard.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    on_cuda = torch.device(device).type == "cuda"
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=on_cuda, foreach=not on_cuda,
                             capturable=capturable)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's per-weight state (AdamW's step count and moments) before its first step, so a
    checkpoint can be loaded into it: one step at learning rate 0 over zero gradients, which leaves every
    weight exactly as it was (x * (1 - 0) and x - 0 * m / (sqrt(v) + eps))."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if all(p in optimizer.state for p in params):
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = torch.zeros_like(group["lr"]) if torch.is_tensor(group["lr"]) else 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr over warmup_steps, cosine decay to min_lr at lr_decay_steps, then min_lr."""
    decay_steps = cfg.lr_decay_steps or cfg.max_steps
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / (cfg.warmup_steps + 1)
    if step >= decay_steps:
        return cfg.min_lr
    progress = (step - cfg.warmup_steps) / max(decay_steps - cfg.warmup_steps, 1)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)
