"""Tensor-parallel serving on several GPUs against one (issue 16), in one process: the same random-weight model
(a preset's shape), run by the engine at `--tensor-parallel-size` 1 and N.

- Greedy: `--check-requests` prompts, `--check-tokens` tokens each, in fp32 (bf16 lets the ranks' different
  summation order flip near-ties): the token ids at N against 1, which must be equal.
- Throughput: one workload (`--requests`, prompts and outputs `--min-len`..`--max-len` tokens) in bf16, output
  tokens/s at 1 and N, and their ratio.
- Batch-1 decode: one 128-token prompt, `--decode-tokens` out, tokens/s at 1 and N.

    python benchmarks/multigpu_serve.py --shape llama3-8b --tp 2          # on a machine with 2 GPUs
    python benchmarks/multigpu_serve.py --cpu --shape tiny-llama --tp 2   # a dry run: gloo on the CPU, ~1 min

Writes $OUT/multigpu_serve_<shape>.json (default ./out) and prints a table. A model too large for one GPU
(`--no-single`) is run at N only.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from nanoforge.serve.bench_throughput import (  # noqa: E402
    Workload, _model_on, build_model, make_workload, model_config, run_engine)
from nanoforge.train.progress import write_json  # noqa: E402


def engine_run(w: Workload, dtype: torch.dtype, device: torch.device, tp: int, prompts, outputs, *,
               max_num_seqs: int) -> tuple[dict, list[list[int]]]:
    """The engine on `prompts` at tensor-parallel size `tp`, greedy: its numbers and each request's token ids."""
    model = build_model(w, device, dtype)
    try:
        return run_engine(model, prompts, outputs, max_num_seqs=max_num_seqs, temperature=0.0,
                          tensor_parallel_size=tp, model_factory=functools.partial(_model_on, w, dtype),
                          use_cuda_graphs=device.type == "cuda")
    finally:
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama3-8b", help="a model preset (random weights)")
    p.add_argument("--tp", type=int, default=2, help="the tensor-parallel size to set against 1")
    p.add_argument("--cpu", action="store_true", help="a dry run on the CPU (gloo), small sizes")
    p.add_argument("--no-single", action="store_true", help="skip the runs at size 1 (the model needs several GPUs)")
    p.add_argument("--check-requests", type=int, default=8)
    p.add_argument("--check-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--decode-tokens", type=int, default=256)
    args = p.parse_args(argv)
    if args.cpu:
        args.requests, args.min_len, args.max_len, args.decode_tokens = 8, 16, 48, 24
        args.check_requests, args.check_tokens = 4, 12
    device = torch.device("cpu" if args.cpu else "cuda")
    if not args.cpu and torch.cuda.device_count() < args.tp:
        print(f"multigpu_serve: --tp {args.tp} needs {args.tp} GPUs; this machine has {torch.cuda.device_count()}",
              file=sys.stderr)
        return 2
    sizes = [args.tp] if args.no_single else [1, args.tp]
    fast = torch.float32 if args.cpu else torch.bfloat16
    w = Workload(args.shape, args.requests, args.min_len, args.max_len, args.min_len, args.max_len)
    check = Workload(args.shape, args.check_requests, 16, 128, args.check_tokens, args.check_tokens)
    vocab = min(model_config(w).vocab_size, 10000)  # the prompts' token ids, as bench throughput draws them
    check_prompts, check_out = make_workload(check.requests, check.max_input, check.max_output, vocab, 1,
                                             min_input=check.min_input, min_output=check.min_output)
    prompts, outputs = make_workload(w.requests, w.max_input, w.max_output, vocab, 0, min_input=w.min_input,
                                     min_output=w.min_output)
    one = [prompts[0][:128]]
    result = {"shape": args.shape, "tp": args.tp, "device": "cpu" if args.cpu else torch.cuda.get_device_name(),
              "gpus": 0 if args.cpu else torch.cuda.device_count(), "workload": w.describe(), "runs": {}}
    for tp in sizes:
        print(f"== tensor-parallel size {tp}", flush=True)
        _, ids = engine_run(check, torch.float32, device, tp, check_prompts, check_out, max_num_seqs=64)
        thr, _ = engine_run(w, fast, device, tp, prompts, outputs, max_num_seqs=256)
        dec, _ = engine_run(w, fast, device, tp, one, [args.decode_tokens], max_num_seqs=1)
        result["runs"][tp] = {"greedy_ids": ids, "throughput": thr, "batch1": dec}
    runs = result["runs"]
    if 1 in runs:
        same = [a == b for a, b in zip(runs[1]["greedy_ids"], runs[args.tp]["greedy_ids"])]
        result["greedy_equal"] = all(same)
        result["greedy_equal_requests"] = f"{sum(same)}/{len(same)}"
        for key in ("throughput", "batch1"):
            result[f"{key}_ratio"] = runs[args.tp][key]["output_tok_s"] / runs[1][key]["output_tok_s"]
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / f"multigpu_serve_{args.shape}.json", result)
    print(f"{'tensor-parallel size':<22}{'throughput tok/s':>18}{'batch-1 tok/s':>15}")
    for tp, r in runs.items():
        print(f"{tp:<22}{r['throughput']['output_tok_s']:>18.1f}{r['batch1']['output_tok_s']:>15.1f}")
    if 1 in runs:
        print(f"greedy ids at {args.tp} equal to 1 (fp32): {result['greedy_equal_requests']} requests; "
              f"throughput {result['throughput_ratio']:.2f}x, batch-1 decode {result['batch1_ratio']:.2f}x")
    print(f"wrote {out / f'multigpu_serve_{args.shape}.json'}")
    return 0 if result.get("greedy_equal", True) else 1


if __name__ == "__main__":
    sys.exit(main())
