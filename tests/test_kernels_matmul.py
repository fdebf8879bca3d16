"""Triton GEMM (every schedule, epilogues, linear) against a float64 torch reference.

CPU tests run the kernels under TRITON_INTERPRET=1 (tests/conftest.py sets it
on machines without CUDA) with small ragged shapes; the interpreter uses one
small non-square tile config (32x16x16), so these shapes cut tiles and K-ranges
unevenly. Output buffers are poisoned with NaN so an element the kernel fails to
write fails the comparison. `gpu` tests repeat the checks at full size.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import interpreter, raises_bug

from nanoforge.errors import NanoforgeError
from nanoforge.kernels import bench
from nanoforge.kernels import matmul as mm

# sigmoid(-large) in the GELU/SiLU epilogues overflows exp() to inf (correctly giving 0); numpy warns
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

# Relative tolerance: one unit in the last place of the output dtype (the
# interpreter truncates float32 -> bfloat16 instead of rounding, so a full ulp).
RTOL = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


@pytest.fixture
def force_triton(monkeypatch):
    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")


def _inputs(M, N, K, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g).to(dtype).to(device)
    b = torch.randn(K, N, generator=g).to(dtype).to(device)
    bias = torch.randn(N, generator=g).to(dtype).to(device)
    return a, b, bias


def _assert_matches(out, ref, dtype):
    """|out - ref| <= rtol * |ref| + atol, elementwise; NaN (an unwritten element) fails."""
    atol = 1e-4 * max(1.0, ref.abs().max().item())  # fp32-accumulation noise on values that cancel to ~0
    torch.testing.assert_close(out.double(), ref, rtol=RTOL[dtype], atol=atol)


def _run(a, b, **kw):
    out = torch.full((a.shape[0], b.shape[1]), float("nan"), dtype=a.dtype, device=a.device)
    result = mm.matmul(a, b, out=out, **kw)
    assert result is out
    return out


# (M, N, K, uses TMA descriptors): the first two are 16-byte aligned, the others are not.
SHAPES = [(64, 48, 64, True), (40, 56, 72, True), (37, 45, 70, False), (150, 40, 33, False), (1, 16, 5, False)]


@interpreter
@pytest.mark.parametrize("schedule", mm.SCHEDULES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,K,tma", SHAPES)
def test_matmul_matches_float64(force_triton, schedule, dtype, M, N, K, tma):
    a, b, _ = _inputs(M, N, K, dtype)
    out = _run(a, b, schedule=schedule)
    assert mm._tma_ok(a, b, out) == tma  # both addressing modes are covered
    _assert_matches(out, a.double() @ b.double(), dtype)


@interpreter
@pytest.mark.parametrize("schedule", ["tiled", "hybrid"])
@pytest.mark.parametrize("activation", [a for a in mm.ACTIVATIONS if a != "swiglu"])  # swiglu: below
@pytest.mark.parametrize("use_bias", [False, True])
def test_fused_epilogue(force_triton, schedule, activation, use_bias):
    a, b, bias = _inputs(45, 70, 40, torch.bfloat16, seed=1)
    bias = bias if use_bias else None
    out = _run(a, b, bias=bias, activation=activation, schedule=schedule)
    ref = mm.matmul_ref(a.double(), b.double(), bias=None if bias is None else bias.double(), activation=activation)
    _assert_matches(out, ref, torch.bfloat16)


def swiglu_want(a, b, bias, dtype):
    """silu_mul's rounding of a GEMM's output, from float64 products: gate and up rounded to the dtype, silu
    rounded, then their product (which the fused epilogue computes exactly in fp32 and rounds once)."""
    y = a.double() @ b.double() + (0 if bias is None else bias.double())
    gate, up = (h.to(dtype).double() for h in y.chunk(2, dim=-1))
    return F.silu(gate).to(dtype).double() * up


@interpreter
@pytest.mark.parametrize("dtype,use_bias,schedule", [(torch.bfloat16, True, "tiled"), (torch.float16, False, "tiled"),
                                                     (torch.bfloat16, False, "persistent")])
@pytest.mark.parametrize("M,N,K,tma", [(64, 96, 64, True), (40, 48, 72, True), (37, 90, 70, False),
                                       (150, 34, 33, False)])  # F = 17: the last tile's gate half runs past F
def test_swiglu_epilogue_matches_silu_mul_of_the_product(force_triton, dtype, use_bias, schedule, M, N, K, tma):
    """activation="swiglu": each tile computes its gate columns and the up columns F further on, and writes
    silu(gate) * up, (M, N / 2), through TMA descriptors (b a 3-D view whose block holds a tile's gate and up
    columns, one product a K tile; c's block half a tile wide) and through pointers; every output element
    written (NaN in `out` before), the (M, N) product never; by one program a tile ("tiled") or by programs
    that loop over tiles ("persistent": 4 programs under the interpreter, so most take several). Then as a
    model's (2F, K) weight (`linear`)."""
    a, b, bias = _inputs(M, N, K, dtype, seed=M)
    bias = bias if use_bias else None
    out = torch.full((M, N // 2), float("nan"), dtype=dtype)
    assert mm.matmul(a, b, bias=bias, activation="swiglu", schedule=schedule, out=out) is out
    plan = list(mm._PLANS.values())[-1]
    assert (plan.use_tma, plan.schedule) == (tma, schedule)
    want = swiglu_want(a, b, bias, dtype)
    # three roundings to the dtype, each a full ulp where the interpreter truncates bfloat16 (RTOL's note); a
    # gate or up column off by one, or the halves swapped, is off by O(1)
    torch.testing.assert_close(out.double(), want, rtol=4 * RTOL[dtype], atol=1e-3 * want.abs().max().item())
    x = torch.randn(2, 5, K, generator=torch.Generator().manual_seed(1)).to(dtype)
    w = b.t().contiguous()  # a model's (2F, K) gate-and-up weight
    y = mm.linear(x, w, activation="swiglu")
    assert y.shape == (2, 5, N // 2)
    torch.testing.assert_close(y.double(), swiglu_want(x, w.t(), None, dtype), rtol=4 * RTOL[dtype],
                               atol=1e-3 * y.double().abs().max().item())


@interpreter
def test_swiglu_through_tma_needs_halves_of_16_bytes(force_triton):
    """A (K, N) b whose halves are 24 bytes apart (F = 12 in bf16) has no 3-D TMA view, even where every row is
    16-byte aligned (`out` a view with padded rows): the pointers take it, with the same result."""
    a, b, _ = _inputs(33, 24, 40, torch.bfloat16, seed=3)
    out = torch.full((33, 16), float("nan"), dtype=torch.bfloat16)[:, :12]
    assert mm._tma_ok(a, b, out)
    mm.matmul(a, b, activation="swiglu", out=out)
    assert not list(mm._PLANS.values())[-1].use_tma
    want = swiglu_want(a, b, None, torch.bfloat16)
    torch.testing.assert_close(out.double(), want, rtol=4 * RTOL[torch.bfloat16], atol=1e-3 * want.abs().max().item())


def test_the_swiglu_epilogue_switch_and_its_reference(monkeypatch):
    """`auto` by default: off on the CPU whatever the rows (cuBLAS's stand-in, then the SwiGLU kernel; a GPU
    test checks it on); the other values whatever the input; the reference path (here the CPU) is silu_mul's."""
    x = torch.zeros(mm.SWIGLU_EPILOGUE_MIN_ROWS, 8, dtype=torch.bfloat16)
    assert mm.swiglu_epilogue(x) is None
    for value, schedule in (("1", "auto"), ("tiled", "tiled"), ("Persistent", "persistent"), ("0", None),
                            ("auto", None)):
        monkeypatch.setenv("NANOFORGE_SWIGLU_EPILOGUE", value)
        assert mm.swiglu_epilogue(x[:1]) == schedule
    monkeypatch.setenv("NANOFORGE_SWIGLU_EPILOGUE", "yes")
    with pytest.raises(NanoforgeError, match="NANOFORGE_SWIGLU_EPILOGUE must be auto, 0, 1, tiled or persistent, "
                                             "not 'yes'"):
        mm.swiglu_epilogue(x)
    a, b = torch.randn(3, 8), torch.randn(8, 10)
    h = a @ b
    assert torch.equal(mm.matmul(a, b, activation="swiglu"), F.silu(h[:, :5]) * h[:, 5:])


@interpreter
@pytest.mark.parametrize("name,switch,schedule", [("tiny-llama", "1", "auto"), ("tiny-qwen3", "persistent",
                                                                                 "persistent")])
def test_a_prefills_gate_and_up_take_the_swiglu_epilogue_when_enabled(force_triton, monkeypatch, name, switch,
                                                                        schedule):
    """NANOFORGE_SWIGLU_EPILOGUE=1 (or a schedule): a bf16 forward of a prompt outside autograd runs every block's
    gate-and-up as one GEMM with SwiGLU in its epilogue, on that schedule, and gives the logits of the forward
    without it (cuBLAS's stand-in and the SwiGLU kernel) to bf16 rounding; a decode's few rows keep the skinny
    matmul's way, autograd nn.Linear."""
    from nanoforge.model.config import preset
    from nanoforge.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(preset(name)).bfloat16().eval()
    ids = torch.randint(0, model.cfg.vocab_size, (2, 20))
    calls, real = [], mm._matmul_triton
    monkeypatch.setattr(mm, "_matmul_triton", lambda a, b, bias, act, sched, out: calls.append((act, sched))
                        or real(a, b, bias, act, sched, out))
    with torch.no_grad():
        want = model(ids).double()
        assert calls == []
        monkeypatch.setenv("NANOFORGE_SWIGLU_EPILOGUE", switch)
        got = model(ids).double()
        assert calls == [("swiglu", schedule)] * model.cfg.n_layers
        model(ids[:1, :3])  # 3 rows: the decode's way
        assert len(calls) == model.cfg.n_layers
    # bf16 rounding apart (~0.4% here, the interpreter truncating); the halves swapped or offset by a column
    # would move the logits by tens of percent
    assert ((got - want).norm() / want.norm()).item() < 0.02
    model(ids)  # autograd
    assert len(calls) == model.cfg.n_layers


@interpreter
@pytest.mark.parametrize("num_sms", [1, 3, 4, 7])
@pytest.mark.parametrize("schedule", ["persistent", "streamk", "hybrid", "hybrid-atomic"])
# one tile of 5 K-steps; 12 tiles of 3; 12 tiles of 7 (a hybrid tail tile split 3 ways, some ranges inside one)
@pytest.mark.parametrize("M,N,K", [(32, 16, 80), (70, 50, 48), (96, 64, 104)])
def test_streamk_splits(force_triton, monkeypatch, num_sms, schedule, M, N, K):
    """Vary the program count so that tiles are split 1..7 ways, including ranges that
    neither start nor end a tile; stale owner-slot contents (NaN) must never be read,
    every flag must be reset for the next launch, and the atomic fix-up's tiles must be
    left zero. Two launches, so the second one runs on what the first left behind."""
    monkeypatch.setattr(mm, "_INTERPRET_NUM_SMS", num_sms)
    if schedule == "hybrid-atomic":
        monkeypatch.setattr(mm, "_INTERPRET_FIXUP", "atomic")
        schedule = "hybrid"
    partials, flags = mm._workspace(torch.device("cpu"), num_sms)
    owner_slots, atomic_tiles = partials[: num_sms * mm._MAX_TILE_ELEMS], partials[num_sms * mm._MAX_TILE_ELEMS :]
    owner_slots.fill_(float("nan"))
    for seed in (num_sms, num_sms + 10):
        a, b, bias = _inputs(M, N, K, torch.float16, seed=seed)
        out = _run(a, b, bias=bias, schedule=schedule)
        _assert_matches(out, a.double() @ b.double() + bias.double(), torch.float16)
        assert flags.eq(0).all() and atomic_tiles.eq(0).all()


@interpreter
@pytest.mark.parametrize("K", [64, 36])  # 64: weight read through a transposed TMA descriptor; 36: pointers
def test_linear(force_triton, K):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 9, K, generator=g).bfloat16()
    w = torch.randn(24, K, generator=g).bfloat16()
    bias = torch.randn(24, generator=g).bfloat16()
    y = mm.linear(x, w, bias)
    assert y.shape == (2, 9, 24) and y.dtype == torch.bfloat16
    _assert_matches(y, F.linear(x.double(), w.double(), bias.double()), torch.bfloat16)


@interpreter
def test_strided_operands(force_triton):
    """Transposed views (a column-major, b row-major and vice versa) go through the pointer path."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(40, 50, generator=g).half().t()  # (50, 40), strides (1, 50)
    b = torch.randn(30, 40, generator=g).half().t()  # (40, 30), strides (1, 40)
    out = _run(a, b, schedule="streamk")
    _assert_matches(out, a.double() @ b.double(), torch.float16)


class _FakeAutotuner:
    """Stands in for triton.autotune on the CPU: runs the interpreter with one fixed config, calls the
    config's pre-hook like Triton does, and returns a 'compiled kernel' that launches the interpreter
    with every parameter positional, as Triton's CompiledKernel takes them."""

    def __init__(self, fn, config):
        self.fn, self.best_config, self.runs = fn, config, 0

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.runs += 1
            nargs = {**dict(zip(self.fn.arg_names, args)), **kwargs, **self.best_config.all_kwargs()}
            mm._set_tma_block_shapes(nargs)
            self.fn[grid](*args, **kwargs, **self.best_config.kwargs)
            return _FakeCompiled(self.fn)
        return run


class _FakeCompiled:
    packed_metadata = None
    launches = 0

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        assert len(grid) == 3

        def run(*args):
            assert len(args) == len(self.fn.arg_names)  # every parameter, in order, the constexprs too
            _FakeCompiled.launches += 1
            self.fn[grid](*args)
        return run


@interpreter
@pytest.mark.parametrize("schedule", ["tiled", "hybrid"])
@pytest.mark.parametrize("M,N,K", [(64, 48, 64), (37, 45, 70)])  # TMA descriptors; pointers
def test_launch_plan_reuses_the_compiled_kernel(force_triton, monkeypatch, schedule, M, N, K):
    """The GPU launch path, on the CPU: the first call of a shape goes through the autotuner, later
    ones launch the compiled kernel directly with the plan's arguments, and every result is right."""
    import triton

    config = triton.Config({**mm._INTERPRET_CONFIG, "SK_ITERS": mm._INTERPRET_SK_ITERS, "FIXUP": "owner",
                            "WS_TILE": mm._MAX_TILE_ELEMS}, num_warps=4, num_stages=2)
    tuner = _FakeAutotuner(mm._matmul_tiled_kernel, triton.Config(dict(mm._INTERPRET_CONFIG), num_warps=4))
    ptuner = _FakeAutotuner(mm._matmul_persistent_kernel, config)
    monkeypatch.setattr(mm, "_tiled_tuned", tuner)
    monkeypatch.setattr(mm, "_persistent_tuned", ptuner)
    monkeypatch.setattr(mm, "_autotuned", lambda device: True)
    monkeypatch.setattr(mm, "_PLANS", {})
    monkeypatch.setattr(_FakeCompiled, "launches", 0)
    for seed in range(3):
        a, b, bias = _inputs(M, N, K, torch.bfloat16, seed=seed)
        b = b.t().contiguous().t()  # the (N, K) weight seen through .t(), as linear() passes it
        out = mm.matmul(a, b, bias=bias, activation="silu", schedule=schedule)
        ref = mm.matmul_ref(a.double(), b.double(), bias=bias.double(), activation="silu")
        _assert_matches(out, ref, torch.bfloat16)
    assert tuner.runs + ptuner.runs == 1 and _FakeCompiled.launches == 2 and len(mm._PLANS) == 1


@interpreter
def test_misaligned_operands_take_pointers(force_triton, monkeypatch):
    """A view that starts 2 bytes into its storage cannot be a TMA base: the same shape and strides as an
    aligned call (whose plan uses TMA) must still give the right answer, through pointers."""
    monkeypatch.setattr(mm, "_PLANS", {})
    a, b, _ = _inputs(64, 48, 64, torch.bfloat16, seed=5)
    _assert_matches(_run(a, b), a.double() @ b.double(), torch.bfloat16)  # aligned: TMA
    a_off = torch.cat([torch.zeros(1, dtype=a.dtype), a.flatten()])[1:].view(64, 64)
    assert a_off.data_ptr() % 16 != 0 and a_off.stride() == a.stride()
    out = _run(a_off, b)
    assert not mm._tma_ok(a_off, b, out)
    assert [plan.use_tma for plan in mm._PLANS.values()] == [True, False]
    _assert_matches(out, a.double() @ b.double(), torch.bfloat16)


def test_pick_schedule():
    # 1024x4352 with 128x128 tiles: 272 tiles = 2.06 waves on 132 SMs -> hybrid
    assert mm._pick_schedule(1024, 4352, 132) == "hybrid"
    # 8192x8192: 4096 tiles = 31.03 waves, the tail costs ~3% -> data-parallel
    assert mm._pick_schedule(8192, 8192, 132) == "tiled"
    # one tile on a big GPU: Stream-K spreads its K-loop
    assert mm._pick_schedule(64, 64, 132) == "hybrid"


def test_reference_path_and_autograd(monkeypatch):
    """NANOFORGE_KERNELS=torch, and tensors that need a gradient, use the differentiable reference."""
    monkeypatch.setenv("NANOFORGE_KERNELS", "torch")
    a, b, bias = _inputs(9, 7, 5, torch.bfloat16)
    assert torch.equal(mm.matmul(a, b, bias=bias, activation="silu"), F.silu(a @ b + bias))
    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")
    x = torch.randn(3, 8, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(5, 8, dtype=torch.bfloat16, requires_grad=True)
    mm.linear(x, w).float().square().sum().backward()
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    F.linear(x2, w2).float().square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)


def test_empty_k_gives_bias(force_triton):
    a = torch.empty(3, 0, dtype=torch.bfloat16)
    b = torch.empty(0, 4, dtype=torch.bfloat16)
    bias = torch.arange(4.0).bfloat16()
    assert torch.equal(mm.matmul(a, b, bias=bias), bias.expand(3, 4))


@pytest.mark.parametrize("call, words", [
    (lambda: mm.matmul(torch.zeros(2, 3), torch.zeros(4, 5)), "(2, 3)"),
    (lambda: mm.matmul(torch.zeros(2, 3), torch.zeros(3, 5, dtype=torch.float16)), "float16"),
    (lambda: mm.matmul(torch.zeros(2, 3), torch.zeros(3, 5), bias=torch.zeros(4)), "bias"),
    (lambda: mm.matmul(torch.zeros(2, 3), torch.zeros(3, 5), activation="gelu"), "activation"),
    (lambda: mm.matmul(torch.zeros(2, 3), torch.zeros(3, 5), schedule="splitk"), "schedule"),
    (lambda: mm.matmul(torch.zeros(2, 3), torch.zeros(3, 5), out=torch.zeros(5, 2)), "out"),
    (lambda: mm.linear(torch.zeros(2, 3), torch.zeros(3, 5)), "weight"),
    (lambda: mm.matmul(torch.zeros(2, 3), torch.zeros(3, 5), activation="swiglu"), "even N"),
    (lambda: mm.matmul(torch.zeros(2, 3), torch.zeros(3, 6), activation="swiglu", schedule="hybrid"),
     "tiled or persistent"),
    (lambda: mm.matmul(torch.zeros(2, 3), torch.zeros(3, 6), activation="swiglu", out=torch.zeros(2, 6)), "(2, 3)"),
])
def test_bad_arguments_raise_clear_errors(call, words):
    with raises_bug(re.escape(words)):
        call()


# --------------------------------------------------------------------------- bench harness (no GPU needed)


def test_bench_refuses_without_cuda(monkeypatch, tmp_path):
    with pytest.raises(NanoforgeError, match="unknown benchmark kind"):
        bench.run(["gemmm"], tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(NanoforgeError, match="needs a CUDA GPU"):
        bench.run(["gemm"], tmp_path)


def test_bench_shapes():
    shapes = {(M, N, K) for _, M, N, K in bench.gemm_shapes()}
    assert len(shapes) == 12
    assert {(4096, 4096, 4096), (8192, 8192, 8192), (16384, 50257, 768), (16384, 1024, 4096),
            (16384, 14336, 4096), (16384, 4096, 14336), (16384, 128256, 4096)} <= shapes
    for M, N, K in bench.streamk_shapes(132):  # tile counts (128x256) just past a multiple of 132
        assert M % 128 == 0 and N % 256 == 0 and 0 < (M // 128) * (N // 256) % 132 <= 16


def test_bench_report(tmp_path):
    rows = [bench.make_row("gemm", "a", 2.0, 1.0, "cuBLAS", 2e12, 1e9),
            bench.make_row("gemm", "b", 1.0, 2.0, "cuBLAS", 2e12, 1e9),
            bench.make_row("gemm-streamk", "s", 1.0, 1.5, "tiled", 1e12, 1e9),
            bench.make_row("gemm-hybrid", "s", 1.0, 1.2, "tiled", 1e12, 1e9)]
    assert rows[0]["ratio"] == 0.5 and rows[0]["ours_tflops"] == pytest.approx(1000.0)
    assert rows[0]["ours_gbps"] == pytest.approx(500.0)
    summary = bench.summarize(rows)
    assert summary["gemm_vs_cublas_geomean"] == pytest.approx(1.0)
    assert summary["streamk_vs_dp_min"] == pytest.approx(1.5) and summary["streamk_shapes"] == 1
    table = bench.format_table(rows)
    assert len(table.splitlines()) == 2 + len(rows) and "gemm-hybrid" in table
    bench.plot_roofline(rows, {"copy_gbps": 4000.0, "matmul_tflops": 700.0}, tmp_path / "r.png", "test")
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


# --------------------------------------------------------------------------- GPU, full size

# (M, N, K): aligned (TMA descriptors) and ragged (pointers); with 128x256 tiles, 3.9 and 3.6 waves
# on 132 SMs, so the hybrid splits a partial wave of ~100 tiles and Stream-K splits every tile.
GPU_CASES = [(4096, 4096, 4096), (3001, 5003, 1037)]


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", mm.SCHEDULES)
@pytest.mark.parametrize("M,N,K", GPU_CASES)
def test_gpu_full_size(schedule, M, N, K):
    a, b, bias = _inputs(M, N, K, torch.bfloat16, device="cuda")
    out = _run(a, b, bias=bias, activation="gelu_tanh", schedule=schedule)
    ref = mm.matmul_ref(a.double(), b.double(), bias=bias.double(), activation="gelu_tanh")
    _assert_matches(out, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("M,F,K", [(16384, 8192, 2048), (4096, 3072, 1024), (3001, 2501, 1037),  # Llama-3.2-1B's
                                   (1000, 1000, 512)])  # and Qwen3-0.6B's gate-and-up, a ragged one (pointers), and
def test_gpu_swiglu_epilogue_full_size(M, F, K):  # one whose last tile's halves the 3-D descriptor clips
    g = torch.Generator().manual_seed(5)
    x = torch.randn(M, K, generator=g).bfloat16().cuda()
    w = (torch.randn(2 * F, K, generator=g) / K**0.5).bfloat16().cuda()
    want = swiglu_want(x, w.t(), None, torch.bfloat16)
    torch.testing.assert_close(mm.linear(x, w, activation="swiglu").double(), want, rtol=2**-6, atol=1e-2)
    assert list(mm._PLANS.values())[-1].schedule == "persistent"  # "auto"'s
    # a Hopper GPU's default for a prefill's rows (NANOFORGE_SWIGLU_EPILOGUE=auto)
    assert mm.swiglu_epilogue(x) == ("persistent" if M >= mm.SWIGLU_EPILOGUE_MIN_ROWS else None)
    for schedule in ("tiled", "persistent"):  # each autotuned on its own
        got = mm.matmul(x, w.t(), activation="swiglu", schedule=schedule)
        torch.testing.assert_close(got.double(), want, rtol=2**-6, atol=1e-2, msg=schedule)


@pytest.mark.gpu
def test_gpu_linear_full_size():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 2048, 768, generator=g).bfloat16().cuda()
    w = torch.randn(3072, 768, generator=g).bfloat16().cuda()
    _assert_matches(mm.linear(x, w), F.linear(x.double(), w.double()), torch.bfloat16)


@pytest.fixture(scope="module", autouse=True)
def gemm_launch_smoke(request, tmp_path_factory):
    """benchmarks/gpu_gemm_launch.py --smoke, started with this module's first test: a child process of its own,
    it runs beside the in-process tests here (its timings are of interpreted kernels against stubbed launches,
    orders of magnitude apart); its own test reads the result."""
    if not any(item.module is request.module and item.name == "test_gemm_launch_script_smoke"
               for item in request.session.items):
        yield None
        return
    out = tmp_path_factory.mktemp("gemm_launch")
    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "NANOFORGE_KERNELS"}
    env.update(OUT=str(out), TRITON_INTERPRET="1", PYTHONPATH=str(repo))
    with (out / "output.txt").open("w") as log:  # a file, not a pipe: nobody reads it until the test does
        proc = subprocess.Popen([sys.executable, str(repo / "benchmarks" / "gpu_gemm_launch.py"), "--smoke"],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    yield proc, out
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_gemm_launch_script_smoke(gemm_launch_smoke):
    """benchmarks/gpu_gemm_launch.py --smoke on the CPU (interpreter): the H200 script cannot rot."""
    proc, out = gemm_launch_smoke
    assert proc.wait(timeout=300) == 0, (out / "output.txt").read_text()
    report = json.loads((out / "gemm_launch.json").read_text())
    assert report["launched"]["shapes"] == 2 and report["launched"]["geomean_vs_cublas"] > 0
    host = report["host"][0]
    assert 0 < host["ours_python_us"] < host["ours_host_us"] and host["cublas_host_us"] > 0
    assert report["readme_row"].startswith("| GEMM")
