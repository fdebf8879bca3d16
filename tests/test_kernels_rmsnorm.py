"""RMSNorm and fused add+RMSNorm (forward and backward) against float64 torch autograd.

CPU tests run the Triton kernels under TRITON_INTERPRET=1 (tests/conftest.py);
`gpu` tests repeat them at full size. Every buffer the kernels allocate is
poisoned with NaN first, so an element a kernel fails to write fails the test.
"""

import os
import re

import pytest
import torch

from conftest import raises_bug
from nanoforge.kernels import rmsnorm as rn

interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU-interpreter test (TRITON_INTERPRET=1); the gpu tests cover the compiled kernels")

# One output ulp (the interpreter truncates instead of rounding); float32 is near-exact.
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
EPS = 1e-5


@pytest.fixture
def force_triton(monkeypatch):
    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")


@pytest.fixture(autouse=True)
def poison_allocations(monkeypatch):
    """torch.empty / torch.empty_like hand out NaN-filled floating-point buffers during the test."""
    def poisoned(alloc):
        def wrapper(*args, **kwargs):
            t = alloc(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t
        return wrapper

    monkeypatch.setattr(torch, "empty", poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(torch.empty_like))


def _close(actual, expected, dtype, scale=None):
    scale = expected.abs().max().item() if scale is None else scale
    torch.testing.assert_close(actual.double(), expected, rtol=RTOL[dtype], atol=RTOL[dtype] * scale)


def _dx_scale(dy, w, x64):
    """Size of dx's terms rstd * dy * w (they cancel when the hidden size is 1)."""
    rstd = x64.square().mean(-1, keepdim=True).rsqrt()
    return (dy.double() * w.double() * rstd).abs().max().item()


def _dw_scale(dy, x64):
    """Largest sum over rows of |dy * x_hat|: the size of dweight's terms, which cancel in the sum."""
    x_hat = x64 * x64.square().mean(-1, keepdim=True).rsqrt()
    return (dy.double() * x_hat).abs().reshape(-1, x64.shape[-1]).sum(0).max().item()


def _leaf(t):
    return t.detach().clone().requires_grad_()


def _inputs(shape, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype).to(device)
    residual = torch.randn(shape, generator=g).to(dtype).to(device)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(dtype).to(device)
    dy = torch.randn(shape, generator=g).to(dtype).to(device)
    return x, residual, w, dy


def _check_rms_norm(shape, dtype, device="cpu"):
    x, _, w, dy = _inputs(shape, dtype, device)
    xt, wt = _leaf(x), _leaf(w)
    y = rn.rms_norm(xt, wt, EPS)
    y.backward(dy)
    x64, w64 = _leaf(x.double()), _leaf(w.double())
    y64 = rn.rms_norm_ref(x64, w64, EPS)
    y64.backward(dy.double())
    assert y.dtype == dtype and xt.grad.dtype == dtype and wt.grad.dtype == dtype
    _close(y, y64, dtype)
    _close(xt.grad, x64.grad, dtype, scale=_dx_scale(dy, w, x64))
    _close(wt.grad, w64.grad, dtype, scale=_dw_scale(dy, x64))


def _check_add_rms_norm(shape, dtype, device="cpu"):
    x, residual, w, dy = _inputs(shape, dtype, device, seed=1)
    dh = torch.randn(shape, generator=torch.Generator().manual_seed(9)).to(dtype).to(device)
    xt, rt, wt = _leaf(x), _leaf(residual), _leaf(w)
    y, h = rn.add_rms_norm(xt, rt, wt, EPS)
    torch.autograd.backward([y, h], [dy, dh])
    x64, r64, w64 = _leaf(x.double()), _leaf(residual.double()), _leaf(w.double())
    # the reference normalizes the sum rounded to the input dtype, as the kernel does (gradient: identity)
    exact = x64 + r64
    h64 = exact + (exact.to(dtype).double() - exact).detach()
    y64 = rn.rms_norm_ref(h64, w64, EPS)
    torch.autograd.backward([y64, h64], [dy.double(), dh.double()])
    _close(h, x.double() + residual.double(), dtype)
    _close(y, y64, dtype)
    _close(xt.grad, x64.grad, dtype)
    _close(rt.grad, r64.grad, dtype)
    _close(wt.grad, w64.grad, dtype, scale=_dw_scale(dy, h64.detach()))


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 5, 70), (7, 256), (1, 1)])
def test_rms_norm_forward_backward(force_triton, dtype, shape):
    _check_rms_norm(shape, dtype)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 5, 70), (11, 33)])
def test_add_rms_norm_forward_backward(force_triton, dtype, shape):
    _check_add_rms_norm(shape, dtype)


