"""Session 34: gate-and-up + SwiGLU of a 16K-token prefill step (CUDA-graph replays): cuBLAS + the SwiGLU kernel,
our GEMM with SwiGLU in its epilogue, tiled and persistent. Run in the tree and in a copy with 539c56e^'s kernels."""
import json, os, sys
import torch
from nanoforge.kernels import matmul as mm
from nanoforge.kernels.bench import time_ms
from nanoforge.kernels.swiglu import silu_mul

TOKENS = 16384
rows = []
for name, d, f in (("llama3-1b", 2048, 8192), ("qwen3-0.6b", 1024, 3072)):
    x = torch.randn(TOKENS, d, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(2 * f, d, device="cuda") / d**0.5).bfloat16()
    want = silu_mul(x @ w.t()).float()
    r = {"shape": name, "tree": sys.argv[1]}
    r["cublas_silu_ms"] = time_ms(lambda: silu_mul(x @ w.t()), graph=True)
    for s in ("tiled", "persistent"):
        got = mm.matmul(x, w.t(), activation="swiglu", schedule=s).float()
        r[f"swiglu_{s}_maxerr"] = (got - want).abs().max().item()
        r[f"swiglu_{s}_ms"] = time_ms(lambda: mm.matmul(x, w.t(), activation="swiglu", schedule=s), graph=True)
    rows.append(r)
    print(f"{sys.argv[1]} {name}: cuBLAS+SwiGLU {r['cublas_silu_ms']:.3f} ms; tiled {r['swiglu_tiled_ms']:.3f} "
          f"persistent {r['swiglu_persistent_ms']:.3f} (maxerr {r['swiglu_persistent_maxerr']:.3g})", flush=True)
json.dump(rows, open(os.environ["OUT"] + f"/gemm_{sys.argv[1]}.json", "w"), indent=1)
