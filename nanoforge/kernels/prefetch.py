"""A decode layer's next weights into L2 while its attention runs and HBM idles.

A batch-1 decode layer is a chain of kernels. The Q/K/V projection comes first. Then RoPE + KV write, paged
attention and the split combine: on the H200 they took ~14 us of each Llama-3.2-1B layer, reading under a MB
of KV cache (session 14's step timeline, `docs/results/issue14/session14/`). Last come the attention-out,
gate-and-up and down projections, which stream 8-67 MB of weights each. In the attention kernels' microseconds
HBM has almost nothing to do. The skinny matmul asks L2 for its own weights before its PDL wait
(`gemv.prefetch_k`), but that begins only once the kernel is launched, one kernel ahead.

`prefetch_ahead(*weights)` is called right after the Q/K/V projection with the weights that the layer reads
next, in order. It launches one small kernel. With PDL, the kernel lets its successor launch at once, waits
for the projection before it, asks L2 for the weights' first NANOFORGE_PREFETCH_AHEAD_MB, and exits. It uses
Hopper's bulk prefetch (`cp.async.bulk.prefetch.L2`), one instruction per CHUNK bytes spread over
PROGRAMS programs, and nothing waits for the transfers. So the HBM streams the next projections' weights
while attention runs, and those projections start with that share of their weights in L2 (50 MB on an
H200).

The kernel waits before it asks, so its prefetches do not take bandwidth from the Q/K/V projection, which is
on the critical path. It ends after that projection, so the kernels after it keep their order. Weights are
no kernel's output, so the prefetches race with nothing.

NANOFORGE_PREFETCH_AHEAD_MB: 0 (the default) launches nothing. It stays 0 until `benchmarks/gpu_engine.py
--decode-variants prefetch_ahead_16,prefetch_ahead_32,prefetch_ahead_48` has timed it on the H200. It acts
only on CUDA devices of compute capability 9.0 or newer (the bulk prefetch), outside the Triton interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoforge.kernels import pdl
from nanoforge.kernels.dispatch import env_mib, interpreting

CHUNK = 512 << 10  # bytes one bulk prefetch asks for
PROGRAMS = 16  # one warp each: a 48 MiB budget is 6 prefetches a program
MAX_RANGES = 3  # weights one launch takes (a SwiGLU layer's attention-out, gate-and-up and down)


def ahead_bytes() -> int:
    """NANOFORGE_PREFETCH_AHEAD_MB in bytes (0: off)."""
    return max(0, int(env_mib("NANOFORGE_PREFETCH_AHEAD_MB", "0") * (1 << 20)))


def plan(weights: tuple[torch.Tensor, ...], budget: int) -> list[tuple[torch.Tensor, int]]:
    """(weight, bytes from its start) for the weights in order until `budget` bytes are taken: whole weights,
    then the first part of the one the budget ends in. Every count is a multiple of 16, as the bulk prefetch
    needs, and the weights stop at the first that is not one dense, 16-byte-aligned range."""
    ranges = []
    for w in weights:
        if not (w.is_contiguous() and w.data_ptr() % 16 == 0):
            break
        take = min(w.numel() * w.element_size(), budget) // 16 * 16
        if take <= 0:
            break
        ranges.append((w, take))
        budget -= take
    return ranges


def prefetch_ahead(*weights: torch.Tensor) -> None:
    """Ask L2 for the first NANOFORGE_PREFETCH_AHEAD_MB of `weights` (in order) once the kernel before this
    launch has finished; nothing where that is 0 or the device has no bulk prefetch."""
    budget = ahead_bytes()
    if not budget or not weights or interpreting() or not pdl.hopper(weights[0].device):
        return
    ranges = plan(weights[:MAX_RANGES], budget)
    if not ranges:
        return
    ranges += [(ranges[0][0], 0)] * (MAX_RANGES - len(ranges))  # unused slots: no bytes
    args = [x for w, n in ranges for x in (w, n)]
    on = pdl.enabled(weights[0])
    _prefetch_kernel[(PROGRAMS,)](*args, CHUNK=CHUNK, BLOCK=32, PDL=on, num_warps=1, launch_pdl=bool(on))


@triton.jit
def _bulk_prefetch(W, NBYTES, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Ask L2 for bytes [0, NBYTES) at W in chunks of CHUNK bytes: chunk c by program c % programs, one a
    thread (the compiler issues a warp's prefetches one lane at a time: few chunks a program keep that short)."""
    base = W.to(tl.pointer_type(tl.int8))
    programs = tl.num_programs(0)
    offs = (tl.program_id(0) + programs * tl.arange(0, BLOCK)).to(tl.int64) * CHUNK
    for start in range(0, NBYTES, programs * BLOCK * CHUNK):
        o = start + offs
        size = tl.where(o < NBYTES, tl.minimum(NBYTES - o, CHUNK), 0).to(tl.int32)
        tl.inline_asm_elementwise(
            "{\n\t.reg .pred p;\n\tsetp.gt.s32 p, $2, 0;\n\t@p cp.async.bulk.prefetch.L2.global [$1], $2;"
            "\n\tmov.u32 $0, 0;\n\t}",
            "=r,l,r", [tl.where(size > 0, base + o, base), size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_kernel(W0, N0, W1, N1, W2, N2, CHUNK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Let the next kernel launch, wait for the one before (PDL), then ask L2 for N0, N1, N2 bytes at W0, W1, W2."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    _bulk_prefetch(W0, N0, CHUNK, BLOCK)
    _bulk_prefetch(W1, N1, CHUNK, BLOCK)
    _bulk_prefetch(W2, N2, CHUNK, BLOCK)
