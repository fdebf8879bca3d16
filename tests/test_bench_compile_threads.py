"""benchmarks/compile_threads.py: the skinny matmul's candidates compiled for sm_90 (no GPU) one after another and
in threads, each round into an empty cache."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_compiles_every_candidate_both_ways_and_reports_the_ratio(tmp_path):
    from nanoforge.kernels import gemv
    from nanoforge.kernels import inspect as ki

    if not ki._tool_candidates("ptxas"):
        pytest.skip("needs ptxas (CUDA toolkit or the triton wheel)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "benchmarks/compile_threads.py", "--rounds", "1", "--threads", "2",
                          "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    r = json.loads((tmp_path / "compile_threads.json").read_text())
    assert r["candidates"] == len(gemv._TUNED["default"].configs) and r["threads"] == 2
    assert len(r["seconds"]["serial"]) == len(r["seconds"]["threads"]) == 1
    # each round compiled all five into an empty cache (a cache hit takes milliseconds, a compile ~1 s)
    assert min(r["seconds"]["serial"] + r["seconds"]["threads"]) > 0.5
    assert r["speedup"] == pytest.approx(r["serial_median_s"] / r["threads_median_s"])
    assert "speedup" in run.stdout


@pytest.mark.parametrize("args,env,line", [
    (["--rounds", "0"], {}, "--threads and --rounds must be positive"),
    (["--threads", "0"], {}, "--threads and --rounds must be positive"),
    ([], {"NANOFORGE_COMPILE_THREADS": "many"}, "NANOFORGE_COMPILE_THREADS must be a whole number from 1 to 256"),
])
def test_a_bad_count_is_one_line(args, env, line):
    run = subprocess.run([sys.executable, "benchmarks/compile_threads.py", *args], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env=os.environ | {"PYTHONPATH": str(REPO)} | env)
    assert run.returncode == 2 and run.stderr.strip().startswith(line) and len(run.stderr.strip().splitlines()) == 1
