"""AdamW with decay and no-decay parameter groups, and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch

from nanoforge.train.config import TrainConfig


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, capturable: bool = False) -> torch.optim.AdamW:
    """AdamW where matrices and embeddings decay and biases and norm gains do not (nanoGPT's rule: dim >= 2).

    Fused into one kernel on CUDA; the multi-tensor (foreach) path elsewhere. Tied weights appear once.
    `capturable`: its step can be recorded in a CUDA graph (step counts and learning rate on the device).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    on_cuda = params[0].is_cuda
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=on_cuda, foreach=not on_cuda,
                             capturable=capturable)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr over warmup_steps, cosine decay to min_lr at lr_decay_steps, then min_lr."""
    decay_steps = cfg.lr_decay_steps or cfg.max_steps
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / (cfg.warmup_steps + 1)
    if step >= decay_steps:
        return cfg.min_lr
    progress = (step - cfg.warmup_steps) / max(decay_steps - cfg.warmup_steps, 1)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)
