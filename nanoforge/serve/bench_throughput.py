"""`nanoforge bench throughput`: offline generation throughput, engine vs Hugging Face.

The workload is nano-vllm's benchmark: 256 requests, prompts of 100 to 1,024
random token ids, outputs of 100 to 1,024 tokens with `ignore_eos`, on a model
of Qwen3-0.6B's shape with random weights. The baseline, run in the same
process on the same weights, is Hugging Face `transformers` batched
`generate` (batch 64, 512 prompt tokens, 256 new tokens), the setting whose
H200 figure (~930 output tokens/s) the issue quotes. Output tokens per second
of both, their ratio, and the KV-cache utilisation the engine kept (tokens
held over the capacity of the blocks it had allocated, averaged over steps)
are printed as a table and written to JSON.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from nanoforge.model.config import preset
from nanoforge.model.hf import save_model
from nanoforge.model.transformer import Transformer
from nanoforge.serve.llm_engine import EngineConfig, LLMEngine
from nanoforge.serve.sampling_params import SamplingParams


def make_workload(num_requests: int, max_input: int, max_output: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(100, max_input))] for _ in range(num_requests)]
    outputs = [rng.randint(100, max_output) for _ in range(num_requests)]
    return prompts, outputs


def run_engine(model: Transformer, prompts, outputs, *, max_num_seqs: int, temperature: float = 0.6,
               use_cuda_graphs: bool = True) -> dict:
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=16384,
                                                 max_model_len=max(len(p) + o for p, o in zip(prompts, outputs)) + 1,
                                                 use_cuda_graphs=use_cuda_graphs))
    # warm up (compilation, autotuning, graph capture happen in the constructor and the first steps)
    engine.add_request(prompts[0][:64], SamplingParams(max_tokens=8, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    for p, o in zip(prompts, outputs):
        engine.add_request(p, SamplingParams(temperature=temperature, max_tokens=o, ignore_eos=True))
    util_sum, samples, step, produced = 0.0, 0, 0, 0
    bar = tqdm(total=sum(outputs), desc="engine", unit="tok", unit_scale=True)
    sync = torch.cuda.synchronize if model.embed.weight.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step()
        step += 1
        # utilisation walks every block table: sample it every 8th step to keep it off the clock
        if step % 8 == 0 and engine.scheduler.block_manager.num_used_blocks:
            util_sum += engine.scheduler.kv_utilization()
            samples += 1
        bar.update(len(outs))  # each request that progressed got one token (n = 1)
        produced += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
    sync()
    dt = time.perf_counter() - t0
    bar.close()
    s = engine.stats()
    return {"seconds": dt, "output_tokens": produced, "output_tok_s": produced / dt,
            "kv_utilization_mean": util_sum / max(samples, 1), "preemptions": s["preemptions"],
            "steps": s["steps"], "kv_blocks_total": s["kv_blocks_total"]}


def run_hf(model_dir: Path, device, dtype, *, batch: int, prompt_len: int, new_tokens: int, vocab: int) -> dict:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, prompt_len), generator=g).to(device)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        hf.generate(ids[:, :32], max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)  # warm up
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = hf.generate(ids, **kw)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    n = (out.shape[1] - prompt_len) * batch
    del hf
    return {"seconds": dt, "output_tokens": n, "output_tok_s": n / dt, "batch": batch, "prompt_len": prompt_len,
            "new_tokens": new_tokens}


def bench_throughput(*, model_preset: str = "qwen3-0.6b", num_requests: int = 256, max_input: int = 1024,
                     max_output: int = 1024, hf_batch: int = 64, hf_prompt: int = 512, hf_new: int = 256,
                     max_num_seqs: int = 256, baseline: bool = True, out_dir: Path = Path("runs/bench"),
                     device: torch.device, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(preset(model_preset)).to(dtype).eval()
    vocab = model.cfg.vocab_size
    prompts, outputs = make_workload(num_requests, max_input, max_output, min(vocab, 10000))
    result = {"model": model_preset, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "dtype": str(dtype), "workload": {"requests": num_requests, "prompt_tokens": [100, max_input],
                                                "output_tokens": [100, max_output]}}
    result["nanoforge"] = run_engine(model, prompts, outputs, max_num_seqs=max_num_seqs)
    if baseline:
        with tempfile.TemporaryDirectory() as d:
            save_model(model, d)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
            result["hf"] = run_hf(Path(d), device, dtype, batch=hf_batch, prompt_len=hf_prompt, new_tokens=hf_new,
                                  vocab=vocab)
        result["speedup"] = result["nanoforge"]["output_tok_s"] / result["hf"]["output_tok_s"]
    rows = [("nanoforge engine", result["nanoforge"]["output_tok_s"], result["nanoforge"]["seconds"])]
    if baseline:
        rows.append(("HF transformers generate", result["hf"]["output_tok_s"], result["hf"]["seconds"]))
    print(f"\n{'system':<28}{'output tok/s':>14}{'seconds':>10}")
    for name, tps, sec in rows:
        print(f"{name:<28}{tps:>14,.0f}{sec:>10.1f}")
    if baseline:
        print(f"speed-up over HF: {result['speedup']:.2f}x")
    print(f"KV-cache utilisation (mean over steps): {100 * result['nanoforge']['kv_utilization_mean']:.1f}%  "
          f"preemptions: {result['nanoforge']['preemptions']}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "throughput.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out_dir / 'throughput.json'}")
    return result
