"""The `train`, `sft` and `bench train` verbs: `add_<verb>_arguments(parser)` and `run_<verb>(args)`.

Every training flag defaults to None, meaning "the preset's value" (or, with
--resume, the checkpoint's), so a flag given on the command line always wins.

Parallel training: `torchrun --nproc-per-node N -m nanoforge train ... --tp 2 --dp-shard -1` (any of
--tp --cp --pp --dp-shard --dp-replicate). Degrees are checked against the world size and the model before
any process group work; the layout is not part of the run's TrainConfig, so a run resumes at another one.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from nanoforge.errors import NanoforgeError
from nanoforge.runtime import pick_device

# TrainConfig field -> (type, help) of the flags both verbs share (--max-steps sets max_steps).
_LOOP_FLAGS = {
    "max_steps": (int, "optimizer steps"),
    "batch_size": (int, "sequences per micro-batch"),
    "seq_len": (int, "tokens per sequence (default: the model's context)"),
    "grad_accum": (int, "micro-batches per optimizer step"),
    "lr": (float, "peak learning rate"),
    "min_lr": (float, "learning rate at the end of the cosine decay"),
    "warmup_steps": (int, "linear warmup steps"),
    "lr_decay_steps": (int, "steps of cosine decay (default: max_steps)"),
    "weight_decay": (float, "AdamW weight decay of matrices and embeddings"),
    "beta2": (float, "AdamW beta2"),
    "grad_clip": (float, "clip the gradient norm to this (0: off)"),
    "ema": (float, "evaluate and save a moving average of the weights with this decay, e.g. 0.998 (0: off)"),
    "eval_interval": (int, "validate and checkpoint every this many steps"),
    "eval_iters": (int, "validation batches per evaluation"),
    "log_interval": (int, "steps between progress updates"),
    "val_fraction": (float, "share of the data held out for validation"),
    "seed": (int, "seed of initialisation, batches and dropout"),
    "loss_chunk": (int, "fuse the LM head and the loss, this many tokens at a time (saves the logits' memory)"),
    "ac": (str, "activation checkpointing: none (default), full (every block recomputes its activations in the "
                "backward), or N (every N-th block)"),
}


def _add_loop_arguments(p: argparse.ArgumentParser, default_out: str) -> None:
    p.add_argument("--out", default=default_out,
                   help=f"run folder: checkpoint, log.json, loss.png (default {default_out})")
    p.add_argument("--resume", action="store_true", help="continue the checkpoint in --out exactly where it stopped")
    p.add_argument("--overwrite", action="store_true", help="start again even if --out holds a checkpoint")
    for name, (kind, text) in _LOOP_FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=text)
    p.add_argument("--device", default=None, help="auto (default: cuda if available), cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default=None, help="auto (bf16 autocast on GPU, fp32 on CPU), bf16 or fp32")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the model (default: on GPU only)")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="replay the whole optimizer step as one CUDA graph (default: on GPU only)")
    g = p.add_argument_group("parallel training (launch with torchrun; degrees multiply to the process count)")
    g.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (+ sequence parallelism)")
    g.add_argument("--cp", type=int, default=None, help="context-parallel degree (each rank 1/cp of every sequence)")
    g.add_argument("--pp", type=int, default=None, help="pipeline-parallel degree (stages)")
    g.add_argument("--dp-shard", type=int, default=None,
                   help="FSDP2 degree; -1 (default under torchrun): the processes the other degrees leave")
    g.add_argument("--dp-replicate", type=int, default=None, help="replicas of the FSDP group (HSDP)")
    g.add_argument("--pp-schedule", default=None, help="gpipe, 1f1b (default) or interleaved-1f1b")
    g.add_argument("--pp-stages-per-rank", type=int, default=None,
                   help="pipeline stages on each rank (interleaved-1f1b; default 2)")
    g.add_argument("--dist-timeout", type=float, default=None,
                   help="seconds a collective waits for the other ranks before the run fails (default 600)")


def _parallel(args, cfg, out: Path):
    """The run's ParallelDims (None: one device, no torch.distributed), checked against the model's shapes
    (from the preset, --init, or the checkpoint being resumed) before any process group exists."""
    from nanoforge.model.config import preset as model_preset
    from nanoforge.model.hf import read_config
    from nanoforge.train.config import sequence_length
    from nanoforge.train.parallel.dims import parallel_dims

    dims = parallel_dims(tp=args.tp, cp=args.cp, pp=args.pp, dp_shard=args.dp_shard, dp_replicate=args.dp_replicate,
                         pp_schedule=args.pp_schedule, stages_per_rank=args.pp_stages_per_rank,
                         timeout_s=args.dist_timeout)
    if dims is None:
        return None
    source = out if args.resume else cfg.init
    model = read_config(source) if source else model_preset(cfg.model, **cfg.model_overrides)
    dims.check(model, seq_len=sequence_length(cfg, model), batch_size=cfg.batch_size, grad_accum=cfg.grad_accum,
               loss_chunk=cfg.loss_chunk)
    return dims


def _run(dims, device: str, out: Path, args, work, report) -> int:
    """`work(layout)` on one device, or on every rank of a parallel layout, then `report(result)` on the main
    process. In a parallel run the main rank checks --out first, every rank leaves the process group at the
    end, and a rank whose peer died or stopped answering (within --dist-timeout) stops with one line."""
    from nanoforge.train.trainer import SingleDevice

    if dims is None:
        _check_out(out, args)
        report(work(SingleDevice(pick_device(device))))
        return 0
    from nanoforge.train.parallel.layout import Parallel, lost_peer

    layout = Parallel.start(dims, device)
    try:
        layout.on_main(lambda: _check_out(out, args))
        result = work(layout)
    except BaseException as e:
        layout.abort()
        if not lost_peer(e):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SystemExit(f"nanoforge {args.verb}: rank {layout.rank} of {layout.world_size} stopped: another rank "
                         f"failed or did not answer within --dist-timeout {dims.timeout_s:g} s ({first[:200]}); "
                         f"`--resume` continues from the last checkpoint in {out}") from None
    layout.close()
    if layout.is_main:
        report(result)
    # The run is over and reported. Leave now: gloo's threads can abort the interpreter's exit after a run
    # that went well (seen here about once in a dozen short runs), which torchrun would report as a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _overrides(args) -> dict:
    """TrainConfig fields given on the command line."""
    names = [*_LOOP_FLAGS, "device", "dtype", "compile", "cuda_graph", "tokenizer", "doc_masking"]
    found = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    if getattr(args, "data", None):
        found["data"] = [str(p) for p in args.data]
    return found


def _check_out(out: Path, args) -> None:
    from nanoforge.train.checkpoint import has_checkpoint, load_state, remove_checkpoint

    if args.resume and args.overwrite:
        raise NanoforgeError("--resume and --overwrite contradict each other; give one", param="resume")
    if not args.resume and has_checkpoint(out):
        if not args.overwrite:
            step = load_state(out)["step"]
            raise NanoforgeError(f"{out} already holds a checkpoint (step {step}); pass --resume to continue it, "
                                 f"--overwrite to start again, or another --out", param="out")
        remove_checkpoint(out)


def _print_summary(s: dict) -> None:
    from nanoforge.train.progress import format_mfu

    rate = f"{s['ms_per_step']:.1f} ms/step, {s['tokens_per_s']:,.0f} tok/s" if s["ms_per_step"] else "no steps run"
    start = s["start_step"]  # a resumed run counts the steps it ran, from the step it resumed at
    steps = f"{s['step']} steps" if not start else f"{s['step'] - start} steps (from step {start} to {s['step']})"
    print(f"{s['title']}: {steps} in {s['wall_time_s']:.1f} s wall time ({rate}, MFU {format_mfu(s['mfu'])})")
    if s["val_loss"] is not None:
        n = s["config"]["eval_iters"]  # the evaluations along the way cover this much of the val split
        print(f"val loss {s['initial_val_loss']:.4f} at the start -> {s['final_val_loss_full_split']:.4f} at the end, "
              f"over the whole val split (lowest evaluation {s['best_val_loss']:.4f}, along the way on "
              f"{'the whole split' if n is None else f'{n} batches'})")


# --- train ---------------------------------------------------------------------------------------

def add_train_arguments(p: argparse.ArgumentParser) -> None:
    from nanoforge.train.config import PRESETS, preset_names

    others = [n for n in preset_names() if n not in PRESETS]
    p.add_argument("--preset", default=None,
                   help=f"a recipe ({', '.join(PRESETS)}; default: default) or any model preset ({', '.join(others)}), "
                        f"which trains with the generic recipe")
    p.add_argument("--init", default=None,
                   help="start from this Hugging Face / nanoforge model folder (its weights and tokenizer) instead of "
                        "a preset's random initialisation; --preset then only picks the recipe (default: generic)")
    p.add_argument("--data", nargs="+", type=Path, default=None,
                   help="text files/folders, .jsonl/.json/.parquet, or a `nanoforge data prepare` folder "
                        "(default: the built-in offline corpus)")
    p.add_argument("--tokenizer", default=None, help="char | bpe:VOCAB | PATH, for raw --data (default: the preset's)")
    p.add_argument("--dropout", type=float, default=None, help="dropout of the model (default: the preset's)")
    p.add_argument("--no-doc-masking", dest="doc_masking", action="store_false", default=None,
                   help="let packed documents attend to each other")
    _add_loop_arguments(p, "runs/pretrain")


def run_train(args) -> int:
    from nanoforge.train.checkpoint import load_state
    from nanoforge.train.config import GENERIC, TrainConfig, preset
    from nanoforge.train.pretrain import pretrain

    out = Path(args.out)
    overrides = _overrides(args)
    if args.init is not None:
        if not (Path(args.init) / "config.json").is_file():
            raise NanoforgeError(f"{args.init}/config.json not found: --init takes a model folder", param="init")
        overrides["init"] = str(args.init)
    if args.resume:
        cfg = TrainConfig.from_dict(load_state(out)["config"])
        if args.preset:  # the checkpoint must hold this preset's model (pretrain checks the shapes)
            chosen = preset(args.preset)
            cfg = cfg.replace(model=chosen.model, model_overrides=chosen.model_overrides, pad_vocab=chosen.pad_vocab,
                              init=None)
        cfg = cfg.replace(**overrides)
    else:
        cfg = preset(args.preset, **overrides) if args.preset else \
            GENERIC.replace(**overrides) if args.init else preset("default", **overrides)
    if args.dropout is not None:
        cfg = cfg.replace(model_overrides=cfg.model_overrides | {"dropout": args.dropout})
    dims = _parallel(args, cfg, out)

    def report(summary):
        _print_summary(summary)
        print(f"model, tokenizer and trainer state in {out}; log in {out / 'log.json'}, curve in {out / 'loss.png'}")

    # _check_out after the flags are known to be good: --overwrite deletes the old checkpoint
    return _run(dims, cfg.device, out, args, lambda layout: pretrain(cfg, out, resume=args.resume, layout=layout),
                report)


# --- sft -----------------------------------------------------------------------------------------

def add_sft_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--init", default=None, help="pretrained model folder to start from (default runs/pretrain)")
    p.add_argument("--data", nargs=1, type=Path, default=None,
                   help="instructions: a .json list or .jsonl of Alpaca {instruction, input, output} or chat "
                        "{messages} records (default: the built-in offline set)")
    p.add_argument("--epochs", type=float, default=None,
                   help="passes over the examples when --max-steps is not given (default 3)")
    p.add_argument("--answer-tokens", type=int, default=256,
                   help="token limit of the held-out answers checked at the end (default 256)")
    p.add_argument("--eval-samples", type=int, default=100, help="held-out prompts answered at the end (default 100)")
    _add_loop_arguments(p, "runs/sft")


def run_sft(args) -> int:
    from nanoforge.train.checkpoint import load_state
    from nanoforge.train.config import SFT_DEFAULTS, TrainConfig
    from nanoforge.train.sft import finetune

    out = Path(args.out)
    if args.answer_tokens <= 0 or args.eval_samples <= 0:
        raise NanoforgeError("--answer-tokens and --eval-samples must be positive", param="answer_tokens")
    overrides = _overrides(args) | {k: getattr(args, k) for k in ("init", "epochs") if getattr(args, k) is not None}
    if args.max_steps is not None:
        overrides["epochs"] = None  # an explicit step budget wins over the default number of passes
    base = TrainConfig.from_dict(load_state(out)["config"]) if args.resume else SFT_DEFAULTS
    cfg = base.replace(**overrides)
    dims = _parallel(args, cfg, out)

    def report(result):
        _print_summary(result)
        check = result["answers"]
        print(f"held-out answers ending with the end-of-turn token within {check['max_new_tokens']} tokens: "
              f"{check['ended_with_eot']}/{check['samples']} ({100 * check['eot_rate']:.1f}%; {check['tokens']:,} tokens "
              f"generated in {check['seconds']:.1f} s)")
        for ex in check["examples"]:
            print(f"\n> {ex['prompt']}\n{ex['answer']}")
        print(f"\nchat model in {out}: nanoforge generate --chat --model {out} --prompt '...'")

    return _run(dims, cfg.device, out, args, lambda layout: finetune(
        cfg, out, resume=args.resume, answer_tokens=args.answer_tokens, eval_samples=args.eval_samples,
        layout=layout), report)


# --- bench train ---------------------------------------------------------------------------------

def add_bench_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="gpt2-124m", help="model preset (default gpt2-124m)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=8, help="untimed steps first (compilation, autotuning)")
    p.add_argument("--doc-len", type=int, default=512, help="mean document length of the packed batches")
    p.add_argument("--variants", nargs="+", default=None, help="nanoforge, no-doc-mask, baseline (default: all)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto (bf16 autocast on GPU), bf16 or fp32")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help="default: on GPU only")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="replay each step as one CUDA graph (default: on GPU only)")
    p.add_argument("--json", type=Path, default=Path("runs/bench/train.json"), help="where to write the numbers")


def run_bench_train(args) -> int:
    from nanoforge.train.bench import bench_train, print_table
    from nanoforge.train.progress import write_json

    report = bench_train(preset=args.preset, batch_size=args.batch_size, seq_len=args.seq_len, steps=args.steps,
                         warmup=args.warmup, mean_doc_len=args.doc_len, variants=args.variants, device=args.device,
                         dtype=args.dtype, compile=args.compile, cuda_graph=args.cuda_graph)
    print_table(report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.json, report)
    print(f"wrote {args.json}")
    return 0


# --- plan ----------------------------------------------------------------------------------------

def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a model preset (e.g. llama3-8b, llama3-70b, llama3-405b)")
    p.add_argument("--gpus", type=int, required=True, help="GPUs of the run")
    p.add_argument("--hbm-gib", type=float, default=80.0, help="memory per GPU (default 80: H100; H200: 141)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the context, at most 8192)")
    p.add_argument("--batch-tokens", default="4M", help="tokens per optimizer step, all GPUs (e.g. 512K, 16M; default 4M)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch per data-parallel rank")
    p.add_argument("--tp", type=int, default=None, help="only layouts with this tensor-parallel degree")
    p.add_argument("--cp", type=int, default=None, help="only layouts with this context-parallel degree")
    p.add_argument("--pp", type=int, default=None, help="only layouts with this pipeline-parallel degree")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU (default 989: H100/H200)")
    p.add_argument("--efficiency", type=float, default=0.5, help="share of the peak the kernels reach (default 0.5)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs sharing NVLink (default 8)")
    p.add_argument("--nvlink-gbs", type=float, default=360.0, help="collective bandwidth inside a node, GB/s per GPU")
    p.add_argument("--network-gbs", type=float, default=40.0, help="bandwidth across nodes, GB/s per GPU")
    p.add_argument("--overhead-gib", type=float, default=4.0, help="memory for CUDA, NCCL and the allocator (GiB)")
    p.add_argument("--no-compile", dest="compiled", action="store_false",
                   help="the step runs eagerly: the logits' fp32 copy and log-softmax are held too")
    p.add_argument("--top", type=int, default=12, help="rows shown (default 12)")
    p.add_argument("--llama3", action="store_true",
                   help="also estimate Llama 3 405B's published layouts (the paper's Table 4) on this hardware")
    p.add_argument("--json", type=Path, default=None, help="write every estimate here")


def run_plan(args) -> int:
    from nanoforge.model.config import preset as model_preset
    from nanoforge.train.parallel.plan import Hardware, Workload, llama3_405b, parse_count, plan, table
    from nanoforge.train.progress import write_json

    for name in ("gpus", "hbm_gib", "micro_batch", "peak_tflops", "efficiency", "gpus_per_node", "nvlink_gbs",
                 "network_gbs", "top"):
        if getattr(args, name) <= 0:
            raise NanoforgeError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}", param=name)
    model = model_preset(args.model)
    seq_len = args.seq_len or min(model.max_seq_len, 8192)
    hw = Hardware(gpus=args.gpus, hbm_gib=args.hbm_gib, peak_tflops=args.peak_tflops, efficiency=args.efficiency,
                  gpus_per_node=args.gpus_per_node, nvlink_gbs=args.nvlink_gbs, network_gbs=args.network_gbs,
                  overhead_gib=args.overhead_gib, compiled=args.compiled)
    work = Workload(seq_len=seq_len, batch_tokens=parse_count(args.batch_tokens), micro_batch=args.micro_batch)
    rows = plan(model, work, hw, tp=args.tp, cp=args.cp, pp=args.pp)
    fit = sum(r["fits"] for r in rows)
    print(f"{args.model} ({model.num_params(False) / 1e9:.1f}B parameters) on {args.gpus} GPUs of {args.hbm_gib:g} GiB: "
          f"{work.batch_tokens:,} tokens per step in sequences of {seq_len:,}; {fit} of {len(rows)} layouts fit "
          f"(rc: with activation recomputation, --ac full; >: does not fit)")
    print(table(rows, hw.hbm_gib, args.top))
    report = {"model": args.model, "hardware": vars(hw), "workload": vars(work), "layouts": rows}
    if args.llama3:
        paper = llama3_405b(model_preset("llama3-405b"), hw)
        print("\nLlama 3 405B's published layouts (paper: TP 8, PP 16, DP 64 / 128 at 8K tokens; TP 8, CP 16, PP 16, "
              "DP 8 at 128K), estimated here:")
        print(table(paper, hw.hbm_gib))
        published = {(r["tp"], r["cp"], r["pp"], r["dp"]): r["paper_mfu"] for r in paper}
        print("MFU the paper reports: " + "; ".join(f"TP {t} CP {c} PP {p} DP {d}: {100 * mfu:.0f}%"
                                                    for (t, c, p, d), mfu in published.items()))
        report["llama3_405b"] = paper
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.json, report)
        print(f"wrote {args.json}")
    return 0

