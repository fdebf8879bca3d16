"""SwiGLU's gate (kernels/swiglu.py): the Triton kernel (interpreted) computes silu(gate) * up as the reference,
which is checked against float64; autograd keeps the reference."""

from __future__ import annotations

import pytest
import torch

from conftest import interpreter
from nanoforge.kernels import swiglu
from nanoforge.kernels.swiglu import silu_mul, silu_mul_ref


def test_reference_is_silu_of_the_gate_times_up():
    h = torch.randn(3, 4, 10, dtype=torch.float64)
    gate, up = h[..., :5], h[..., 5:]
    assert torch.allclose(silu_mul_ref(h), gate / (1 + torch.exp(-gate)) * up, atol=1e-14)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("f", [7, 1500])
def test_triton_gate_equals_the_reference(dtype, f, monkeypatch):
    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")
    h = (torch.randn(2, 3, 2 * f) * 4).to(dtype)
    got, want = silu_mul(h), silu_mul_ref(h)
    assert got.shape == (2, 3, f) and got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 2 ** -5  # two truncations (the interpreter truncates, GPUs round)
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
    # a strided view (rows of a wider buffer) reads in place
    wide = (torch.randn(4, 2 * f + 6) * 4).to(dtype)[:, :2 * f]
    assert torch.allclose(silu_mul(wide).float(), silu_mul_ref(wide).float(), rtol=tol, atol=tol)


@interpreter
def test_autograd_keeps_the_reference(monkeypatch):
    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")
    h = torch.randn(2, 8, requires_grad=True)
    assert not swiglu._fast(h)
    silu_mul(h).sum().backward()
    assert h.grad is not None
