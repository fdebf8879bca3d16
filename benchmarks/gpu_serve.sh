#!/usr/bin/env bash
# One-shot H200 run of the HTTP server under the Mooncake trace.
#
#   bash benchmarks/gpu_serve.sh        # files under $OUT (default ./out)
#
# 1. A Qwen3-0.6B-shaped model with random bf16 weights, beside a byte-level BPE
#    trained in a second on this repo's sources (benchmarks/random_model.py).
# 2. `nanoforge serve` on it, once with the prefix cache and once without (the
#    baseline), each replaying the same scaled Mooncake trace with
#    `nanoforge bench serve`: lengths x LENGTH_SCALE (and 512-token blocks ->
#    51), inputs capped at MAX_INPUT, arrivals x TIME_SCALE, the first
#    NUM_REQUESTS rows, exactly output_length tokens each (--ignore-eos).
# 3. Per run: serve.json (summary + every request), serve_cdf.png, the server's
#    log and /metrics; then serve_compare.json and a table of both runs.
#
# Needs fastapi, uvicorn, prometheus_client and httpx; if they are missing and
# ./.whl holds wheels (carry it), they are installed from there, offline.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's nanoforge, for benchmarks/random_model.py too

PY=${PYTHON:-python3}
OUT=${OUT:-out}
TRACE=${TRACE:-}
NUM_REQUESTS=${NUM_REQUESTS:-600}
LENGTH_SCALE=${LENGTH_SCALE:-0.1}
TIME_SCALE=${TIME_SCALE:-0.25}
MAX_INPUT=${MAX_INPUT:-6144}
MAX_OUTPUT=${MAX_OUTPUT:-1024}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-8192}
SLO_TTFT_MS=${SLO_TTFT_MS:-2000}
SLO_TPOT_MS=${SLO_TPOT_MS:-50}
PRESET=${PRESET:-qwen3-0.6b}  # PRESET=tiny-qwen3 DEVICE=cpu: a quick dry run of the script without a GPU
DEVICE=${DEVICE:-cuda}
WARMUP_LENS=${WARMUP_LENS:-128 1024 4096}  # prompt lengths the warm-up sends (8 requests each) before the replay
mkdir -p "$OUT"

source benchmarks/trace_path.sh  # TRACE: the Mooncake trace, or exit 2

if ! $PY -c "import fastapi, uvicorn, prometheus_client, httpx" 2>/dev/null; then
    $PY -m pip install -q --no-index --find-links .whl fastapi uvicorn prometheus_client httpx
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt" || true
get() { $PY -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())" "$1"; }

MODEL_DIR=$(mktemp -d)
SERVER_PID=""  # the server running now: stopped on any exit, so that a failed step leaves no port open
trap '[[ -n "$SERVER_PID" ]] && kill -TERM "$SERVER_PID" 2>/dev/null; rm -rf "$MODEL_DIR"' EXIT
$PY benchmarks/random_model.py "$MODEL_DIR" "$PRESET" "$DEVICE"
VOCAB=$($PY -c "from nanoforge.tokenizer import Tokenizer; print(Tokenizer.load('$MODEL_DIR').vocab_size)")

