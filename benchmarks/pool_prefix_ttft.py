"""The pool skips prefill across instances: a request that shares a long prefix with an earlier one, routed to the
*other* prefill instance, computes only its uncached tokens, and its time to first token falls accordingly.

    python benchmarks/pool_prefix_ttft.py [--preset gpt2-124m] [--device cpu] [--prefix 992] [--suffix 16]
                                          [--rounds 4] [--out DIR]

Starts `nanoforge serve --disagg --prefill 2 --decode 1 --policy round-robin` on a random model of the preset
(`benchmarks/random_model.py`; everything on 127.0.0.1, MC_TCP_BIND_ADDRESS=127.0.0.1), warms it up, then each
round sends, one after the other, with a fresh random prefix P of `--prefix` tokens:

    cold   P + a    round-robin: prefill instance 1 computes all of it and saves P's blocks to the pool
    hit    P + b    prefill instance 2, which has never seen P: it loads P's blocks from the pool

both streamed (TTFT = the first token at the client; `usage.prompt_tokens_details.cached_tokens` from the usage
chunk) with 4 output tokens. Prints a table; writes pool_prefix_ttft.json and pool_prefix_ttft.png under --out
(default out/). The expected fall: the hit computes only the share of the prompt it did not get from the pool
(the suffix, the prefix's partial block, and what one load's staging buffer could not carry), and pays the load.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def stream(url: str, prompt: list[int], max_tokens: int = 4) -> dict:
    """One streamed completion: TTFT (s), cached prompt tokens, the text."""
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    start = time.perf_counter()
    ttft, usage, text = None, None, ""
    try:
        r = urllib.request.urlopen(req, timeout=600)
    except urllib.error.HTTPError as e:  # e.g. a prompt longer than the model's context: the server's message
        sys.exit(f"pool_prefix_ttft: the server answered {e.code}: {e.read().decode()[:500]}")
    with r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = ttft if ttft is not None else time.perf_counter() - start
                text += chunk["choices"][0]["text"]
            if chunk.get("usage"):
                usage = chunk["usage"]
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"ttft_s": ttft, "cached_tokens": cached, "prompt_tokens": (usage or {}).get("prompt_tokens"), "text": text}


def start_cluster(model_dir: Path, device: str, log: Path, max_len: int) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "nanoforge.cli", "serve", "--model", str(model_dir), "--port", "0", "--disagg",
           "--prefill", "2", "--decode", "1", "--policy", "round-robin", "--pool-memory", "1", "--device", device,
           "--max-model-len", str(max_len), "--served-model-name", "m", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"})
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        m = re.search(r"^nanoforge conductor: .* at (http://127\.0\.0\.1:\d+)/v1", log.read_text(), re.M)
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            sys.exit(f"the cluster exited ({proc.returncode}); its log:\n{log.read_text()[-3000:]}")
        time.sleep(1)
    proc.terminate()
    sys.exit("the cluster did not start within 900 s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpt2-124m")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prefix", type=int, default=992)  # GPT-2: 1,024 positions
    p.add_argument("--suffix", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", default="out")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from nanoforge.model.config import PRESETS

    if args.preset not in PRESETS:
        p.error(f"--preset: no preset {args.preset!r}; choose one of {', '.join(PRESETS)}")
    if args.prefix < 16 or args.suffix < 1 or args.rounds < 1:
        p.error("--prefix must be >= 16 (a full block), --suffix and --rounds >= 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        subprocess.run([sys.executable, "benchmarks/random_model.py", str(model_dir), args.preset, args.device],
                       cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        vocab = json.loads((model_dir / "config.json").read_text()).get("vocab_size", 8192)
        tokens = (lambda n: [rng.randrange(10, vocab) for _ in range(n)])
        proc, url = start_cluster(model_dir, args.device, out / "pool_prefix_ttft_server.log",
                                  args.prefix + args.suffix + 64)
        try:
            print(f"cluster at {url}; warming up", flush=True)
            for _ in range(2):  # each prefill instance's first prompt of this length (and the decode's load)
                stream(url, tokens(args.prefix + args.suffix))
            rounds = []
            t0 = time.monotonic()
            for i in range(args.rounds):
                prefix = tokens(args.prefix)
                cold = stream(url, prefix + tokens(args.suffix))
                hit = stream(url, prefix + tokens(args.suffix))
                rounds.append({"cold": cold, "hit": hit})
                done = time.monotonic() - t0
                print(f"round {i + 1}/{args.rounds}: cold {1000 * cold['ttft_s']:.0f} ms, hit "
                      f"{1000 * hit['ttft_s']:.0f} ms ({hit['cached_tokens']} cached); "
                      f"ETA {done / (i + 1) * (args.rounds - i - 1):.0f} s", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=120)
    cold = statistics.median(r["cold"]["ttft_s"] for r in rounds)
    hit = statistics.median(r["hit"]["ttft_s"] for r in rounds)
    n = args.prefix + args.suffix
    # what the hit computed: all but what it took from the pool (the suffix, P's partial block, and whatever one
    # load could not carry: a load is capped by the connector's staging buffer, 64 MiB on a CPU, 1 GiB on a GPU)
    share = 1 - statistics.median(r["hit"]["cached_tokens"] for r in rounds) / n
    result = {"preset": args.preset, "device": args.device, "prefix": args.prefix, "suffix": args.suffix,
              "rounds": rounds, "cold_ttft_s": cold, "hit_ttft_s": hit, "ratio": hit / cold,
              "computed_share": share,
              "hit_cached_tokens": [r["hit"]["cached_tokens"] for r in rounds],
              "cold_cached_tokens": [r["cold"]["cached_tokens"] for r in rounds]}
    (out / "pool_prefix_ttft.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{args.preset} on {args.device}, prompts of {args.prefix} + {args.suffix} tokens, {args.rounds} rounds "
          "(medians)")
    print(f"{'request':<44}{'TTFT':>10}{'cached tokens':>16}")
    print(f"{'cold: prefill 1 computes it all':<44}{1000 * cold:>8.0f} ms{rounds[0]['cold']['cached_tokens']:>16}")
    print(f"{'hit: prefill 2 loads the prefix from the pool':<44}{1000 * hit:>8.0f} ms"
          f"{rounds[0]['hit']['cached_tokens']:>16}")
    print(f"hit / cold TTFT {hit / cold:.3f}; the hit computes {100 * share:.1f}% of the prompt")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        xs = range(1, len(rounds) + 1)
        ax.bar([x - 0.2 for x in xs], [1000 * r["cold"]["ttft_s"] for r in rounds], 0.4, label="cold (prefill 1)")
        ax.bar([x + 0.2 for x in xs], [1000 * r["hit"]["ttft_s"] for r in rounds], 0.4,
               label="prefix from the pool (prefill 2)")
        ax.set_xlabel("round (a fresh prefix each)")
        ax.set_ylabel("time to first token (ms)")
        ax.set_title(f"{args.preset} on {args.device}: {args.prefix}-token prefix + {args.suffix}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "pool_prefix_ttft.png", dpi=120)
    except ImportError:
        pass
    print(f"wrote {out / 'pool_prefix_ttft.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
