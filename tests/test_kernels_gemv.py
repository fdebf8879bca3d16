"""The skinny matmul of decode (kernels/gemv.py) against float64 F.linear, and its place in the model.

CPU tests run the Triton kernel under TRITON_INTERPRET=1 (tests/conftest.py); `gpu` tests repeat it at the
model shapes it serves. The kernel's output is poisoned with NaN first, so an element it fails to write fails.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import interpreter

from nanoforge.kernels import gemv as gv
from nanoforge.kernels.swiglu import silu_mul_ref


@pytest.fixture
def poisoned(monkeypatch):
    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")
    monkeypatch.setattr(gv, "_empty", lambda *shape, like: torch.full(shape, math.nan, dtype=like.dtype,
                                                                         device=like.device))


def reference(x, w, b, swiglu):
    x64 = x.double()
    if swiglu:  # silu rounded to the dtype, as the kernel and swiglu.silu_mul do, then the product
        g, u = x.chunk(2, dim=-1)
        x64 = (F.silu(g.float()).to(x.dtype).double() * u.double()).to(x.dtype).double()
    return F.linear(x64, w.double(), None if b is None else b.double())


# (leading shape of x, K, N): one row, a few rows, 16 rows; K and N not multiples of the tiles
SHAPES = [((1,), 64, 48), ((1, 3), 100, 40), ((16,), 96, 33)]


@interpreter
@pytest.mark.parametrize("lead,k,n", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("swiglu,bias", [(False, False), (False, True), (True, False)])
def test_matches_float64(poisoned, lead, k, n, dtype, swiglu, bias):
    gen = torch.Generator().manual_seed(k + n)
    x = torch.randn(*lead, 2 * k if swiglu else k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    assert gv.fits(x, w)
    got = gv.gemv(x, w, b, swiglu=swiglu)
    assert got.shape == (*lead, n) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), reference(x, w, b, swiglu), rtol=tol, atol=tol)


def test_takes_the_reference_where_the_kernel_does_not_apply(monkeypatch):
    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")
    w = torch.randn(8, 16)
    assert not gv.fits(torch.randn(gv.MAX_ROWS + 1, 16), w)  # a GEMM's rows
    assert not gv.fits(torch.randn(2, 16, requires_grad=True), w)  # autograd
    assert not gv.fits(torch.randn(2, 16, dtype=torch.float64), w.double())
    monkeypatch.setenv("NANOFORGE_KERNELS", "torch")
    assert not gv.fits(torch.randn(2, 16), w)
    x = torch.randn(gv.MAX_ROWS + 1, 32)
    torch.testing.assert_close(gv.gemv(x, w, swiglu=True), F.linear(silu_mul_ref(x), w))


def test_bad_shapes_raise_one_clear_error():
    with pytest.raises(ValueError, match=r"gemv: x has 16 features; weight \(8, 16\) needs 32 \(gate and up\)"):
        gv.gemv(torch.randn(1, 16), torch.randn(8, 16), swiglu=True)


@interpreter
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_the_model_sends_decode_rows_through_it_when_enabled(poisoned, monkeypatch, name):
    """NANOFORGE_GEMV=1: a forward of a few tokens outside autograd takes the kernel for every projection of
    every block (q/k/v, attention-out, gate-and-up, and MLP-down with SwiGLU in its prologue) and gives the
    logits of the layers' own forward; more rows than a tile, or autograd, take nn.Linear."""
    from nanoforge.model.config import preset
    from nanoforge.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(preset(name)).eval()
    ids = torch.randint(0, model.cfg.vocab_size, (1, 5))
    calls = []
    real = gv.gemv
    monkeypatch.setattr(gv, "gemv", lambda *a, **k: calls.append(k.get("swiglu", False)) or real(*a, **k))
    with torch.no_grad():
        monkeypatch.setenv("NANOFORGE_GEMV", "0")
        want = model(ids)
        assert not calls
        monkeypatch.setenv("NANOFORGE_GEMV", "1")
        got = model(ids)
        assert len(calls) == 4 * model.cfg.n_layers and sum(calls) == model.cfg.n_layers
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        calls.clear()
        model(torch.randint(0, model.cfg.vocab_size, (2, 9)))  # 18 rows
        assert not calls
    model(ids)  # autograd
    assert not calls


