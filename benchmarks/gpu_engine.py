"""The engine at the hardware limit (issue 14): every measurement against its reference, in one process.

    python benchmarks/gpu_engine.py [--out DIR] [--only a,b,...]    # H200, < 9.5 minutes; JSON + PNG under $OUT
    python benchmarks/gpu_engine.py --smoke                         # CPU, tiny presets, fp32: the dry run

Random bf16 weights of each preset's shape; every reference is built in this script from the same weights.

(a) throughput: nano-vllm's workload (256 requests, prompts and outputs of 100-1,024 tokens, ignore_eos,
    temperature 0.6) on Qwen3-0.6B's shape through `nanoforge bench throughput`'s engine loop; output tok/s
    (target >= 20,000).
(b) decode: batch-1 greedy decode of Llama-3.2-1B's and Qwen3-0.6B's shapes: the engine against a
    gpt-fast-style reference (static KV-cache tensors, the decode step written in plain PyTorch and compiled
    with torch.compile(mode="reduce-overhead"), i.e. one CUDA graph); tok/s, ratio (target >= 1.3x) and the
    achieved HBM bandwidth (weights + the KV read per token, over the time per token; target >= 55%).
    `--decode-variants` runs the engine again with levers off or forced (DECODE_VARIANTS: cuBLAS for every
    projection, no programmatic dependent launch, ...), each on the same model and prompt.
(c) prefill: 64 prompts of 2,000 tokens on Llama-3.2-1B's and Qwen3-0.6B's shapes (one output token each): the engine against
    Hugging Face transformers' forward with SDPA (batches of 8, logits of the last position only: the same
    work); tok/s and MFU (forward FLOPs: 2 per weight per token, causal attention pairs; 989 TFLOP/s dense bf16
    on an H200). Targets: >= 1.5x HF on both shapes, MFU >= 55% on Llama-3.2-1B's.
    `--prefill-variants` runs (a) and (c) again with prefill levers: another tile of prefill attention
    (NANOFORGE_ATTN_PREFILL_TILE, e.g. 64x64w4s3); gate-and-up's GEMM and SwiGLU as cuBLAS + the SwiGLU
    kernel (`swiglu_off`) or one GEMM with SwiGLU in its epilogue on the tiled schedule (`swiglu_tiled`) or the
    persistent one (`swiglu_persistent`: the default from 1,024 rows on Hopper); or several at once
    (`64x64w4s3+swiglu_off`).
(d) prefix: a trace of 8 system prompts (1,536 tokens) each followed by 8 unique questions (512 tokens), sent in
    8 waves of one request per system prompt, with and without the prefix cache: the share of prompt tokens
    that hit the cache against the share of prefill time saved (target: saved >= 80% of the hit share).
(e) profile: the engine's per-step-kind breakdown (`bench throughput --profile`) on half of (a)'s workload:
    host and device ms per step, achieved HBM / FLOP fractions.

The GPU is kept busy for 5 s before the first section (its clocks ramp up from idle). Each section has a time
budget: loops stop at their deadline (the JSON says so) and a section that no longer
fits the run's total is skipped; a section that fails is reported and the rest still run.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch._inductor.config  # noqa: E402  (the reference patches it, as gpt-fast sets it)
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from nanoforge.errors import NanoforgeError  # noqa: E402
from nanoforge.kernels import gemv  # noqa: E402
from nanoforge.kernels.paged_attention import PREFILL_TILE_BY_HEAD_DIM, PREFILL_TILE_DEFAULT, _parse_tile  # noqa: E402
from nanoforge.serve import layer_kernel  # noqa: E402
from nanoforge.kernels.rope import apply_rope_ref  # noqa: E402  (the reference in plain PyTorch)
from nanoforge.model.config import preset  # noqa: E402
from nanoforge.model.transformer import Transformer  # noqa: E402
from nanoforge.runtime import peak_flops, peak_hbm_bandwidth  # noqa: E402
from nanoforge.serve.bench_throughput import make_workload, run_engine  # noqa: E402
from nanoforge.serve.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from nanoforge.serve.model_runner import GRAPH_PREFILL_DEFAULT, kv_bytes_per_block  # noqa: E402
from nanoforge.serve.sampling_params import SamplingParams  # noqa: E402
from nanoforge.serve.step_profile import StepProfiler, print_profile  # noqa: E402

H200_FLOPS, H200_HBM = 989e12, 4.8e12  # dense bf16, bytes/s: the fractions when the device is not recognised

GPU = {"throughput": dict(preset="qwen3-0.6b", requests=256, lo=100, hi=1024, budget=150),
       "decode": dict(presets=("llama3-1b", "qwen3-0.6b"), prompt=128, tokens=512, compile=True, budget=170),
       "prefill": dict(presets=("llama3-1b", "qwen3-0.6b"), prompts=64, length=2000, hf_batch=8, budget=130),
       "prefix": dict(preset="llama3-1b", groups=8, waves=8, prefix=1536, suffix=512, budget=60),
       "profile": dict(preset="qwen3-0.6b", requests=128, lo=100, hi=1024, budget=60),
       "total": 540}
SMOKE = {"throughput": dict(preset="tiny-qwen3", requests=6, lo=8, hi=40, budget=60),
         "decode": dict(presets=("tiny-llama", "tiny-qwen3"), prompt=8, tokens=24, compile=False, budget=60),
         "prefill": dict(presets=("tiny-llama", "tiny-qwen3"), prompts=4, length=100, hf_batch=2, budget=60),
         "prefix": dict(preset="tiny-llama", groups=2, waves=3, prefix=64, suffix=32, budget=60),
         "profile": dict(preset="tiny-qwen3", requests=6, lo=8, hi=40, budget=60),
         "total": 300}
OTHER = not GRAPH_PREFILL_DEFAULT  # the prefill-step mode each section also measures, beside the default
OTHER_NAME = "graphed" if OTHER else "eager"
# Prefill levers (--prefill-variants): a variant is '+'-joined parts, each a name here or a prefill attention tile
# (NANOFORGE_ATTN_PREFILL_TILE, kernels/paged_attention.py)
PREFILL_LEVERS = {"swiglu_off": {"NANOFORGE_SWIGLU_EPILOGUE": "0"},  # gate-and-up by cuBLAS, then the SwiGLU kernel
                  "swiglu_tiled": {"NANOFORGE_SWIGLU_EPILOGUE": "tiled"},  # ... in one GEMM, a program a tile
                  "swiglu_persistent": {"NANOFORGE_SWIGLU_EPILOGUE": "persistent"}}  # ... programs loop over tiles


def prefill_env(variant: str) -> dict[str, str]:
    """The environment of a --prefill-variants entry; one line naming the problem if a part is neither."""
    env = {}
    for part in variant.split("+"):
        if part in PREFILL_LEVERS:
            env |= PREFILL_LEVERS[part]
        else:
            try:
                _parse_tile(part)
            except NanoforgeError as e:
                raise NanoforgeError(f"{part!r} (in {variant!r}) is neither a lever ({', '.join(PREFILL_LEVERS)}) "
                                     f"nor a tile: {e}", param="prefill-variants") from None
            env["NANOFORGE_ATTN_PREFILL_TILE"] = part
    return env


# timed past the deadline if need be (compiling the reference may take most of it): 256 steps, ~0.3 s a run, where
# session 49's runs had 64 (~70 ms) and one stall of a few ms moved a rate by several percent
MIN_DECODE_TOKENS = 256
SECTIONS = ("throughput", "decode", "prefill", "prefix", "profile")


def run_on(smoke: bool):
    """(device, dtype) of a run: the GPU in bf16, or the CPU in fp32 for --smoke; None (said why) without a GPU."""
    if not smoke and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --smoke for the CPU dry run)", file=sys.stderr)
        return None
    return (torch.device("cpu"), torch.float32) if smoke else (torch.device("cuda"), torch.bfloat16)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def warm_up(device, seconds: float = 5.0) -> float:
    """Keep the GPU busy for a few seconds before the first measurement: its clocks ramp up from idle, and a
    first measurement on a machine that had just started read 15% low (session 11: Llama-3.2-1B batch-1 decode
    783 tok/s cold, 920 warm). Returns the seconds spent (0 on the CPU)."""
    if device.type != "cuda":
        return 0.0
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def build_model(name: str, device, dtype, max_seq_len: int) -> Transformer:
    torch.manual_seed(0)
    with torch.device(device):
        return Transformer(preset(name, max_seq_len=max_seq_len)).to(dtype).eval()


def peaks(device) -> tuple[float, float]:
    return peak_flops(device) or H200_FLOPS, peak_hbm_bandwidth(device) or H200_HBM


def make_engine(model, *, max_num_seqs: int, max_len: int, tokens: int = 16384, seqs_blocks: int | None = None,
                prefix_caching: bool = True, graph_prefill: bool | None = None,
                async_scheduling: bool | None = None) -> LLMEngine:
    """An engine whose KV cache holds `seqs_blocks` sequences of max_len (default: max_num_seqs of them)."""
    blocks = (seqs_blocks or max_num_seqs) * math.ceil(max_len / 16) + 16
    return LLMEngine(model, None, EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=tokens,
                                               max_model_len=max_len, num_gpu_blocks=blocks,
                                               enable_prefix_caching=prefix_caching, graph_prefill=graph_prefill,
                                               async_scheduling=async_scheduling))


def drain(engine: LLMEngine, deadline: float = math.inf) -> dict[str, object]:
    """Step until every request finished (or the deadline passed); the finished outputs by request id."""
    done = {}
    while engine.has_unfinished() and time.perf_counter() < deadline:
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return done


# --- (a) and (e): nano-vllm's workload ------------------------------------------------------------------

def section_throughput(c: dict, device, dtype, deadline: float, profile: bool = False) -> dict:
    model = build_model(c["preset"], device, dtype, 2 * c["hi"] + 8)
    prompts, outputs = make_workload(c["requests"], c["hi"], c["hi"], min(10000, model.cfg.vocab_size),
                                     min_input=c["lo"], min_output=c["lo"])
    if not profile:  # the same work scheduled step by step first: what the one-step lag buys
        sync_r, _ = run_engine(model, prompts, outputs, max_num_seqs=256, temperature=0.6, async_scheduling=False)
    # the engine's defaults (on a GPU: a step ahead)
    r, _ = run_engine(model, prompts, outputs, max_num_seqs=256, temperature=0.6, profile=profile)
    keys = ("output_tok_s", "seconds", "steps", "preemptions", "kv_blocks_total")
    if not profile:
        for variant in c.get("prefill_variants", ()):  # the default again with prefill levers
            t = with_env(prefill_env(variant), lambda: run_engine(model, prompts, outputs, max_num_seqs=256,
                                                                  temperature=0.6)[0])
            r.setdefault("prefill_variants", {})[variant] = {**{k: t[k] for k in keys},
                                                             "vs_default": t["output_tok_s"] / r["output_tok_s"]}
        r["sync_scheduling"] = {k: sync_r[k] for k in keys}
        r["vs_sync_scheduling"] = r["output_tok_s"] / sync_r["output_tok_s"]
        # and with the other kind of prefill steps (graphed or eager)
        other, _ = run_engine(model, prompts, outputs, max_num_seqs=256, temperature=0.6, graph_prefill=OTHER)
        r[f"{OTHER_NAME}_prefill"] = {k: other[k] for k in keys}
        r["other_prefill_vs_default"] = other["output_tok_s"] / r["output_tok_s"]
    r["workload"] = {"preset": c["preset"], "requests": c["requests"], "lengths": [c["lo"], c["hi"]],
                     "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(outputs)}
    del model
    if profile:
        print_profile(r["profile"])
    else:
        print(f"\n(a) throughput, {c['preset']} shape, {c['requests']} requests: {r['output_tok_s']:,.0f} output tok/s "
              f"({r['seconds']:.1f} s, {sum(k['steps'] for k in r['steps'].values())} steps, {r['preemptions']} preemptions; target >= 20,000); "
              f"{r['sync_scheduling']['output_tok_s']:,.0f} scheduled step by step ({r['vs_sync_scheduling']:.2f}x); "
              f"{r[OTHER_NAME + '_prefill']['output_tok_s']:,.0f} with {OTHER_NAME} prefill steps "
              f"({r['other_prefill_vs_default']:.2f}x)"
              + "".join(f"; prefill {v} {d['output_tok_s']:,.0f} ({d['vs_default']:.2f}x)"
                        for v, d in r.get("prefill_variants", {}).items()))
    return r


# --- (b) batch-1 decode ------------------------------------------------------------------------------------

# gpt-fast's generate.py sets these for every compile; without them (sessions 6-17) the reference left
# Inductor's coordinate-descent tuning of its generated kernels off.
GPTFAST_INDUCTOR = {"coordinate_descent_tuning": True, "triton.unique_kernel_names": True, "fx_graph_cache": True}


def gptfast_decoder(model: Transformer, max_len: int, compile_step: bool):
    """gpt-fast's recipe on our weights: static per-layer K/V tensors (1, Hkv, max_len, D), a decode step in
    plain PyTorch (F.rms_norm, F.linear, SDPA over the whole static cache with a mask, K/V repeated to the
    query heads) compiled with mode="reduce-overhead" (CUDA graphs) under gpt-fast's Inductor settings
    (GPTFAST_INDUCTOR), and run, as gpt-fast's decode loop runs it, with SDPA's math backend (so that Inductor
    generates the attention itself). Returns step(token (1, 1), pos (1,))."""
    cfg = model.cfg
    dev, dtype = model.embed.weight.device, model.embed.weight.dtype
    hkv, d = cfg.n_kv_heads, cfg.head_dim
    kc = [torch.zeros(1, hkv, max_len, d, device=dev, dtype=dtype) for _ in range(cfg.n_layers)]
    vc = [torch.zeros_like(k) for k in kc]
    eps, rep = cfg.norm_eps, cfg.n_heads // hkv
    span = torch.arange(max_len, device=dev)

    def step(tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = F.embedding(tok, model.embed.weight)
        cos, sin = model.rope(pos[None], dtype)
        mask = (span <= pos)[None, None, None, :]
        for i, layer in enumerate(model.layers):
            a = layer.attn
            h = F.rms_norm(x, (cfg.d_model,), layer.attn_norm.weight, eps)
            q, k, v = F.linear(h, a.wqkv.weight, a.wqkv.bias).split(a.split, dim=-1)
            q, k, v = q.view(1, 1, -1, d), k.view(1, 1, hkv, d), v.view(1, 1, hkv, d)
            if a.q_norm is not None:
                q = F.rms_norm(q, (d,), a.q_norm.weight, eps)
                k = F.rms_norm(k, (d,), a.k_norm.weight, eps)
            q, k = apply_rope_ref(q, cos, sin), apply_rope_ref(k, cos, sin)
            kc[i].index_copy_(2, pos, k.transpose(1, 2))
            vc[i].index_copy_(2, pos, v.transpose(1, 2))
            keys, values = kc[i].repeat_interleave(rep, dim=1), vc[i].repeat_interleave(rep, dim=1)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask)
            x = x + F.linear(o.transpose(1, 2).reshape(1, 1, -1), a.wo.weight, a.wo.bias)
            h = F.rms_norm(x, (cfg.d_model,), layer.mlp_norm.weight, eps)
            gate, up = F.linear(h, layer.mlp.w_in.weight, layer.mlp.w_in.bias).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.mlp.w_out.weight, layer.mlp.w_out.bias)
        x = F.rms_norm(x, (cfg.d_model,), model.norm.weight, eps)
        return F.linear(x[:, -1], model.lm_head.weight).argmax(dim=-1, keepdim=True)

    if compile_step:
        for t in kc + vc:  # as gpt-fast's cache buffers: static addresses the captured graph writes in place
            torch._dynamo.mark_static_address(t)
        step = torch.compile(step, mode="reduce-overhead", fullgraph=True)

    def run(tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        with torch._inductor.config.patch(GPTFAST_INDUCTOR), sdpa_kernel(SDPBackend.MATH):
            return step(tok, pos)

    return run


@torch.no_grad()
def decode_reference(model, prompt: list[int], tokens: int, compile_step: bool, deadline: float) -> dict:
    dev = model.embed.weight.device
    step = gptfast_decoder(model, len(prompt) + tokens + 8, compile_step)
    pos = torch.zeros(1, dtype=torch.long, device=dev)
    for _ in range(2):  # compile and capture (twice: reduce-overhead records on a later call), then the prompt
        pos.zero_()
        for t in prompt:
            nxt = step(torch.tensor([[t]], device=dev), pos).clone()
            pos.add_(1)
    out = [int(nxt)]
    sync(dev)
    t0 = time.perf_counter()
    marks = [step_mark(dev)]  # after each step: the loop never syncs, so on a GPU these are events on its stream
    while len(out) < tokens and (time.perf_counter() < deadline or len(out) < MIN_DECODE_TOKENS):
        nxt = step(nxt, pos).clone()
        pos.add_(1)
        out.append(nxt)  # a tensor: reading it would sync every step
        marks.append(step_mark(dev))
    sync(dev)
    dt = time.perf_counter() - t0
    out = [out[0]] + [int(t) for t in out[1:]]
    from torch._dynamo.utils import counters  # a reference that fell back from CUDA graphs would flatter us

    return {"tokens": out, "decode_tokens": len(out) - 1, "seconds": dt, "tok_s": (len(out) - 1) / dt,
            "median_step_tok_s": 1 / statistics.median(step_seconds(marks)),
            "truncated": len(out) < tokens, "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"])}


def step_mark(dev: torch.device):
    """A point between two steps of a loop that does not sync: a CUDA event recorded on the stream (the GPU's
    clock), or the host's clock elsewhere (the CPU runs each step before the call returns)."""
    if dev.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def step_seconds(marks: list) -> list[float]:
    """Each step's seconds from `step_mark`s taken around the steps (after the loop's sync)."""
    if marks and isinstance(marks[0], float):
        return [b - a for a, b in zip(marks, marks[1:])]
    return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]


