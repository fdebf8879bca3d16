"""Device and dtype choice, shared by every front door (CLI, engine, trainer)."""

from __future__ import annotations

import torch

from nanoforge.errors import NanoforgeError

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise NanoforgeError(f"device {name!r}: no CUDA GPU is available", param="device")
    try:
        return torch.device(name)
    except RuntimeError:
        raise NanoforgeError(f"device {name!r} is not a torch device (auto, cpu, cuda, cuda:1, ...)",
                             param="device") from None


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto" is bf16 on a GPU and fp32 on the CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise NanoforgeError(f"dtype {name!r} is not one of auto, {', '.join(DTYPES)}", param="dtype")
    return DTYPES[name]
