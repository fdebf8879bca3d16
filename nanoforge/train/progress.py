"""What a run reports: throughput and MFU, the JSON log and the loss-curve PNG."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from nanoforge.model.config import ModelConfig

# Dense bf16 tensor-core peaks (FLOP/s, no sparsity), by a substring of the device name.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12}


def peak_flops(device: torch.device) -> float | None:
    """The device's bf16 peak, or None where we do not know it (CPUs, other GPUs): MFU shows n/a."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token, nanoGPT's (PaLM's) count: 6 N + 12 L H Q T, with N including the
    output projection (`cfg.flops_per_token` leaves the vocab matmul out with the embeddings)."""
    return cfg.flops_per_token(seq_len) + 6 * cfg.vocab_size * cfg.d_model


def format_mfu(mfu: float | None) -> str:
    return "n/a" if mfu is None else f"{100 * mfu:.1f}%"


def write_json(path: Path, obj) -> None:
    """Write JSON under a temporary name and rename, so readers never see half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def plot_losses(path: Path, history: dict, title: str) -> None:
    """Training loss per step and validation loss per evaluation, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    if history["train"]:
        ax.plot([r["step"] for r in history["train"]], [r["loss"] for r in history["train"]], lw=0.8, alpha=0.7,
                label="train")
    if history["val"]:
        ax.plot([r["step"] for r in history["val"]], [r["loss"] for r in history["val"]], "o-", ms=3, label="val")
    ax.set(xlabel="step", ylabel="loss (nats/token)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
