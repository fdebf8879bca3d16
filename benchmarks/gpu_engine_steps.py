"""Where an engine step's time goes, on a GPU (a diagnostic beside gpu_engine.py; about a minute on an H200):

    python benchmarks/gpu_engine_steps.py [--only steps,host,decode]   # $OUT/diag.json (default ./out)
    python benchmarks/gpu_engine_steps.py --smoke                      # the CPU dry run (tiny model, fp32)

steps   Prefill of 64 prompts of 2,000 tokens on Llama-3.2-1B's shape (random bf16 weights), eager and graphed
        prefill steps, three passes over the same prompts in one engine: the wall ms of every step (synced), and
        how many matmul autotunings and GEMM launch plans it added; then a graphed pass as gpu_engine.py's (c)
        runs it (unsynced, a step ahead) and its device timeline: kernels against gaps a step. A step far slower
        than its neighbours in the first passes only is a one-time cost (a kernel compiled or tuned);
        docs/results/issue14/session7/diag_before_fix.json is how it found Triton specializing on per-step
        values. Also torch.profiler's kernels of one eager 16K-token step.
host    The host time of a small prefill step (Qwen3-0.6B's shape, 8 prompts of 8 tokens: the ~25-30 ms floor of
        an eager step): its wall ms eager and graphed (the default on a GPU), then, profiled, eager, each kernel
        entry point's calls and microseconds per call
        (every `nanoforge.kernels` function the engine calls wrapped in a profiler range named after it, in
        every module that imported it) beside the aten ops'.
decode  torch.profiler's kernels over 100 graphed batch-1 decode steps of Llama-3.2-1B's shape (`--decode-preset`
        picks another), the step's ms unprofiled, and one step's kernels in order (NANOFORGE_PDL=0 for durations
        that add up: under PDL a kernel launched early counts its wait).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from benchmarks.gpu_engine import build_model, drain, make_engine, run_on  # noqa: E402
from nanoforge.kernels import matmul as mm  # noqa: E402
from nanoforge.serve.sampling_params import SamplingParams  # noqa: E402

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def tuned() -> tuple[int, int]:
    return len(mm._tiled_tuned.cache) + len(mm._persistent_tuned.cache), len(mm._PLANS)


def activities(device) -> list:
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def device_table(prof, n: int = 14) -> list:
    top = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:n]
    return [(e.key[:90], e.count, round(e.device_time_total / 1e3, 3)) for e in top]


def timeline(intervals: list[tuple[float, float]], steps: int, step_gap_us: float = 20.0) -> dict:
    """Where a run of `steps` steps spends the device's time, from its kernels' (start, end) in microseconds:
    busy (the union of kernels), the gaps shorter than `step_gap_us` (between the kernels of a replayed graph:
    launch latency) and the longer ones (the device waiting for the host: between steps), each per step."""
    if not intervals or not steps:
        return {}
    intervals = sorted(intervals)
    busy, short, long_, end = 0.0, 0.0, 0.0, intervals[0][0]
    for start, stop in intervals:
        if start > end:
            gap = start - end
            if gap < step_gap_us:
                short += gap
            else:
                long_ += gap
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    span = end - intervals[0][0]
    return {"kernels_per_step": len(intervals) / steps, "span_us_per_step": span / steps,
            "busy_us_per_step": busy / steps, "short_gaps_us_per_step": short / steps,
            "long_gaps_us_per_step": long_ / steps, "step_gap_us": step_gap_us}


def kernel_intervals(prof) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every device kernel and memcpy the profiler saw."""
    cuda = torch.autograd.DeviceType.CUDA
    return [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == cuda]


