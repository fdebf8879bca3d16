"""One-shot H200 check of the attention kernels: full-size correctness, then benchmarks.

    python benchmarks/gpu_kernels_attention.py [--quick]
    python benchmarks/gpu_kernels_attention.py --prefill-sweep   # only the chunked-prefill sweep (~1 minute)
    python benchmarks/gpu_kernels_attention.py --prefill-sweep --compiled   # its tiles compiled and read, no GPU

1. Correctness at full size, bfloat16, kernel outputs poisoned with NaN, against the float64 reference:
   flash attention forward and backward (causal, GQA, documents with length-1 ones, non-causal),
   paged attention decode over long ragged contexts and chunked prefill. (CUDA-graph replay of a decode
   step is `pytest -m gpu tests/test_kernels_paged.py`.)
2. Benchmarks: `bench_rows` of both modules (flash vs SDPA's flash backend; document masking vs the
   same kernel without it; paged decode vs the torch reference, as a fraction of 4.17 TB/s), the
   configurations flash attention's autotuner chose, and sweeps of paged-attention launch configurations:
   decode (not with --quick) and chunked prefill at the engine's prefill shapes (Llama-3.2-1B, Qwen3-0.6B).
Prints tables and writes attention_bench.json under $OUT (or ./out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import triton

from nanoforge.kernels import flash_attention as fa
from nanoforge.kernels import paged_attention as pa
from nanoforge.kernels.bench import time_ms


def nan_empty(*shape, like, dtype=None):
    dtype = dtype or like.dtype
    poison = math.nan if dtype.is_floating_point else torch.iinfo(dtype).min  # integers: a value never written
    return torch.full(shape, poison, device=like.device, dtype=dtype)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||; NaN anywhere (an unwritten element) gives NaN, which fails every check."""
    return ((got.double() - want).norm() / want.norm()).item()


def as_float64(batch: dict) -> dict:
    return {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}


def check_flash(quick: bool) -> list[dict]:
    cases = [  # (B, T, Hq, Hkv, D, causal, documents)
        (16, 1024, 12, 12, 64, True, False),
        (2, 4096, 32, 8, 128, True, False),
        (4, 2048, 12, 4, 64, True, True),
        (2, 1000, 8, 8, 128, False, True),
        (3, 777, 6, 2, 64, False, False),
    ]
    if quick:
        cases = cases[:3]
    results = []
    for B, T, hq, hkv, d, causal, docs in cases:
        gen = torch.Generator().manual_seed(B * T)
        q, k, v, do = (torch.randn(B, T, h, d, generator=gen).to("cuda", torch.bfloat16) for h in (hq, hkv, hkv, hq))
        doc_ids = fa.random_doc_ids(B, T, gen).cuda() if docs else None
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        out = fa.attention(q, k, v, doc_ids=doc_ids, causal=causal)
        got = (out, *torch.autograd.grad(out, (q, k, v), do))
        q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
        ref = fa.attention_ref(q64, k64, v64, doc_ids=doc_ids, causal=causal)
        want = (ref, *torch.autograd.grad(ref, (q64, k64, v64), do.double()))
        errs = {name: rel_error(g, w) for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)}
        shape = f"B{B} T{T} Hq{hq} Hkv{hkv} D{d} {'causal' if causal else 'full'}{' docs' if docs else ''}"
        results.append({"kernel": "flash fwd+bwd", "shape": shape, **errs, "ok": all(e < 1e-2 for e in errs.values())})
        del q, k, v, do, got, want, q64, k64, v64
        torch.cuda.empty_cache()
    return results


def check_paged(quick: bool) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    cases = [  # (name, contexts, query tokens per sequence)
        ("decode", torch.randint(1, 32769, (64,), generator=gen).tolist(), [1] * 64),
        ("decode", [1, 16, 17, 4095, 4096, 4097, 32768, 100], [1] * 8),
        ("prefill", [3000, 512, 9000, 70], [256, 512, 1, 70]),
    ]
    if quick:
        cases = cases[1:]
    results = []
    for name, ctx, qlens in cases:
        b = pa.make_paged_batch(ctx, qlens, 32, 8, 128, 16, torch.bfloat16, "cuda")
        out = pa.paged_attention(**b, max_q_len=max(qlens))
        ref = pa.paged_attention_ref(**as_float64(b))
        err = rel_error(out, ref)
        shape = f"{name} B{len(ctx)} ctx {min(ctx)}-{max(ctx)} Hq32 Hkv8 D128 bf16"
        results.append({"kernel": "paged", "shape": shape, "out": err, "ok": err < 1e-2})
        del b, out, ref
        torch.cuda.empty_cache()

    return results


