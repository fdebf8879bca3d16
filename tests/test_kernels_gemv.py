"""The skinny matmul of decode (kernels/gemv.py) against float64 references, and its place in the model.

CPU tests run the Triton kernel under TRITON_INTERPRET=1 (tests/conftest.py); `gpu` tests repeat it at the
model shapes it serves, with programmatic dependent launch as the engine runs it. The kernel's outputs (the
projection and the residual sum) are poisoned with NaN first, so an element it fails to write fails.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import interpreter

from nanoforge.kernels import dispatch
from nanoforge.kernels import gemv as gv


@pytest.fixture
def poisoned(monkeypatch):
    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")
    monkeypatch.setattr(gv, "_empty", lambda *shape, like: torch.full(shape, math.nan, dtype=like.dtype,
                                                                         device=like.device))


def reference(x, w, b, swiglu):
    """float64 F.linear; with swiglu, its output rounded to the dtype, silu(gate) rounded, times up."""
    y = F.linear(x.double(), w.double(), None if b is None else b.double())
    if swiglu:
        g, u = y.to(x.dtype).chunk(2, dim=-1)
        y = (F.silu(g.float()).to(x.dtype).double() * u.double()).to(x.dtype).double()
    return y


def norm_reference(a, x, g, eps, w, b, swiglu):
    """x + a rounded to the dtype; RMSNorm in float64, rounded; then `reference`."""
    s = x if a is None else (x.double() + a.double()).to(x.dtype)
    sd = s.double()
    h = (sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + eps) * g.double()).to(x.dtype)
    return reference(h, w, b, swiglu), s


# (leading shape of x, K, N): one row, a few rows, 16 rows; K and N not multiples of the tiles; one program
# for three K tiles (it stores the whole residual sum), three programs for four (one stores two)
SHAPES = [((1,), 64, 48), ((1, 3), 100, 40), ((16,), 96, 34), ((2,), 96, 16)]


def _tol(dtype):
    return 1e-5 if dtype == torch.float32 else 3e-2


@interpreter
@pytest.mark.parametrize("lead,k,n", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("swiglu,bias", [(False, False), (False, True), (True, False), (True, True)])
def test_matches_float64(poisoned, lead, k, n, dtype, swiglu, bias):
    gen = torch.Generator().manual_seed(k + n)
    x = torch.randn(*lead, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    assert gv.fits(x, w)
    got = gv.gemv(x, w, b, swiglu=swiglu)
    assert got.shape == (*lead, n // 2 if swiglu else n) and got.dtype == dtype
    torch.testing.assert_close(got.double(), reference(x, w, b, swiglu), rtol=_tol(dtype), atol=_tol(dtype))
    out = torch.full_like(got, float("nan"))  # written in place by the kernel: every element, the same bits
    assert gv.gemv(x, w, b, swiglu=swiglu, out=out) is out and torch.equal(out, got)


@interpreter
@pytest.mark.parametrize("lead,k,n", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("stats", [4096, 32])
def test_norm_prologue_matches_float64(poisoned, monkeypatch, lead, k, n, dtype, residual, swiglu, stats):
    """The residual add and RMSNorm fused before the projection: the projection of the normalised sum, and the
    sum itself (every element stored by exactly one program; x itself without a residual). The statistics' pass
    takes whole rows at once, or (stats=32) rows in pieces of 32 columns, one row at a time."""
    monkeypatch.setattr(gv, "STATS_ELEMENTS", stats)
    gen = torch.Generator().manual_seed(3 * k + n)
    x = torch.randn(*lead, k, generator=gen).to(dtype)
    a = torch.randn(*lead, k, generator=gen).to(dtype) if residual else None
    g = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype)
    w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(dtype)
    got, s = gv.norm_gemv(a, x, g, 1e-5, w, swiglu=swiglu)
    want, want_s = norm_reference(a, x, g, 1e-5, w, None, swiglu)
    assert s.shape == x.shape and (s is x) == (not residual)
    # the interpreter rounds to bfloat16 by its own rule (rmsnorm's kernel differs from torch there too)
    torch.testing.assert_close(s.double(), want_s.double(), rtol=_tol(dtype), atol=_tol(dtype))
    torch.testing.assert_close(got.double(), want.double(), rtol=_tol(dtype), atol=_tol(dtype))


def test_takes_the_reference_where_the_kernel_does_not_apply(monkeypatch):
    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")
    w = torch.randn(8, 16)
    assert not gv.fits(torch.randn(gv.MAX_ROWS + 1, 16), w)  # a GEMM's rows
    assert not gv.fits(torch.randn(2, 16, requires_grad=True), w)  # autograd
    assert not gv.fits(torch.randn(2, 16, dtype=torch.float64), w.double())
    monkeypatch.setenv("NANOFORGE_KERNELS", "torch")
    assert not gv.fits(torch.randn(2, 16), w)
    x, a, g = torch.randn(gv.MAX_ROWS + 1, 16), torch.randn(gv.MAX_ROWS + 1, 16), torch.rand(16)
    torch.testing.assert_close(gv.gemv(x, w, swiglu=True), gv.gemv_ref(x, w, swiglu=True))
    y, s = gv.norm_gemv(a, x, g, 1e-6, w)
    torch.testing.assert_close(s, x + a)
    torch.testing.assert_close(y, F.linear(F.rms_norm(x + a, (16,), g, 1e-6), w), rtol=1e-5, atol=1e-5)


def test_bad_shapes_raise_one_clear_error():
    with pytest.raises(ValueError, match=r"gemv: x has 12 features and weight is \(8, 16\)"):
        gv.gemv(torch.randn(1, 12), torch.randn(8, 16))
    with pytest.raises(ValueError, match=r"with N even \(gate and up\)"):
        gv.gemv(torch.randn(1, 16), torch.randn(7, 16), swiglu=True)
    with pytest.raises(ValueError, match=r"norm_gemv: x \(1, 16\), residual \(1, 8\)"):
        gv.norm_gemv(torch.randn(1, 8), torch.randn(1, 16), torch.ones(16), 1e-6, torch.randn(8, 16))


def test_the_weight_prefetch_takes_a_share_of_its_budget(monkeypatch):
    """NANOFORGE_GEMV_PREFETCH_MB bounds the bytes of W a program launched early asks L2 for: every column of a
    matrix that fits, the first columns of a bigger one in proportion, none at 0; anything else is one error (as
    for NANOFORGE_GEMV_CONFIGS, the autotuner's candidates)."""
    from nanoforge.errors import NanoforgeError

    qkv, gate_up = torch.empty(4096, 1024, dtype=torch.bfloat16), torch.empty(16384, 2048, dtype=torch.bfloat16)
    monkeypatch.delenv("NANOFORGE_GEMV_PREFETCH_MB", raising=False)
    assert gv.prefetch_k(qkv) == 1024  # 8 MiB: all of it
    assert gv.prefetch_k(gate_up) == 512  # 64 MiB: 16 / 64 of its 2,048 columns
    monkeypatch.setenv("NANOFORGE_GEMV_PREFETCH_MB", "0")
    assert gv.prefetch_k(qkv) == 0
    monkeypatch.setenv("NANOFORGE_GEMV_PREFETCH_MB", "lots")
    with pytest.raises(NanoforgeError, match="NANOFORGE_GEMV_PREFETCH_MB must be a number of MiB, not 'lots'"):
        gv.prefetch_k(qkv)
    monkeypatch.setenv("NANOFORGE_GEMV_CONFIGS", "all")
    with pytest.raises(NanoforgeError, match="NANOFORGE_GEMV_CONFIGS must be default or wide, not 'all'"):
        gv.configs()


def _launches(monkeypatch):
    """Record every kernel launch as (norm, residual, swiglu)."""
    calls, real = [], gv._launch

    def spy(x, a, norm_weight, eps, weight, bias, swiglu, out=None):
        calls.append((norm_weight is not None, a is not None, swiglu))
        return real(x, a, norm_weight, eps, weight, bias, swiglu, out)

    monkeypatch.setattr(gv, "_launch", spy)
    return calls


@interpreter
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_the_model_sends_decode_rows_through_it_when_enabled(poisoned, monkeypatch, name):
    """NANOFORGE_GEMV=1: a forward of a few tokens outside autograd takes the kernel for every projection of
    every block: Q/K/V with the residual add and norm before it (the first block: the norm alone),
    attention-out, gate-and-up with the add, the norm and SwiGLU, MLP-down; and gives the logits of the same
    forward with cuBLAS and the separate kernels. More rows than a tile, or autograd, take nn.Linear."""
    from nanoforge.model.config import preset
    from nanoforge.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(preset(name)).eval()
    layers = model.cfg.n_layers
    ids = torch.randint(0, model.cfg.vocab_size, (1, 5))
    calls = _launches(monkeypatch)
    with torch.no_grad():
        monkeypatch.setenv("NANOFORGE_GEMV", "0")
        want = model(ids)
        assert not calls
        monkeypatch.setenv("NANOFORGE_GEMV", "1")
        got = model(ids)
        assert calls.count((True, False, False)) == 1 and calls.count((True, True, False)) == layers - 1
        assert calls.count((True, True, True)) == layers and calls.count((False, False, False)) == 2 * layers
        assert len(calls) == 4 * layers
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        calls.clear()
        model(torch.randint(0, model.cfg.vocab_size, (2, 9)))  # 18 rows
        assert not calls
    model(ids)  # autograd
    assert not calls


@interpreter
@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-qwen3"])  # a head of its own; one tied to the embedding
def test_the_lm_head_takes_it_for_a_decodes_rows(poisoned, monkeypatch, name):
    """Transformer.logits (the serving engine's sampled rows): a few rows outside autograd go the way the
    projections go (NANOFORGE_GEMV=1: the kernel), into `out` where given; more rows than a tile, or autograd,
    take the plain matmul. The same logits either way."""
    from nanoforge.model.config import preset
    from nanoforge.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(preset(name)).eval()
    hidden = torch.randn(3, model.cfg.d_model)
    want = hidden.double() @ model.lm_head.weight.double().t()
    calls = _launches(monkeypatch)
    monkeypatch.setenv("NANOFORGE_GEMV", "1")
    with torch.no_grad():
        out = torch.full((3, model.cfg.vocab_size), float("nan"))
        got = model.logits(hidden, out=out)
        assert calls == [(False, False, False)] and got is out  # the kernel wrote `out` itself (no copy after)
        torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)
        assert torch.equal(model.logits(hidden), out)
        many = torch.randn(gv.MAX_ROWS + 1, model.cfg.d_model)
        torch.testing.assert_close(model.logits(many).double(), many.double() @ model.lm_head.weight.double().t(),
                                   rtol=1e-4, atol=1e-4)
    model.logits(hidden)  # autograd
    assert len(calls) == 2  # (the two logits of 3 rows outside autograd)