@interpreter
def test_auto_takes_the_way_measured_fastest_once_per_shape(poisoned, monkeypatch):
    """NANOFORGE_GEMV=auto (the default): each projection shape is timed once (here a stand-in timer that makes
    the fused prologue fastest for MLP-down and cuBLAS for everything else but Q/K/V) and then always takes the
    way found; the logits stay the layers' own; where nothing can be timed (inside a capture, or no GPU) it is
    cuBLAS, and nothing is remembered."""
    from nanoforge.model.config import preset
    from nanoforge.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(preset("tiny-llama")).eval()
    ids = torch.randint(0, model.cfg.vocab_size, (1, 3))
    monkeypatch.delenv("NANOFORGE_GEMV", raising=False)
    monkeypatch.setattr(gv, "_CHOICES", {})
    with torch.no_grad():
        want = model(ids)
        assert gv._CHOICES == {}  # no GPU to time on: cuBLAS, nothing remembered
        timed, calls = [], []
        real, qkv = gv.gemv, model.layers[0].attn.wqkv.out_features
        monkeypatch.setattr(gv, "_can_time", lambda x: True)
        monkeypatch.setattr(gv, "_fastest", lambda x, w, b, swiglu: timed.append(tuple(w.shape)) or (
            "fused" if swiglu else "ours" if w.shape[0] == qkv else "cublas"))
        monkeypatch.setattr(gv, "gemv", lambda *a, **k: calls.append(k.get("swiglu", False)) or real(*a, **k))
        for _ in range(2):
            torch.testing.assert_close(model(ids), want, rtol=1e-4, atol=1e-4)
        assert len(timed) == len(set(timed)) == 4  # the four shapes (every layer has the same), once each
        assert calls.count(True) == calls.count(False) == 2 * model.cfg.n_layers  # fused MLP-down, ours Q/K/V


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048),  # Llama-3.2-1B
                                 (1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024)])  # Qwen3-0.6B
def test_gpu_model_shapes_bf16(poisoned, k, n):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (runs on the H200 machine)")
    gen = torch.Generator(device="cuda").manual_seed(n)
    w = (torch.randn(n, k, generator=gen, device="cuda") / math.sqrt(k)).bfloat16()
    for rows in (1, 4, 16):
        for swiglu in (False, True):
            x = torch.randn(rows, 2 * k if swiglu else k, generator=gen, device="cuda").bfloat16()
            got = gv.gemv(x, w, swiglu=swiglu).double()
            want = reference(x, w, None, swiglu)
            assert ((got - want).norm() / want.norm()).item() < 1e-2, (rows, swiglu)


@pytest.mark.gpu
def test_gpu_auto_times_each_shape_once_and_every_way_is_right(monkeypatch):
    """On the GPU the choice is timed (a real measurement: some way wins), once per shape, and whichever way
    it picks gives F.linear's answer to bf16 rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (runs on the H200 machine)")
    monkeypatch.delenv("NANOFORGE_GEMV", raising=False)
    monkeypatch.setattr(gv, "_CHOICES", {})
    timed = []
    real = gv._fastest
    monkeypatch.setattr(gv, "_fastest", lambda *a: timed.append(a[1].shape) or real(*a))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for k, n, swiglu in ((2048, 1024, False), (3072, 1024, True), (2048, 3072, False)):
        w = (torch.randn(n, k, generator=gen, device="cuda") / math.sqrt(k)).bfloat16()
        x = torch.randn(1, 2 * k if swiglu else k, generator=gen, device="cuda").bfloat16()
        for _ in range(2):
            got = gv.skinny_linear(x, w, swiglu=swiglu).double()
            want = reference(x, w, None, swiglu)
            assert ((got - want).norm() / want.norm()).item() < 1e-2, (k, n, swiglu)
        assert gv.choose(x, w, None, swiglu) in (("cublas", "ours", "fused") if swiglu else ("cublas", "ours"))
    assert len(timed) == 3
