"""Session 33: gate-and-up + SwiGLU of a 16K-token prefill step, each way timed from a CUDA graph (the bench's
time_ms): cuBLAS alone, cuBLAS + the SwiGLU kernel, our GEMM with SwiGLU in its epilogue on the tiled and the
persistent schedule; and our plain GEMM on both schedules. Writes $OUT/gemm.json."""
import json, os, sys
import torch
from nanoforge.kernels import matmul as mm
from nanoforge.kernels.bench import time_ms
from nanoforge.kernels.swiglu import silu_mul

TOKENS = 16384
rows = []
print(torch.cuda.get_device_name())
for name, d, f in (("llama3-1b", 2048, 8192), ("qwen3-0.6b", 1024, 3072)):
    x = torch.randn(TOKENS, d, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(2 * f, d, device="cuda") / d**0.5).bfloat16()
    want = silu_mul(x @ w.t()).float()
    r = {"shape": name, "M": TOKENS, "N": 2 * f, "K": d}
    r["cublas_ms"] = time_ms(lambda: x @ w.t(), graph=True)
    r["cublas_silu_ms"] = time_ms(lambda: silu_mul(x @ w.t()), graph=True)
    for s in ("tiled", "persistent"):
        got = mm.matmul(x, w.t(), activation="swiglu", schedule=s).float()
        r[f"swiglu_{s}_maxerr"] = (got - want).abs().max().item()
        r[f"swiglu_{s}_ms"] = time_ms(lambda: mm.matmul(x, w.t(), activation="swiglu", schedule=s), graph=True)
        r[f"plain_{s}_ms"] = time_ms(lambda: mm.matmul(x, w.t(), schedule=s), graph=True)
        plan = [p for k, p in mm._PLANS.items() if k[2:5] == (TOKENS, 2 * f, d) and k[10] == "swiglu" and k[11] == s]
        r[f"swiglu_{s}_config"] = {k: v for k, v in plan[0].consts.items() if k.isupper() or k.startswith("num_")} \
            if plan else None
    fl = 2.0 * TOKENS * 2 * f * d
    for k in [k for k in r if k.endswith("_ms")]:
        r[k.replace("_ms", "_tflops")] = fl / r[k] / 1e9
    rows.append(r)
    print(json.dumps(r, default=str), flush=True)
    print(f"{name}: cuBLAS {r['cublas_ms']:.3f} ms; +SwiGLU {r['cublas_silu_ms']:.3f}; ours swiglu tiled "
          f"{r['swiglu_tiled_ms']:.3f} persistent {r['swiglu_persistent_ms']:.3f}; plain tiled {r['plain_tiled_ms']:.3f} "
          f"persistent {r['plain_persistent_ms']:.3f}", flush=True)
json.dump(rows, open(os.environ.get("OUT", ".") + "/gemm.json", "w"), indent=1, default=str)
