"""SwiGLU's gate: silu(h[..., :F]) * h[..., F:] for the fused gate-and-up projection h (..., 2F).

The reference is `F.silu(gate) * up`. The Triton kernel reads both halves once and writes the product, one
launch where the reference takes two (and an intermediate tensor); it rounds silu's result to the input's dtype
before the product, as the reference does. It runs outside autograd and torch.compile (serving).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanoforge.kernels import pdl
from nanoforge.kernels.dispatch import use_fast

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK = 1024


def silu_mul_ref(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """h (..., 2F) -> (..., F)."""
    if not _fast(h):
        return silu_mul_ref(h)
    f = h.shape[-1] // 2
    rows = h.reshape(-1, 2 * f)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(*h.shape[:-1], f, device=h.device, dtype=h.dtype)
    on = pdl.enabled(h)
    _silu_mul_kernel[(rows.shape[0], triton.cdiv(f, _BLOCK))](rows, out, f, rows.stride(0), BLOCK=_BLOCK, PDL=on,
                                                              launch_pdl=bool(on))
    return out


def _fast(h: torch.Tensor) -> bool:
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and h.requires_grad):
        return False
    return use_fast(h) and h.dtype in _DTYPES and h.shape[-1] % 2 == 0 and h.numel() > 0


@triton.jit
def _silu_mul_kernel(H, OUT, F_, stride, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < F_
    g = tl.load(H + row * stride + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(H + row * stride + F_ + cols, mask=m, other=0.0).to(tl.float32)
    ty = OUT.dtype.element_ty
    s = (g / (1.0 + tl.exp(-g))).to(ty).to(tl.float32)
    tl.store(OUT + row * F_ + cols, (s * u).to(ty), mask=m)
