"""The engine's host work per step, the device's part taken away: what async scheduling must hide.

The real scheduler, block manager, persistent input batch and engine bookkeeping run nano-vllm's workload
(256 requests, prompts and outputs of 100-1,024 tokens, `ignore_eos`, temperature 0.6) on a model whose
forward pass and sampler are stubbed out: the forward returns zeros at once and the sampler draws token ids
from a seeded generator. Every second measured is then the host's: per step phase (schedule; prepare = pack
the inputs, upload and block operations; collect = read the tokens back; update = append them, check stops;
outputs = the rest of `LLMEngine.step()`: the request outputs it returns), per step and per sequence-step,
in three modes: sync (`LLM.generate` step by step), async (a step ahead, the GPU default) and streamed (a step
ahead, every request streamed as the server does: each step reports every request).

On the H200 a decode step of this workload at ~146 sequences takes the GPU ~6 ms, and the engine keeps up
only while the host's step is shorter: the host's per-sequence cost bounds tokens/s at any device speed.

`--against REV` measures the package as it was at git revision REV too (a worktree of REV, the same script,
a subprocess per round, rounds alternating) and reports this tree's speed-up over it, phase by phase.

    python benchmarks/engine_host.py [--requests N] [--rounds R] [--modes sync,async,streamed] [--against REV]

Prints a table; writes engine_host.json under $OUT (default ./out). Runs on the CPU (~10 s a round).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHASES = ("schedule", "prepare", "collect", "update", "outputs")


MODES = {  # name: (async scheduling, outputs every step)
    "sync": (False, False),  # LLM.generate, step by step
    "async": (True, False),  # LLM.generate a step ahead (the GPU default)
    "streamed": (True, True),  # the server streaming every request a step ahead: each step reports every one
}


def measure(requests: int, seed: int, async_scheduling: bool, streamed: bool) -> dict:
    """One run of the workload through an engine with the device's part stubbed out: host seconds per phase."""
    import torch

    from nanoforge.model.config import preset
    from nanoforge.model.transformer import Transformer
    from nanoforge.serve import llm_engine
    from nanoforge.serve.llm_engine import EngineConfig, LLMEngine
    from nanoforge.serve.sampling_params import SamplingParams

    torch.manual_seed(seed)
    cfg = dataclasses.replace(preset("tiny-llama"), vocab_size=151_936, max_seq_len=4096)
    model = Transformer(cfg).eval()
    engine = LLMEngine(model, None, EngineConfig(device="cpu", dtype="float32", use_cuda_graphs=False,
                                                 num_gpu_blocks=requests * 2048 // 16 + 64,
                                                 async_scheduling=async_scheduling))
    runner, gen = engine.runner, torch.Generator().manual_seed(seed)
    runner._forward = lambda v, n, s, max_q_len, width, kernel: torch.zeros(n, cfg.d_model)

    def sample(v, hidden, n, logits_out=None):
        runner.sampled[:n] = torch.randint(0, cfg.vocab_size, (n,), generator=gen)

    runner._sample = sample
    spent = dict.fromkeys(PHASES[:4], 0.0)

    def timed(obj, name: str, phase: str) -> None:
        fn = getattr(obj, name)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[phase] += time.perf_counter() - t

        setattr(obj, name, wrapper)

    timed(engine.scheduler, "schedule", "schedule")
    timed(runner, "launch", "prepare")
    timed(runner, "collect", "collect")
    timed(engine.scheduler, "update", "update")
    rng = random.Random(seed)
    # as `LLM.generate` asks, or a stream (a revision from before output kinds reports every step either way)
    kind = {"output_kind": "cumulative" if streamed else "final_only"} \
        if "output_kind" in SamplingParams.__dataclass_fields__ else {}
    requested = 0
    for _ in range(requests):
        prompt = [rng.randrange(cfg.vocab_size) for _ in range(rng.randint(100, 1024))]
        requested += (max_tokens := rng.randint(100, 1024))
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.6, **kind))
    steps = seq_steps = tokens = 0
    # the step loop as `LLM.generate` and the server run it (a revision from before `frozen_heap`: as it ran then)
    loop = getattr(llm_engine, "frozen_heap", contextlib.nullcontext)
    started = time.perf_counter()
    with loop():
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    tokens += len(out.outputs[0].token_ids)
            steps += 1
            seq_steps += sum(len(g.seqs) for g in engine.scheduler.running)
    total = time.perf_counter() - started
    spent["outputs"] = total - sum(spent.values())
    return {"seconds": total, "steps": steps, "seq_steps": seq_steps, "output_tokens": tokens,
            "requested_tokens": requested, "phases": spent}


def rows(r: dict) -> dict:
    """Per phase and in all: microseconds per step and per sequence-step."""
    out = {}
    for name, s in [*r["phases"].items(), ("step", r["seconds"])]:
        out[name] = {"us_per_step": 1e6 * s / r["steps"], "us_per_seq_step": 1e6 * s / r["seq_steps"]}
    return out