def sweep_paged_decode() -> list[dict]:
    """GB/s of KV read for decode (batch 64, 4k-32k contexts) across launch configurations."""
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(4096, 32769, (64,), generator=gen).tolist()
    b = pa.make_paged_batch(ctx, [1] * 64, 32, 8, 128, 16, torch.bfloat16, "cuda")
    kv = pa._kv_bytes(ctx, 8, 128, torch.bfloat16)
    block_m, block_q, block_n, warps, stages = pa._tile_config(1, 4, 128)
    default_splits = pa._num_splits(64 * 8, 64 * 8, b["block_tables"].shape[1] * 16, b["q"].device)
    rows = []

    def run(splits, block_n, warps, stages):
        def decode():
            return pa._paged_attention_triton(
                **b, scale=1 / math.sqrt(128), max_q_len=1, block_m=block_m, block_q=block_q, block_n=block_n,
                num_splits=splits, num_warps=warps, num_stages=stages,
            )  # fmt: skip

        ms = time_ms(decode)
        row = dict(splits=splits, block_n=block_n, warps=warps, stages=stages, ms=ms, gbps=kv / ms / 1e6)
        row["hbm_fraction"] = row["gbps"] / (pa.HBM_COPY_TBPS * 1000)
        print(f"  splits {splits:2d} BLOCK_N {block_n:3d} warps {warps} stages {stages}: {ms:.3f} ms "
              f"{row['gbps']:.0f} GB/s ({row['hbm_fraction']:.0%})", flush=True)  # fmt: skip
        rows.append(row)
        return row

    print(f"paged decode sweep (default: splits {default_splits}, BLOCK_N {block_n}, warps {warps}, stages {stages})")
    best = max((run(s, block_n, warps, stages) for s in (1, 2, 4, 8, 16)), key=lambda r: r["gbps"])
    for bn in (32, 64, 128):
        for w, st in ((2, 3), (4, 2), (4, 3), (4, 4), (8, 3)):
            if (bn, w, st) != (block_n, warps, stages):
                run(best["splits"], bn, w, st)
    return rows


# (name, query heads, kv heads, head dim): the engine's prefill shapes of gpu_engine.py's (c) and (a)
PREFILL_SHAPES = (("llama3-1b", 32, 8, 64), ("qwen3-0.6b", 16, 8, 128))
# the prefill sweep's launch configurations: (BLOCK_M, BLOCK_N, warps, stages); 256 rows (session 39): a key tile's
# loads, addresses and loop shared by twice the rows (sm_90, D 64: 0.27-0.29 instructions a (row, key) pair
# against the default's 0.33), one block an SM of 8 or 16 warps where the default fits two
PREFILL_TILES = ([(m, n, w, s) for m in (64, 128) for n in (32, 64, 128) for w, s in ((4, 2), (4, 3), (8, 2), (8, 3))]
                 + [(256, n, w, s) for n in (32, 64) for w, s in ((8, 2), (16, 2), (16, 3))])


def default_prefill_tile(group: int, head_dim: int) -> tuple[int, int, int, int]:
    """The engine's prefill tile at these heads (`_tile_config`), as a PREFILL_TILES entry."""
    block_m, _, block_n, warps, stages = pa._tile_config(2000, group, head_dim)
    return block_m, block_n, warps, stages


