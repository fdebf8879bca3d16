"""`nanoforge bench throughput`: offline generation throughput, engine vs Hugging Face, on the same requests.

The workload on a GPU is nano-vllm's benchmark: 256 requests, prompts of 100
to 1,024 random token ids, outputs of 100 to 1,024 tokens with `ignore_eos`,
on a model of Qwen3-0.6B's shape with random weights. On a CPU, where that
takes hours, the default is a small workload that finishes in seconds
(`CPU_WORKLOAD`); a workload asked for on a CPU gets a time estimate first.

The engine takes every request at once (continuous batching). The baseline,
in the same process on the same weights, is Hugging Face `generate` run on
the very same requests the way its users batch them: sorted by prompt length
(longest first), `--hf-batch` at a time, left-padded with an attention mask,
each batch generating its longest output (`max_new_tokens`) with end-of-
sequence turned off, as `ignore_eos` does in the engine; sampling is the
engine's (temperature, no top-k / top-p) or greedy on both sides.

Both sides report output tokens/s over the requested output tokens (the same
numerator, so the ratio compares the same work); HF also reports the tokens
it generated, which include what padding every request to its batch's
longest output wastes. With `--temperature 0` the bench also counts the
requests whose tokens are identical on both sides (in fp32 on a CPU all are;
in bf16, kernels round differently and greedy paths can part). The table is
printed and the numbers, the workload and the batching go to JSON.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import random
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from tqdm import tqdm

from nanoforge.errors import NanoforgeError
from nanoforge.model.config import PRESETS, ModelConfig, preset
from nanoforge.runtime import pick_device, pick_dtype
from nanoforge.serve.step_profile import print_profile
from nanoforge.serve.tensor_parallel import check_tensor_parallel

if TYPE_CHECKING:
    from nanoforge.model.transformer import Transformer

# The model, the engine and transformers are imported where they are used: the CLI builds this verb's parser
# on every command, and they take a while to import.


@dataclass(frozen=True)
class Workload:
    preset: str
    requests: int
    min_input: int
    max_input: int
    min_output: int
    max_output: int
    seed: int = 0

    def describe(self) -> str:
        return (f"{self.preset} shape, {self.requests} requests, prompts {self.min_input}-{self.max_input} tokens, "
                f"outputs {self.min_output}-{self.max_output}")

    def flags(self) -> str:
        return (f"--model-preset {self.preset} --num-requests {self.requests} --min-input {self.min_input} "
                f"--max-input {self.max_input} --min-output {self.min_output} --max-output {self.max_output}")


GPU_WORKLOAD = Workload("qwen3-0.6b", 256, 100, 1024, 100, 1024)  # nano-vllm's benchmark
CPU_WORKLOAD = Workload("shakespeare-char", 16, 10, 100, 10, 100)  # nano-vllm's lengths / 10: ~10 s on 2 cores
LONG_ON_CPU_S = 180  # beyond this a CPU run says how to shrink itself


def make_workload(num_requests: int, max_input: int, max_output: int, vocab: int, seed: int = 0, *,
                  min_input: int = 100, min_output: int = 100):
    """Random prompts (token ids below `vocab`) and output lengths, uniform in [min, max]."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(min_input, max_input))] for _ in range(num_requests)]
    outputs = [rng.randint(min_output, max_output) for _ in range(num_requests)]
    return prompts, outputs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- the engine ------------------------------------------------------------------------------------

def run_engine(model: Transformer, prompts, outputs, *, max_num_seqs: int, temperature: float = 0.6,
               use_cuda_graphs: bool = True, tensor_parallel_size: int = 1, model_factory=None,
               profile: bool = False, async_scheduling: bool | None = None,
               graph_prefill: bool | None = None) -> tuple[dict, list[list[int]]]:
    """Every request at once; returns the numbers and each request's output token ids. With tensor parallelism
    the other ranks build their copy of the model with `model_factory(device)` (default: from its weights).
    `profile`: time each step by kind (serve/step_profile.py), into the numbers' "profile". `async_scheduling`
    and `graph_prefill`: the engine's options (None: its default)."""
    from nanoforge.serve.llm_engine import EngineConfig, LLMEngine

    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=16384,
                                                 max_model_len=max(len(p) + o for p, o in zip(prompts, outputs)) + 1,
                                                 use_cuda_graphs=use_cuda_graphs,
                                                 tensor_parallel_size=tensor_parallel_size,
                                                 async_scheduling=async_scheduling, graph_prefill=graph_prefill),
                       model_factory=model_factory)
    try:
        return _run(engine, model, prompts, outputs, temperature, max_num_seqs, profile)
    finally:
        engine.close()