run() {  # run NAME [serve flags...]: start a server, replay the trace against it, stop it with SIGTERM
    local name=$1; shift
    local dir="$OUT/$name" log="$OUT/$name/server.log"
    mkdir -p "$dir"
    $PY -m nanoforge.cli serve --model "$MODEL_DIR" --port 0 --served-model-name qwen3-0.6b-random \
        --max-model-len "$MAX_MODEL_LEN" --max-waiting 100000 --device "$DEVICE" --log-level warning "$@" \
        >"$log" 2>&1 &
    local pid=$! url=""
    SERVER_PID=$pid
    for _ in $(seq 600); do  # model load, KV-cache sizing, CUDA-graph capture
        url=$(grep -o 'http://[0-9.]*:[0-9]*' "$log" | head -1 || true)
        [[ -n "$url" ]] && get "$url/health" >/dev/null 2>&1 && break
        kill -0 $pid 2>/dev/null || { cat "$log"; echo "server died" >&2; return 1; }
        sleep 1
    done
    echo "== $name: $(head -1 "$log")"
    # lengths within the served context (a tiny preset's is 128 tokens): prompt + output must fit it
    local ctx in_cap out_cap
    ctx=$(grep -o 'context [0-9]*' "$log" | head -1 | cut -d' ' -f2)
    in_cap=$(( MAX_INPUT < ctx - 64 ? MAX_INPUT : ctx - 64 ))
    out_cap=$(( MAX_OUTPUT < ctx - in_cap ? MAX_OUTPUT : ctx - in_cap ))
    # Warm up outside the measurement: Triton autotuning and compilation happen on the first prefill
    # of each shape. Random prompts, so nothing of the trace lands in the prefix cache, and a seed a length: with
    # one seed each length's prompts began with the shorter ones' tokens and hit the cache, in the server's rate.
    for len in $WARMUP_LENS; do
        (( len + 8 <= ctx )) || len=$(( ctx - 8 ))
        $PY -m nanoforge.cli bench serve --base-url "$url" --model qwen3-0.6b-random --rate 20 --num-requests 8 \
            --input-len $len --output-len 8 --vocab-size "$VOCAB" --ignore-eos --seed "$len" \
            --out "$dir/warmup" >/dev/null
    done
    $PY -m nanoforge.cli bench serve --base-url "$url" --model qwen3-0.6b-random --trace "$TRACE" \
        --num-requests "$NUM_REQUESTS" --length-scale "$LENGTH_SCALE" --time-scale "$TIME_SCALE" \
        --max-input-len "$in_cap" --max-output-len "$out_cap" --vocab-size "$VOCAB" --ignore-eos \
        --slo-ttft-ms "$SLO_TTFT_MS" --slo-tpot-ms "$SLO_TPOT_MS" --out "$dir" | tee "$dir/table.txt"
    get "$url/metrics" >"$dir/metrics.txt" || true
    kill -TERM $pid
    wait $pid || true  # uvicorn re-raises SIGTERM after draining: exit status 143
    SERVER_PID=""
}

run prefix_cache_on
run prefix_cache_off --no-prefix-caching

$PY - "$OUT" <<'EOF'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
runs = {name: json.loads((out / name / "serve.json").read_text()) for name in ("prefix_cache_on", "prefix_cache_off")}
rows = [("output tokens/s", "output_token_throughput", None), ("requests/s", "request_throughput", None),
        ("goodput (req/s)", "goodput", None), ("TTFT p50 (ms)", "ttft_ms", "p50"), ("TTFT p99 (ms)", "ttft_ms", "p99"),
        ("TPOT p50 (ms)", "tpot_ms", "p50"), ("TPOT p99 (ms)", "tpot_ms", "p99"), ("E2E p50 (ms)", "e2e_ms", "p50"),
        ("E2E p99 (ms)", "e2e_ms", "p99")]
compare = {}
print(f"\n{'':<22}{'prefix cache':>14}{'no cache':>14}{'ratio':>9}")
for label, key, sub in rows:
    on, off = (r["summary"][key] if sub is None else r["summary"][key][sub] for r in runs.values())
    compare[label] = {"prefix_cache_on": on, "prefix_cache_off": off, "ratio": on / off if off else None}
    print(f"{label:<22}{on:>14.1f}{off:>14.1f}{(on / off if off else float('nan')):>9.2f}")
for name, r in runs.items():
    m = r["server_metrics"]
    print(f"{name}: prefix-cache hit rate {100 * m.get('nanoforge_prefix_cache_hit_rate', 0):.1f}%, "
          f"preemptions {m.get('nanoforge_preemptions_total', 0):.0f}, "
          f"{r['summary']['completed']}/{r['summary']['requests']} completed")
(out / "serve_compare.json").write_text(json.dumps(compare, indent=2))
print(f"wrote {out / 'serve_compare.json'}")
EOF
