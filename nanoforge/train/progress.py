"""What a run reports: throughput and MFU, the JSON log and the loss-curve PNG."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from nanoforge.runtime import peak_flops  # noqa: F401 (re-exported: the trainer's MFU)


def format_mfu(mfu: float | None) -> str:
    return "n/a" if mfu is None else f"{100 * mfu:.1f}%"


class Throughput:
    """Tokens per second of training time, interval by interval (padding counts as tokens).

    `pause`/`resume` leave evaluation and checkpointing out. The first interval holds compilation
    and warm-up, so the steady rate leaves it out when there is more than one.
    """

    def __init__(self, tokens_per_step: int, flops_per_token: float, peak: float | None):
        self.tokens_per_step, self.flops_per_token, self.peak = tokens_per_step, flops_per_token, peak
        self.intervals: list[tuple[int, float]] = []  # (steps, seconds)
        self.steps, self.seconds, self.tick = 0, 0.0, time.perf_counter()

    def pause(self) -> None:
        self.seconds += time.perf_counter() - self.tick

    def resume(self) -> None:
        self.tick = time.perf_counter()

    def end_interval(self) -> float:
        """Close the current interval; its tokens per second."""
        self.pause()
        self.intervals.append((self.steps, self.seconds))
        tok_s = self.tokens_per_step * self.steps / self.seconds
        self.steps, self.seconds = 0, 0.0
        self.resume()
        return tok_s

    def mfu(self, tokens_per_s: float | None) -> float | None:
        return tokens_per_s * self.flops_per_token / self.peak if tokens_per_s and self.peak else None

    def steady(self) -> tuple[float | None, float | None]:
        """(ms per step, tokens per second) over every interval but the first (unless it is the only one)."""
        kept = self.intervals[1:] or self.intervals
        steps, seconds = sum(n for n, _ in kept), sum(s for _, s in kept)
        if not steps:
            return None, None
        return 1000 * seconds / steps, self.tokens_per_step * steps / seconds


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
