"""Session 38: the engine's paged prefill attention (8 fresh prompts of 2,000 tokens) against torch SDPA's
backends on the same q/k/v, dense [B, H, T, D] causal: is a library kernel a lever for (c)?"""
import json, os, sys
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from nanoforge.kernels.bench import time_ms
from nanoforge.kernels.paged_attention import make_paged_batch, paged_attention

out = {}
for hq, hkv, d in ((32, 8, 64), (16, 8, 128)):
    B, T = 8, 2000
    batch = make_paged_batch([T] * B, [T] * B, hq, hkv, d, 16, torch.bfloat16, "cuda")
    flops = 4 * B * (T * (T + 1) // 2) * hq * d
    ours = time_ms(lambda: paged_attention(**batch, max_q_len=T))
    row = {"ours_ms": ours, "ours_tflops": flops / ours / 1e9}
    q = torch.randn(B, hq, T, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, hkv, T, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ke, ve = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                     ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        for gqa in (True, False):
            try:
                with sdpa_kernel(be):
                    f = (lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)) if gqa \
                        else (lambda: torch.nn.functional.scaled_dot_product_attention(q, ke, ve, is_causal=True))
                    f()
                    ms = time_ms(f)
                row[f"{name}{'_gqa' if gqa else ''}_ms"] = ms
                row[f"{name}{'_gqa' if gqa else ''}_tflops"] = flops / ms / 1e9
            except Exception as e:
                row[f"{name}{'_gqa' if gqa else ''}"] = repr(e)[:160]
    # the engine's packed layout, varlen: q (total, Hq, D), k / v (total, Hkv, D), cumulative lengths
    qp = q.transpose(1, 2).reshape(B * T, hq, d)
    kp, vp = (t.transpose(1, 2).reshape(B * T, hkv, d) for t in (k, v))
    cu = torch.arange(0, B * T + 1, T, device="cuda", dtype=torch.int32)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), ke.float(), ve.float(), is_causal=True)
    ref = ref.transpose(1, 2).reshape(B * T, hq, d)
    calls = {"flash_varlen": lambda: torch.ops.aten._flash_attention_forward(qp, kp, vp, cu, cu, T, T, 0.0, True, False)[0],
             "cudnn_varlen": lambda: torch.ops.aten._cudnn_attention_forward(qp, kp, vp, None, cu, cu, T, T, False, 0.0, True, False)[0],
             "cudnn_varlen_exp": lambda: torch.ops.aten._cudnn_attention_forward(qp, kp.repeat_interleave(hq // hkv, 1), vp.repeat_interleave(hq // hkv, 1), None, cu, cu, T, T, False, 0.0, True, False)[0]}
    for name, f in calls.items():
        try:
            o = f()
            row[f"{name}_maxerr"] = (o.float() - ref).abs().max().item()
            ms = time_ms(f)
            row[f"{name}_ms"] = ms
            row[f"{name}_tflops"] = flops / ms / 1e9
        except Exception as e:
            row[name] = repr(e)[:200]
    out[f"Hq{hq} Hkv{hkv} D{d}"] = row
    print(f"Hq{hq} Hkv{hkv} D{d}", json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}))
print(torch.__version__, torch.backends.cudnn.version())
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "sdpa_probe.json"), "w"), indent=1)