def decode_engine(model, prompt: list[int], tokens: int, deadline: float) -> dict:
    dev = model.embed.weight.device
    engine = make_engine(model, max_num_seqs=1, max_len=len(prompt) + tokens + 8, tokens=max(256, len(prompt)))
    greedy = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    try:
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))  # warm up
        drain(engine)
        rid = engine.add_request(prompt, greedy)
        while not engine.step():  # the prefill and the first token (async scheduling reads it a step later)
            pass
        sync(dev)
        times = [time.perf_counter()]  # after each step: a step is one token at batch 1
        outs = engine.step()
        times.append(time.perf_counter())
        while engine.has_unfinished() and (time.perf_counter() < deadline or len(times) <= MIN_DECODE_TOKENS):
            outs = engine.step()
            times.append(time.perf_counter())
        sync(dev)
        dt = time.perf_counter() - times[0]
        got = next(o for o in outs if o.request_id == rid).outputs[0].token_ids
        # the median step's rate beside the mean: one stall of the host loop (session 48: Qwen3's 1,060 tok/s
        # where the runs around it made ~1,225) pulls the mean down and leaves the median where it was
        median = statistics.median(step_seconds(times))
        return {"tokens": got, "decode_tokens": len(got) - 1, "seconds": dt, "tok_s": (len(got) - 1) / dt,
                "steps_timed": len(times) - 1, "median_step_tok_s": 1 / median,
                "truncated": len(got) < tokens, "decode_layers": getattr(engine.runner, "decode_layers", None)}
    finally:
        engine.close()


