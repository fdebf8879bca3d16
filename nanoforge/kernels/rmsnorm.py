"""RMSNorm, y = x / sqrt(mean(x^2) + eps) * weight, and its fused residual-add variant.

`add_rms_norm(x, residual, weight, eps)` returns (rms_norm(x + residual), x + residual):
the pre-norm transformer block's "add the sublayer output to the residual
stream, then normalize for the next sublayer" in one pass over memory instead
of three (vLLM's fused_add_rms_norm).

Both are differentiable. The Triton forward keeps 1/rms per row (fp32) for a
Triton backward: one program per group of rows computes dx row by row and
accumulates its rows' share of dweight, and the per-program shares are summed
by torch. Statistics are in fp32 whatever the input dtype (float64 inputs take
the reference path, which then computes in float64); the result has x's dtype.
Under torch.compile both take the reference, which Inductor fuses.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoforge.kernels import pdl
from nanoforge.kernels.dispatch import use_fast

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_N = 65536  # one row lives in registers
_INTERPRET_BWD_PROGRAMS = 3  # backward row groups on the CPU (tests see uneven groups)


# --------------------------------------------------------------------------- reference


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(xf.dtype)).to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    h = x + residual
    return rms_norm_ref(h, weight, eps), h


# --------------------------------------------------------------------------- public API


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (any leading dims); weight: (hidden,)."""
    _check(x, None, weight, eps)
    if not _fast(x, weight):
        return rms_norm_ref(x, weight, eps)
    return _RMSNorm.apply(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), fused; x and residual of one shape and dtype."""
    _check(x, residual, weight, eps)
    if not _fast(x, weight):
        return add_rms_norm_ref(x, residual, weight, eps)
    return _AddRMSNorm.apply(x, residual, weight, eps)


def _check(x, residual, weight, eps) -> None:
    if x.dim() < 1 or weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight has shape {tuple(weight.shape)} but x has shape {tuple(x.shape)}; "
                         f"weight must be (hidden,) = ({x.shape[-1] if x.dim() else '?'},)")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"add_rms_norm: residual is {tuple(residual.shape)} {residual.dtype} but x is "
                         f"{tuple(x.shape)} {x.dtype}; they must match")
    if not eps > 0:
        raise ValueError(f"rms_norm: eps must be > 0, not {eps}")
    if x.shape[-1] > _MAX_N:
        raise ValueError(f"rms_norm: hidden size {x.shape[-1]} exceeds the kernel's limit of {_MAX_N}")


def _fast(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The Triton kernels on a GPU, outside torch.compile: compiled (training's default on a GPU), Inductor
    generates the norm from the reference and fuses it with its neighbours, and it cannot inline these kernels
    (it copies a kernel's source but not the `pdl` module its helpers live in: a NameError on the H200)."""
    if torch.compiler.is_compiling():
        return False
    return use_fast(x, weight) and x.dtype in _TRITON_DTYPES and x.numel() > 0


# --------------------------------------------------------------------------- Triton kernels