@interpreter
def test_auto_takes_the_way_measured_fastest_once_per_shape(poisoned, monkeypatch):
    """NANOFORGE_GEMV=auto (the default): each projection shape is timed once (here a stand-in timer that makes
    ours fastest where a norm is fused and cuBLAS elsewhere) and then always takes the way found; the logits
    stay the layers' own; where nothing can be timed (inside a capture, or no GPU) it is cuBLAS, and nothing is
    remembered."""
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
        timed = []
        monkeypatch.setattr(gv, "_can_time", lambda x: True)
        monkeypatch.setattr(gv, "_fastest", lambda x, w, b, swiglu, norm, residual: timed.append(
            (tuple(w.shape), swiglu, norm, residual)) or ("ours" if norm else "cublas"))
        calls = _launches(monkeypatch)
        for _ in range(2):
            torch.testing.assert_close(model(ids), want, rtol=1e-4, atol=1e-4)
        # Q/K/V of the first block (no residual) and of the others, attention-out, gate-and-up, MLP-down: once each
        assert len(timed) == len(set(timed)) == 5
        assert len(calls) == 2 * 2 * model.cfg.n_layers and all(norm for norm, _, _ in calls)


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048),  # Llama-3.2-1B
                                 (1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024)])  # Qwen3-0.6B