def one_step_kernels(prof, steps: int) -> list[tuple[str, float, float]]:
    """The kernels of one step in the middle of a profiled run of `steps` graphed steps, in launch order:
    (name, microseconds from the step's first kernel's start, duration). With PDL on, a kernel launched early
    counts its wait in its duration; run with NANOFORGE_PDL=0 for durations that add up."""
    cuda = torch.autograd.DeviceType.CUDA
    evs = sorted((e for e in prof.events() if e.device_type == cuda), key=lambda e: e.time_range.start)
    per = len(evs) // steps if steps else 0
    if not per:
        return []
    step = evs[(steps // 2) * per:(steps // 2 + 1) * per]
    t0 = step[0].time_range.start
    return [(e.name[:60], round(e.time_range.start - t0, 2), round(e.time_range.end - e.time_range.start, 2))
            for e in step]


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def section_steps(c: dict, device, dtype, res: dict) -> None:
    model = build_model(c["preset"], device, dtype, c["length"] + 16)
    rng = random.Random(2)
    vocab = min(10000, model.cfg.vocab_size)
    prompts = [[rng.randrange(vocab) for _ in range(c["length"])] for _ in range(c["prompts"])]
    for graphed in (False, True):
        kind = "graphed" if graphed else "eager"
        eng = make_engine(model, max_num_seqs=c["prompts"], max_len=c["length"] + 8, prefix_caching=False,
                          graph_prefill=graphed)
        for p in range(3):
            for x in prompts[:len(prompts) // 2] if p == 0 else prompts:
                eng.add_request(x, ONE)
            steps = []
            while eng.has_unfinished():
                t0, a = time.perf_counter(), tuned()
                if p == 2 and not steps:  # one full step of each kind, profiled (the pass is warm)
                    with profile(activities=activities(device)) as prof:
                        eng.step()
                        sync(device)
                    res[f"{kind}_step_kernels"] = device_table(prof, 24)  # the top rows (CPU ops' ranges among them)
                    # every kernel of the step (what the top rows leave out): the two kinds' kernels compared
                    t = res[f"{kind}_step_device"] = timeline(kernel_intervals(prof), 1)
                    print(f"{kind} step profiled: kernels {t.get('busy_us_per_step', 0) / 1e3:.1f} ms of "
                          f"{t.get('kernels_per_step', 0):.0f} launches", flush=True)
                else:
                    eng.step()
                    sync(device)
                b = tuned()
                steps.append((round(1e3 * (time.perf_counter() - t0), 1), b[0] - a[0], b[1] - a[1]))
            res[f"{kind}_pass{p}"] = steps
            print(kind, "pass", p, "(ms, autotunings, plans):", steps, flush=True)
        if graphed:
            res["graphed_timeline"] = drained_timeline(eng, prompts, device)
        eng.close()


def drained_timeline(eng, prompts: list, device) -> dict:
    """Every prompt through the engine as gpu_engine.py's (c) runs them (a step ahead, no sync between steps):
    the wall ms a step unprofiled, then the device's timeline of the same work profiled (device activity only):
    how much of a step the kernels cover, and the gaps between them, short (launches inside a graph) and long
    (the device waiting for the host)."""
    def drain_all() -> int:
        for x in prompts:
            eng.add_request(x, ONE)
        sync(device)
        n = 0
        while eng.has_unfinished():
            eng.step()
            n += 1
        sync(device)
        return n

    t0 = time.perf_counter()
    steps = drain_all()
    wall = 1e3 * (time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU]) as prof:
        drain_all()
    t = {"steps": steps, "wall_ms": round(wall, 2), "wall_ms_per_step": round(wall / steps, 2),
         **timeline(kernel_intervals(prof), steps)}
    # the pass's totals (its last step may only collect the tokens of the one before: a mean per step hides it)
    print(f"drained like (c): {steps} steps in {wall:.1f} ms unprofiled", end="")
    if "busy_us_per_step" in t:
        ms = {k: t[f"{k}_us_per_step"] * steps / 1e3 for k in ("span", "busy", "short_gaps", "long_gaps")}
        print(f"; profiled, the device's timeline spans {ms['span']:.1f} ms = kernels {ms['busy']:.1f} + short gaps "
              f"{ms['short_gaps']:.2f} + long gaps {ms['long_gaps']:.2f}", end="")
    print(flush=True)
    return t


def attribute_kernel_calls() -> list[str]:
    """Wrap each public function of the engine's kernel modules in a profiler range of its name, wherever a
    nanoforge module holds it (`from ... import f` copies the reference); returns the names wrapped."""
    from nanoforge.kernels import paged_attention, rmsnorm, rope, sampling, swiglu

    wrapped = {}
    for mod in (paged_attention, rmsnorm, rope, sampling, swiglu):
        for name, f in vars(mod).items():
            if inspect.isfunction(f) and f.__module__ == mod.__name__ and not name.startswith("_"):
                def wrapper(*args, __f=f, __name=f"nf::{name}", **kwargs):
                    with record_function(__name):
                        return __f(*args, **kwargs)

                wrapped[id(f)] = functools.wraps(f)(wrapper)
    for m in list(sys.modules.values()):
        if getattr(m, "__name__", "").startswith("nanoforge"):
            for attr, val in list(vars(m).items()):
                if id(val) in wrapped:
                    setattr(m, attr, wrapped[id(val)])
    return sorted(w.__name__ for w in wrapped.values())


def small_steps_ms(model, c: dict, device, graphed: bool, steps: int = 20) -> float:
    """Wall ms of one prefill step of c["prompts"] x c["tokens"] new tokens, unprofiled, eager or graphed."""
    rng = random.Random(5)
    eng = make_engine(model, max_num_seqs=c["prompts"], max_len=64, prefix_caching=False, graph_prefill=graphed,
                      async_scheduling=False)
    vocab = min(1000, model.cfg.vocab_size)
    times = []
    for i in range(steps + 3):
        for _ in range(c["prompts"]):
            eng.add_request([rng.randrange(vocab) for _ in range(c["tokens"])], ONE)
        sync(device)
        t0 = time.perf_counter()
        eng.step()  # all of them in one prefill step (step by step: it is read back at once)
        sync(device)
        if i >= 3:  # the first ones compile
            times.append(time.perf_counter() - t0)
        drain(eng)
    eng.close()
    return 1e3 * sorted(times)[len(times) // 2]


def section_host(c: dict, device, dtype, res: dict) -> None:
    model = build_model(c["preset"], device, dtype, 256)
    eager, graphed = small_steps_ms(model, c, device, False), small_steps_ms(model, c, device, True)
    res["small_step"] = {"eager_ms": eager, "graphed_ms": graphed, "ratio": eager / graphed}
    print(f"\none prefill step of {c['prompts']} x {c['tokens']} tokens, {c['preset']} shape: {eager:.2f} ms eager, "
          f"{graphed:.2f} ms graphed: {eager / graphed:.2f}x")
    names = attribute_kernel_calls()
    rng = random.Random(4)
    eng = make_engine(model, max_num_seqs=c["prompts"], max_len=64, prefix_caching=False, graph_prefill=False)
    prompts = [[rng.randrange(min(1000, model.cfg.vocab_size)) for _ in range(c["tokens"])] for _ in range(c["prompts"])]
    for _ in range(3):  # warm: every kernel compiled
        for p in prompts:
            eng.add_request(p, ONE)
        drain(eng)
    for p in prompts:
        eng.add_request(p, ONE)
    sync(device)
    with profile(activities=activities(device)) as prof:
        t0 = time.perf_counter()
        eng.step()  # the prefill step (with async scheduling, it is read back by the next call)
        sync(device)
        wall = time.perf_counter() - t0
    drain(eng)
    eng.close()
    rows = []
    for e in prof.key_averages():
        if e.key.startswith("nf::") or e.key.startswith("aten::") or e.key.startswith("cu"):
            rows.append({"name": e.key, "calls": e.count, "cpu_ms": round(e.cpu_time_total / 1e3, 3),
                         "us_per_call": round(e.cpu_time_total / max(1, e.count), 1)})
    rows.sort(key=lambda r: -r["cpu_ms"])
    ours = [r for r in rows if r["name"].startswith("nf::")]
    res["host"] = {"preset": c["preset"], "prompts": c["prompts"], "tokens": c["tokens"], "wall_ms": 1e3 * wall,
                   "kernel_functions": ours, "top": rows[:25], "wrapped": names}
    print(f"\nhost time of one eager step of {c['prompts']} x {c['tokens']} tokens, {c['preset']} shape "
          f"({1e3 * wall:.1f} ms wall, profiled):")
    for r in ours + [r for r in rows if not r["name"].startswith("nf::")][:12]:
        print(f"  {r['name']:<44}{r['calls']:>6} calls {r['cpu_ms']:>9.3f} ms {r['us_per_call']:>9.1f} us/call")


def section_decode(c: dict, device, dtype, res: dict) -> None:
    model = build_model(c["preset"], device, dtype, 1024)
    rng = random.Random(1)
    vocab = min(10000, model.cfg.vocab_size)
    eng = make_engine(model, max_num_seqs=1, max_len=700, tokens=256)
    eng.add_request([rng.randrange(vocab) for _ in range(128)],
                    SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    drain(eng)
    eng.add_request([rng.randrange(vocab) for _ in range(128)],
                    SamplingParams(temperature=0.0, max_tokens=2 * c["steps"] + 60, ignore_eos=True))
    for _ in range(50):
        eng.step()
    sync(device)
    with profile(activities=activities(device)) as prof:
        for _ in range(c["steps"]):
            eng.step()
        sync(device)
    res["decode_kernels"] = device_table(prof, 20)
    res["decode_timeline"] = timeline(kernel_intervals(prof), c["steps"])
    res["decode_one_step"] = one_step_kernels(prof, c["steps"])
    res["decode_preset"], res["pdl"] = c["preset"], os.environ.get("NANOFORGE_PDL", "auto")
    t0 = time.perf_counter()
    for _ in range(c["steps"]):
        eng.step()
    sync(device)
    res["decode_ms_per_step"] = 1e3 * (time.perf_counter() - t0) / c["steps"]
    eng.close()
    print(f"\nbatch-1 decode, {c['preset']} shape: {res['decode_ms_per_step']:.3f} ms a step; kernels over "
          f"{c['steps']} steps:", *res["decode_kernels"], sep="\n  ")
    t = res["decode_timeline"]
    if t:
        print(f"device timeline a step (profiled): {t['kernels_per_step']:.0f} kernels, span {t['span_us_per_step']:.0f} "
              f"us = busy {t['busy_us_per_step']:.0f} + gaps under {t['step_gap_us']:.0f} us "
              f"{t['short_gaps_us_per_step']:.0f} + longer gaps {t['long_gaps_us_per_step']:.0f}")
    first = res["decode_one_step"][:24]
    if first:
        print("one step's first kernels (name, start us, duration us):", *first, sep="\n  ")


GPU = {"steps": dict(preset="llama3-1b", prompts=64, length=2000), "host": dict(preset="qwen3-0.6b", prompts=8,
       tokens=8), "decode": dict(preset="llama3-1b", steps=100)}
SMOKE = {"steps": dict(preset="tiny-llama", prompts=4, length=40), "host": dict(preset="tiny-qwen3", prompts=4,
         tokens=8), "decode": dict(preset="tiny-llama", steps=10)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="steps,host,decode")
    p.add_argument("--smoke", action="store_true", help="tiny presets on the CPU in fp32 (a dry run)")
    p.add_argument("--decode-preset", default=None, help="the decode section's model shape (default llama3-1b)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    args = p.parse_args(argv)
    picked = run_on(args.smoke)
    if picked is None:
        return 2
    device, dtype = picked
    conf = {k: dict(v) for k, v in (SMOKE if args.smoke else GPU).items()}
    if args.decode_preset:
        conf["decode"]["preset"] = args.decode_preset
    res: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    sections = {"steps": section_steps, "host": section_host, "decode": section_decode}
    for name in args.only.split(","):
        if name not in sections:
            print(f"--only: sections are {', '.join(sections)}", file=sys.stderr)
            return 2
        sections[name](conf[name], device, dtype, res)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "diag.json").write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out / 'diag.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
