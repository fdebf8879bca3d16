"""Session 33: gate-and-up + SwiGLU at a step's row counts (CUDA-graph replays, L2 cleared: bench.time_ms):
cuBLAS + the SwiGLU kernel against our GEMM with SwiGLU in its epilogue, tiled and persistent. $OUT/sweep.json."""
import json, os
import torch
from nanoforge.kernels import matmul as mm
from nanoforge.kernels.bench import time_ms
from nanoforge.kernels.swiglu import silu_mul

print(torch.cuda.get_device_name(), flush=True)
rows = []
for name, d, f in (("llama3-1b", 2048, 8192), ("qwen3-0.6b", 1024, 3072)):
    w = (torch.randn(2 * f, d, device="cuda") / d**0.5).bfloat16()
    for m in (32, 64, 128, 256, 512, 1024, 2048, 3072, 4096, 8192, 16384):
        x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
        want = silu_mul(x @ w.t())
        r = {"shape": name, "M": m, "base_ms": time_ms(lambda: silu_mul(x @ w.t()), graph=True)}
        for s in ("tiled", "persistent"):
            got = mm.matmul(x, w.t(), activation="swiglu", schedule=s)
            r[f"{s}_maxerr"] = (got.float() - want.float()).abs().max().item()
            r[f"{s}_ms"] = time_ms(lambda: mm.matmul(x, w.t(), activation="swiglu", schedule=s), graph=True)
            r[f"{s}_speedup"] = r["base_ms"] / r[f"{s}_ms"]
        rows.append(r)
        print(f"{name} M={m:6d}: cuBLAS+SwiGLU {r['base_ms']:.4f} ms; tiled {r['tiled_ms']:.4f} ({r['tiled_speedup']:.2f}x); "
              f"persistent {r['persistent_ms']:.4f} ({r['persistent_speedup']:.2f}x); err {r['persistent_maxerr']:.3g}",
              flush=True)
json.dump(rows, open(os.environ.get("OUT", ".") + "/sweep.json", "w"), indent=1)