def test_gpu_model_shapes_bf16(poisoned, k, n):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (runs on the H200 machine)")
    gen = torch.Generator(device="cuda").manual_seed(n)
    w = (torch.randn(n, k, generator=gen, device="cuda") / math.sqrt(k)).bfloat16()
    g = (1 + 0.1 * torch.randn(k, generator=gen, device="cuda")).bfloat16()
    for rows in (1, 4, 16):
        x = torch.randn(rows, k, generator=gen, device="cuda").bfloat16()
        a = torch.randn(rows, k, generator=gen, device="cuda").bfloat16()
        for swiglu in (False, True):
            got, want = gv.gemv(x, w, swiglu=swiglu).double(), reference(x, w, None, swiglu)
            assert ((got - want).norm() / want.norm()).item() < 1e-2, (rows, swiglu)
            got, s = gv.norm_gemv(a, x, g, 1e-5, w, swiglu=swiglu)
            want, want_s = norm_reference(a, x, g, 1e-5, w, None, swiglu)
            assert torch.equal(s, want_s), (rows, swiglu)  # the sum rounds as torch's bf16 add does
            assert ((got.double() - want).norm() / want.norm()).item() < 1e-2, (rows, swiglu)


@pytest.mark.gpu
def test_gpu_auto_times_each_shape_once_and_every_way_is_right(monkeypatch):
    """On the GPU the choice is timed (a real measurement: some way wins), once per shape, and whichever way
    it picks gives the reference's answer to bf16 rounding; the time it took is counted in `tuning_s`."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (runs on the H200 machine)")
    monkeypatch.delenv("NANOFORGE_GEMV", raising=False)
    monkeypatch.setattr(gv, "_CHOICES", {})
    timed = []
    real = gv._fastest
    monkeypatch.setattr(gv, "_fastest", lambda *a: timed.append(a[1].shape) or real(*a))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for k, n, swiglu, norm in ((2048, 1024, False, False), (1024, 6144, True, True), (2048, 3072, False, True)):
        w = (torch.randn(n, k, generator=gen, device="cuda") / math.sqrt(k)).bfloat16()
        x = torch.randn(1, k, generator=gen, device="cuda").bfloat16()
        a, g = torch.randn_like(x), torch.ones(k, device="cuda", dtype=torch.bfloat16)
        tuned = []
        for _ in range(2):
            tuned.append(gv.tuning_s())
            if norm:
                got = gv.norm_linear(a, x, g, 1e-6, w, swiglu=swiglu)[0].double()
                want = norm_reference(a, x, g, 1e-6, w, None, swiglu)[0]
            else:
                got, want = gv.skinny_linear(x, w, swiglu=swiglu).double(), reference(x, w, None, swiglu)
            assert ((got - want).norm() / want.norm()).item() < 1e-2, (k, n, swiglu)
        # the first call's timing is counted as tuning (what a server's first line reports); the second tunes nothing
        assert tuned[1] > tuned[0] and gv.tuning_s() == tuned[1], (k, n, tuned)
        assert gv.choose(x, w, None, swiglu, norm=norm, residual=norm) in ("cublas", "ours")
    assert len(timed) >= 3  # the three shapes (the separate way's own projection choice times more)


# --- the autotuner's candidates compiled in threads (dispatch.compile_in_parallel) -------------------------------

class _Recording:
    """A stand-in @triton.jit function: each warmup hands a compile to Triton's active AsyncCompileMode as the JIT
    does (`submit(key, compile, finalize[, cleanup])`), and records the call, the thread each compile ran on and
    the compiles finalized. `fail_at`: that warmup raises; `bad_compile`: that compile raises in its thread."""

    __name__ = "recording"

    def __init__(self, fail_at: int | None = None, bad_compile: int | None = None):
        self.calls, self.threads, self.finalized = [], [], []
        self.fail_at, self.bad_compile = fail_at, bad_compile

    def warmup(self, *args, grid, **kwargs):
        import inspect
        import threading

        from triton.runtime import _async_compile

        mode = _async_compile.active_mode.get()
        assert mode is not None, "warmup outside Triton's AsyncCompileMode: nothing would compile in parallel"
        i = len(self.calls)
        if self.fail_at == i:
            raise RuntimeError("a warmup error")
        self.calls.append((args, grid, kwargs))

        def compile_it():
            self.threads.append(threading.current_thread().name)
            if self.bad_compile == i:
                raise RuntimeError("a compile error")
            return i

        hooks = [self.finalized.append, lambda _: None][:len(inspect.signature(mode.submit).parameters) - 2]
        return mode.submit(("recording", i), compile_it, *hooks)


def test_compile_in_parallel_warms_up_each_candidate_as_the_autotuner_launches_it(monkeypatch):
    """Each candidate configuration is warmed up once, with the launch's arguments, its meta-parameters and the
    configuration's own (what the autotuner's timing launch passes), inside Triton's AsyncCompileMode, whose
    compiles run on the pool's threads."""
    import triton

    if not hasattr(triton, "AsyncCompileMode"):
        pytest.skip("this Triton has no AsyncCompileMode (the autotuner compiles one by one)")
    monkeypatch.setenv("NANOFORGE_COMPILE_THREADS", "3")
    fn, configs = _Recording(), gv._TUNED["default"].configs
    args, meta = (torch.zeros(2), 7, 3.0), {"NORM": True, "launch_pdl": True}
    assert dispatch.compile_in_parallel(fn, configs, args, meta)
    assert [c[0] for c in fn.calls] == [args] * len(configs)
    assert all(grid == (1,) for _, grid, _ in fn.calls)
    assert [kw for _, _, kw in fn.calls] == [{**meta, **c.all_kwargs()} for c in configs]
    assert len(fn.threads) == len(configs) and all(t.startswith("nanoforge-compile") for t in fn.threads)
    assert sorted(fn.finalized) == list(range(len(configs)))  # every compile finished before it returned


