"""One-GPU check of parallel training (issue 13); everything it measures goes to $OUT (or --out).

1. bench train unchanged: the single-device training step (GPT-2 124M, 16 x 1024 tokens, bf16, document
   masks, compiled, CUDA graph; `nanoforge bench train --variants nanoforge baseline`) against the numbers
   on record (docs/results/train/bench_train.json: 501,878 tokens/s; runs differ by ~2%). Passes within 4%.
2. FSDP2 and TP of degree 1 run on one GPU, through torchrun like any parallel run: the same 40-step recipe
   (a small Llama on a generated corpus, bf16, compiled per block) as one process, `--dp-shard 1`, `--tp 1`
   and `--dp-shard 1 --tp 1 --cp 1`; each must finish and track the single-device losses (bf16: within 2%
   at every logged step). The FSDP run's DCP checkpoint then resumes on the single-device trainer for 10
   more steps (the sharded checkpoint read without a process group, on the GPU).
3. The planner against the GPU: `nanoforge plan` for Llama-3.2-1B on one GPU (4 x 2048 tokens) next to the
   step time and peak memory `bench train` measures for the same shape.

Run from the repository root on the GPU machine (about 5 minutes):
    python benchmarks/gpu_parallel.py [--out DIR] [--skip-bench] [--skip-runs] [--skip-plan]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from nanoforge.train.progress import write_json  # noqa: E402

RECORDED_TOKENS_PER_S = 501_878  # docs/results/train/bench_train.json, nanoforge variant
WORDS = "the king shall speak of war and love to thee my lord what now good night sweet prince".split()


def nanoforge(*argv, torchrun: bool = False, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"] if torchrun \
        else [sys.executable]
    env = os.environ | {"PYTHONPATH": str(REPO)} | (env_extra or {})
    run = subprocess.run([*launcher, "-m", "nanoforge", *map(str, argv)], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=900)
    print(f"$ {'torchrun ' if torchrun else ''}nanoforge {' '.join(map(str, argv))}: exit {run.returncode}",
          flush=True)
    if run.returncode:
        print(run.stdout[-2000:], run.stderr[-4000:], sep="\n")
    return run


def check_bench(out: Path) -> dict:
    from nanoforge.train.bench import bench_train, print_table

    report = bench_train(variants=["nanoforge", "baseline"])
    print_table(report)
    ours = next(r for r in report["results"] if r["variant"] == "nanoforge")["tokens_per_s"]
    ratio = ours / RECORDED_TOKENS_PER_S
    result = {"tokens_per_s": ours, "recorded": RECORDED_TOKENS_PER_S, "ratio": ratio, "pass": ratio > 0.96,
              "report": report}
    print(f"bench train: {ours:,.0f} tokens/s, {ratio:.3f}x the recorded {RECORDED_TOKENS_PER_S:,}: "
          f"{'PASS' if result['pass'] else 'FAIL'}", flush=True)
    write_json(out / "bench_train.json", report)
    return result


def check_runs(out: Path) -> dict:
    work = Path(tempfile.mkdtemp(prefix="gpu_parallel_"))
    rng = np.random.default_rng(0)
    corpus = work / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS, size=rng.integers(3, 40)))}) + "\n"
                              for _ in range(4000)))
    common = ["train", "--preset", "tiny-llama", "--data", corpus, "--tokenizer", "char", "--batch-size", "8",
              "--seq-len", "128", "--max-steps", "40", "--lr", "3e-3", "--warmup-steps", "5", "--eval-interval", "20",
              "--eval-iters", "4", "--log-interval", "5", "--dtype", "bf16"]
    layouts = {"single": [], "fsdp1": ["--dp-shard", "1"], "tp1": ["--tp", "1"],
               "fsdp1_tp1_cp1": ["--dp-shard", "1", "--tp", "1", "--cp", "1"]}
    result = {}
    for name, flags in layouts.items():
        run = nanoforge(*common, "--out", work / name, *flags, torchrun=bool(flags))
        entry = {"exit": run.returncode}
        if run.returncode == 0:
            log = json.loads((work / name / "log.json").read_text())
            entry |= {"losses": [r["loss"] for r in log["history"]["train"]], "parallel": log.get("parallel"),
                      "tokens_per_s": log["tokens_per_s"], "final_val": log["final_val_loss_full_split"]}
        result[name] = entry
    base = result["single"].get("losses")
    for name, entry in result.items():
        if name != "single":
            losses = entry.get("losses")
            entry["pass"] = bool(base and losses and len(losses) == len(base)
                                 and all(abs(a - b) <= 0.02 * b for a, b in zip(losses, base)))
            worst = max((abs(a - b) / b for a, b in zip(losses, base)), default=None) if losses and base else None
            entry["worst_rel_diff"] = worst
            print(f"{name} ({entry.get('parallel')}): final loss {losses[-1] if losses else None} vs single "
                  f"{base[-1] if base else None}, worst step {worst}: {'PASS' if entry['pass'] else 'FAIL'}", flush=True)
    run = nanoforge("train", "--resume", "--out", work / "fsdp1", "--max-steps", "50")
    resumed = json.loads((work / "fsdp1" / "log.json").read_text())["history"]["train"] if run.returncode == 0 else []
    result["fsdp1_resumed_on_one_gpu"] = {"exit": run.returncode, "last_step": resumed[-1]["step"] if resumed else None,
                                          "pass": run.returncode == 0 and resumed and resumed[-1]["step"] == 50}
    print(f"FSDP2 checkpoint resumed by the single-device trainer: "
          f"{'PASS' if result['fsdp1_resumed_on_one_gpu']['pass'] else 'FAIL'}", flush=True)
    return result


def check_plan(out: Path) -> dict:
    from nanoforge.model.config import preset
    from nanoforge.train.bench import bench_train
    from nanoforge.train.parallel.plan import Hardware, Layout, Workload, estimate

    gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    est = estimate(preset("llama3-1b"), Layout(1, 1, 1, 1), Workload(seq_len=2048, batch_tokens=4 * 2048,
                                                                      micro_batch=4), Hardware(gpus=1, hbm_gib=gib))
    report = bench_train(preset="llama3-1b", batch_size=4, seq_len=2048, steps=20, warmup=6, variants=["nanoforge"])
    measured = report["results"][0]
    # torch's peak allocation has no CUDA context or allocator slack in it: compare it with the plan less its overhead
    planned_tensors = est["memory_gib"]["total"] - Hardware.overhead_gib
    result = {"planned_step_ms": 1000 * est["time_s"]["step"], "measured_step_ms": measured["ms_per_step"],
              "planned_memory_gib": est["memory_gib"]["total"], "planned_tensors_gib": planned_tensors,
              "measured_peak_gib": measured["peak_memory_gib"], "plan": est, "bench": report}
    print(f"planner vs H200, llama3-1b 4 x 2048: step {result['planned_step_ms']:.1f} ms planned, "
          f"{result['measured_step_ms']:.1f} measured; tensors {planned_tensors:.1f} GiB planned (plus "
          f"{Hardware.overhead_gib:g} GiB overhead), {result['measured_peak_gib']:.1f} GiB peak allocated", flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/gpu_parallel")))
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--skip-runs", action="store_true")
    parser.add_argument("--skip-plan", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():  # one line, not a traceback from the first CUDA call
        print("gpu_parallel.py needs a CUDA GPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    if not args.skip_bench:
        results["bench_train"] = check_bench(args.out)
    if not args.skip_runs:
        results["degree_1_runs"] = check_runs(args.out)
    if not args.skip_plan:
        results["planner"] = check_plan(args.out)
    write_json(args.out / "gpu_parallel.json", results)
    print(f"wrote {args.out / 'gpu_parallel.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
