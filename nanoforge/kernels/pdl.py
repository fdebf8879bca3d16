"""Programmatic dependent launch (PDL) for the chain of small kernels that a decode step is.

A batch-1 decode step is ~7 kernels a layer, each a few microseconds: the time between one kernel's last
block and the next one's first (the launch, the block scheduler, the ramp of the first loads) is a large
share of the step. On Hopper, a kernel launched with PDL may start while the kernel before it in the stream
is still running; it waits (`griddepcontrol.wait`) for that kernel's completion and memory flush before it
touches anything the predecessor wrote, and the predecessor lets it launch early
(`griddepcontrol.launch_dependents`). CUDA graph capture keeps these edges, so the engine's replayed decode
graphs run with them.

Every kernel that launches with PDL calls `wait_then_release(PDL)` first, in every program, before it reads
or writes memory: a kernel that launched early and did not wait could finish before its predecessor, and the
kernel after it would then wait on the wrong one. Waiting at the very start keeps that rule simple; the gain
is the launch and scheduling latency hidden behind the predecessor's tail.

NANOFORGE_PDL: `auto` (the default: on for CUDA devices of compute capability 9.0 or newer), `1` (on wherever
the device supports it), `0` (off).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from nanoforge.kernels.dispatch import interpreting


def mode() -> str:
    m = os.environ.get("NANOFORGE_PDL", "auto").lower()
    if m not in ("auto", "1", "0"):
        from nanoforge.errors import NanoforgeError

        raise NanoforgeError(f"NANOFORGE_PDL must be auto, 1 or 0, not {m!r}", param="NANOFORGE_PDL")
    return m


def enabled(t: torch.Tensor) -> bool:
    """Whether kernels on t's device launch with PDL (never under the interpreter, never before sm_90)."""
    if mode() == "0" or t.device.type != "cuda" or interpreting():
        return False
    return _supported(t.device.index if t.device.index is not None else torch.cuda.current_device())


@functools.cache
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """With PDL: wait until the kernel before this one has finished and its writes are visible, then let the
    kernel after this one launch. A no-op without PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
