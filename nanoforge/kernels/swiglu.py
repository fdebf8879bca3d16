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
from nanoforge.kernels.dispatch import interpreting, use_fast

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK = 1024
_FTZ_EXP = tl.constexpr(not interpreting())  # `swiglu_round`'s exponential in PTX (the interpreter runs none)


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
    tl.store(OUT + row * F_ + cols, swiglu_round(g, u, OUT.dtype.element_ty), mask=m)


@triton.jit
def swiglu_round(gate, up, ty: tl.constexpr):
    """silu(gate) * up from fp32 gate and up, rounded as the reference rounds a projection's output: gate and up
    to ty, silu(gate) = gate / (1 + exp(-gate)) to ty, then the product to ty. Every SwiGLU here takes it (this
    kernel, the skinny matmul's and the GEMM's epilogues, the persistent decode kernel through the former), so
    their roundings agree. On a GPU exp is `ex2.approx.ftz.f32` of -gate * log2(e), what `tl.exp` computes with
    `ex2.approx.f32` but for subnormal results (gate > 87, where 1 + exp rounds to 1 either way): ptxas then
    leaves out the subnormal rescaling around each MUFU.EX2 (a compare and two multiplies an element)."""
    g = gate.to(ty).to(tl.float32)
    if _FTZ_EXP:
        e = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [g * -1.4426950408889634],
                                      dtype=tl.float32, is_pure=True, pack=1)
    else:
        e = tl.exp(-g)
    return ((g / (1.0 + e)).to(ty).to(tl.float32) * up.to(ty).to(tl.float32)).to(ty)
