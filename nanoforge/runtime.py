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


# Dense bf16 tensor-core peaks (FLOP/s, no sparsity) and HBM bandwidth (bytes/s), by a substring of the device name.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12}
PEAK_HBM_BYTES = {"H100": 3.35e12, "H200": 4.8e12, "H800": 3.35e12, "A100": 2.0e12, "A800": 2.0e12}


def _peak(table: dict, device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in table.items() if key in name), None)


def peak_flops(device: torch.device) -> float | None:
    """The device's bf16 peak, or None where we do not know it (CPUs, other GPUs): MFU shows n/a."""
    return _peak(PEAK_BF16_FLOPS, device)


def peak_hbm_bandwidth(device: torch.device) -> float | None:
    """The device's memory bandwidth in bytes/s, or None where we do not know it."""
    return _peak(PEAK_HBM_BYTES, device)