@interpreter
def test_under_torch_compile_the_norms_take_the_reference_that_inductor_fuses(force_triton, monkeypatch):
    """Traced by torch.compile (training's default on a GPU), rms_norm and add_rms_norm leave the Triton kernels
    to Inductor's own fused norm: it cannot inline them (on the H200 the compiled Llama loop died with
    "NameError: pdl is not defined"). Compiled here with the kernels forced on, neither autograd Function is
    reached, and values and gradients match float64; eager, the kernel still runs."""
    def refuse(*args):
        raise AssertionError("the Triton norm was traced by torch.compile")

    x, residual, w, _ = _inputs((3, 5, 70), torch.float32)
    eager = rn.rms_norm(x, w, EPS)  # the kernel, under the interpreter
    monkeypatch.setattr(rn._RMSNorm, "apply", refuse)
    monkeypatch.setattr(rn._AddRMSNorm, "apply", refuse)
    xs, rs, ws = (t.clone().requires_grad_() for t in (x, residual, w))

    def both(x, r, w):
        y, h = rn.add_rms_norm(x, r, w, EPS)
        return rn.rms_norm(y + h, w, EPS)

    out = torch.compile(both, backend="aot_eager", fullgraph=True)(xs, rs, ws)
    out.sum().backward()
    x64, r64, w64 = (t.double().requires_grad_() for t in (x, residual, w))
    y64, h64 = rn.add_rms_norm_ref(x64, r64, w64, EPS)
    ref = rn.rms_norm_ref(y64 + h64, w64, EPS)
    ref.sum().backward()
    _close(out, ref, torch.float32)
    for got, want in ((xs, x64), (rs, r64), (ws, w64)):
        _close(got.grad, want.grad, torch.float32)
    _close(eager, rn.rms_norm_ref(x.double(), w.double(), EPS), torch.float32)
    with pytest.raises(AssertionError, match="traced"):
        rn.rms_norm(x, w, EPS)  # eager: the Function is still the way


@interpreter
def test_non_contiguous_input(force_triton):
    x = torch.randn(40, 6).t()  # (6, 40), hidden dim strided
    w = torch.randn(40)
    _close(rn.rms_norm(x, w, EPS), rn.rms_norm_ref(x.double(), w.double(), EPS), torch.float32)


def test_reference_path(monkeypatch):
    monkeypatch.setenv("NANOFORGE_KERNELS", "torch")
    x, residual, w, _ = _inputs((4, 9), torch.float32)
    expected = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS) * w
    torch.testing.assert_close(rn.rms_norm(x, w, EPS), expected)
    y, h = rn.add_rms_norm(x, residual, w, EPS)
    assert torch.equal(h, x + residual)
    torch.testing.assert_close(y, rn.rms_norm_ref(x + residual, w, EPS))


@pytest.mark.parametrize("call, words", [
    (lambda: rn.rms_norm(torch.zeros(2, 8), torch.zeros(7), EPS), "weight has shape (7,)"),
    (lambda: rn.rms_norm(torch.zeros(2, 8), torch.zeros(8), 0.0), "eps"),
    (lambda: rn.add_rms_norm(torch.zeros(2, 8), torch.zeros(2, 8).half(), torch.zeros(8), EPS), "residual"),
    (lambda: rn.rms_norm(torch.zeros(1, 70000), torch.zeros(70000), EPS), "65536"),
])
def test_bad_arguments_raise_clear_errors(call, words):
    with raises_bug(re.escape(words)):
        call()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_full_size(dtype):
    _check_rms_norm((16384, 4096), dtype, device="cuda")
    _check_add_rms_norm((4096, 4100), dtype, device="cuda")


@interpreter
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-gpt2"])
def test_the_serving_forward_fuses_every_residual_add_with_the_next_norm(force_triton, monkeypatch, name):
    """Outside autograd (serving) the blocks defer their MLP's residual add to the next norm: one fused
    add + RMSNorm per norm but the first, and the same logits as the training forward (plain adds and norms);
    GPT-2's LayerNorm keeps the plain add."""
    import nanoforge.model.transformer as tr
    from nanoforge.model.config import preset

    torch.manual_seed(0)
    model = tr.Transformer(preset(name, vocab_size=64, max_seq_len=32)).eval()
    ids = torch.randint(0, 64, (2, 9))
    calls = {"fused": 0}
    fused = tr.add_rms_norm

    def counting(*args):
        calls["fused"] += 1
        return fused(*args)

    monkeypatch.setattr(tr, "add_rms_norm", counting)
    want = model(ids)  # autograd on: every add and norm as written
    assert calls["fused"] == 0
    with torch.no_grad():
        got = model(ids)
    layers = model.cfg.n_layers
    assert calls["fused"] == (0 if name == "tiny-gpt2" else 2 * layers)  # all 2L + 1 norms but the first
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