def _run(engine, model, prompts, outputs, temperature, max_num_seqs, profile) -> tuple[dict, list[list[int]]]:
    from nanoforge.serve.llm_engine import frozen_heap
    from nanoforge.serve.model_runner import kv_bytes_per_block
    from nanoforge.serve.sampling_params import SamplingParams
    from nanoforge.serve.step_profile import StepProfiler

    # warm up (compilation, autotuning, graph capture happen in the constructor and the first steps)
    engine.add_request(prompts[0][:64], SamplingParams(max_tokens=8, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    rids = [engine.add_request(p, SamplingParams(temperature=temperature, max_tokens=o, ignore_eos=True,
                                                 output_kind="final_only"))  # as `LLM.generate` asks
            for p, o in zip(prompts, outputs)]
    token_ids: dict[str, list[int]] = {}
    util_sum, samples, step = 0.0, 0, 0
    bar = tqdm(total=sum(outputs), desc="nanoforge engine", unit="tok", unit_scale=True)
    device = model.embed.weight.device
    runner = engine.runner
    prof = runner.profiler = StepProfiler(runner.model, kv_bytes_per_block(runner.model, 1, runner.dtype)) \
        if profile else None
    _sync(device)
    t0 = time.perf_counter()
    with frozen_heap():  # as `LLM.generate` runs its loop
        while engine.has_unfinished():
            if prof is not None:
                prof.step_begin()
            outs = engine.step()
            if prof is not None:
                prof.step_end()
            step += 1
            # utilisation walks every block table: sample it every 8th step to keep it off the clock
            if step % 8 == 0 and engine.scheduler.block_manager.num_used_blocks:
                util_sum += engine.scheduler.kv_utilization()
                samples += 1
            for o in outs:  # (only finished requests report)
                token_ids[o.request_id] = o.outputs[0].token_ids
                bar.update(len(o.outputs[0].token_ids))
    _sync(device)
    dt = time.perf_counter() - t0
    bar.close()
    s = engine.stats()
    produced = sum(len(t) for t in token_ids.values())
    result = {"async_scheduling": engine.async_scheduling, "graph_prefill": bool(engine.runner.batch.prefill_buckets),
              "seconds": dt, "output_tokens": produced, "output_tok_s": produced / dt,
              "kv_utilization_mean": util_sum / max(samples, 1), "preemptions": s["preemptions"],
              "steps": s["steps"], "kv_blocks_total": s["kv_blocks_total"], "max_num_seqs": max_num_seqs}
    if prof is not None:
        result["profile"] = prof.summary()
        runner.profiler = None
    return result, [token_ids[r] for r in rids]


# --- the Hugging Face baseline ------------------------------------------------------------------------

def hf_batches(prompts, batch: int) -> list[list[int]]:
    """Request indices as HF users batch them: sorted by prompt length, longest first, `batch` at a time."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]), reverse=True)
    return [order[i:i + batch] for i in range(0, len(order), batch)]


def run_hf(model_dir: Path, prompts, outputs, device: torch.device, dtype: torch.dtype, *, batch: int,
           temperature: float) -> tuple[dict, list[list[int]]]:
    """Batched `generate` on the same requests; returns the numbers and each request's output token ids."""
    import transformers
    from transformers.generation.streamers import BaseStreamer

    class Progress(BaseStreamer):  # generate() calls put() with the prompts, then once per step
        def __init__(self, bar, rows):
            self.bar, self.rows, self.started = bar, rows, False

        def put(self, value):
            if self.started:
                self.bar.update(self.rows)
            self.started = True

        def end(self):
            pass

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    hf.generation_config.eos_token_id = None  # ignore_eos: never stop early, never mask the end token
    sampling = (dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0
                else dict(do_sample=False))
    batches = hf_batches(prompts, batch)
    plan = []
    for idx in batches:
        plan.append({"requests": len(idx), "prompt_len": max(len(prompts[i]) for i in idx),
                     "max_new_tokens": max(outputs[i] for i in idx)})
    generated = sum(b["requests"] * b["max_new_tokens"] for b in plan)
    token_ids: list[list[int] | None] = [None] * len(prompts)
    with torch.no_grad():
        warm = torch.tensor([prompts[0][:32]], device=device)
        hf.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, pad_token_id=0, **sampling)
        bar = tqdm(total=generated, desc="HF generate", unit="tok", unit_scale=True)
        _sync(device)
        t0 = time.perf_counter()
        for idx, b in zip(batches, plan):
            L, n = b["prompt_len"], b["max_new_tokens"]
            ids = torch.tensor([[0] * (L - len(prompts[i])) + prompts[i] for i in idx], device=device)
            mask = torch.tensor([[0] * (L - len(prompts[i])) + [1] * len(prompts[i]) for i in idx], device=device)
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
                              streamer=Progress(bar, len(idx)), **sampling)
            if out.shape[1] != L + n:
                raise RuntimeError(f"HF generated {out.shape[1] - L} tokens for a batch asked for {n}")
            new = out[:, L:].tolist()
            for row, i in enumerate(idx):
                token_ids[i] = new[row][:outputs[i]]
        _sync(device)
        dt = time.perf_counter() - t0
        bar.close()
    del hf
    useful = sum(outputs)
    return ({"seconds": dt, "output_tokens": useful, "output_tok_s": useful / dt, "generated_tokens": generated,
             "generated_tok_s": generated / dt, "padding_waste": 1 - useful / generated,
             "batching": {"batch": batch, "order": "by prompt length, longest first", "padding": "left",
                          "max_new_tokens": "the batch's longest output", "batches": plan}},
            token_ids)


