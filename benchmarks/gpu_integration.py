"""End-to-end effect of the kernels: the engine and the training step with nanoforge's Triton kernels
("auto") and with the PyTorch references ("torch"), in one process on one GPU.

    python benchmarks/gpu_integration.py [--requests 64] [--out DIR]    # JSON under $OUT or ./out

Engine: nano-vllm's workload (prompts of 100-1,024 random tokens, outputs of 100-1,024 with ignore_eos)
on a Qwen3-0.6B-shaped model with random bf16 weights; output tokens/s with each kernel mode (the mode is
read at every kernel call, so each run builds its own engine and captures its own CUDA graphs).
Training: `bench train` (GPT-2 124M, 16 x 1,024 tokens), whose variants already are the before and
after: flash attention with document masks against PyTorch SDPA.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from nanoforge.model.config import preset  # noqa: E402
from nanoforge.model.transformer import Transformer  # noqa: E402
from nanoforge.serve.bench_throughput import make_workload, run_engine  # noqa: E402
from nanoforge.train.bench import bench_train, print_table  # noqa: E402

# (kernel mode, CUDA-graph decode): the PyTorch references read sequence bounds on the host, so they run
# without graphs; our kernels without graphs isolate the kernels' own effect; with graphs is the real engine.
RUNS = (("torch", False), ("auto", False), ("auto", True))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--preset", default="qwen3-0.6b", help="model shape (a tiny one with --device cpu: a dry run)")
    p.add_argument("--max-len", type=int, default=1024,
                   help="longest prompt and longest output (the shortest: 100, or a tenth of this below 1,000)")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu for a dry run)", file=sys.stderr)
        return 2
    cfg = preset(args.preset)
    if args.max_len < 1 or 2 * args.max_len > cfg.max_seq_len:  # a request cut at the context would go uncounted
        print(f"--max-len {args.max_len}: a prompt and its output (up to {2 * args.max_len} tokens) must fit "
              f"{args.preset}'s context of {cfg.max_seq_len} tokens", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    with torch.device(args.device):
        model = Transformer(cfg).to(torch.bfloat16 if args.device == "cuda" else torch.float32).eval()
    shortest = min(100, max(1, args.max_len // 10))  # nano-vllm's 100, or a tenth of a dry run's --max-len
    prompts, outputs = make_workload(args.requests, args.max_len, args.max_len, min(10000, model.cfg.vocab_size),
                                     min_input=shortest, min_output=shortest)
    results = {"engine": {}}
    for mode, graphs in RUNS:
        os.environ["NANOFORGE_KERNELS"] = mode
        name = f"{mode}{' + CUDA graphs' if graphs else ''}"
        results["engine"][name], _ = run_engine(model, prompts, outputs, max_num_seqs=256, use_cuda_graphs=graphs)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    os.environ["NANOFORGE_KERNELS"] = "auto"
    if not args.skip_train:
        results["train"] = bench_train()
        print_table(results["train"])
    e = results["engine"]
    base = e["torch"]["output_tok_s"]
    print(f"\n{'engine (' + args.preset + ', ' + str(args.requests) + ' requests)':<40}{'output tok/s':>14}"
          f"{'vs torch reference':>20}")
    for name, r in e.items():
        print(f"{name:<40}{r['output_tok_s']:>14,.0f}{r['output_tok_s'] / base:>19.2f}x")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "integration.json").write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {args.out / 'integration.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
