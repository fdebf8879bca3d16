"""The `nanoforge` command. One function per verb; heavy imports happen inside them.

Errors the user can fix (a bad path, flag or file) come out as one line on
stderr and exit code 2; no tracebacks.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nanoforge.errors import NanoforgeError
from nanoforge.runtime import pick_device, pick_dtype


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_int(s: str) -> int:
    v = int(s)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {s}")
    return v


# --- generate ----------------------------------------------------------------------------------

def _add_generate(sub):
    p = sub.add_parser("generate", help="generate text from a model with the reference KV-cache generator")
    p.add_argument("--model", required=True, help="a Hugging Face / nanoforge model directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=_positive_int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = no limit")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template; stop at end of turn")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), fp32, bf16, fp16")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    from nanoforge.model.generate import generate_stream
    from nanoforge.model.hf import load_model
    from nanoforge.tokenizer import IncrementalDecoder, Tokenizer

    if args.temperature < 0:
        raise NanoforgeError(f"--temperature must be >= 0, got {args.temperature}", param="temperature")
    if not 0 < args.top_p <= 1:
        raise NanoforgeError(f"--top-p must be in (0, 1], got {args.top_p}", param="top_p")
    device = pick_device(args.device)
    model = load_model(args.model, device=device, dtype=pick_dtype(args.dtype, device))
    tok = Tokenizer.load(args.model)
    if args.chat:
        ids = tok.encode_chat([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    else:
        ids = tok.encode_prompt(args.prompt)
    stop = set(tok.stop_ids)
    decoder = IncrementalDecoder(tok)
    produced, stopped = 0, False
    for t in generate_stream(model, ids, max_new_tokens=args.max_tokens, temperature=args.temperature,
                             top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_ids=stop):
        produced += 1
        if t in stop:
            stopped = True
            break
        sys.stdout.write(decoder.push(t))
        sys.stdout.flush()
    sys.stdout.write(decoder.flush() + "\n")
    context = model.cfg.max_seq_len
    if not stopped and produced < args.max_tokens:
        print(f"nanoforge generate: stopped after {produced} of --max-tokens {args.max_tokens} tokens: the prompt "
              f"({len(ids)} tokens) and the answer filled the model's context of {context} tokens", file=sys.stderr)
    return 0


# --- data prepare ------------------------------------------------------------------------------

def _add_data(sub):
    from nanoforge.data import prepare

    data = sub.add_parser("data", help="prepare training data")
    verbs = data.add_subparsers(dest="data_verb", required=True, parser_class=_Parser)
    p = verbs.add_parser("prepare", help="tokenize text/JSONL/Parquet into train.bin / val.bin shards")
    prepare.add_cli_arguments(p)
    p.set_defaults(func=prepare.run_cli)


# --- bench --------------------------------------------------------------------------------------

def _add_bench(sub):
    bench = sub.add_parser("bench", help="benchmarks: print a table, write JSON")
    verbs = bench.add_subparsers(dest="bench_verb", required=True, parser_class=_Parser)
    from nanoforge.serve import bench_serve, bench_throughput

    p = verbs.add_parser("throughput", help="offline generation throughput: engine vs HF generate, same requests")
    bench_throughput.add_cli_arguments(p)
    p.set_defaults(func=bench_throughput.run_cli)

    p = verbs.add_parser("serve", help="load-test an OpenAI-compatible server: Poisson arrivals or a Mooncake trace")
    bench_serve.add_cli_arguments(p)
    p.set_defaults(func=bench_serve.run_cli)
    return verbs


# --- serve --------------------------------------------------------------------------------------

def _add_serve(sub):
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("--model", default=None,
                   help="a Hugging Face / nanoforge model directory (with its tokenizer); without it, the offline "
                        "default chat model in runs/default/sft, trained first if it is not there")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed at start)")
    p.add_argument("--served-model-name", default=None, help="the name clients ask for (default: the directory's)")
    p.add_argument("--max-num-seqs", type=_positive_int, default=256, help="sequences per batch")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=8192, help="tokens per engine step")
    p.add_argument("--max-model-len", type=_positive_int, default=None, help="context length (default: the model's)")
    p.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV-cache block")
    p.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                   help="GiB for the KV cache (default: most of the free GPU memory)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.90, metavar="F",
                   help="without --kv-cache-memory: the fraction of the GPU the server may fill")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--tensor-parallel-size", type=_positive_int, default=1, metavar="N",
                   help="split the model over N GPUs, one process each (default: 1)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule step n + 1 while the GPU runs step n (default: on a GPU, except for an instance "
                        "that saves prompts to a KV pool, where it is not yet measured)")
    p.add_argument("--graph-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="CUDA-graph the prefill and mixed steps too, padded to token buckets, one graph per bucket "
                        "captured at start (default: on where decode steps are graphed, i.e. on a GPU)")
    p.add_argument("--max-waiting", type=_positive_int, default=256,
                   help="requests that may wait for a batch slot; more get 429 with Retry-After")
    p.add_argument("--max-request-bytes", type=_positive_int, default=8 << 20, help="larger bodies get 413")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds that requests in flight get to finish before they are aborted")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), fp32, bf16, fp16")
    g = p.add_argument_group("disaggregated serving (prefill and decode instances, a KV cache pool, a conductor)")
    g.add_argument("--role", choices=["prefill", "decode", "both"], default=None,
                   help="serve as an instance for `nanoforge conductor`: prefill computes prompts and their first "
                        "tokens, decode generates the rest, both does either (without --role or --store: today's "
                        "server, with no conductor endpoints)")
    g.add_argument("--store", metavar="MASTER_ADDR", default=None,
                   help="host:port of a mooncake_master: share prompt KV blocks through its pool (Mooncake Store)")
    g.add_argument("--pool-memory", type=float, default=1.0, metavar="GIB",
                   help="with --store: GiB of this machine's memory the instance adds to the pool (0: none)")
    g.add_argument("--kv-pool-workers", type=_positive_int, default=4, metavar="N",
                   help="with --store: threads moving KV blocks to and from the pool, one request's blocks each "
                        "(default: 4)")
    g.add_argument("--store-hostname", default="127.0.0.1",
                   help="with --store: the address other machines reach this one's pool memory at (a cluster: "
                        "this machine's address on the cluster network)")
    g.add_argument("--disagg", action="store_true",
                   help="start a whole cluster on this machine: mooncake_master, --prefill N prefill and --decode M "
                        "decode instances, and a conductor at --host:--port, all on loopback")
    g.add_argument("--prefill", type=_positive_int, default=1, metavar="N", help="with --disagg: prefill instances")
    g.add_argument("--decode", type=_positive_int, default=1, metavar="M", help="with --disagg: decode instances")
    g.add_argument("--colocated", type=_positive_int, default=None, metavar="K",
                   help="with --disagg, instead of --prefill and --decode: K colocated instances (--role both) behind "
                        "the conductor, sharing the pool (the baseline at the same GPU count)")
    g.add_argument("--devices", default=None, metavar="I,J,...",
                   help="with --disagg: a GPU of its own for each instance, in order (prefill, then decode; or the "
                        "colocated ones), e.g. 0,1 (default: all on the one GPU, each with a share of its memory)")
    _add_routing_arguments(g)
    p.set_defaults(func=cmd_serve)


def _positive_float(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {s}")
    return v


def _add_routing_arguments(g) -> None:
    g.add_argument("--policy", choices=["random", "round-robin", "least-loaded", "cache-aware"],
                   default="cache-aware", help="the conductor's routing (cache-aware: Mooncake's)")
    g.add_argument("--ttft-slo", type=_positive_float, default=None, metavar="S",
                   help="the conductor answers 429 at once when a request's predicted time to first token is over S")
    g.add_argument("--tpot-slo", type=_positive_float, default=None, metavar="S",
                   help="the same for the predicted time per output token")


def cmd_serve(args) -> int:
    from nanoforge.serve.api import run_server

    if not args.disagg and (args.prefill != 1 or args.decode != 1 or args.colocated or args.devices):
        raise NanoforgeError("--prefill, --decode, --colocated and --devices describe the instances of --disagg; "
                             "give --disagg too", param="disagg")
    if args.colocated and (args.prefill != 1 or args.decode != 1):
        raise NanoforgeError("give --colocated K, or --prefill N and --decode M, not both", param="colocated")
    if args.disagg:
        if args.model is None or args.store or args.role is not None:
            raise NanoforgeError("--disagg needs --model DIR and starts its own mooncake_master and roles: drop "
                                 "--store and --role", param="disagg")
        from nanoforge.serve.disagg.launcher import run_local_cluster

        return run_local_cluster(args)
    if args.role is not None or args.store:
        args.role = args.role or "both"
        if args.model is None:
            raise NanoforgeError("an instance with --role or --store needs --model DIR", param="model")
        from nanoforge.serve.disagg.instance import run_instance

        return run_instance(args)
    if args.model is not None:
        return run_server(args)
    args.model = str(_first_run_model(Path("runs"), args.device))
    args.served_model_name = FIRST_RUN_MODEL_NAME  # the name _first_chat asks for
    return run_server(args, on_ready=_first_chat)


# The first run: a fresh machine with no network and no model goes from nothing to a served chat model in
# a few minutes, with the verbs a user would run by hand, into runs/default (apart from the runs/ folders
# that the README's other commands write). On 2 CPU cores it is a smoke test of the whole pipeline: a ~1M
# parameter model trained for a few minutes answers in Python-documentation words, not sense. On a GPU the
# same minutes train a 23M model for longer (preset default-gpu), whose answers are the documentation of what
# was asked (an H200 answers in ~90 s from a fresh checkout).
FIRST_RUN = {"cpu": {"train": ["--max-steps", "300"], "sft": ["--max-steps", "150", "--eval-samples", "20"]},
             "cuda": {"train": ["--preset", "default-gpu"],
                      "sft": ["--epochs", "6", "--no-compile", "--eval-samples", "20"]}}
FIRST_QUESTION = "What does the zip function do?"
FIRST_RUN_MODEL_NAME = "default"


def _first_run_model(runs: Path, device: str) -> Path:
    sft, pre = runs / "default" / "sft", runs / "default" / "pretrain"
    if (sft / "config.json").is_file():
        return sft
    kind = pick_device(device).type
    recipe = FIRST_RUN["cuda" if kind == "cuda" else "cpu"]
    what = ("a few minutes on a GPU" if kind == "cuda" else
            "a few minutes on 2 CPU cores: a smoke test of the pipeline, whose answers are not meant to make sense")
    print(f"first run: no --model given and no {sft}; training the offline default chat model on Python's own "
          f"documentation (train {' '.join(recipe['train'])}, then sft {' '.join(recipe['sft'])}; {what})", flush=True)
    steps = [["train", "--out", str(pre), "--overwrite", "--device", device, *recipe["train"]],
             ["sft", "--init", str(pre), "--out", str(sft), "--overwrite", "--device", device, *recipe["sft"]]]
    if (pre / "config.json").is_file():
        steps = steps[1:]
    for argv in steps:
        if main(argv) != 0:
            raise NanoforgeError(f"the first-run `nanoforge {' '.join(argv)}` failed (see above)")
    return sft


def _first_chat(base_url: str) -> None:
    """Ask the freshly served model one question over the OpenAI-style HTTP API and print the exchange."""
    import json
    import urllib.request

    body = json.dumps({"model": FIRST_RUN_MODEL_NAME, "messages": [{"role": "user", "content": FIRST_QUESTION}],
                       "max_tokens": 64, "temperature": 0}).encode()
    req = urllib.request.Request(f"{base_url}/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())["choices"][0]["message"]["content"]
    except Exception as e:  # the server keeps running; say what went wrong in one line
        print(f"first chat message failed: {e}", flush=True)
        return
    print(f"\nuser: {FIRST_QUESTION}\nassistant: {answer}\n\nserving; try:\n  curl {base_url}/chat/completions "
          f"-H 'Content-Type: application/json' -d '{{\"model\": \"default\", \"messages\": "
          f"[{{\"role\": \"user\", \"content\": \"What is a generator?\"}}]}}'\n(Ctrl-C stops the server)",
          flush=True)


# --- conductor ----------------------------------------------------------------------------------

def _add_conductor(sub):
    p = sub.add_parser("conductor", help="the front door of a disaggregated cluster: routes each request to a "
                                         "prefill and a decode instance (OpenAI-compatible HTTP)")
    p.add_argument("--prefill", nargs="+", default=[], metavar="URL",
                   help="prefill instances (`nanoforge serve --role prefill`), e.g. http://10.0.0.2:8001")
    p.add_argument("--decode", nargs="+", default=[], metavar="URL", help="decode instances (--role decode)")
    p.add_argument("--colocated", nargs="+", default=[], metavar="URL",
                   help="instead of --prefill and --decode: colocated instances (--role both), each running whole "
                        "requests (the baseline at the same GPU count)")
    p.add_argument("--store", metavar="MASTER_ADDR", default=None,
                   help="host:port of the instances' mooncake_master: route by what the KV pool holds")
    p.add_argument("--store-hostname", default="127.0.0.1", help="this machine's address for the pool's clients")
    _add_routing_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed at start)")
    p.add_argument("--request-timeout", type=float, default=300.0, metavar="S",
                   help="the longest an instance may keep a request's answer (or the next event) waiting")
    p.add_argument("--wait-timeout", type=float, default=120.0, metavar="S",
                   help="how long to wait at start for instances that do not answer yet")
    p.add_argument("--max-waiting", type=_positive_int, default=256, help="the largest batch of prompts in a request")
    p.add_argument("--max-request-bytes", type=_positive_int, default=8 << 20, help="larger bodies get 413")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds that requests in flight get to finish before they are aborted")
    p.add_argument("--seed", type=int, default=0, help="for the random policy")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_conductor)


def cmd_conductor(args) -> int:
    from nanoforge.serve.disagg.conductor import run_conductor

    return run_conductor(args)


# --- simulate -----------------------------------------------------------------------------------

def _add_simulate(sub):
    from nanoforge.sim import commands

    # allow_abbrev=False: its verbs have flags its own are prefixes of (`simulate profile --pool` against
    # --pool-gib, --pool-lease-s), which Python 3.11's argparse matches as an ambiguous abbreviation
    p = sub.add_parser("simulate", help="simulate a disaggregated or colocated cluster on a trace (the real "
                                        "scheduler and router on modelled time): goodput, latencies, capacity",
                       allow_abbrev=False)
    commands.add_run_arguments(p)
    p.set_defaults(func=commands.run_cli)
    commands.add_verbs(p.add_subparsers(dest="sim_verb", parser_class=_Parser,
                                        title="verbs (none: one simulation run)"))


# --- train, sft, bench train -------------------------------------------------------------------

def _add_training_verbs(sub, bench_verbs):
    """`train`, `sft`, `bench train` and `plan`: their flags and runners live in nanoforge/train/commands.py."""
    from nanoforge.train import commands

    for parent, name, help_, add, run in (
        (sub, "train", "pretrain a GPT (default: a small Llama on the built-in corpus)",
         commands.add_train_arguments, commands.run_train),
        (sub, "sft", "fine-tune a pretrained model on instructions (loss on answers only)",
         commands.add_sft_arguments, commands.run_sft),
        (bench_verbs, "train", "training-step throughput: flash attention + document masking vs SDPA",
         commands.add_bench_train_arguments, commands.run_bench_train),
        (sub, "plan", "parallel layouts of a model on N GPUs: memory per GPU and estimated step time",
         commands.add_plan_arguments, commands.run_plan),
    ):
        p = parent.add_parser(name, help=help_)
        add(p)
        p.set_defaults(func=run)


# --- kernels --------------------------------------------------------------------------------------

def _add_kernels(sub):
    kernels = sub.add_parser("kernels", help="GPU kernels: benchmarks, the SIMT ladder, compiled-code inspection")
    verbs = kernels.add_subparsers(dest="kernels_verb", required=True, parser_class=_Parser)
    p = verbs.add_parser("ladder", help="SIMT SGEMM ladder (Numba CUDA) next to cuBLAS")
    p.add_argument("--sizes", type=_positive_int, nargs="+", default=[1024, 4096])
    p.add_argument("--out", default="runs/kernels")
    p.set_defaults(func=lambda a: _run_ladder(a))
    p = verbs.add_parser("inspect", help="registers, shared memory, spills, occupancy; writes PTX and SASS")
    p.add_argument("name", help="a kernel name (see `nanoforge kernels inspect list`)")
    p.add_argument("--out", default="runs/kernels")
    p.set_defaults(func=lambda a: _run_inspect(a))
    p = verbs.add_parser("bench", help="each kernel beside its library baseline: table, JSON, roofline PNG")
    kinds = ["gemm", "streamk", "rmsnorm", "flash", "paged", "gemv"]  # kernels.bench.KINDS (not imported here)
    p.add_argument("--kinds", nargs="+", default=kinds, choices=kinds)
    p.add_argument("--quick", action="store_true", help="fewer shapes")
    p.add_argument("--out", default="runs/kernels")
    p.set_defaults(func=lambda a: _run_kernels_bench(a))
    return verbs


def _run_kernels_bench(args) -> int:
    from pathlib import Path

    from nanoforge.kernels.bench import run

    run(args.kinds, Path(args.out), quick=args.quick)
    return 0


def _run_ladder(args) -> int:
    from nanoforge.kernels.simt.bench import run_ladder

    run_ladder(args.sizes, args.out)
    return 0


def _run_inspect(args) -> int:
    from nanoforge.kernels.inspect import inspect_kernel, kernel_names

    names = kernel_names()
    if args.name == "list":
        print("\n".join(names))
        return 0
    if args.name not in names:
        raise NanoforgeError(f"no kernel named {args.name!r}; `nanoforge kernels inspect list` shows them",
                             param="name")
    inspect_kernel(args.name, args.out)
    return 0


# --- entry point -------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="nanoforge", description="Pretrain, fine-tune and serve GPTs.")
    sub = parser.add_subparsers(dest="verb", required=True, parser_class=_Parser)
    _add_generate(sub)
    _add_data(sub)
    _add_training_verbs(sub, _add_bench(sub))
    _add_serve(sub)
    _add_conductor(sub)
    _add_simulate(sub)
    _add_kernels(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # a bare `nanoforge`: say what it can do
        parser.print_help(sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except NanoforgeError as e:
        print(f"nanoforge {args.verb}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
