"""The benchmark scripts no other test runs (session 49's sweep): those that need a GPU say so in one line on a
machine without one (exit 2), where some of them died in a traceback from their first CUDA call; the integration
script's CPU dry run; the device call's step runner."""

from __future__ import annotations

import os
import re
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


def test_the_integration_script_dry_run_counts_whole_requests_and_refuses_a_length_past_the_context(tmp_path):
    """gpu_integration.py on a tiny Qwen3 on the CPU: every engine run writes the same workload's output tokens
    (lengths from a tenth of --max-len up: the 100-token floor of nano-vllm's workload would not fit); a --max-len
    whose prompt and output cannot fit the model's context is refused in one line, where it used to die in
    `randrange` or cut requests at the context uncounted."""
    import json

    cmd = [sys.executable, "benchmarks/gpu_integration.py", "--device", "cpu", "--preset", "tiny-qwen3",
           "--skip-train", "--requests", "2", "--out", str(tmp_path)]
    run = subprocess.run(cmd + ["--max-len", "60"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    engine = json.loads((tmp_path / "integration.json").read_text())["engine"]
    from nanoforge.model.config import preset
    from nanoforge.serve.bench_throughput import make_workload

    _, outputs = make_workload(2, 60, 60, min(10000, preset("tiny-qwen3").vocab_size), min_input=6, min_output=6)
    assert len(engine) == 3 and {r["output_tokens"] for r in engine.values()} == {sum(outputs)}
    bad = subprocess.run(cmd + ["--max-len", "100"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip() == ("--max-len 100: a prompt and its output (up to 200 tokens) must fit tiny-qwen3's "
                                  "context of 128 tokens")


def test_a_device_call_ends_each_step_at_its_share_and_counts_the_steps_that_failed(tmp_path):
    """benchmarks/gpu_call.sh: each step's log, rc and failures; `{left}` is the seconds to its share's end less 3%
    of the call; a step that overruns is ended at its share (rc 124) and one whose share has passed is skipped;
    the exit status counts the steps that did not exit 0; a malformed step is refused in one line (exit 2)."""
    steps = ["ok:30:echo left {left} out $OUT", "bad:60:python3 -c 'import sys; print(\"E boom\"); sys.exit(3)'",
             "slow:80:sleep 30", "late:81:echo never"]
    run = subprocess.run(["bash", "benchmarks/gpu_call.sh", *steps], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "CALL_S": "10", "OUT": str(tmp_path)})
    assert run.returncode == 3, run.stdout + run.stderr
    out = run.stdout
    assert "== ok rc 0 at 0 s" in out and re.search(r"^== bad rc 3 at [0-2] s$", out, re.M) and "\nE boom\n" in out
    assert "== slow rc 124 at 8 s" in out and "== late skipped: its share ended at 8 s, the call is at 8 s" in out
    # 3 s from the call's start to the first share's end, less 3% of a 10 s call (0 in whole seconds)
    assert (tmp_path / "ok.log").read_text() == f"left 3 out {tmp_path}\n"
    assert not (tmp_path / "late.log").exists()
    bad = subprocess.run(["bash", "benchmarks/gpu_call.sh", "tests:pytest"], capture_output=True, text=True,
                         timeout=30)
    assert bad.returncode == 2
    assert bad.stderr.strip() == ("gpu_call.sh: 'tests:pytest' is not NAME:PCT:COMMAND with PCT a whole percent of "
                                  "CALL_S")
