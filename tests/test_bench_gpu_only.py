"""The benchmark scripts that need a GPU say so in one line on a machine without one (exit 2), where some of them
died in a traceback from their first CUDA call (session 49's sweep of the scripts no other test runs)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

SCRIPTS = [["gpu_kernels_gemm.py", "--quick"], ["gpu_kernels_simt.py"], ["gpu_streamk_sweep.py", "--repeats", "1"],
           ["gpu_parallel.py", "--skip-bench"], ["gpu_decode_layers.sh"]]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU these scripts run their benchmarks")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s[0])
def test_a_gpu_benchmark_without_a_gpu_refuses_in_one_line(script, tmp_path):
    name, *args = script
    cmd = ["bash", f"benchmarks/{name}"] if name.endswith(".sh") else [sys.executable, f"benchmarks/{name}"]
    run = subprocess.run(cmd + args, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OUT": str(tmp_path / "out")})
    assert run.returncode == 2, run.stdout[-1500:] + run.stderr[-1500:]
    assert run.stderr.strip() == f"{name} needs a CUDA GPU"
    assert "Traceback" not in run.stdout + run.stderr
