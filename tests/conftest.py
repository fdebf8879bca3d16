"""Test-wide setup: run GPU kernels on the CPU when there is no GPU.

Triton kernels run under the interpreter (TRITON_INTERPRET=1) and Numba SIMT
kernels under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1). Both variables must
be set before triton / numba.cuda are imported, hence here, at collection.
Tests marked `gpu` are skipped with a reason on machines without CUDA.
"""

import contextlib
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

# The project's shared data sits beside the checkout (../shared/data), in CI as on a developer's machine.
SHARED_DATA = Path(os.environ.get("NANOFORGE_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
# Every test tunes afresh and writes nothing under ~/.cache (kernels/tuning_cache.py); its own tests turn it on.
os.environ.setdefault("NANOFORGE_TUNING_CACHE", "0")
# One intra-op thread a core: under `-n auto` each of the worker processes gets its share of the cores (on 2 cores,
# one each), and the programs a test starts (CLI runs, torchrun's ranks) inherit it. Two workers of two threads
# each on two cores made OpenMP's spinning threads wait on each other's time slices: test_train.py took 240 s of
# the suite where alone it takes 18 s.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = max(1, min(2, (os.cpu_count() or 1) // _WORKERS))
os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))
torch.set_num_threads(min(_THREADS, torch.get_num_threads()))


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (the README's test command): two worker processes on a machine without a GPU, where the suite is
    bound by the CPU (a clean-clone CI on 2 cores in session 37: 301 s, with a thread a worker); none (one
    process, as before) on a GPU machine, whose tests would otherwise share one GPU."""
    return 0 if HAS_CUDA else min(2, os.cpu_count() or 1)


# Kernel tests that need the Triton interpreter (the compiled kernels are covered by the `gpu` tests).
interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU-interpreter test (TRITON_INTERPRET=1); gpu tests cover the compiled kernels",
)


def nan_empty(*shape, like, dtype=None):
    """A stand-in for a kernel module's `_empty`: outputs start as NaN (integers: their minimum), so an
    unwritten element fails."""
    dtype = dtype or like.dtype
    poison = math.nan if dtype.is_floating_point else torch.iinfo(dtype).min
    return torch.full(shape, poison, device=like.device, dtype=dtype)


@contextlib.contextmanager
def raises_bug(match: str):
    """A wrong call between nanoforge's own parts (a kernel given tensors of the wrong shape, say): a plain
    ValueError or RuntimeError that keeps its traceback, never the NanoforgeError that front doors answer
    as bad input (exit 2, HTTP 4xx)."""
    from nanoforge.errors import NanoforgeError

    with pytest.raises((ValueError, RuntimeError), match=match) as info:
        yield info
    assert not isinstance(info.value, NanoforgeError), f"{info.value!r} is reported as bad input"


def finish(proc: subprocess.Popen, timeout: float = 300) -> subprocess.CompletedProcess:
    """Wait for a background subprocess (killed past `timeout`) and return what `subprocess.run` would have."""
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs on the H200 machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
