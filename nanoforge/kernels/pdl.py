"""Programmatic dependent launch (PDL) for the chain of small kernels that a decode step is.

A batch-1 decode step is ~7 kernels a layer, each a few microseconds: the time between one kernel's last
block and the next one's first (the launch, the block scheduler, the ramp of the first loads) is a large
share of the step. On Hopper, a kernel launched with PDL may start while the kernel before it in the stream
is still running; it waits (`griddepcontrol.wait`) for that kernel's completion and memory flush before it
touches anything the predecessor wrote, and the predecessor lets it launch early
(`griddepcontrol.launch_dependents`). CUDA graph capture keeps these edges, so the engine's replayed decode
graphs run with them.

Every kernel that launches with PDL calls `enter(PDL)` in every program before it reads memory the kernel
right before it may write, and before it writes any: a kernel that launched early and did not wait could
finish before its predecessor, and the kernel after it would then wait on the wrong one. What no kernel writes
may be touched before the wait: the skinny matmul asks L2 for its weights there (`prefetch_l2`), so that a
kernel launched early spends its predecessor's last microseconds streaming them in. So may what only earlier
kernels wrote: a kernel launches only once its predecessor has passed its own wait, i.e. once every kernel
before that one has finished and flushed its writes. A kernel lets its successor launch at once, after its
wait: the successor's programs are resident and waiting when this kernel ends. Measured on the H200 (session
11): batch-1 decode +5% (Llama-3.2-1B), +12% (Qwen3-0.6B). Releasing the successor after the main loop
instead (`NANOFORGE_PDL=late`, for the big kernels) was slower in the engine (916 tok/s against 958 on Llama,
session 12) and was taken out in session 52 (the code is at 74a5d60).

NANOFORGE_PDL: `auto` (the default: on for CUDA devices of compute capability 9.0 or newer), `1` (on wherever
the device supports it), `0` (off).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from nanoforge.kernels.dispatch import env_choice, interpreting


OFF, EARLY = 0, 1


def mode() -> str:
    return env_choice("NANOFORGE_PDL", ("auto", "1", "0"))


def enabled(t: torch.Tensor) -> int:
    """How kernels on t's device launch: OFF or EARLY (never under the interpreter, never before sm_90).
    Kernels take it as their PDL constexpr and launch with `launch_pdl=bool(...)`."""
    m = mode()
    if m == "0" or interpreting() or not hopper(t.device):
        return OFF
    return EARLY


def hopper(device: torch.device) -> bool:
    """Whether `device` is a CUDA GPU of compute capability 9.0 or newer (PDL, the bulk L2 prefetch)."""
    return device.type == "cuda" and _sm90(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


@triton.jit
def enter(PDL: tl.constexpr):
    """With PDL: wait until the kernel before this one has finished and its writes are visible, then let the
    kernel after this one launch. A no-op without PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the lines at `ptrs` (one address per 128-byte line is enough), not waiting for them: what a
    kernel launched early may do before `enter` with memory that no kernel writes (a decode step's weights), so
    that its first loads after the wait hit L2 while the kernel before it was still finishing."""
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)

