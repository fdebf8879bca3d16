"""Probe: (c)'s prefill attention (8 fresh prompts x 2,000 tokens) through our paged kernel, cuDNN dense, cuDNN
ragged (aten._cudnn_attention_forward with cumulative lengths, the layout the engine has: (tokens, heads, D)),
FlashAttention-2 varlen; equality against ours; and whether the ragged cuDNN call replays in a CUDA graph with
other lengths than it was captured with."""
import json, math, os, sys, time
import torch
from nanoforge.kernels.bench import time_ms
from nanoforge.kernels.paged_attention import make_paged_batch, paged_attention

out = {}
print(torch.__version__, torch.backends.cudnn.version(), torch.cuda.get_device_name())
for hq, d in ((32, 64), (16, 128)):
    b, t, hkv = 8, 2000, 8
    batch = make_paged_batch([t] * b, [t] * b, hq, hkv, d, 16, torch.bfloat16, "cuda")
    flops = 4 * b * (t * (t + 1) // 2) * hq * d
    row = {}
    row["ours_ms"] = time_ms(lambda: paged_attention(**batch, max_q_len=t))
    ref = paged_attention(**batch, max_q_len=t)
    # the same keys and values as contiguous (tokens, hkv, d): gather the pages
    tab = batch["block_tables"].long()
    k = batch["k_cache"][tab].reshape(b, -1, hkv, d)[:, :t].reshape(b * t, hkv, d).contiguous()
    v = batch["v_cache"][tab].reshape(b, -1, hkv, d)[:, :t].reshape(b * t, hkv, d).contiguous()
    q = batch["q"]
    cu = batch["cu_seqlens_q"]
    scale = 1 / math.sqrt(d)
    def ragged(q=q, k=k, v=v, cu=cu, mq=t):
        return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, mq, mq, False, 0.0, True, False,
                                                       scale=scale)[0]
    for name, fn in (("cudnn_ragged", ragged),
                     ("fa2_varlen", lambda: torch.ops.aten._flash_attention_forward(
                         q, k, v, cu, cu, t, t, 0.0, True, False, scale=scale)[0])):
        try:
            o = fn()
            row[name + "_maxdiff"] = (o.float() - ref.float()).abs().max().item()
            row[name + "_ms"] = time_ms(fn)
        except Exception as e:
            row[name + "_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qd = q.view(b, t, hq, d).transpose(1, 2)
    kd, vd = k.view(b, t, hkv, d).transpose(1, 2), v.view(b, t, hkv, d).transpose(1, 2)
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            fn = lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)
            row["cudnn_dense_maxdiff"] = (fn().transpose(1, 2).reshape(b * t, hq, d).float() - ref.float()).abs().max().item()
            row["cudnn_dense_ms"] = time_ms(fn)
    except Exception as e:
        row["cudnn_dense_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    for key in list(row):
        if key.endswith("_ms"):
            row[key.replace("_ms", "_tflops")] = flops / row[key] / 1e9
    # ragged in a graph: captured at lengths [2000]*8 with max 4096, replayed at other lengths
    if "cudnn_ragged_ms" in row:
        try:
            qb, kb, vb = q.clone(), k.clone(), v.clone()
            cub = cu.clone()
            torch.cuda.synchronize()
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                ragged(qb, kb, vb, cub, 4096)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                og = ragged(qb, kb, vb, cub, 4096)
            lens = [3000, 1000, 2500, 1500, 2000, 2000, 1800, 2200]
            cub.copy_(torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32))
            g.replay(); torch.cuda.synchronize()
            eager = ragged(qb, kb, vb, cub, max(lens))
            row["graph_replay_other_lengths_maxdiff"] = (og.float() - eager.float()).abs().max().item()
            # and against SDPA per sequence in float32
            worst = 0.0
            starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
            for i, n in enumerate(lens):
                a, z = starts[i], starts[i + 1]
                qq = qb[a:z].float().transpose(0, 1)
                kk = kb[a:z].float().transpose(0, 1).repeat_interleave(hq // hkv, 0)
                vv = vb[a:z].float().transpose(0, 1).repeat_interleave(hq // hkv, 0)
                r = torch.nn.functional.scaled_dot_product_attention(qq[None], kk[None], vv[None], is_causal=True)[0]
                worst = max(worst, (og[a:z].float() - r.transpose(0, 1)).abs().max().item())
            row["graph_replay_vs_fp32_sdpa_maxdiff"] = worst
            row["graph_ms_max4096"] = time_ms(lambda: g.replay())
        except Exception as e:
            row["graph_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    out[f"Hq{hq}_D{d}"] = row
    print(f"Hq{hq} D{d}", json.dumps(row, indent=1))
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "attn_probe.json"), "w"), indent=1)
