"""benchmarks/multigpu_serve.py runs on the CPU (gloo, 2 processes): the plumbing of the multi-GPU serving script
cannot rot while no multi-GPU machine is lent. Its greedy check is a real one: fp32 token ids at tensor-parallel
size 2 against 1, on the same weights."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_dry_run_measures_two_ranks_against_one(tmp_path):
    run = subprocess.run([sys.executable, "benchmarks/multigpu_serve.py", "--cpu", "--shape", "tiny-llama", "--tp", "2"],
                         cwd=REPO, capture_output=True, text=True, timeout=600,
                         env=os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "OUT": str(tmp_path)})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "multigpu_serve_tiny-llama.json").read_text())
    runs = result["runs"]
    assert set(runs) == {"1", "2"} and result["greedy_equal"] and result["greedy_equal_requests"] == "4/4"
    assert [len(ids) for ids in runs["2"]["greedy_ids"]] == [12] * 4  # every request ran to its 12 tokens
    for key in ("throughput", "batch1"):
        assert runs["2"][key]["output_tok_s"] > 0 and result[f"{key}_ratio"] > 0
    assert runs["1"]["batch1"]["output_tokens"] == 24 and "greedy ids at 2 equal to 1" in run.stdout