def test_a_candidate_that_fails_to_compile_is_left_to_the_autotuner(monkeypatch):
    """A compile that raises in its thread is ignored here (the autotuner compiles that candidate again and
    handles the error as it always has), the others are kept, and Triton's AsyncCompileMode is not left active:
    Triton 3.6's stays active after raising, which would send every later compile of the process to a closed pool."""
    import triton
    from triton.runtime import _async_compile

    if not hasattr(triton, "AsyncCompileMode"):
        pytest.skip("this Triton has no AsyncCompileMode (the autotuner compiles one by one)")
    monkeypatch.setenv("NANOFORGE_COMPILE_THREADS", "2")
    fn, configs = _Recording(bad_compile=2), gv._TUNED["default"].configs
    assert dispatch.compile_in_parallel(fn, configs, (), {})
    assert sorted(fn.finalized) == [i for i in range(len(configs)) if i != 2]
    assert _async_compile.active_mode.get() is None


def test_compile_in_parallel_steps_aside_with_one_thread_or_on_an_error(monkeypatch, recwarn):
    """With one thread, or without AsyncCompileMode, nothing is warmed up; a failing warmup is warned about
    once and nothing is raised: the autotuner then compiles (and reports) as it always did."""
    import triton

    configs = gv._TUNED["default"].configs
    monkeypatch.setenv("NANOFORGE_COMPILE_THREADS", "1")
    fn = _Recording()
    assert not dispatch.compile_in_parallel(fn, configs, (), {}) and not fn.calls
    monkeypatch.setenv("NANOFORGE_COMPILE_THREADS", "4")
    assert not dispatch.compile_in_parallel(fn, configs[:1], (), {}) and not fn.calls  # one candidate: nothing to gain
    if hasattr(triton, "AsyncCompileMode"):
        monkeypatch.setattr(dispatch, "_COMPILE_FAILED", [])
        for _ in range(2):
            assert not dispatch.compile_in_parallel(_Recording(fail_at=1), configs, (), {})
        assert len(dispatch._COMPILE_FAILED) == 2
        assert sum("compiling recording's candidates in parallel failed" in str(w.message) for w in recwarn) == 1
    monkeypatch.delattr(triton, "AsyncCompileMode", raising=False)
    assert not dispatch.compile_in_parallel(fn, configs, (), {}) and not fn.calls


