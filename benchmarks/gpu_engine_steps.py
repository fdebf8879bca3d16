"""Where an engine step's time goes, on a GPU (a diagnostic beside gpu_engine.py; ~45 s on an H200):

    python benchmarks/gpu_engine_steps.py        # $OUT/diag.json (default ./out)

1. Prefill of 64 prompts of 2,000 tokens on Llama-3.2-1B's shape (random bf16 weights), eager and graphed
   prefill steps, three passes over the same prompts in one engine: the wall ms of every step (synced), and how
   many matmul autotunings and launch plans it added. A step far slower than its neighbours in the first passes
   only is a one-time cost (a kernel compiled or tuned); docs/results/issue14/session7/diag_before_fix.json is
   how it found Triton specializing on per-step values.
2. torch.profiler tables of one eager 16K-token step (device time by kernel, host time by op) and of 100
   graphed batch-1 decode steps, with the decode step's ms unprofiled.
"""
import json
import os
import random
import sys
import time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
from benchmarks.gpu_engine import build_model, make_engine, drain
from nanoforge.kernels import matmul as mm
from nanoforge.serve.sampling_params import SamplingParams

OUT = Path(os.environ.get("OUT", "out"))
dev, dt = torch.device("cuda"), torch.bfloat16
res = {}

def tuned():
    return len(mm._tiled_tuned.cache) + len(mm._persistent_tuned.cache), len(mm._PLANS)

def kernels(prof, n=14):
    rows = []
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:n]:
        rows.append((e.key[:90], e.count, round(e.device_time_total / 1e3, 2)))
    return rows

model = build_model("llama3-1b", dev, dt, 2016)
rng = random.Random(2)
prompts = [[rng.randrange(10000) for _ in range(2000)] for _ in range(64)]
one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
for graphed in (False, True):
    eng = make_engine(model, max_num_seqs=64, max_len=2008, prefix_caching=False, graph_prefill=graphed)
    for p in range(3):
        for x in prompts[:32] if p == 0 else prompts:
            eng.add_request(x, one)
        steps = []
        while eng.has_unfinished():
            t0 = time.perf_counter(); a = tuned()
            if p == 2 and len(steps) == 2 and not graphed:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
                    eng.step(); torch.cuda.synchronize()
                res["eager_step_kernels"] = kernels(prof)
                res["eager_step_cpu"] = [(e.key[:60], e.count, round(e.cpu_time_total / 1e3, 2)) for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]]
            else:
                eng.step(); torch.cuda.synchronize()
            steps.append((round(1e3 * (time.perf_counter() - t0), 1), tuned()[0] - a[0], tuned()[1] - a[1]))
        res[f"{'graphed' if graphed else 'eager'}_pass{p}"] = steps
        print(graphed, p, steps, flush=True)
    eng.close()
print(json.dumps({k: v for k, v in res.items() if "kernels" in k or "cpu" in k}, indent=0))

# batch-1 decode: where the time goes
eng = make_engine(model, max_num_seqs=1, max_len=700, tokens=256)
eng.add_request(prompts[0][:128], SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)); drain(eng)
eng.add_request(prompts[1][:128], SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True))
for _ in range(50): eng.step()
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
    t0 = time.perf_counter()
    for _ in range(100): eng.step()
    torch.cuda.synchronize()
res["decode_ms_per_step_profiled"] = (time.perf_counter() - t0) * 10
res["decode_kernels_100_steps"] = kernels(prof, 20)
t0 = time.perf_counter()
for _ in range(100): eng.step()
torch.cuda.synchronize()
res["decode_ms_per_step"] = (time.perf_counter() - t0) * 10
eng.close()
print(json.dumps({k: v for k, v in res.items() if "decode" in k}, indent=0))
OUT.mkdir(parents=True, exist_ok=True)
(OUT / "diag.json").write_text(json.dumps(res, indent=1))
