"""Multi-GPU training runs (issue 16): 4D layouts through torchrun, against one GPU and against the planner.

For one model shape and the GPUs of this machine, every run is `torchrun -m nanoforge train` on the same
prepared data (a byte-level BPE of 8,192 entries trained on this repository's sources: no download; the
shape is the preset's with that vocabulary) and the same global batch (`--batch-size` rows per micro-batch,
all ranks together, times `--grad-accum`: the single-GPU run accumulates what the others spread), so the
losses of every layout should equal the single-GPU run's within bf16 noise. Per run it records tokens/s,
tokens/s per GPU and its ratio to one GPU (scaling efficiency), MFU, the peak memory of the busiest GPU
against the planner's prediction for the layout (`nanoforge.train.parallel.plan.estimate`), and the losses.

    python benchmarks/multigpu_train.py --shape llama3-1b                  # every layout for this machine's GPUs
    python benchmarks/multigpu_train.py --shape llama3-1b --runs single,fsdp8,tp2-fsdp4 --steps 50
    python benchmarks/multigpu_train.py --shape llama3-1b --runs cp32k     # context parallelism at 32K tokens
    python benchmarks/multigpu_train.py --shape llama3-1b --runs reshard   # DCP: save at one layout, resume at another
    python benchmarks/multigpu_train.py --shape llama3-8b --runs fsdp2,fsdp8,tp2-fsdp4   # 8B: no single-GPU run
    python benchmarks/multigpu_train.py --cpu --gpus 2                     # a dry run on CPUs (gloo, tiny-llama)

Results accumulate in $OUT/multigpu_train_<shape>.json (a later call adds its runs to what an earlier one
measured: the runs of one shape need several 10-minute calls) with a table printed after each call.
NCCL's settings are left as the machine sets them (NVLink multicast off on the lent hosts).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nanoforge.errors import NanoforgeError
from nanoforge.model.config import preset
from nanoforge.train.parallel.plan import Hardware, Layout, Workload, estimate
from nanoforge.train.progress import write_json

PP_MICRO = 4  # micro-batches per step of pipelined runs
VOCAB = 8192  # the runs' byte-level BPE (prepare_data)
H200_HBM_GIB = 143771 / 1024  # what torch and nvidia-smi report for the lent H200s
BF16_NOISE = 0.02  # relative loss difference at any step that bf16 runs of different layouts stay within


def layouts(n: int) -> dict[str, dict[str, int]]:
    """The layouts worth measuring on n GPUs, by name: mesh sizes (pp, dp_shard, cp, tp)."""
    out: dict[str, dict[str, int]] = {"single": {}, "single-pp": {}}
    for g in (2, 4, 8):
        if g > n:
            break
        out[f"fsdp{g}"] = {"dp_shard": g}
        out[f"tp{g}"] = {"tp": g}
    if n >= 2:
        out["pp2"] = {"pp": 2}
        out["cp2"] = {"cp": 2}
    if n >= 4:
        out["tp2-fsdp2"] = {"tp": 2, "dp_shard": 2}
        out["pp2-fsdp2"] = {"pp": 2, "dp_shard": 2}
        out["cp2-fsdp2"] = {"cp": 2, "dp_shard": 2}
        out["tp2-cp2"] = {"tp": 2, "cp": 2}
    if n >= 8:
        out["tp2-fsdp4"] = {"tp": 2, "dp_shard": 4}
        out["tp2-cp2-fsdp2"] = {"tp": 2, "cp": 2, "dp_shard": 2}
        out["pp2-tp2-fsdp2"] = {"pp": 2, "tp": 2, "dp_shard": 2}
    return out


def gpus_of(mesh: dict[str, int]) -> int:
    return math.prod(mesh.values()) if mesh else 1


def flags_of(mesh: dict[str, int]) -> list[str]:
    return [f for k, v in mesh.items() for f in (f"--{k.replace('_', '-')}", str(v))]


class Runner:
    def __init__(self, args: argparse.Namespace, work: Path):
        self.args, self.work = args, work
        self.data = work / "data"

    def prepare_data(self) -> None:
        if (self.data / "meta.json").exists():
            return
        sources = sorted(str(p) for p in (REPO / "nanoforge").rglob("*.py") if p.stat().st_size)
        vocab = "bpe:512" if self.args.cpu else f"bpe:{VOCAB}"
        subprocess.run([sys.executable, "-m", "nanoforge", "data", "prepare", *sources, "--out", str(self.data),
                        "--tokenizer", vocab], check=True, cwd=REPO, env=self.env(), stdout=subprocess.DEVNULL)

    def env(self) -> dict:
        env = os.environ | {"PYTHONPATH": str(REPO)}
        if self.args.cpu:
            env |= {"OMP_NUM_THREADS": "1"}
        return env

    def train(self, name: str, mesh: dict[str, int], *, seq_len: int, batch: int, accum: int, steps: int,
              extra: list[str] = (), out: Path | None = None) -> dict:
        """One run; its summary (log.json) with how it was launched, or its failure."""
        a = self.args
        out = out or self.work / name
        n = gpus_of(mesh)
        argv = ["train", "--data", str(self.data), "--preset", a.shape, "--seq-len", str(seq_len),
                "--batch-size", str(batch), "--grad-accum", str(accum), "--max-steps", str(steps),
                "--lr", "3e-4", "--warmup-steps", "5", "--log-interval", "1", "--eval-interval", str(a.eval_interval),
                "--eval-iters", "2", "--out", str(out), *flags_of(mesh), *extra]
        if a.cpu:
            argv += ["--no-compile", "--dtype", "fp32"]
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
                    "--master-addr", "127.0.0.1", "--master-port", str(29500 + os.getpid() % 1000)] if mesh else \
            [sys.executable]
        t0 = time.perf_counter()
        run = subprocess.run([*launcher, "-m", "nanoforge", *argv], capture_output=True, text=True, cwd=REPO,
                             env=self.env(), timeout=a.run_timeout, check=False)
        wall = time.perf_counter() - t0
        print(f"[{name}] {f'torchrun x{n} ' if mesh else ''}nanoforge {' '.join(argv[:1] + flags_of(mesh))}: "
              f"exit {run.returncode} in {wall:.0f} s", flush=True)
        if run.returncode:
            said = [line for line in run.stderr.splitlines() if "error:" in line or "Error" in line][:3]
            tail = "\n".join(said) or (run.stdout[-1500:] + run.stderr[-3000:]).strip()
            print(tail, flush=True)
            return {"exit": run.returncode, "gpus": n, "mesh": mesh, "error": tail[-3000:]}
        log = json.loads((out / "log.json").read_text())
        return {"exit": 0, "gpus": n, "mesh": mesh, "seq_len": seq_len, "batch": batch, "grad_accum": accum,
                "wall_s": wall, "tokens_per_s": log["tokens_per_s"], "mfu": log["mfu"],
                "peak_memory_gib": log.get("peak_memory_gib"), "ms_per_step": log["ms_per_step"],
                "losses": [r["loss"] for r in log["history"]["train"]], "vocab_size": log["model"]["vocab_size"],
                "final_val": log.get("final_val_loss_full_split"), "parallel": log.get("parallel")}

    def plan(self, spec: dict) -> dict | None:
        """The planner's numbers for a run (`run_spec`) on this machine's GPUs (None on CPUs)."""
        if self.args.cpu:
            return None
        import torch

        entry = spec | {"gpus": gpus_of(spec["mesh"]), "vocab_size": VOCAB}
        return planned(self.args.shape, entry, torch.cuda.get_device_properties(0).total_memory / 2**30)


def planned(shape: str, entry: dict, hbm_gib: float) -> dict:
    """The planner's memory per GPU (all of it, and the tensors alone: what a run's peak measures), step time,
    tokens/s and MFU (at its assumed kernel efficiency) for a run's layout, batch and sequence length, on GPUs of
    `hbm_gib`; whether it fits, and whether only with activation recomputation (the run then trains with
    `--ac full`, and the memory is that of the recomputing layout)."""
    mesh = entry["mesh"]
    cfg = preset(shape, vocab_size=entry["vocab_size"])
    dp = mesh.get("dp_shard", 1)
    lay = Layout(tp=mesh.get("tp", 1), cp=mesh.get("cp", 1), pp=mesh.get("pp", 1), dp=dp,
                 schedule="1f1b" if mesh.get("pp", 1) > 1 else "fsdp")
    work = Workload(seq_len=entry["seq_len"], batch_tokens=entry["batch"] * entry["grad_accum"] * entry["seq_len"],
                    micro_batch=max(1, entry["batch"] // dp))
    hw = Hardware(gpus=entry["gpus"], hbm_gib=hbm_gib)
    est = estimate(cfg, lay, work, hw)
    memory = est["memory_gib"]["total_recompute" if est["recompute"] else "total"]
    return {"memory_gib": memory, "tensors_gib": memory - hw.overhead_gib,
            "step_ms": 1000 * est["time_s"]["step"], "tokens_per_s": est["tokens_per_s"], "mfu": est["mfu"],
            "fits": est["fits"], "recompute": est["recompute"], "efficiency_assumed": hw.efficiency}


def compare_losses(entry: dict, reference: list[float] | None) -> None:
    losses = entry.get("losses")
    if not (losses and reference):
        return
    pairs = list(zip(losses, reference))
    worst = max(abs(a - b) / b for a, b in pairs)
    entry["worst_loss_rel_diff"] = worst
    entry["losses_match"] = len(pairs) == len(losses) and worst <= BF16_NOISE


def refuse(message: str) -> None:
    """Bad input or the wrong machine: one line, exit 2."""
    print(f"multigpu_train.py: {message}", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default=None, help="model preset (default llama3-1b; with --cpu a tiny one, default "
                                                 "tiny-llama)")
    p.add_argument("--runs", default="all", help="comma-separated layout names (see layouts()), cp32k, reshard; "
                                                 "default: every layout for this machine's GPUs")
    p.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--rows-per-gpu", type=int, default=4, help="sequences per GPU per micro-batch at the widest layout")
    p.add_argument("--eval-interval", type=int, default=1000)
    p.add_argument("--run-timeout", type=int, default=1800)
    p.add_argument("--cpu", action="store_true", help="a dry run on CPUs: gloo, fp32, eager, small sizes")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    p.add_argument("--work", type=Path, default=None, help="run folders (default: a temporary one)")
    p.add_argument("--predict", action="store_true",
                   help="no runs: the planner's memory per GPU and step time for each run on --gpus GPUs (default 8) "
                        "of --hbm-gib, written before the runs to compare them with")
    p.add_argument("--hbm-gib", type=float, default=H200_HBM_GIB, help="with --predict: memory per GPU "
                                                                        "(default: an H200's 143,771 MiB)")
    a = p.parse_args()
    a.shape = a.shape or ("tiny-llama" if a.cpu and not a.predict else "llama3-1b")
    try:
        preset(a.shape)
    except NanoforgeError as e:
        refuse(f"--shape: {e}")
    if a.cpu and not a.predict and not a.shape.startswith("tiny"):
        refuse(f"--shape {a.shape}: a --cpu dry run trains a tiny preset (tiny-llama, tiny-qwen3, ...)")
    if a.predict:
        a.gpus = a.gpus or 8
    elif a.cpu:
        a.gpus = a.gpus or 2
        a.seq_len, a.steps, a.rows_per_gpu = min(a.seq_len, 64), min(a.steps, 4), min(a.rows_per_gpu, 2)
    else:
        import torch

        if not torch.cuda.is_available():
            refuse("needs CUDA GPUs (or --cpu for a dry run)")
        a.gpus = a.gpus or torch.cuda.device_count()
    n = a.gpus
    known = layouts(n)
    names = list(known) + ["cp32k", "reshard"] if a.runs == "all" else a.runs.split(",")
    unknown = [x for x in names if x not in known and x not in ("cp32k", "reshard")]
    if unknown:
        refuse(f"--runs: unknown {unknown}; on {n} GPUs: {', '.join(known)}, cp32k, reshard")
    a.out.mkdir(parents=True, exist_ok=True)
    # One global batch for every layout: rows_per_gpu x n rows (the loader draws each micro-batch's rows from
    # (seed, micro-step), so every run reads the same rows; `run_spec`)
    rows = a.rows_per_gpu * n
    if a.predict:
        predict(a, names, known, rows)
        return
    path = a.out / f"multigpu_train_{a.shape}.json"
    results = json.loads(path.read_text()) if path.exists() else {"shape": a.shape, "runs": {}}
    results |= {"gpus": n, "seq_len": a.seq_len, "steps": a.steps}
    work = a.work or Path(tempfile.mkdtemp(prefix="multigpu_train_"))
    runner = Runner(a, work)
    runner.prepare_data()
    for k, name in enumerate(names, 1):
        t0 = time.perf_counter()
        print(f"== run {k}/{len(names)}: {name}", flush=True)
        if name == "reshard":  # DCP: FSDP over n saves at the half-way step, TP x FSDP resumes to the end
            half = a.steps // 2
            first = {"dp_shard": n}
            second = {"tp": 2, "dp_shard": n // 2} if n >= 4 else {"tp": n}
            out = work / "reshard"
            plan = runner.plan({"mesh": second, "seq_len": a.seq_len, "batch": rows, "grad_accum": 1})
            saved = runner.train("reshard-save", first, seq_len=a.seq_len, batch=rows, accum=1, steps=half, out=out)
            entry = saved if saved.get("exit") else runner.train(
                "reshard-resume", second, seq_len=a.seq_len, batch=rows, accum=1, steps=a.steps, out=out,
                extra=["--resume"])
            entry |= {"saved_at": first, "resumed_at": second, "saved_step": half,
                      "reference": f"fsdp{n}" if f"fsdp{n}" in results["runs"] else "single"}
        else:
            spec = run_spec(name, known, rows, a)
            plan = runner.plan(spec)
            # where the planner finds the activations too big for the GPU, it plans their recomputation: so does the run
            ac = "full" if plan and plan["recompute"] else "none"
            entry = runner.train(name, spec["mesh"], seq_len=spec["seq_len"], batch=spec["batch"],
                                 accum=spec["grad_accum"], steps=spec["steps"], extra=["--ac", ac])
            entry |= {"reference": spec["reference"], "ac": ac}
        entry["planned"] = plan
        entry["call_s"] = time.perf_counter() - t0
        results["runs"][name] = entry
        write_json(path, results)

    runs = results["runs"]
    for name, e in runs.items():
        ref = runs.get(e.get("reference") or "", {})
        if e.get("exit") or not ref or ref is e:
            continue
        compare_losses(e, ref.get("losses"))
        if name != "cp32k" and ref.get("tokens_per_s") and e.get("tokens_per_s") and ref.get("gpus") == 1:
            e["scaling_efficiency"] = e["tokens_per_s"] / e["gpus"] / ref["tokens_per_s"]
    write_json(path, results)
    print_table(results)
    print(f"wrote {path}")


def run_spec(name: str, known: dict, rows: int, a: argparse.Namespace) -> dict:
    """A run's layout, sequence length, rows per micro-batch (all ranks), micro-batches, steps and the run its
    losses are compared with. Layouts read the global batch's `rows` in one micro-batch; a pipeline needs
    micro-batches, so its runs, and their single-GPU twin "single-pp", take the same rows in PP_MICRO of them.
    cp32k: context parallelism over every GPU, one 32K-token sequence of packed documents."""
    if name == "cp32k":
        return {"mesh": {"cp": a.gpus}, "seq_len": 128 if a.cpu else 32768, "batch": 1, "grad_accum": 1,
                "steps": min(a.steps, 20), "reference": None}
    mesh = known[name]
    piped = mesh.get("pp", 1) > 1 or name == "single-pp"
    accum = PP_MICRO if piped else 1
    return {"mesh": mesh, "seq_len": a.seq_len, "batch": rows // accum, "grad_accum": accum, "steps": a.steps,
            "reference": None if name.startswith("single") else "single-pp" if piped else "single"}


def predict(a: argparse.Namespace, names: list[str], known: dict, rows: int) -> None:
    """--predict: no run, the planner's numbers for each run on `a.gpus` GPUs of `a.hbm_gib`, written as
    $OUT/multigpu_train_<shape>_<gpus>gpus_planned.json and a table, so that a run is compared with numbers fixed
    before it. (The resharding run's two layouts are fsdpN's and the TP one's.)"""
    plans = {}
    for name in names:
        if name == "reshard":
            continue
        spec = run_spec(name, known, rows, a)
        entry = spec | {"gpus": gpus_of(spec["mesh"]), "vocab_size": VOCAB}
        plans[name] = entry | {"planned": planned(a.shape, entry, a.hbm_gib)}
    path = a.out / f"multigpu_train_{a.shape}_{a.gpus}gpus_planned.json"
    write_json(path, {"shape": a.shape, "gpus": a.gpus, "hbm_gib": a.hbm_gib, "runs": plans})
    print(f"{a.shape}: the planner's numbers for {a.gpus} GPUs of {a.hbm_gib:.1f} GiB "
          f"(step time at {next(iter(plans.values()))['planned']['efficiency_assumed']:.0%} of peak in the kernels)")
    head = f"{'run':<16}{'GPUs':>5}{'seq':>7}{'rows':>6}{'GiB/GPU':>9}{'tensors':>9}{'tok/s':>12}{'tok/s/GPU':>11}" \
           f"{'MFU':>7}  note"
    print(head + "\n" + "-" * len(head))
    for name, e in plans.items():
        pl = e["planned"]
        note = "does not fit" if not pl["fits"] else "--ac full (activations recomputed)" if pl["recompute"] else ""
        print(f"{name:<16}{e['gpus']:>5}{e['seq_len']:>7}{e['batch'] * e['grad_accum']:>6}{pl['memory_gib']:>9.1f}"
              f"{pl['tensors_gib']:>9.1f}{pl['tokens_per_s']:>12,.0f}{pl['tokens_per_s'] / e['gpus']:>11,.0f}"
              f"{pl['mfu']:>7.1%}  {note}")
    print(f"wrote {path}")


def print_table(results: dict) -> None:
    print(f"\n{results['shape']}, {results['gpus']} GPUs, {results['seq_len']} tokens per sequence, "
          f"{results['steps']} steps")
    head = f"{'run':<16}{'GPUs':>5}{'tok/s':>12}{'tok/s/GPU':>11}{'scaling':>9}{'MFU':>7}{'peak GiB':>10}" \
           f"{'planned':>9}{'losses':>10}"
    print(head + "\n" + "-" * len(head))
    for name, e in results["runs"].items():
        if e.get("exit"):
            print(f"{name:<16}{e['gpus']:>5}  failed (exit {e['exit']})")
            continue
        fmt = lambda v, f: format(v, f) if v is not None else "-"
        plan = (e.get("planned") or {}).get("tensors_gib")
        match = {True: "equal", False: "DIFFER"}.get(e.get("losses_match"), "-")
        print(f"{name:<16}{e['gpus']:>5}{fmt(e['tokens_per_s'], ',.0f'):>12}"
              f"{fmt(e['tokens_per_s'] / e['gpus'] if e['tokens_per_s'] else None, ',.0f'):>11}"
              f"{fmt(e.get('scaling_efficiency'), '.1%'):>9}{fmt(e.get('mfu'), '.1%'):>7}"
              f"{fmt(e.get('peak_memory_gib'), '.1f'):>10}{fmt(plan, '.1f'):>9}{match:>10}")


if __name__ == "__main__":
    main()
