"""`nanoforge bench train`: training throughput of the real training step, against a baseline.

Each variant builds the same model from the same seed and times the training
step (forward, backward, clipping, fused AdamW) on packed batches of random
tokens whose documents have random lengths, as the pretraining loader makes them:

  nanoforge      our Triton flash attention with document masking (what `train` runs),
                 the whole step replayed as one CUDA graph on a GPU (unless --no-cuda-graph)
  chunked-loss   the same, with the LM head and the loss fused 1,024 tokens at a time (--loss-chunk)
  no-doc-mask    the same, plain causal (every row one sequence)
  torch-doc-mask the same documents masked without our kernels: SDPA with a dense boolean mask
  baseline       nanoGPT's step: PyTorch's scaled_dot_product_attention, plain causal,
                 torch.compile and fused AdamW, launched from Python (no CUDA graph)

All run in one process, so the ratios compare like with like. Prints a table
and writes the numbers to a JSON file.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch._dynamo.utils import counters

from nanoforge.data.loader import Batch, doc_ids_and_positions
from nanoforge.errors import NanoforgeError
from nanoforge.model.config import preset as model_preset
from nanoforge.model.transformer import Transformer
from nanoforge.runtime import pick_device
from nanoforge.train.config import TrainConfig
from nanoforge.train.optim import make_optimizer
from nanoforge.train.progress import format_mfu, peak_flops
from nanoforge.model.attention import SDPAAttention
from nanoforge.train.trainer import (autocast, causal_attention, compute_dtype, device_peak_gib, document_attention,
                                     make_loss_fn, make_stepper, use_cuda_graph)


# name -> (what it runs, attention, tokens per chunk of the fused head + loss or None)
VARIANTS = {
    "nanoforge": ("flash attention + document masking", document_attention, None),
    "chunked-loss": ("the same, head + loss fused per 1k tokens", document_attention, 1024),
    "no-doc-mask": ("flash attention, causal only", causal_attention, None),
    "torch-doc-mask": ("torch SDPA + dense document mask", lambda batch: SDPAAttention(batch.doc_ids), None),
    "baseline": ("torch SDPA, causal only (nanoGPT)", lambda batch: SDPAAttention(None), None),
}


def packed_batches(n: int, batch_size: int, seq_len: int, vocab: int, eos: int, mean_doc_len: int,
                   seed: int) -> list[Batch]:
    """Random tokens cut into documents of geometric length (mean `mean_doc_len`) by end-of-text tokens."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=(n, batch_size, seq_len + 1))
    tokens[tokens == eos] = (eos + 1) % vocab
    tokens[rng.random(tokens.shape) < 1 / mean_doc_len] = eos
    out = []
    for window in torch.from_numpy(tokens):
        inputs, targets = window[:, :-1].contiguous(), window[:, 1:].contiguous()
        doc_ids, positions = doc_ids_and_positions(inputs, eos)
        out.append(Batch(inputs, targets, doc_ids, positions))
    return out