@pytest.mark.parametrize("value", ["0", "two", "-1", "257"])
def test_compile_threads_setting_is_checked(monkeypatch, value):
    from nanoforge.errors import NanoforgeError

    monkeypatch.setenv("NANOFORGE_COMPILE_THREADS", value)
    with pytest.raises(NanoforgeError, match="NANOFORGE_COMPILE_THREADS must be a whole number from 1 to 256"):
        dispatch.compile_threads()
    monkeypatch.delenv("NANOFORGE_COMPILE_THREADS")
    assert 1 <= dispatch.compile_threads() <= 16


@pytest.mark.gpu
def test_gpu_a_new_shape_compiles_its_candidates_in_parallel_and_the_autotuner_reuses_them(monkeypatch):
    """On the GPU, a shape the autotuner has not seen compiles its candidates in threads first; the autotuner then
    compiles nothing more (the JIT's cache holds one kernel per candidate, no more after its timing), and the
    result is right against float64."""
    import triton

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (runs on the H200 machine)")
    if not hasattr(triton, "AsyncCompileMode"):
        pytest.skip("this Triton has no AsyncCompileMode (the autotuner compiles one by one)")
    monkeypatch.setenv("NANOFORGE_COMPILE_THREADS", "8")
    monkeypatch.delenv("NANOFORGE_GEMV_CONFIGS", raising=False)
    ran = []
    real = dispatch.compile_in_parallel
    monkeypatch.setattr(gv, "compile_in_parallel", lambda *a: ran.append(real(*a)) or ran[-1])
    k, n = 1344, 2112  # a shape no other test uses
    gen = torch.Generator(device="cuda").manual_seed(5)
    w = (torch.randn(n, k, generator=gen, device="cuda") / math.sqrt(k)).bfloat16()
    x = torch.randn(1, k, generator=gen, device="cuda").bfloat16()
    # Triton keys its kernels by specialisation (constexprs, dtypes, which integers divide by 16), not by shape:
    # an earlier test in this process may have compiled these very kernels, so the count starts from empty
    cache = gv._gemv_kernel.device_caches[torch.cuda.current_device()][0]
    earlier = dict(cache)
    cache.clear()
    try:
        got = gv.gemv(x, w, swiglu=True).double()
        assert ran == [True]
        compiled = len(cache)  # the candidates' kernels: had the autotuner's launches missed them, twice that
        assert compiled == len(gv._TUNED["default"].configs)
        gv.gemv(x, w, swiglu=True)
        assert ran == [True] and len(cache) == compiled  # the tuned shape again: nothing compiled, no tuning
    finally:
        cache.update({key: kernel for key, kernel in earlier.items() if key not in cache})
    want = reference(x, w, None, True)
    assert ((got - want).norm() / want.norm()).item() < 1e-2
