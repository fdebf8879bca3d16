"""benchmarks/multigpu_train.py runs on CPUs (gloo, 2 processes): the plumbing of the multi-GPU script cannot rot
while no multi-GPU machine is lent. Its loss check is a real one: the layouts read the same rows as one process."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_dry_run_measures_each_layout_against_one_process(tmp_path):
    run = subprocess.run([sys.executable, "benchmarks/multigpu_train.py", "--cpu", "--gpus", "2",
                          "--runs", "single,fsdp2", "--out", str(tmp_path / "out"),
                          "--work", str(tmp_path / "work")],
                         cwd=REPO, capture_output=True, text=True, timeout=600,
                         env=os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    runs = json.loads((tmp_path / "out" / "multigpu_train_tiny-llama.json").read_text())["runs"]
    assert set(runs) == {"single", "fsdp2"}
    single, fsdp = runs["single"], runs["fsdp2"]
    assert len(single["losses"]) == len(fsdp["losses"]) == 4
    assert fsdp["gpus"] == 2 and fsdp["mesh"] == {"dp_shard": 2} and fsdp["batch"] == single["batch"] == 4
    # fp32 on the CPU: the same rows give the same losses to rounding (different rows would differ by ~1e-3)
    assert fsdp["worst_loss_rel_diff"] < 1e-5 and fsdp["losses_match"]
    assert 0 < fsdp["scaling_efficiency"] and "scaling" in run.stdout