def sweep_paged_prefill(prompts: int = 8, length: int = 2000, device: str = "cuda", timer=None) -> list[dict]:
    """TFLOP/s of chunked-prefill attention (`prompts` fresh prompts of `length` tokens in one step, causal, as a
    16K-token engine step holds them) across launch configurations, per model shape; the engine's default
    (`_tile_config`) is marked. The attention pairs' FLOPs: 4 * head_dim per query head per causal pair."""
    timer = timer or time_ms
    rows = []
    for name, hq, hkv, d in PREFILL_SHAPES:
        group = hq // hkv
        b = pa.make_paged_batch([length] * prompts, [length] * prompts, hq, hkv, d, 16, torch.bfloat16, device)
        flops = 4 * d * hq * prompts * length * (length + 1) // 2
        default = default_prefill_tile(group, d)
        tile_starts = None
        want = pa.paged_attention_ref(**b, scale=1 / math.sqrt(d)).double() if device == "cpu" else None
        print(f"paged prefill sweep, {name} shape ({hq}/{hkv} heads, head dim {d}), {prompts} x {length} tokens; "
              f"default BLOCK_M {default[0]} BLOCK_N {default[1]} warps {default[2]} stages {default[3]}")
        for block_m, block_n, warps, stages in PREFILL_TILES:
            block_q = max(1, block_m // group)

            def prefill():
                return pa._paged_attention_triton(
                    **b, scale=1 / math.sqrt(d), max_q_len=length, block_m=block_m, block_q=block_q,
                    block_n=block_n, num_splits=1, num_warps=warps, num_stages=stages, tile_starts=tile_starts,
                )  # fmt: skip

            try:
                out = prefill()
                if want is None:  # the first configuration's output is the others' reference
                    want = out.double()
                err = rel_error(out, want)
                ms = timer(prefill)
            except Exception as e:  # a configuration that does not fit (shared memory): reported, skipped
                print(f"  BLOCK_M {block_m:3d} BLOCK_N {block_n:3d} warps {warps} stages {stages}: {e}")
                continue
            row = dict(shape=name, block_m=block_m, block_n=block_n, warps=warps, stages=stages, ms=ms,
                       tflops=flops / ms / 1e9, rel_error=err, ok=err < 1e-2,
                       default=(block_m, block_n, warps, stages) == default)
            print(f"  BLOCK_M {block_m:3d} BLOCK_N {block_n:3d} warps {warps} stages {stages}: {ms:.3f} ms "
                  f"{row['tflops']:.0f} TFLOP/s, rel. error {err:.1e}" + ("  (default)" if row["default"] else "")
                  + ("" if row["ok"] else "  WRONG"), flush=True)
            rows.append(row)
        best = max((r for r in rows if r["shape"] == name and r["ok"]), key=lambda r: r["tflops"])
        base = next((r for r in rows if r["shape"] == name and r["default"]), None)
        best["setting"] = f"{best['block_m']}x{best['block_n']}w{best['warps']}s{best['stages']}"
        print(f"  best: BLOCK_M {best['block_m']} BLOCK_N {best['block_n']} warps {best['warps']} stages "
              f"{best['stages']}, {best['tflops']:.0f} TFLOP/s"
              + (f" ({best['tflops'] / base['tflops']:.2f}x the default)" if base else "")
              + f"; in the engine: NANOFORGE_ATTN_PREFILL_TILE={best['setting']}")
    return rows


def model_paged_prefill(out_dir: Path, tiles=PREFILL_TILES) -> list[dict]:
    """The prefill sweep's tiles compiled for sm_90 without a GPU (`nanoforge kernels inspect`'s compiler): per
    tile its registers, spills, blocks an SM, and its loop over whole key tiles: instructions a warp, the cycles an
    SM takes to issue a block's iteration against its tensor cores' cycles for it (issue / tensor > 1: bound by
    issue), and its wait on asynchronous copies. A model to read the measured sweep against, not a measurement."""
    from nanoforge.kernels import inspect as ki

    rows, t0, total = [], time.time(), len(PREFILL_SHAPES) * len(tiles)
    for name, hq, hkv, d in PREFILL_SHAPES:
        group = hq // hkv
        default = default_prefill_tile(group, d)
        for block_m, block_n, warps, stages in tiles:
            tile = f"{block_m}x{block_n}w{warps}s{stages}"
            r = ki.inspect_variant("paged_attention_prefill", f"{name}_{tile}", out_dir, num_warps=warps,
                                   num_stages=stages, GROUP=group, HEAD_D=d, BLOCK_D=d, BLOCK_M=block_m,
                                   BLOCK_Q=max(1, block_m // group), BLOCK_N=block_n)
            loop = next(lp for lp in r["loops"] if lp["tensor_core"])
            issue, tensor = ki.loop_cycles(loop, warps)
            rows.append(dict(shape=name, tile=tile, registers=r["registers_per_thread"],
                             spill=r["local_bytes_per_thread"], blocks_per_sm=r["occupancy"]["blocks_per_sm"],
                             instructions=loop["instructions"], issue_cycles=issue, tensor_cycles=tensor,
                             issue_per_tensor=round(issue / tensor, 2), wait=" ".join(loop["waits"]),
                             default=(block_m, block_n, warps, stages) == default))
            rate = len(rows) / (time.time() - t0)
            print(f"  [{len(rows)}/{total}, {rate * 60:.0f} tiles a minute, ETA {(total - len(rows)) / rate:.0f} s] "
                  f"{name} {tile}: issue / tensor {rows[-1]['issue_per_tensor']:.2f}", flush=True)
    print_table(rows, ["shape", "tile", "registers", "spill", "blocks_per_sm", "instructions", "issue_cycles",
                       "tensor_cycles", "issue_per_tensor", "wait", "default"])
    return rows


def autotune_choices() -> dict:
    """The configuration each flash kernel's autotuner picked, per tuning key."""
    chosen = {}
    for name in ("_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq"):
        tuner = getattr(fa, name)
        chosen[name] = {str(key): str(cfg) for key, cfg in tuner.cache.items()}
    return chosen


def print_table(rows: list[dict], columns: list[str]) -> None:
    def fmt(v):
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and no launch-configuration sweep")
    parser.add_argument("--prefill-sweep", action="store_true",
                        help="only the sweep of chunked-prefill launch configurations (it checks each one's output)")
    parser.add_argument("--compiled", action="store_true",
                        help="with --prefill-sweep: the tiles compiled for sm_90 and read, no GPU needed (no timing)")
    args = parser.parse_args()
    if args.compiled:
        out_dir = Path(os.environ.get("OUT", "out"))
        rows = model_paged_prefill(out_dir / "prefill_tiles")
        path = out_dir / "attention_prefill_model.json"
        path.write_text(json.dumps({"triton": triton.__version__, "tiles": rows}, indent=1))
        print(f"\nwrote {path}")
        return 0
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    os.environ["NANOFORGE_KERNELS"] = "triton"
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    if args.prefill_sweep:
        report["paged_prefill_sweep"] = sweep_paged_prefill()
        path = out_dir / "attention_prefill_sweep.json"
        path.write_text(json.dumps(report, indent=1))
        print(f"\nwrote {path}")
        return 0 if all(r["ok"] for r in report["paged_prefill_sweep"]) else 1

    t0 = time.time()
    allocators = fa._empty, pa._empty
    fa._empty, pa._empty = nan_empty, nan_empty  # poison every kernel output for the correctness pass
    report["correctness"] = check_flash(args.quick) + check_paged(args.quick)
    fa._empty, pa._empty = allocators
    print(f"\ncorrectness vs float64 (relative L2 error, bf16 inputs; {time.time() - t0:.0f} s)")
    print_table(report["correctness"], ["kernel", "shape", "out", "dq", "dk", "dv", "ok"])

    t0 = time.time()
    rows = fa.bench_rows(args.quick) + pa.bench_rows(args.quick)
    # Document masking: how much of the skipped work it saves (1.0 = speedup equals the work ratio).
    by_shape = {(r["kernel"], r["shape"]): r for r in rows}
    for r in rows:
        if r["kernel"].startswith("flash") and "docs" in r["shape"]:
            dense = by_shape.get((r["kernel"], r["shape"].rsplit(" ", 2)[0]))
            if dense:
                r["doc_mask_efficiency"] = r["ratio"] / (dense["flops"] / r["flops"])
    report["rows"] = rows
    print(f"\nbenchmarks ({time.time() - t0:.0f} s); ratio = baseline ms / ours ms")
    print_table(rows, ["kernel", "shape", "ours_ms", "base_ms", "ratio", "ours_tflops", "ours_gbps",
                       "hbm_fraction", "doc_mask_efficiency", "baseline"])  # fmt: skip
    report["autotune"] = autotune_choices()
    print("\nautotuned flash configurations:", json.dumps(report["autotune"], indent=1))
    if not args.quick:
        report["paged_sweep"] = sweep_paged_decode()
    report["paged_prefill_sweep"] = sweep_paged_prefill()

    path = out_dir / "attention_bench.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {path}")
    return 0 if all(r["ok"] for r in report["correctness"]) else 1


if __name__ == "__main__":
    sys.exit(main())
