"""A graphed step's inputs read from, and its tokens written to, page-locked host memory by kernels.

Between two batch-1 decode graphs the device ran two copies: the step's sampled tokens to the host and the next
step's packed inputs up. Each is a copy-engine operation waited on in stream order, and the profile of a
Qwen3-0.6B step on an H100 (session 49) had ~20 us from the sampler's last kernel to the next step's first:
4.4 us to start the token copy, 1.5 for it, 9.7 until the inputs' copy started, 1.0 for it and 3.0 until the
next graph began. With unified addressing a CUDA kernel can read and write page-locked host memory directly
(the pointer is the same on both sides), so the graph can begin with a kernel that fetches its inputs from the
host and end with one that posts its tokens there, and the step boundary is two graph launches with no copy
between them.

The host fills the next step's inputs while the step before is still in flight, so each direction is a ring of
two host buffers, and the device picks its side by a step counter that it keeps itself: `fetch_inputs` reads
side `counter & 1` and `post_tokens` writes that side, then counts the step. The host counts the graphed steps
it launches the same way (`serve/step_io.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoforge.kernels import pdl
from nanoforge.kernels.dispatch import interpreting, use_fast


def fetch_inputs_ref(ring: torch.Tensor, counter: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """The definition of correct: dst[:] = ring[counter & 1, :len(dst)] (a host sync to read the counter)."""
    return dst.copy_(ring[int(counter.item()) & 1, :dst.numel()])


def post_tokens_ref(src: torch.Tensor, ring: torch.Tensor, counter: torch.Tensor) -> None:
    """The definition of correct: ring[counter & 1, :len(src)] = src, then the counter counts the step."""
    ring[int(counter.item()) & 1, :src.numel()].copy_(src)
    counter += 1


def fetch_inputs(ring: torch.Tensor, counter: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """dst (n,) int64 on the device = ring[counter & 1, :n], ring (2, capacity) int64 in page-locked host memory,
    counter (1,) int64 on the device (only read here)."""
    n = dst.numel()
    if not (ring.dim() == 2 and ring.shape[0] == 2 and n <= ring.shape[1] and dst.is_contiguous()
            and ring.is_contiguous() and ring.dtype == dst.dtype == counter.dtype == torch.int64):
        raise ValueError(f"fetch_inputs: ring (2, >= {n}) int64 contiguous, got {tuple(ring.shape)} {ring.dtype}")
    if not (use_fast(dst) and n):
        return fetch_inputs_ref(ring, counter, dst)
    small = interpreting()
    block = 64 if small else 1024
    on = pdl.enabled(dst)
    _fetch_kernel[(triton.cdiv(n, block),)](ring, ring.shape[1], counter, dst, n, BLOCK=block, PDL=on,
                                            num_warps=1 if small else 4, launch_pdl=bool(on))
    return dst


def post_tokens(src: torch.Tensor, ring: torch.Tensor, counter: torch.Tensor) -> None:
    """ring[counter & 1, :n] = src (n,) int64 on the device, ring (2, capacity) int64 in page-locked host memory;
    then counter (1,) int64 on the device counts the step (the fetch of the next step reads the other side)."""
    n = src.numel()
    if not (ring.dim() == 2 and ring.shape[0] == 2 and n <= ring.shape[1] and src.is_contiguous()
            and ring.is_contiguous() and ring.dtype == src.dtype == counter.dtype == torch.int64):
        raise ValueError(f"post_tokens: ring (2, >= {n}) int64 contiguous, got {tuple(ring.shape)} {ring.dtype}")
    if not use_fast(src):
        return post_tokens_ref(src, ring, counter)
    on = pdl.enabled(src)
    _post_kernel[(1,)](src, ring, ring.shape[1], counter, n, BLOCK=64 if interpreting() else 256, PDL=on,
                       num_warps=1, launch_pdl=bool(on))


@triton.jit
def _fetch_kernel(RING, capacity, COUNTER, DST, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # the counter is the post kernel's write at the end of the step before (a graph earlier: complete)
    pdl.enter(PDL)
    side = tl.load(COUNTER) & 1
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(DST + i, tl.load(RING + side * capacity + i, mask=i < n, volatile=True), mask=i < n)


@triton.jit
def _post_kernel(SRC, RING, capacity, COUNTER, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)  # SRC is the sampler's write, the kernel right before
    c = tl.load(COUNTER)
    side = c & 1
    for i0 in range(0, n, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        tl.store(RING + side * capacity + i, tl.load(SRC + i, mask=i < n), mask=i < n)
    tl.store(COUNTER, c + 1)  # one program: nothing else reads the counter during this kernel
