"""The one place that decides between a Triton kernel and its PyTorch reference.

Every op in `nanoforge.kernels` is a plain function with two implementations:
a PyTorch reference (runs anywhere, float64-capable, the definition of
correct) and a fast one (Triton on a CUDA GPU). `use_fast(*tensors)` picks.

Override with the environment variable NANOFORGE_KERNELS:
  - "auto" (default): Triton on CUDA tensors when Triton imports, else torch;
  - "torch": always the reference;
  - "triton": always Triton (on the CPU this needs TRITON_INTERPRET=1; tests use it).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


_TRITON = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    return _TRITON


def interpreting() -> bool:
    """Whether Triton runs its CPU interpreter (TRITON_INTERPRET=1): kernels pick small fixed configurations."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The environment switch `name` (lower-cased; unset: the first of `choices`), or one line naming the problem."""
    value = os.environ.get(name, choices[0]).lower()
    if value not in choices:
        from nanoforge.errors import NanoforgeError

        allowed = f"{', '.join(choices[:-1])} or {choices[-1]}"
        raise NanoforgeError(f"{name} must be {allowed}, not {value!r}", param=name)
    return value


def env_mib(name: str, default: str) -> float:
    """The environment setting `name` as a number of MiB (unset: `default`), or one line naming the problem."""
    value = os.environ.get(name, default)
    try:
        return float(value)
    except ValueError:
        from nanoforge.errors import NanoforgeError

        raise NanoforgeError(f"{name} must be a number of MiB, not {value!r}", param=name) from None


def kernel_mode() -> str:
    return env_choice("NANOFORGE_KERNELS", ("auto", "torch", "triton"))


def use_fast(*tensors: torch.Tensor) -> bool:
    """True when the fast (Triton) implementation should run on these tensors.

    Sharded tensors (DTensor, a subclass) always take the reference: its PyTorch ops know how to run on
    shards, a Triton launch does not."""
    mode = kernel_mode()
    if mode == "torch" or not triton_available() or any(hasattr(t, "device_mesh") for t in tensors):
        return False
    if mode == "triton":
        return True
    return all(t.is_cuda for t in tensors)


@functools.cache
def sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors (1 for a CPU: the interpreter runs one program at a time)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


_COUNTERS: dict[tuple, torch.Tensor] = {}
_KEPT: list[torch.Tensor] = []  # every counter buffer made: graphs captured with one still use it


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least `n` int32 arrival counts for kernels whose last program to arrive finishes a piece of work (the
    skinny matmul's split-K tiles, paged attention's split contexts), zero between launches (each piece's last
    program resets its own), per device and stream: two launches on one stream never count at once, as a kernel
    counts only after its wait for the one before it (PDL's; stream order without it), so every kernel on the
    stream shares one buffer. Made on the first launch, which is eager (the autotuner and the engine's warm-up
    run a shape before any capture); grown, never shrunk (a captured graph keeps the one it was captured with
    alive here)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    have = _COUNTERS.get(key)
    if have is None or have.numel() < n:
        have = _COUNTERS[key] = torch.zeros(max(n, 4096), device=device, dtype=torch.int32)
        _KEPT.append(have)
    return have