def bench_train(*, preset: str = "gpt2-124m", batch_size: int = 16, seq_len: int = 1024, steps: int = 30,
                warmup: int = 8, mean_doc_len: int = 512, variants: list[str] | None = None, device: str = "auto",
                dtype: str = "auto", compile: bool | None = None, cuda_graph: bool | None = None, pad_vocab: int = 64,
                seed: int = 0) -> dict:
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("steps", steps), ("doc_len", mean_doc_len)):
        if value <= 0:
            raise NanoforgeError(f"bench train: {name} must be positive, got {value}", param=name)
    unknown = set(variants or ()) - set(VARIANTS)
    if unknown:
        raise NanoforgeError(f"bench train: no variant {sorted(unknown)[0]!r}; choose from {', '.join(VARIANTS)}",
                             param="variants")
    dev = pick_device(device)
    cfg = model_preset(preset)
    cfg = cfg.replace(vocab_size=-(-cfg.vocab_size // pad_vocab) * pad_vocab, dropout=0.0)
    seq_len = min(seq_len, cfg.max_seq_len)
    train_cfg = TrainConfig(lr=6e-4, weight_decay=0.1, beta2=0.95)
    compiled = compile if compile is not None else dev.type == "cuda"
    graphed = use_cuda_graph(dev, cuda_graph)
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else 0
    batches = packed_batches(4, batch_size, seq_len, cfg.vocab_size, eos, mean_doc_len, seed)
    if dev.type == "cuda":
        batches = [b.pin_memory() for b in batches]  # pinned once, outside the timed steps
    tokens_per_step = batch_size * seq_len
    flops, peak = cfg.flops_per_token(seq_len), peak_flops(dev)
    amp = autocast(dev, dtype, cache=not graphed)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    results = []
    for name in variants or list(VARIANTS):
        what, attention, loss_chunk = VARIANTS[name]
        graph_it = graphed and name != "baseline"  # nanoGPT launches its step from Python
        torch.manual_seed(seed)
        model = Transformer(cfg).to(dev).train()
        optimizer = make_optimizer(model, train_cfg, capturable=graph_it, device=dev)
        step = make_stepper(make_loss_fn(model, attention, compiled, loss_chunk), model, optimizer, grad_clip=1.0,
                            amp=amp, graphed=graph_it, device=dev)
        counters.clear()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        for i in range(warmup):  # compilation and autotuning happen here
            step([batches[i % len(batches)]], 6e-4)
        sync()
        warm_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(steps):
            loss = step([batches[i % len(batches)]], 6e-4)
        sync()
        step_s = (time.perf_counter() - t0) / steps
        tok_s = tokens_per_step / step_s
        results.append({"variant": name, "attention": what, "cuda_graph": graph_it,
                        "ms_per_step": 1000 * step_s, "tokens_per_s": tok_s,
                        "mfu": tok_s * flops / peak if peak else None, "warmup_s": warm_s, "loss": loss.item(),
                        "graph_breaks": sum(counters["graph_break"].values()),
                        "peak_memory_gib": device_peak_gib(dev)})
        del model, optimizer, step
        if compiled:
            torch._dynamo.reset()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    base = next((r["tokens_per_s"] for r in results if r["variant"] == "baseline"), None)
    for r in results:
        r["vs_baseline"] = r["tokens_per_s"] / base if base else None
    return {"preset": preset, "params_m": cfg.num_params(non_embedding=False) / 1e6,
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "batch_size": batch_size,
            "seq_len": seq_len, "mean_doc_len": mean_doc_len, "dtype": compute_dtype(dev, dtype),
            "compiled": compiled, "cuda_graph": graphed, "steps": steps, "warmup": warmup, "flops_per_token": flops,
            "peak_flops": peak, "results": results}


def print_table(report: dict) -> None:
    print(f"training step, {report['preset']} ({report['params_m']:.1f}M params), {report['batch_size']} x "
          f"{report['seq_len']} tokens, {report['dtype']}, compile {'on' if report['compiled'] else 'off'}, "
          f"CUDA graph {'on' if report.get('cuda_graph') else 'off'}, "
          f"{report['device']}, documents of mean length {report['mean_doc_len']}")
    print(f"{'variant':<12} {'attention':<36} {'ms/step':>9} {'tokens/s':>12} {'MFU':>7} {'vs baseline':>12} "
          f"{'graph breaks':>13}")
    for r in report["results"]:
        ratio = f"{r['vs_baseline']:.2f}x" if r["vs_baseline"] else "-"
        print(f"{r['variant']:<12} {r['attention']:<36} {r['ms_per_step']:>9.1f} {r['tokens_per_s']:>12,.0f} "
              f"{format_mfu(r['mfu']):>7} {ratio:>12} {r['graph_breaks']:>13}")