def with_env(env: dict[str, str], fn):
    """fn() with these environment variables set, restored after."""
    with mock.patch.dict(os.environ, env):
        return fn()


def _same(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy runs share."""
    n = min(len(a), len(b))
    return next((j for j in range(n) if a[j] != b[j]), n)


# What each lever gains: the engine again with one of them off (or forced), on the same model and prompt.
DECODE_VARIANTS = {
    "again": {},  # the same engine run once more: the run-to-run spread
    "torch_gathers": {"NANOFORGE_STEP_GATHERS": "torch"},  # a step's input gathers as 11 PyTorch kernels, not one
    "cublas_only": {"NANOFORGE_GEMV": "0"},  # cuBLAS for every projection, the norms and SwiGLU apart
    "no_pdl": {"NANOFORGE_PDL": "0"},  # no programmatic dependent launch between the kernels
    "no_prefetch": {"NANOFORGE_GEMV_PREFETCH_MB": "0"},  # the skinny matmul does not ask L2 for W before its wait
    "wide_configs": {"NANOFORGE_GEMV_CONFIGS": "wide"},  # its autotuner over session 10's eight candidates
    "fused_combine": {"NANOFORGE_ATTN_COMBINE": "fused"},  # attention's last split combines: no second kernel
    "fused_rope": {"NANOFORGE_ATTN_ROPE": "fused"},  # RoPE (+ q/k norms) and the KV write inside decode attention
    "fused_attention": {"NANOFORGE_ATTN_COMBINE": "fused", "NANOFORGE_ATTN_ROPE": "fused"},  # both: 2 launches fewer
    "gemv_everywhere": {"NANOFORGE_GEMV": "1"},  # the skinny matmul for every projection, fused
    "gemv_everywhere_no_pdl": {"NANOFORGE_GEMV": "1", "NANOFORGE_PDL": "0"},
    "cublas_only_no_pdl": {"NANOFORGE_GEMV": "0", "NANOFORGE_PDL": "0"},
    "persistent": {"NANOFORGE_DECODE_LAYERS": "persistent"},  # every layer in one kernel (serve/layer_kernel.py)
    "layer_by_layer": {"NANOFORGE_DECODE_LAYERS": "kernels"},  # the layers one by one, kernel after kernel
    "auto": {"NANOFORGE_DECODE_LAYERS": "auto"},  # the faster of the two for the batch-1 graph, timed at the start
    # its L2 prefetch of the next phase's weights before each barrier, none or 6 tiles a program (default 2)
    "persistent_pf0": {"NANOFORGE_DECODE_LAYERS": "persistent", "NANOFORGE_DECODE_PREFETCH_TILES": "0"},
    "persistent_pf6": {"NANOFORGE_DECODE_LAYERS": "persistent", "NANOFORGE_DECODE_PREFETCH_TILES": "6"},
    # launched as a plain kernel, not a cooperative one
    "persistent_plain": {"NANOFORGE_DECODE_LAYERS": "persistent", "NANOFORGE_DECODE_COOPERATIVE": "0"},
    # no barriers: each phase's vector stored as tagged words and polled (NANOFORGE_DECODE_SYNC=tagged, session 39)
    "persistent_tagged": {"NANOFORGE_DECODE_LAYERS": "persistent", "NANOFORGE_DECODE_SYNC": "tagged"},
    "auto_tagged": {"NANOFORGE_DECODE_LAYERS": "auto", "NANOFORGE_DECODE_SYNC": "tagged"},
    # parts to join with '+' onto the above (e.g. auto+prefetch_kv2+ring3): the persistent kernel's switches (tagged
    # vectors and the 256 ns back-off are its defaults since session 40)
    "tagged": {"NANOFORGE_DECODE_SYNC": "tagged"},
    "barrier": {"NANOFORGE_DECODE_SYNC": "barrier"},
    "poll_sleep0": {"NANOFORGE_DECODE_POLL_SLEEP_NS": "0"},
    "poll_cap2048": {"NANOFORGE_DECODE_POLL_SLEEP_CAP_NS": "2048"},  # the back-off's cap (default 512 ns since s43)
    "poll_cap1024": {"NANOFORGE_DECODE_POLL_SLEEP_CAP_NS": "1024"},
    "poll_cap256": {"NANOFORGE_DECODE_POLL_SLEEP_CAP_NS": "256"},  # (s46, an H100: Qwen3's layers 1.01x)
    "prefetch_kv2": {"NANOFORGE_DECODE_PREFETCH_KV": "2"},
    "pf0": {"NANOFORGE_DECODE_PREFETCH_TILES": "0"},  # no L2 prefetch of the next phase's tiles nor inside one
    # the ring takes every tile, its first stages copied before each poll (the default since session 46), or not
    "ring_ahead": {"NANOFORGE_DECODE_RING_AHEAD": "1"},
    "ring_behind": {"NANOFORGE_DECODE_RING_AHEAD": "0"},
    "ring3": {"NANOFORGE_DECODE_RING": "3"},
    "ring4": {"NANOFORGE_DECODE_RING": "4"},
    "ring_gate_up": {"NANOFORGE_DECODE_RING_ON": "gate_up"},  # (with ringN: the ring on gate-and-up alone,
    "ring_no_down": {"NANOFORGE_DECODE_RING_ON": "qkv,o,gate_up"},  # or on all but MLP-down)
}


def decode_env(variant: str) -> dict[str, str]:
    """A (b) variant's environment: its '+'-joined parts' (DECODE_VARIANTS), later parts over earlier ones."""
    env = {}
    for part in variant.split("+"):
        if part not in DECODE_VARIANTS:
            raise NanoforgeError(f"{part!r} unknown; variants (joined with '+') are {', '.join(DECODE_VARIANTS)}")
        env.update(DECODE_VARIANTS[part])
    return env


def stalls(r: dict, below: float = 0.95) -> list[tuple[str, float, float]]:
    """(b)'s runs, the engine's and the reference's, whose mean rate fell below `below` x their median step's:
    (name, mean, median)."""
    runs = [("ours", r["ours_tok_s"], r["ours_median_step_tok_s"])]
    runs += [(v, d["tok_s"], d["median_step_tok_s"]) for v, d in r["variants"].items()]
    runs += [("the reference", r["reference_tok_s"], r["reference_median_step_tok_s"])]
    return [run for run in runs if run[1] < below * run[2]]


def section_decode(c: dict, device, dtype, deadline: float) -> dict:
    _, hbm = peaks(device)
    result = {}
    variants = c.get("variants", ("cublas_only", "no_pdl"))
    for i, name in enumerate(c["presets"]):
        share = (deadline - time.perf_counter()) / (len(c["presets"]) - i)
        slice_s = share / 2 / (1 + len(variants))  # half the share for the engine runs, half for the reference
        model = build_model(name, device, dtype, c["prompt"] + c["tokens"] + 16)
        prompt = [random.Random(1).randrange(min(10000, model.cfg.vocab_size)) for _ in range(c["prompt"])]
        ours = decode_engine(model, prompt, c["tokens"], time.perf_counter() + slice_s)
        runs = {v: with_env(decode_env(v), lambda: decode_engine(model, prompt, c["tokens"],
                                                                      time.perf_counter() + slice_s))
                for v in variants}
        ref = decode_reference(model, prompt, c["tokens"], c["compile"], time.perf_counter() + share / 2)
        prof = StepProfiler(model, kv_bytes_per_block(model, 1, dtype))
        ctx = c["prompt"] + c["tokens"] / 2  # the mean context a decode step reads
        per_token = prof.weight_bytes + ctx * prof.kv_bytes_per_token
        n, same = min(len(ours["tokens"]), len(ref["tokens"])), _same(ours["tokens"], ref["tokens"])
        r = result[name] = {"ours_tok_s": ours["tok_s"], "ours_median_step_tok_s": ours["median_step_tok_s"],
                            "ours_steps_timed": ours["steps_timed"], "ours_decode_layers": ours["decode_layers"],
                            "reference_tok_s": ref["tok_s"], "reference_median_step_tok_s": ref["median_step_tok_s"],
                            "ratio": ours["tok_s"] / ref["tok_s"],
                            "median_step_ratio": ours["median_step_tok_s"] / ref["median_step_tok_s"],
                            "bytes_per_token": per_token,
                            "ours_GB_s": per_token * ours["tok_s"] / 1e9, "reference_GB_s": per_token * ref["tok_s"] / 1e9,
                            "ours_hbm_fraction": per_token * ours["tok_s"] / hbm,
                            "reference_hbm_fraction": per_token * ref["tok_s"] / hbm,
                            "greedy_tokens_identical": same, "compared": n,
                            "reference_cudagraph_skips": ref["cudagraph_skips"],
                            "reference_recipe": {"inductor": GPTFAST_INDUCTOR, "sdpa": "math",
                                                 "compiled": bool(c["compile"])},
                            "truncated": ours["truncated"] or ref["truncated"],
                            "ours_decode_tokens": ours["decode_tokens"], "reference_decode_tokens": ref["decode_tokens"],
                            "variants": {v: {"env": decode_env(v), "tok_s": run["tok_s"],
                                             "median_step_tok_s": run["median_step_tok_s"],
                                             "ratio": run["tok_s"] / ref["tok_s"],
                                             "hbm_fraction": per_token * run["tok_s"] / hbm,
                                             "greedy_tokens_identical_to_ours": _same(run["tokens"], ours["tokens"]),
                                             "decode_layers": run["decode_layers"]}
                                         for v, run in runs.items()},
                            "gemv": gemv.decisions()}  # per shape: the autotuner's picks, cuBLAS or ours
        del model
        free_memory(device)
        chose = f" (chose {layer_kernel.describe(ours['decode_layers'])})" if ours["decode_layers"] else ""
        print(f"(b) decode {name}: ours {r['ours_tok_s']:,.0f} tok/s (its median step "
              f"{r['ours_median_step_tok_s']:,.0f}){chose}, "
              f"gpt-fast-style {r['reference_tok_s']:,.0f} tok/s (its median step "
              f"{r['reference_median_step_tok_s']:,.0f}), {r['ratio']:.2f}x (medians {r['median_step_ratio']:.2f}x); "
              f"HBM {100 * r['ours_hbm_fraction']:.1f}% (ref {100 * r['reference_hbm_fraction']:.1f}%);"
              f" greedy tokens identical for the first {same}/{n}; "
              + "; ".join(f"{v} ({' '.join(f'{k}={x}' for k, x in d['env'].items())}) {d['tok_s']:,.0f} tok/s "
                          f"(median step {d['median_step_tok_s']:,.0f})"
                          + (f" (chose {layer_kernel.describe(d['decode_layers'])})" if d["decode_layers"] else "")
                          for v, d in r["variants"].items())
              + (f"; WARNING: the reference skipped CUDA graphs {ref['cudagraph_skips']}x"
                 if ref["cudagraph_skips"] else "")
              + "".join(f"; WARNING: {v}'s mean is {t:,.0f} tok/s against its median step's {m:,.0f} (a stall in "
                        f"the timed loop: rerun, or read the median)" for v, t, m in stalls(r)))
    return result


# --- (c) prefill --------------------------------------------------------------------------------------------

def prefill_flops(model, lengths: list[int]) -> float:
    """Forward FLOPs of prefilling these prompts, sampling one token each (the profiler's formula)."""
    prof = StepProfiler(model, 0)
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    return 2 * prof.body_params * sum(lengths) + 2 * prof.vocab_params * len(lengths) + prof.attn_flops_per_pair * pairs


@torch.no_grad()
def prefill_hf(model, prompts: list[list[int]], batch: int, deadline: float) -> dict:
    import transformers

    from nanoforge.model.hf import save_model

    dev, dtype = model.embed.weight.device, model.embed.weight.dtype
    with tempfile.TemporaryDirectory() as d:
        save_model(model, d)
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dtype, attn_implementation="sdpa")
    hf = hf.to(dev).eval()
    ids = torch.tensor(prompts, device=dev)
    keep = "logits_to_keep" if "logits_to_keep" in inspect.signature(hf.forward).parameters else "num_logits_to_keep"
    first = hf(input_ids=ids[:batch], **{keep: 1}).logits[:, -1].argmax(-1).tolist()  # warm up
    sync(dev)
    t0, done = time.perf_counter(), 0
    for i in range(0, len(prompts), batch):
        hf(input_ids=ids[i:i + batch], **{keep: 1})
        done += len(ids[i:i + batch])
        if time.perf_counter() > deadline:
            break
    sync(dev)
    dt = time.perf_counter() - t0
    del hf
    return {"prompts": done, "seconds": dt, "first_tokens": first}


def section_prefill(c: dict, device, dtype, deadline: float) -> dict:
    """(c) for each preset (the issue asks >= 1.5x HF on both shapes, >= 55% MFU on Llama-3.2-1B's)."""
    result = {}
    for i, name in enumerate(c["presets"]):
        share = (deadline - time.perf_counter()) / (len(c["presets"]) - i)
        result[name] = prefill_one(name, c, device, dtype, time.perf_counter() + share)
    return result


def prefill_one(name: str, c: dict, device, dtype, deadline: float) -> dict:
    flops_peak, _ = peaks(device)
    n, length = c["prompts"], c["length"]
    model = build_model(name, device, dtype, length + 16)
    rng = random.Random(2)
    vocab = min(10000, model.cfg.vocab_size)
    prompts = [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]
    warm = [[rng.randrange(vocab) for _ in range(length)] for _ in range(c["hf_batch"])]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def prefill(graphed, seconds: float) -> tuple[float, dict, list, bool]:
        """The prompts through a fresh engine (after a warm-up batch), timed for up to `seconds` from the warm-up's
        end (a cold machine's compiles and graph captures must not eat the window): seconds, outputs, request
        ids, graphed?"""
        engine = make_engine(model, max_num_seqs=n, max_len=length + 8, prefix_caching=False, graph_prefill=graphed)
        try:
            for p in warm:
                engine.add_request(p, one)
            drain(engine)
            rids = [engine.add_request(p, one) for p in prompts]
            sync(device)
            t0 = time.perf_counter()
            done = drain(engine, t0 + seconds)
            sync(device)
            if not done:
                raise RuntimeError(f"no prompt of {name}'s prefill finished in its {seconds:.0f} s")
            return time.perf_counter() - t0, done, rids, bool(engine.runner.batch.prefill_buckets)
        finally:
            engine.close()

    # the engine's default prefill steps, then the other kind, then the default with each variant; HF last
    runs = [(None, None), (OTHER, None)] + [(None, v) for v in c.get("prefill_variants", ())]
    timed = {}
    for i, (graphed, variant) in enumerate(runs):
        share = max(5.0, (deadline - time.perf_counter()) / (len(runs) - i + 1))  # a few steps at least
        timed[(graphed, variant)] = with_env(prefill_env(variant) if variant else {},
                                             lambda: prefill(graphed, share))
    ours_s, ours_done, ours_rids, ours_graphed = timed[(None, None)]
    other_s, other_done = timed[(OTHER, None)][:2]
    ours_n, other_n = len(ours_done), len(other_done)
    hf = prefill_hf(model, prompts, c["hf_batch"], deadline)
    flops = prefill_flops(model, [length])
    ours_tok_s, hf_tok_s = ours_n * length / ours_s, hf["prompts"] * length / hf["seconds"]
    ours_first = [ours_done[r].outputs[0].token_ids[0] for r in ours_rids[:c["hf_batch"]] if r in ours_done]
    r = {"prompts": n, "length": length, "ours_tok_s": ours_tok_s, "hf_sdpa_tok_s": hf_tok_s,
         "ratio": ours_tok_s / hf_tok_s, "ours_mfu": ours_n * flops / ours_s / flops_peak,
         "hf_mfu": hf["prompts"] * flops / hf["seconds"] / flops_peak, "flops_per_prompt": flops,
         "ours_prompts_timed": ours_n, "hf_prompts_timed": hf["prompts"],
         "truncated": ours_n < n or hf["prompts"] < n,
         "first_tokens_identical": sum(a == b for a, b in zip(ours_first, hf["first_tokens"])),
         "graph_prefill": ours_graphed,
         f"{OTHER_NAME}_prefill_tok_s": other_n * length / other_s,
         f"{OTHER_NAME}_prefill_mfu": other_n * flops / other_s / flops_peak,
         "prefill_variants": {t: {"tok_s": len(done) * length / sec, "mfu": len(done) * flops / sec / flops_peak,
                               "vs_default": len(done) / sec / (ours_n / ours_s), "prompts_timed": len(done),
                               "first_tokens_identical_to_default": sum(
                                   done[a].outputs[0].token_ids == ours_done[b].outputs[0].token_ids
                                   for a, b in zip(rids, ours_rids) if a in done and b in ours_done)}
                           for (_, t), (sec, done, rids, _) in timed.items() if t}}
    del model
    free_memory(device)
    print(f"\n(c) prefill {name}, {n} x {length} tokens: ours {ours_tok_s:,.0f} tok/s (MFU "
          f"{100 * r['ours_mfu']:.1f}%), HF SDPA {hf_tok_s:,.0f} tok/s (MFU {100 * r['hf_mfu']:.1f}%): {r['ratio']:.2f}x; "
          f"{OTHER_NAME} prefill steps {r[OTHER_NAME + '_prefill_tok_s']:,.0f} tok/s "
          f"(MFU {100 * r[OTHER_NAME + '_prefill_mfu']:.1f}%)"
          + "".join(f"; {v} {d['tok_s']:,.0f} tok/s ({d['vs_default']:.2f}x)" for v, d in r["prefill_variants"].items()))
    return r


# --- (d) prefix hits -----------------------------------------------------------------------------------

def section_prefix(c: dict, device, dtype, deadline: float) -> dict:
    length = c["prefix"] + c["suffix"]
    model = build_model(c["preset"], device, dtype, length + 16)
    rng = random.Random(3)
    vocab = min(10000, model.cfg.vocab_size)
    systems = [[rng.randrange(vocab) for _ in range(c["prefix"])] for _ in range(c["groups"])]
    waves = [[s + [rng.randrange(vocab) for _ in range(c["suffix"])] for s in systems] for _ in range(c["waves"])]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    runs = {}
    for graphed, cached in ((None, False), (None, True), (OTHER, False), (OTHER, True)):  # default, then other
        engine = make_engine(model, max_num_seqs=c["groups"], max_len=length + 8, prefix_caching=cached,
                             seqs_blocks=c["groups"] * (c["waves"] + 1), graph_prefill=graphed)
        try:
            engine.add_request([rng.randrange(vocab) for _ in range(length)], one)  # warm up
            drain(engine)
            sync(device)
            t0, hit, total, firsts = time.perf_counter(), 0, 0, []
            for wave in waves:
                rids = [engine.add_request(p, one) for p in wave]
                done = drain(engine)
                hit += sum(done[r].num_cached_tokens for r in rids)
                total += sum(map(len, wave))
                firsts += [done[r].outputs[0].token_ids[0] for r in rids]
            sync(device)
            runs[graphed, cached] = {"seconds": time.perf_counter() - t0, "cached_tokens": hit,
                                     "prompt_tokens": total, "first_tokens": firsts,
                                     "graph_prefill": bool(engine.runner.batch.prefill_buckets)}
        finally:
            engine.close()
        if time.perf_counter() > deadline:
            break
    hit_share = runs[None, True]["cached_tokens"] / runs[None, True]["prompt_tokens"]
    saved = 1 - runs[None, True]["seconds"] / runs[None, False]["seconds"]
    r = {"hit_share": hit_share, "saved_time_share": saved, "saved_over_hit": saved / hit_share if hit_share else 0,
         "seconds_without_cache": runs[None, False]["seconds"], "seconds_with_cache": runs[None, True]["seconds"],
         "graph_prefill": runs[None, True]["graph_prefill"],
         "first_tokens_identical": sum(a == b for a, b in zip(runs[None, False]["first_tokens"],
                                                               runs[None, True]["first_tokens"])),
         "requests": c["groups"] * c["waves"]}
    if (OTHER, True) in runs:
        o_saved = 1 - runs[OTHER, True]["seconds"] / runs[OTHER, False]["seconds"]
        r[f"{OTHER_NAME}_prefill"] = {"saved_time_share": o_saved,
                                      "saved_over_hit": o_saved / hit_share if hit_share else 0,
                                      "seconds_without_cache": runs[OTHER, False]["seconds"],
                                      "seconds_with_cache": runs[OTHER, True]["seconds"]}
    del model
    free_memory(device)
    print(f"\n(d) prefix trace: {100 * hit_share:.1f}% of prompt tokens hit the cache, {100 * saved:.1f}% of prefill "
          f"time saved: {r['saved_over_hit']:.2f} of the hit share (target >= 0.80)"
          + (f"; with {OTHER_NAME} prefill steps {r[OTHER_NAME + '_prefill']['saved_over_hit']:.2f}"
             if OTHER_NAME + "_prefill" in r else ""))
    return r


# --- the run -----------------------------------------------------------------------------------------------

def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    prof = results.get("profile", {}).get("profile")
    if not prof:
        return
    kinds = list(prof)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(kinds))
    ax.bar([x - 0.2 for x in xs], [prof[k]["host_ms"] for k in kinds], 0.4, label="host ms / step")
    ax.bar([x + 0.2 for x in xs], [prof[k]["device_ms"] for k in kinds], 0.4, label="device ms / step")
    ax.set_xticks(list(xs), kinds)
    ax.set_title("engine step: host vs device time by step kind")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    p.add_argument("--smoke", action="store_true", help="tiny presets on the CPU in fp32 (a dry run)")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"sections to run, of {','.join(SECTIONS)}")
    p.add_argument("--total", type=float, help="the run's time budget in seconds (default: 540 on a GPU)")
    p.add_argument("--decode-variants", default="cublas_only,no_pdl",
                   help=f"(b): the engine also run with these levers off or forced, of {','.join(DECODE_VARIANTS)}, "
                        "or several joined with '+'")
    p.add_argument("--prefill-variants", default="",
                   help="(a) and (c): the engine also run with these, comma-separated; each '+'-joined parts, a "
                        f"prefill attention tile (ROWSxKEYSwWARPSsSTAGES; default {PREFILL_TILE_DEFAULT}, at head dim "
                        f"{', '.join(f'{d} {t}' for d, t in PREFILL_TILE_BY_HEAD_DIM.items())}) or one of "
                        f"{', '.join(PREFILL_LEVERS)}"),
    p.add_argument("--presets", help="comma-separated model shapes for (b) and (c) (default: both)")
    args = p.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    if any(s not in SECTIONS for s in only):
        print(f"--only: sections are {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    try:
        for v in args.decode_variants.split(","):
            if v:
                decode_env(v)
    except NanoforgeError as e:
        print(f"--decode-variants: {e}", file=sys.stderr)
        return 2
    prefill_variants = [v for v in args.prefill_variants.split(",") if v]
    try:
        for v in prefill_variants:
            prefill_env(v)
    except NanoforgeError as e:
        print(f"--prefill-variants: {e}", file=sys.stderr)
        return 2
    picked = run_on(args.smoke)
    if picked is None:
        return 2
    device, dtype = picked
    conf = SMOKE if args.smoke else GPU
    start = time.perf_counter()
    total = args.total or conf["total"]
    end = start + total
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": str(dtype),
               "torch": torch.__version__, "smoke": args.smoke, "sections": {}, "warm_up_s": warm_up(device)}
    runs = {"throughput": lambda c, dl: section_throughput(c, device, dtype, dl),
            "decode": lambda c, dl: section_decode(c, device, dtype, dl),
            "prefill": lambda c, dl: section_prefill(c, device, dtype, dl),
            "prefix": lambda c, dl: section_prefix(c, device, dtype, dl),
            "profile": lambda c, dl: section_throughput(c, device, dtype, dl, profile=True)}
    for name in only:
        c = dict(conf[name])
        if name == "decode":
            c["variants"] = [v for v in args.decode_variants.split(",") if v]
        if args.presets and "presets" in c:
            c["presets"] = tuple(args.presets.split(","))
        if name in ("throughput", "prefill"):  # each variant is another engine run: more time for the section
            c["prefill_variants"] = prefill_variants
            c["budget"] += len(prefill_variants) * (25 if name == "throughput" else 30 * len(c["presets"]))
        left = end - time.perf_counter()
        info = results["sections"][name] = {"budget_s": c["budget"]}
        if left < c["budget"] / 2:
            info["skipped"] = f"{left:.0f} s left of the run's {total:.0f} s"
            print(f"\n({name}) skipped: {info['skipped']}")
            continue
        t0 = time.perf_counter()
        try:
            results[name] = runs[name](c, t0 + min(c["budget"], left))
        except Exception as e:  # one section's failure is reported; the others still run
            info["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        info["seconds"] = time.perf_counter() - t0
        free_memory(device)
    results["seconds"] = time.perf_counter() - start
    summarize(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_engine.json").write_text(json.dumps(results, indent=2, default=str))
    plot(results, args.out / "gpu_engine_profile.png")
    print(f"wrote {args.out / 'gpu_engine.json'} ({results['seconds']:.0f} s)")
    return 0


def summarize(r: dict) -> None:
    """One table: each measurement, its reference and the issue's target."""
    rows = []
    if "throughput" in r:
        rows.append(("(a) nano-vllm workload, output tok/s", f"{r['throughput']['output_tok_s']:,.0f}", "-",
                     ">= 20,000"))
        for t, dt in r["throughput"].get("prefill_variants", {}).items():
            rows.append((f"(a) ... prefill {t}", f"{dt['output_tok_s']:,.0f}", f"({dt['vs_default']:.2f}x)", ""))
    for name, d in r.get("decode", {}).items():
        rows.append((f"(b) batch-1 decode {name}, tok/s", f"{d['ours_tok_s']:,.0f}",
                     f"{d['reference_tok_s']:,.0f} ({d['ratio']:.2f}x)", ">= 1.3x" if "llama" in name else ">= 1,500"))
        rows.append((f"(b) ... median steps, tok/s", f"{d['ours_median_step_tok_s']:,.0f}",
                     f"{d['reference_median_step_tok_s']:,.0f} ({d['median_step_ratio']:.2f}x)", ""))
        rows.append((f"(b) batch-1 decode {name}, HBM", f"{100 * d['ours_hbm_fraction']:.1f}%",
                     f"{100 * d['reference_hbm_fraction']:.1f}%", ">= 55%" if "llama" in name else "-"))
        for v, dv in d.get("variants", {}).items():
            rows.append((f"(b) ... {v}, tok/s (HBM)", f"{dv['tok_s']:,.0f} ({100 * dv['hbm_fraction']:.1f}%)",
                         f"({dv['ratio']:.2f}x)", ""))
    for name, d in r.get("prefill", {}).items():
        rows.append((f"(c) prefill {name}, tok/s", f"{d['ours_tok_s']:,.0f}",
                     f"{d['hf_sdpa_tok_s']:,.0f} ({d['ratio']:.2f}x)", ">= 1.5x"))
        rows.append((f"(c) prefill {name}, MFU", f"{100 * d['ours_mfu']:.1f}%", f"{100 * d['hf_mfu']:.1f}%",
                     ">= 55%" if "llama" in name else "-"))
        for t, dt in d.get("prefill_variants", {}).items():
            rows.append((f"(c) ... {t}, tok/s (MFU)", f"{dt['tok_s']:,.0f} ({100 * dt['mfu']:.1f}%)",
                         f"({dt['tok_s'] / d['hf_sdpa_tok_s']:.2f}x)", ""))
    if "prefix" in r:
        d = r["prefix"]
        rows.append(("(d) saved prefill time / hit share", f"{d['saved_over_hit']:.2f}",
                     f"hit {100 * d['hit_share']:.0f}%, saved {100 * d['saved_time_share']:.0f}%", ">= 0.80"))
    print(f"\n{'measurement':<42}{'ours':>12}{'reference':>28}{'target':>12}")
    for row in rows:
        print(f"{row[0]:<42}{row[1]:>12}{row[2]:>28}{row[3]:>12}")
    for name, info in r["sections"].items():
        if "error" in info or "skipped" in info:
            print(f"({name}): {info.get('error') or 'skipped: ' + info['skipped']}")


if __name__ == "__main__":
    sys.exit(main())