def median_run(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]


def run_at(tree: Path, a: argparse.Namespace, mode: str) -> dict:
    """One measurement in a fresh process that imports nanoforge from `tree`."""
    cmd = [sys.executable, __file__, "--child", mode, "--requests", str(a.requests), "--seed", str(a.seed)]
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=256, help="requests in the workload (default 256)")
    p.add_argument("--rounds", type=int, default=3, help="runs of each tree and mode; the median is kept (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--against", metavar="REV", help="also measure the package at this git revision")
    p.add_argument("--modes", default=",".join(MODES), help=f"which of {', '.join(MODES)} (default: all)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(measure(a.requests, a.seed, *MODES[a.child])))
        return 0
    if a.requests < 1 or a.rounds < 1:
        print("--requests and --rounds must be positive", file=sys.stderr)
        return 2
    modes = a.modes.split(",")
    if not modes or set(modes) - set(MODES):
        print(f"--modes takes a comma-separated list of {', '.join(MODES)}, not {a.modes!r}", file=sys.stderr)
        return 2
    here = Path(__file__).resolve().parents[1]
    trees = {"this tree": here}
    tmp = None
    if a.against:
        tmp = tempfile.mkdtemp(prefix="nanoforge-against-")
        made = subprocess.run(["git", "-C", str(here), "worktree", "add", "--detach", tmp, a.against],
                              capture_output=True, text=True)
        if made.returncode:
            os.rmdir(tmp)
            print(f"--against {a.against}: {made.stderr.strip().splitlines()[-1]}", file=sys.stderr)
            return 2
        trees[a.against] = Path(tmp)
    results: dict = {}
    try:
        total = a.rounds * len(trees) * len(modes)
        done, started = 0, time.perf_counter()
        for mode in modes:
            for _ in range(a.rounds):
                for name, tree in trees.items():  # alternating: a machine warming up favours neither
                    results.setdefault(mode, {}).setdefault(name, []).append(run_at(tree, a, mode))
                    done += 1
                    rate = (time.perf_counter() - started) / done
                    print(f"  {done}/{total} runs, {rate:.1f} s each, ETA {rate * (total - done):.0f} s",
                          file=sys.stderr)
    finally:
        if tmp:
            subprocess.run(["git", "-C", str(here), "worktree", "remove", "--force", tmp], capture_output=True)
    report = {"workload": f"{a.requests} requests, prompts and outputs of 100-1,024 tokens", "rounds": a.rounds,
              "machine": os.uname().nodename, "cpus": os.cpu_count(), "modes": {}}
    for mode, by_tree in results.items():
        report["modes"][mode] = {name: {**median_run(runs), "rows": rows(median_run(runs))}
                                 for name, runs in by_tree.items()}
    print_table(report, a.against)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "engine_host.json").write_text(json.dumps(report, indent=1))
    plot(report, a.out / "engine_host.png")
    print(f"wrote {a.out / 'engine_host.json'} and engine_host.png")
    return 0


def plot(report: dict, path: Path) -> None:
    """Per mode, a stacked bar of microseconds per sequence-step by phase for each tree measured."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    bars = [(f"{mode}\n{name}", r["rows"]) for mode, by_tree in report["modes"].items() for name, r in by_tree.items()]
    fig, ax = plt.subplots(figsize=(1.2 * len(bars) + 3, 3.8))
    for i, (_, r) in enumerate(bars):
        bottom = 0.0
        for j, phase in enumerate(PHASES):
            t = r[phase]["us_per_seq_step"]
            ax.bar(i, t, 0.6, bottom=bottom, color=plt.cm.tab10(j), label=phase if i == 0 else None)
            bottom += t
    ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=7)
    ax.set_ylabel("host us per sequence-step")
    ax.set_title(f"engine host work, device stubbed ({report['workload']})", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(report: dict, against: str | None) -> None:
    print(f"\nengine host work per step, device stubbed ({report['workload']}; median of {report['rounds']})")
    for mode, by_tree in report["modes"].items():
        ours = by_tree["this tree"]
        print(f"\n{mode}: {ours['steps']} steps, {ours['seq_steps'] / ours['steps']:.0f} sequences a "
              f"step on average, {ours['seconds']:.2f} s")
        head = f"{'phase':<10}{'us/step':>10}{'us/seq-step':>13}"
        if against:
            head += f"{'at ' + against:>22}{'speed-up':>10}"
        print(head)
        for phase, row in ours["rows"].items():
            line = f"{phase:<10}{row['us_per_step']:>10.0f}{row['us_per_seq_step']:>13.2f}"
            if against:
                base = by_tree[against]["rows"][phase]["us_per_step"]
                line += f"{base:>22.0f}{base / row['us_per_step']:>9.2f}x"
            print(line)


if __name__ == "__main__":
    sys.exit(main())