@triton.jit
def _rms_norm_fwd_kernel(x, res, w, y, h, rstd, N, stride_x, stride_r, stride_y, stride_h, eps,
                         BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    """One row per program: y = x * rstd * w (x += res first, stored to h, if HAS_RESIDUAL)."""
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    xv = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        hv = (xv + tl.load(res + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)).to(h.dtype.element_ty)
        tl.store(h + row * stride_h + cols, hv, mask=mask)
        xv = hv.to(tl.float32)  # normalize the stored (rounded) sum, as the reference does
    r = tl.rsqrt(tl.sum(xv * xv, axis=0) / N + eps)
    tl.store(rstd + row, r)
    wv = tl.load(w + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y + row * stride_y + cols, (xv * r * wv).to(y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(dy, x, w, rstd, dx, dh, dw_part, rows, N, rows_per_program,
                         stride_dy, stride_x, stride_dx, stride_dh,
                         BLOCK_N: tl.constexpr, HAS_DH: tl.constexpr):
    """Rows [pid * rows_per_program, ...): dx (+ dh, the gradient reaching the
    residual-sum output directly), and this program's share of dweight."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    wv = tl.load(w + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program  # int64 row offsets: rows * N may pass 2**31
    for row in range(first, tl.minimum(first + rows_per_program, rows)):
        r = tl.load(rstd + row)
        xhat = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32) * r
        dyv = tl.load(dy + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        g = dyv * wv
        # d/dx of x * rstd(x), for upstream gradient g:  rstd * (g - xhat * mean(g * xhat))
        dxv = r * (g - xhat * (tl.sum(g * xhat, axis=0) / N))
        if HAS_DH:
            dxv += tl.load(dh + row * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx + row * stride_dx + cols, dxv.to(dx.dtype.element_ty), mask=mask)
        dw += dyv * xhat
    tl.store(dw_part + pid * N + cols, dw, mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(rows, hidden) view with unit stride along hidden (copies only if needed)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch_params(n: int) -> tuple[int, int]:
    block = triton.next_power_of_2(n)
    return block, 4 if block <= 1024 else 8 if block <= 4096 else 16


def _forward(x, residual, weight, eps):
    """Returns y, h (x + residual, or the 2-D x when there is no residual) and 1/rms per row."""
    x2 = _rows(x)
    rows, n = x2.shape
    y = torch.empty_like(x2)
    rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
    if residual is not None:
        r2 = _rows(residual)
        h = torch.empty_like(x2)
    else:
        r2, h = x2, x2  # unused pointers
    block, warps = _launch_params(n)
    on = pdl.enabled(x2)
    _rms_norm_fwd_kernel[(rows,)](x2, r2, weight, y, h, rstd, n, x2.stride(0), r2.stride(0), y.stride(0),
                                  h.stride(0), eps, BLOCK_N=block, HAS_RESIDUAL=residual is not None, PDL=on,
                                  num_warps=warps, launch_pdl=bool(on))
    return y.view(x.shape), h, rstd


def _backward(dy, x2, weight, rstd, dh):
    """dx (shaped like dy) and dweight; x2 is the normalized input as (rows, hidden)."""
    dy2 = _rows(dy)
    rows, n = x2.shape
    dx = torch.empty_like(dy2)
    dh2 = _rows(dh) if dh is not None else dy2  # unused pointer without HAS_DH
    if dy.is_cuda:
        programs = min(rows, 2 * torch.cuda.get_device_properties(dy.device).multi_processor_count)
    else:
        programs = min(rows, _INTERPRET_BWD_PROGRAMS)
    rows_per_program = triton.cdiv(rows, programs)
    programs = triton.cdiv(rows, rows_per_program)
    dw_part = torch.empty((programs, n), device=dy.device, dtype=torch.float32)
    block, warps = _launch_params(n)
    _rms_norm_bwd_kernel[(programs,)](dy2, x2, weight, rstd, dx, dh2, dw_part, rows, n, rows_per_program,
                                      dy2.stride(0), x2.stride(0), dx.stride(0), dh2.stride(0),
                                      BLOCK_N=block, HAS_DH=dh is not None, num_warps=warps)
    return dx.view(dy.shape), dw_part.sum(0).to(weight.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, x2, rstd = _forward(x, None, weight, eps)
        ctx.save_for_backward(x2, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = _backward(dy, x2, weight, rstd, None)
        return dx, dw, None


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        y, h2, rstd = _forward(x, residual, weight, eps)
        ctx.save_for_backward(h2, weight, rstd)
        return y, h2.view(x.shape)

    @staticmethod
    def backward(ctx, dy, dh):
        h2, weight, rstd = ctx.saved_tensors
        dx, dw = _backward(dy, h2, weight, rstd, dh)
        return dx, dx, dw, None
