"""One-shot H200 check of the training claims; everything it measures goes to $OUT (or --out).

1. shakespeare-char: nanoGPT's baby GPT (6 x 384, context 256, batch 64, 5000 steps) on Tiny
   Shakespeare must reach val loss <= 1.47 in less wall time than nanoGPT's 35 s (7 ms/iter x 5000).
   The run's wall time (compilation and evaluations included) and its steady ms/step are both
   reported; log.json and loss.png are copied to $OUT/shakespeare-char/.
2. bench train: GPT-2 124M training steps of 16 x 1024 tokens in bf16 with document masking on must
   reach >= 498,000 tokens/s (43% MFU of 989 TFLOP/s), against PyTorch SDPA in the same process.

Run from the repository root on the GPU machine:
    python benchmarks/gpu_train.py [--data tinyshakespeare.txt] [--skip-shakespeare] [--skip-bench]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from nanoforge.train.bench import bench_train, print_table  # noqa: E402
from nanoforge.train.config import preset  # noqa: E402
from nanoforge.train.pretrain import pretrain  # noqa: E402
from nanoforge.train.progress import write_json  # noqa: E402

TARGET_VAL_LOSS, NANOGPT_WALL_S, TARGET_TOKENS_PER_S = 1.47, 35.0, 498_000
DATA_CANDIDATES = ("shared/data/tinyshakespeare.txt", "/work/shared/data/tinyshakespeare.txt")


def shakespeare(data: Path, out: Path, compile: bool | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        s = pretrain(preset("shakespeare-char", data=[str(data)], compile=compile), Path(tmp) / "run")
        (out / "shakespeare-char").mkdir(parents=True, exist_ok=True)
        for name in ("log.json", "loss.png"):
            shutil.copy(Path(tmp) / "run" / name, out / "shakespeare-char" / name)
    result = {k: s[k] for k in ("val_loss", "best_val_loss", "final_val_loss_full_split", "wall_time_s",
                                "ms_per_step", "tokens_per_s", "mfu", "compiled")}
    result["steady_wall_s_for_5000_steps"] = s["ms_per_step"] * 5 if s["ms_per_step"] else None
    result["pass_val_loss"] = s["val_loss"] <= TARGET_VAL_LOSS
    result["pass_wall_time"] = s["wall_time_s"] < NANOGPT_WALL_S
    print(f"\nshakespeare-char: val loss {s['val_loss']:.4f} (best {s['best_val_loss']:.4f}, whole split "
          f"{s['final_val_loss_full_split']:.4f}; target <= {TARGET_VAL_LOSS}), wall time {s['wall_time_s']:.1f} s "
          f"(nanoGPT {NANOGPT_WALL_S:.0f} s), steady {s['ms_per_step']:.2f} ms/step "
          f"= {result['steady_wall_s_for_5000_steps']:.1f} s for 5000 steps (nanoGPT 7 ms/step)")
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=None,
                   help="tinyshakespeare.txt (default: " + " or ".join(DATA_CANDIDATES) + ")")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/gpu_train")))
    p.add_argument("--skip-shakespeare", action="store_true")
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help="default: on (GPU)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"torch": torch.__version__, "cuda": torch.version.cuda,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    print(f"torch {report['torch']}, CUDA {report['cuda']}, {report['device']}")

    if not args.skip_shakespeare:
        data = args.data or next((Path(c) for c in DATA_CANDIDATES if Path(c).is_file()), None)
        if data is None:
            print("tinyshakespeare.txt not found: pass --data", file=sys.stderr)
            return 2
        report["shakespeare_char"] = shakespeare(data, args.out, args.compile)
        write_json(args.out / "gpu_train.json", report)

    if not args.skip_bench:
        bench = bench_train(preset="gpt2-124m", batch_size=16, seq_len=1024, compile=args.compile)
        print()
        print_table(bench)
        write_json(args.out / "bench_train.json", bench)
        ours = next(r for r in bench["results"] if r["variant"] == "nanoforge")
        report["bench_train"] = {"tokens_per_s": ours["tokens_per_s"], "mfu": ours["mfu"],
                                 "vs_baseline": ours["vs_baseline"],
                                 "pass_tokens_per_s": ours["tokens_per_s"] >= TARGET_TOKENS_PER_S}
        print(f"GPT-2 124M with document masking: {ours['tokens_per_s']:,.0f} tokens/s "
              f"(target {TARGET_TOKENS_PER_S:,}), {ours['vs_baseline']:.2f}x the SDPA baseline")

    write_json(args.out / "gpu_train.json", report)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