# --- a time estimate for the CPU -------------------------------------------------------------------------

@torch.no_grad()
def estimate_seconds(model: Transformer, prompts, outputs, *, hf_batch: int, max_num_seqs: int) -> dict:
    """Rough wall time of each side, from pieces of a step timed with this model on this machine.

    A prompt token costs what one token of a 128-token prefill does. A decode step over b sequences costs
    t0 + b * t1 for the layers' matmuls (t0: reading the weights, t1: one token's arithmetic; fitted from
    steps of 1 and b sequences) plus attention at the workload's mean context: per sequence and layer in the
    engine (paged attention, one sequence at a time on a CPU), per layer over the padded batch in HF."""
    from nanoforge.kernels.paged_attention import paged_attention

    cfg, device = model.cfg, model.embed.weight.device
    dtype = model.embed.weight.dtype

    def timed(fn) -> float:  # the median of 3 after a warm-up: a busy machine makes single timings jump
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - t0)
        return sorted(times)[1]

    def forward(batch: int, tokens: int):
        ids = torch.zeros(batch, tokens, dtype=torch.long, device=device)
        return lambda: model.lm_head(model(ids, return_hidden=True)[:, -1])

    b = max(2, min(hf_batch, len(prompts), max_num_seqs))
    per_prompt_token = timed(forward(1, 128)) / 128
    one, many = timed(forward(1, 1)), timed(forward(b, 1))
    t1 = max(many - one, 0.0) / (b - 1)
    t0 = max(one - t1, 0.0)
    ctx = round(sum(len(p) + o / 2 for p, o in zip(prompts, outputs)) / len(prompts))  # mean context of a step
    blocks = -(-ctx // 16)
    cache = torch.randn(blocks, 16, cfg.n_kv_heads, cfg.head_dim, device=device, dtype=dtype)
    q = torch.randn(1, cfg.n_heads, cfg.head_dim, device=device, dtype=dtype)
    table = torch.arange(blocks, device=device, dtype=torch.int32)[None]
    seq_lens, cu = torch.tensor([ctx], device=device, dtype=torch.int32), torch.tensor([0, 1], device=device,
                                                                                        dtype=torch.int32)
    engine_attn = cfg.n_layers * timed(lambda: paged_attention(q, cache, cache, table, seq_lens, cu, max_q_len=1))
    hq = torch.randn(b, cfg.n_heads, 1, cfg.head_dim, device=device, dtype=dtype)
    hkv = torch.randn(b, cfg.n_heads, ctx, cfg.head_dim, device=device, dtype=dtype)
    mask = torch.ones(b, 1, 1, ctx, device=device, dtype=torch.bool)
    hf_attn = cfg.n_layers * timed(lambda: F.scaled_dot_product_attention(hq, hkv, hkv, attn_mask=mask)) / b

    def decode(group) -> float:  # every step runs the sequences not yet finished
        return max(outputs[i] for i in group) * t0 + sum(outputs[i] for i in group) * (t1 + engine_attn)

    order = list(range(len(prompts)))
    engine = sum(map(len, prompts)) * per_prompt_token + sum(
        decode(order[i:i + max_num_seqs]) for i in range(0, len(order), max_num_seqs))
    hf = 0.0
    for idx in hf_batches(prompts, hf_batch):
        L, n = max(len(prompts[i]) for i in idx), max(outputs[i] for i in idx)
        hf += len(idx) * L * per_prompt_token + n * (t0 + len(idx) * (t1 + hf_attn))
    return {"engine": engine, "hf": hf}


def _duration(s: float) -> str:
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


# --- the benchmark --------------------------------------------------------------------------------------

def model_config(w: Workload) -> ModelConfig:
    """The preset's shape, with a context that holds the longest request."""
    cfg = preset(w.preset)
    need = w.max_input + w.max_output + 1
    if need <= cfg.max_seq_len:
        return cfg
    if cfg.learned_positions:
        raise NanoforgeError(f"--max-input + --max-output is {need - 1} tokens, but {w.preset} has learned positions "
                             f"for {cfg.max_seq_len} (prompt + output + 1 must fit)", param="max_input")
    return cfg.replace(max_seq_len=need)  # RoPE: any length works


def build_model(w: Workload, device: torch.device, dtype: torch.dtype) -> Transformer:
    """Random weights of the workload's shape."""
    from nanoforge.model.transformer import Transformer

    torch.manual_seed(w.seed)
    with torch.device(device):
        return Transformer(model_config(w)).to(dtype).eval()


def _model_on(w: Workload, dtype: torch.dtype, device: torch.device) -> Transformer:
    return build_model(w, device, dtype)


def bench_throughput(w: Workload, *, hf_batch: int = 64, max_num_seqs: int = 256, temperature: float = 0.6,
                     baseline: bool = True, out: Path = Path("runs/bench/throughput.json"), device: torch.device,
                     dtype: torch.dtype, tensor_parallel_size: int = 1, profile: bool = False,
                     async_scheduling: bool | None = None, graph_prefill: bool | None = None) -> dict:
    from nanoforge.model.hf import save_model

    model = build_model(w, device, dtype)
    prompts, outputs = make_workload(w.requests, w.max_input, w.max_output, min(model.cfg.vocab_size, 10000),
                                     w.seed, min_input=w.min_input, min_output=w.min_output)
    result = {"model": w.preset, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "dtype": str(dtype), "temperature": temperature,
              "workload": {**asdict(w), "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(outputs)}}
    if device.type == "cpu":
        est = estimate_seconds(model, prompts, outputs, hf_batch=hf_batch, max_num_seqs=max_num_seqs)
        total = est["engine"] + (est["hf"] if baseline else 0)
        result["estimate_s"] = est
        print(f"estimated time on this CPU: about {_duration(total)} (engine {_duration(est['engine'])}"
              + (f", HF {_duration(est['hf'])}" if baseline else "") + ", from pieces of a step timed just now)")
        if total > LONG_ON_CPU_S:
            print("to shrink it: lower --num-requests, --max-input, --max-output, pick a smaller --model-preset, or "
                  "add --no-baseline; with no workload flags the CPU default takes seconds")
    torch.manual_seed(w.seed)
    result["nanoforge"], engine_ids = run_engine(model, prompts, outputs, max_num_seqs=max_num_seqs,
                                                 temperature=temperature, tensor_parallel_size=tensor_parallel_size,
                                                 model_factory=functools.partial(_model_on, w, dtype),
                                                 profile=profile, async_scheduling=async_scheduling,
                                                 graph_prefill=graph_prefill)
    result["tensor_parallel_size"] = tensor_parallel_size
    if baseline:
        with tempfile.TemporaryDirectory() as d:
            save_model(model, d)
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            torch.manual_seed(w.seed)
            result["hf"], hf_ids = run_hf(Path(d), prompts, outputs, device, dtype, batch=hf_batch,
                                          temperature=temperature)
        result["speedup"] = result["nanoforge"]["output_tok_s"] / result["hf"]["output_tok_s"]
        if temperature == 0:
            result["greedy_identical"] = sum(a == b for a, b in zip(engine_ids, hf_ids))
    print_table(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


def print_table(r: dict) -> None:
    e, hf = r["nanoforge"], r.get("hf")
    print(f"\n{'system':<32}{'output tok/s':>14}{'generated tok/s':>17}{'seconds':>10}")
    print(f"{'nanoforge engine':<32}{e['output_tok_s']:>14,.0f}{e['output_tok_s']:>17,.0f}{e['seconds']:>10.1f}")
    if hf:
        name = f"HF generate (batch {hf['batching']['batch']})"
        print(f"{name:<32}{hf['output_tok_s']:>14,.0f}{hf['generated_tok_s']:>17,.0f}{hf['seconds']:>10.1f}")
        print(f"speed-up over HF on the same requests: {r['speedup']:.2f}x  ({100 * hf['padding_waste']:.0f}% of "
              f"the tokens HF generated pad a request to its batch's longest output)")
    if "profile" in e:
        print_profile(e["profile"])
    if "greedy_identical" in r:
        print(f"greedy outputs identical on both sides: {r['greedy_identical']}/{r['workload']['requests']} requests")
    print(f"KV-cache utilisation (mean over steps): {100 * e['kv_utilization_mean']:.1f}%  "
          f"preemptions: {e['preemptions']}")


# --- the command line ------------------------------------------------------------------------------------

WORKLOAD_FLAGS = {"model_preset": "preset", "num_requests": "requests", "min_input": "min_input",
                  "max_input": "max_input", "min_output": "min_output", "max_output": "max_output"}


def add_cli_arguments(p: argparse.ArgumentParser) -> None:
    g, c = GPU_WORKLOAD, CPU_WORKLOAD

    def both(field: str) -> str:
        return f"(default: {getattr(g, field)} on a GPU, {getattr(c, field)} on a CPU)"

    p.add_argument("--model-preset", metavar="NAME", help=f"model shape, random weights {both('preset')}")
    p.add_argument("--num-requests", type=int, metavar="N", help=f"requests in the workload {both('requests')}")
    p.add_argument("--min-input", type=int, metavar="N", help=f"shortest prompt, in tokens {both('min_input')}")
    p.add_argument("--max-input", type=int, metavar="N", help=f"longest prompt, in tokens {both('max_input')}")
    p.add_argument("--min-output", type=int, metavar="N", help=f"shortest output, in tokens {both('min_output')}")
    p.add_argument("--max-output", type=int, metavar="N", help=f"longest output, in tokens {both('max_output')}")
    p.add_argument("--seed", type=int, default=0, metavar="N",
                   help="seed of the workload, the weights and sampling (default: 0)")
    p.add_argument("--temperature", type=float, default=0.6, metavar="T",
                   help="sampling temperature on both sides; 0: greedy, and count the requests whose tokens are "
                        "identical on both sides (default: 0.6, nano-vllm's)")
    p.add_argument("--max-num-seqs", type=int, default=256, metavar="N",
                   help="engine: sequences per batch (default: 256)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="engine: split the model over N devices, one process each (default: 1)")
    p.add_argument("--hf-batch", type=int, default=64, metavar="N",
                   help="HF baseline: requests per generate() call, sorted by prompt length (default: 64)")
    p.add_argument("--no-baseline", action="store_true", help="skip the HF baseline (default: run it)")
    p.add_argument("--profile", action="store_true",
                   help="engine: per step kind (prefill, decode, mixed), host and device time per step and the "
                        "achieved fraction of the device's memory bandwidth and FLOP/s (default: off)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="engine: schedule step n + 1 while the device runs step n (default: on a GPU)")
    p.add_argument("--graph-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="engine: CUDA-graph prefill and mixed steps too, padded to token buckets (default: on a GPU)")
    p.add_argument("--out", default="runs/bench/throughput.json", metavar="PATH",
                   help="JSON file for the results; a directory gets throughput.json (default: %(default)s)")
    p.add_argument("--device", default="auto",
                   help="auto (a GPU if there is one), cpu, cuda, cuda:1, ... (default: auto)")
    p.add_argument("--dtype", default="auto",
                   help="auto (bf16 on a GPU, fp32 on a CPU), fp32, bf16, fp16 (default: auto)")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def resolve_workload(args: argparse.Namespace, device: torch.device) -> tuple[Workload, str]:
    """The workload the flags ask for, unset flags taken from the device's default; and a line saying what."""
    base = CPU_WORKLOAD if device.type == "cpu" else GPU_WORKLOAD
    given = {field: getattr(args, flag) for flag, field in WORKLOAD_FLAGS.items() if getattr(args, flag) is not None}
    w = replace(base, seed=args.seed, **given)
    for flag, field in WORKLOAD_FLAGS.items():
        if field != "preset" and getattr(w, field) < 1:
            raise NanoforgeError(f"{_flag(flag)} must be >= 1, got {getattr(w, field)}", param=flag)
    for lo, hi in (("min_input", "max_input"), ("min_output", "max_output")):
        if getattr(w, lo) > getattr(w, hi):
            raise NanoforgeError(f"{_flag(lo)} ({getattr(w, lo)}) is above {_flag(hi)} ({getattr(w, hi)})", param=lo)
    if w.preset not in PRESETS:
        raise NanoforgeError(f"--model-preset {w.preset!r} is not a preset; choose one of {', '.join(PRESETS)}",
                             param="model_preset")
    model_config(w)  # the longest request must fit the model's context
    if base is CPU_WORKLOAD and not given:
        return w, (f"CPU: a small workload that finishes in seconds ({w.describe()}); nano-vllm's workload, "
                   f"the GPU default, takes hours on a CPU: nanoforge bench throughput {GPU_WORKLOAD.flags()}")
    return w, f"workload: {w.describe()}"


def run_cli(args: argparse.Namespace) -> int:
    try:
        device = pick_device(args.device)
        dtype = pick_dtype(args.dtype, device)
    except NanoforgeError as e:
        raise NanoforgeError(f"{_flag(e.param)}: {e}", param=e.param) from None
    for name in ("max_num_seqs", "hf_batch", "tensor_parallel_size"):
        if getattr(args, name) < 1:
            raise NanoforgeError(f"{_flag(name)} must be >= 1, got {getattr(args, name)}", param=name)
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise NanoforgeError(f"--temperature must be a finite number >= 0 (0: greedy), got {args.temperature}",
                             param="temperature")
    workload, line = resolve_workload(args, device)
    check_tensor_parallel(model_config(workload), args.tensor_parallel_size)
    out = Path(args.out)
    if out.is_dir():
        out = out / "throughput.json"
    try:  # before the run, not after it
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise NanoforgeError(f"--out {args.out}: cannot create its folder ({e.strerror})", param="out") from None
    print(line, flush=True)
    bench_throughput(workload, hf_batch=args.hf_batch, max_num_seqs=args.max_num_seqs, temperature=args.temperature,
                     baseline=not args.no_baseline, out=out, device=device, dtype=dtype,
                     tensor_parallel_size=args.tensor_parallel_size, profile=args.profile,
                     async_scheduling=args.async_scheduling, graph_prefill=args.graph_prefill)
    return 0
