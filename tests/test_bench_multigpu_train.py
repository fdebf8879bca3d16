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


def test_predict_writes_the_planners_numbers_for_every_run_without_running_one(tmp_path):
    """--predict (no GPU, no torchrun): per run of an 8-GPU machine, the planner's memory and rate at the script's
    own batch; the runs that fit only with recomputation are the ones the script trains with --ac full."""
    run = subprocess.run([sys.executable, "benchmarks/multigpu_train.py", "--predict", "--shape", "llama3-8b",
                          "--gpus", "8", "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=os.environ | {"PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads((tmp_path / "multigpu_train_llama3-8b_8gpus_planned.json").read_text())
    runs = r["runs"]
    assert r["hbm_gib"] == 143771 / 1024 and "reshard" not in runs
    assert {"single", "fsdp8", "tp8", "tp2-fsdp4", "pp2-tp2-fsdp2", "tp2-cp2-fsdp2", "cp32k"} <= set(runs)
    assert runs["fsdp8"]["batch"] == runs["single"]["batch"] == 32 and runs["cp32k"]["seq_len"] == 32768
    assert runs["single-pp"]["batch"] * runs["single-pp"]["grad_accum"] == 32  # the same rows in 4 micro-batches
    plan = {name: e["planned"] for name, e in runs.items()}
    assert plan["single"]["recompute"] and not plan["fsdp8"]["recompute"]  # 8B's fp32 state alone is ~119 GiB
    assert plan["fsdp8"]["tensors_gib"] < plan["fsdp4"]["tensors_gib"] < plan["single"]["tensors_gib"]
    assert all(p["fits"] and p["tensors_gib"] == p["memory_gib"] - 4.0 for p in plan.values())
    assert "--ac full" in run.stdout and "fsdp8" in run.stdout


def test_bad_shapes_and_runs_are_one_line_and_exit_2(tmp_path):
    """An unknown preset (it was a 14-line NanoforgeError traceback from the planner), a --cpu dry run asked for a
    large shape (it was swapped for tiny-llama without a word), an unknown run: one line each, exit 2."""
    cases = {("--predict", "--shape", "nope"): "multigpu_train.py: --shape: no model preset named 'nope'; choose ",
             ("--cpu", "--shape", "llama3-8b"): "multigpu_train.py: --shape llama3-8b: a --cpu dry run trains a tiny "
                                                "preset (tiny-llama, tiny-qwen3, ...)",
             ("--cpu", "--runs", "nope"): "multigpu_train.py: --runs: unknown ['nope']; on 2 GPUs: single, "}
    for args, start in cases.items():
        run = subprocess.run([sys.executable, "benchmarks/multigpu_train.py", *args, "--out", str(tmp_path)], cwd=REPO,
                             capture_output=True, text=True, timeout=120, env=os.environ | {"PYTHONPATH": str(REPO)})
        assert run.returncode == 2 and run.stderr.startswith(start) and run.stderr.count("\n") == 1, (args, run.stderr)
