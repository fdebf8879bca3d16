"""The SIMT ladder against float64 references.

On a CPU machine the kernels run under Numba's CUDA simulator (one Python
thread per CUDA thread, so shapes are small); `gpu` tests repeat the check at
full size on a real GPU. Every shape is ragged: M, N and K do not divide the
block tiles, and each grid has at least 2x2 blocks and 2 K-steps. Launchers
fill the output with NaN first, so an element no thread writes fails.
"""

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # must precede the first numba.cuda import (ladder imports it lazily)
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

from nanoforge.errors import NanoforgeError  # noqa: E402
from nanoforge.kernels.simt import bench, ladder  # noqa: E402
from conftest import raises_bug  # noqa: E402

EPS32 = float(np.finfo(np.float32).eps)


def assert_sgemm_close(c, a, b):
    """|C - A@B| <= 16 eps32 (|A| @ |B|) elementwise, A@B in float64; NaN (unwritten) fails."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    err = np.abs(np.asarray(c, np.float64) - a64 @ b64)
    bound = 16 * EPS32 * (np.abs(a64) @ np.abs(b64))
    assert not np.isnan(c).any(), f"{int(np.isnan(c).sum())} elements of C were never written"
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), f"C{worst} off by {err[worst]:.3g} > bound {bound[worst]:.3g}"


def ragged_shape(rung: ladder.Rung) -> tuple[int, int, int]:
    """2x2 blocks, ragged in M and N; K = 37 is two K-steps of 32 and five of 8, ragged either way."""
    return rung.tile[0] + 5, rung.tile[1] + 3, 37


@pytest.mark.parametrize("name", list(ladder.RUNGS))
def test_sgemm_rung_matches_float64_on_ragged_shape(name):
    m, n, k = ragged_shape(ladder.RUNGS[name])
    rng = np.random.default_rng(list(ladder.RUNGS).index(name))
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    c = ladder.sgemm(a, b, name)
    assert isinstance(c, np.ndarray) and c.shape == (m, n) and c.dtype == np.float32
    assert_sgemm_close(c, a, b)


def test_sgemm_on_device_arrays_overwrites_out():
    """Device in, device out; a caller's `out` is fully overwritten (it is poisoned first)."""
    cuda = ladder.numba_cuda()
    rng = np.random.default_rng(1)
    a = rng.standard_normal((19, 13), dtype=np.float32)
    b = rng.standard_normal((13, 21), dtype=np.float32)
    out = cuda.to_device(np.full((19, 21), 7.0, np.float32))
    c = ladder.sgemm(cuda.to_device(a), cuda.to_device(b), "coalesced", out=out)
    assert c is out
    assert_sgemm_close(c.copy_to_host(), a, b)


def test_vector_add_matches_float64_on_ragged_length():
    rng = np.random.default_rng(2)
    n = 3 * ladder.VECTOR_ADD_THREADS + 17
    a, b = rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32)
    c = ladder.vector_add(a, b)
    # fp32 addition is correctly rounded: exactly the float64 sum rounded to fp32
    np.testing.assert_array_equal(c, (a.astype(np.float64) + b).astype(np.float32))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda a: ladder.sgemm(a, a, "blocked"), "unknown SGEMM rung"),
        (lambda a: ladder.sgemm(a, a[:3], "naive"), "inner sizes differ"),
        (lambda a: ladder.sgemm(a.astype(np.float64), a.T, "naive"), "float32"),
        (lambda a: ladder.sgemm(a, a.T, "naive", out=np.zeros((4, 4), np.float32)), "out must be a device array"),
        (lambda a: ladder.sgemm(a, a.T, "naive", out=ladder.numba_cuda().to_device(a)), "out has shape"),
        (lambda a: ladder.vector_add(a, a), "1-D"),
        (lambda a: ladder.sgemm([[1.0]], a, "naive"), "numpy array or a CUDA device array"),
    ],
)
def test_bad_inputs_raise_one_line_errors(call, match):
    a = np.ones((4, 5), np.float32)
    with raises_bug(match):
        call(a)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on machines without a GPU")
def test_run_ladder_without_gpu_says_so():
    with pytest.raises(NanoforgeError, match="needs a CUDA GPU"):
        bench.run_ladder([64], "unused")


def test_ladder_report_ratios_json_and_plot(tmp_path, capsys):
    """The reporting half of run_ladder on made-up timings (the timing half needs a GPU)."""
    vec = [{"kernel": "torch add", "shape": "n=8", "ms": 1.0, "rate": 4000.0, "unit": "GB/s"},
           {"kernel": "vector_add", "shape": "n=8", "ms": 1.0, "rate": 3000.0, "unit": "GB/s"}]
    rates = {"cuBLAS": 50000.0, "naive": 500.0, "coalesced": 2000.0, "smem_tiled": 4000.0,
             "regtile_1d": 10000.0, "regtile_2d": 20000.0}
    sgemm = [{"kernel": k, "shape": "64^3", "ms": 1.0, "rate": r, "unit": "GFLOP/s"} for k, r in rates.items()]
    result = bench._report([vec, sgemm], [64], tmp_path, {"device": "fake", "repeats": 3, "naive_repeats": 1})

    rows = {r["kernel"]: r for r in result["sgemm"]["64"]}
    assert rows["naive"]["pct_of_baseline"] == pytest.approx(1.0)
    assert rows["naive"]["speedup_vs_prev"] is None
    assert rows["coalesced"]["speedup_vs_prev"] == pytest.approx(4.0)
    assert rows["regtile_2d"]["speedup_vs_prev"] == pytest.approx(2.0)
    assert result["vector_add"][1]["pct_of_baseline"] == pytest.approx(75.0)
    assert result["register_tiling_over_smem_tiling"]["64"] == pytest.approx({"regtile_1d": 2.5, "regtile_2d": 5.0})
    assert (tmp_path / "simt_ladder.json").exists() and (tmp_path / "simt_ladder.png").stat().st_size > 0
    table = capsys.readouterr().out
    assert "regtile_2d" in table and "5.00x" in table


# --------------------------------------------------------------------------- full size, real GPU

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("name", list(ladder.RUNGS))
def test_sgemm_rung_full_size_on_gpu(name):
    """4096-ish ragged SGEMM on torch CUDA tensors vs torch float64."""
    if ladder.simulator_active():
        pytest.skip("NUMBA_ENABLE_CUDASIM=1: full-size shapes are for a real GPU")
    m, n, k = 4093, 4099, 4097
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, k, device="cuda", generator=gen)
    b = torch.randn(k, n, device="cuda", generator=gen)
    c = torch.as_tensor(ladder.sgemm(a, b, name), device="cuda")
    ref = a.double() @ b.double()
    bound = 16 * EPS32 * (a.double().abs() @ b.double().abs())
    assert not c.isnan().any(), f"{int(c.isnan().sum())} elements of C were never written"
    excess = ((c.double() - ref).abs() - bound).max().item()
    assert excess <= 0, f"error exceeds 16 eps |A||B| by {excess:.3g}"


@gpu
def test_vector_add_full_size_on_gpu():
    if ladder.simulator_active():
        pytest.skip("NUMBA_ENABLE_CUDASIM=1: full-size shapes are for a real GPU")
    n = (1 << 26) + 3
    a, b = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    c = torch.as_tensor(ladder.vector_add(a, b), device="cuda")
    torch.testing.assert_close(c, (a.double() + b.double()).float(), rtol=0, atol=0)
