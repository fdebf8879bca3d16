"""The `nanoforge` command. One function per verb; heavy imports happen inside them.

Errors the user can fix (a bad path, flag or file) come out as one line on
stderr and exit code 2; no tracebacks.
"""

from __future__ import annotations

import argparse
import sys

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
        ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(args.prompt)
    stop = set(tok.stop_ids)
    decoder = IncrementalDecoder(tok)
    for t in generate_stream(model, ids, max_new_tokens=args.max_tokens, temperature=args.temperature,
                             top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_ids=stop):
        if t in stop:
            break
        sys.stdout.write(decoder.push(t))
        sys.stdout.flush()
    sys.stdout.write(decoder.flush() + "\n")
    return 0


# --- data prepare ------------------------------------------------------------------------------

def _add_data(sub):
    from nanoforge.data import prepare

    data = sub.add_parser("data", help="prepare training data")
    verbs = data.add_subparsers(dest="data_verb", required=True, parser_class=_Parser)
    p = verbs.add_parser("prepare", help="tokenize text/JSONL/Parquet into train.bin / val.bin shards")
    prepare.add_cli_arguments(p)
    p.set_defaults(func=prepare.run_cli)


# --- entry point -------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="nanoforge", description="Pretrain, fine-tune and serve GPTs.")
    sub = parser.add_subparsers(dest="verb", required=True, parser_class=_Parser)
    _add_generate(sub)
    _add_data(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
