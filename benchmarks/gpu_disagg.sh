#!/usr/bin/env bash
# Disaggregated serving the Mooncake way on one H200, against the colocated server, under the Mooncake trace.
#
#   bash benchmarks/gpu_disagg.sh                  # files under $OUT (default ./out)
#   PRESETS=tiny-qwen3 DEVICE=cpu NUM_REQUESTS=16 LENGTH_SCALE=0.01 MAX_INPUT=100 MAX_OUTPUT=12 MAX_MODEL_LEN=128 \
#       TIME_SCALE=0.05 WARMUP_LENS=32 POOL_MEMORY=0.05 bash benchmarks/gpu_disagg.sh   # a dry run on a CPU
#
# For each model shape in PRESETS (random weights; benchmarks/random_model.py), the same scaled replay of
# synthetic_trace.jsonl (rows TRACE_START.. TRACE_START+NUM_REQUESTS, where requests share more prefixes than at
# the start; lengths x LENGTH_SCALE, arrivals x TIME_SCALE; requests sharing hash_ids share token prefixes) with
# `nanoforge bench serve`, against each of CONFIGS:
#
#   colocated     nanoforge serve: one instance, prefill and decode in the same batches, its own prefix cache
#   1p1d          nanoforge serve --disagg --prefill 1 --decode 1: two instances on the GPU, the KV pool between
#   2p1d-rr       --prefill 2 --decode 1 --policy round-robin
#   2p1d-ca       --prefill 2 --decode 1 --policy cache-aware (Mooncake's: predicted TTFT with cache hits)
#   2p1d-ca-slo   the same with early rejection: --ttft-slo / --tpot-slo at the SLOs (429s count as failures)
#   colocated2    --colocated 2 --policy cache-aware: two colocated instances behind the conductor, sharing the pool
#                 (the baseline for 1p1d at the same GPU count)
#
# DEVICES=0,1 gives each instance of the --disagg configurations a GPU of its own (`serve --devices`; 1p1d and
# colocated2 on two GPUs: `DEVICES=0,1 CONFIGS="1p1d colocated2"`); without it they share the one GPU. The run
# directory then holds devices.txt, which `nanoforge simulate validate` reads (one GPU per instance, not shared).
#
# Per run under $OUT/PRESET/CONFIG: serve.json (summary + every request), serve_cdf.png, server.log and the
# /metrics of the server (and of every instance). Per preset: disagg.json (every run's summary, pool hit rate,
# rejections), table.txt, and disagg_cdf.png (TTFT and TPOT CDFs of all runs). Goodput counts requests that
# met both SLOs (SLO_TTFT_MS, SLO_TPOT_MS).
#
# Needs Mooncake Store and the serve extras. Where `import mooncake.store` fails, it installs them from what the
# caller carries: ./.whl (mooncake_transfer_engine_non_cuda-*-cp312-*.whl; fastapi, uvicorn, ... if missing) and
# ./.deb (libibverbs1, libnl-3-200, libnl-route-3-200 .deb files, unpacked under /tmp, no root needed).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

PY=${PYTHON:-python3}
OUT=${OUT:-out}
TRACE=${TRACE:-}
PRESETS=${PRESETS:-"qwen3-0.6b llama3-1b"}
CONFIGS=${CONFIGS:-"colocated 1p1d 2p1d-rr 2p1d-ca 2p1d-ca-slo"}
TRACE_START=${TRACE_START:-3000}
NUM_REQUESTS=${NUM_REQUESTS:-300}
LENGTH_SCALE=${LENGTH_SCALE:-0.1}
TIME_SCALE=${TIME_SCALE:-0.25}
MAX_INPUT=${MAX_INPUT:-6144}
MAX_OUTPUT=${MAX_OUTPUT:-512}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-8192}
SLO_TTFT_MS=${SLO_TTFT_MS:-2000}
SLO_TPOT_MS=${SLO_TPOT_MS:-50}
POOL_MEMORY=${POOL_MEMORY:-8}  # GiB of host memory each instance adds to the KV pool
WARMUP_LENS=${WARMUP_LENS:-"128 1024 4096"}
DEVICE=${DEVICE:-cuda}
SERVE_FLAGS=${SERVE_FLAGS:-}  # more `nanoforge serve` flags for every run (e.g. "--kv-pool-workers 1")
mkdir -p "$OUT"

source benchmarks/trace_path.sh  # TRACE: the Mooncake trace, or exit 2
sed -n "$((TRACE_START + 1)),$((TRACE_START + NUM_REQUESTS))p" "$TRACE" >"$OUT/trace.jsonl"

# --- what the machine may lack, from what was carried -----------------------------------------------------
SERVE_EXTRAS=1 source benchmarks/mooncake_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt" || true
get() { $PY -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())" "$1"; }

MODEL_DIR=$(mktemp -d)
trap 'rm -rf "$MODEL_DIR"' EXIT

run() {  # run PRESET CONFIG: start the server or cluster, warm it up, replay the trace, stop it with SIGTERM
    local preset=$1 config=$2 dir="$OUT/$1/$2" flags=() banner="nanoforge serve:"
    local log="$dir/server.log"
    case $config in
        colocated)   ;;
        1p1d)        flags=(--disagg --prefill 1 --decode 1 --policy round-robin) ;;
        2p1d-rr)     flags=(--disagg --prefill 2 --decode 1 --policy round-robin) ;;
        2p1d-ca)     flags=(--disagg --prefill 2 --decode 1 --policy cache-aware) ;;
        2p1d-ca-slo) flags=(--disagg --prefill 2 --decode 1 --policy cache-aware
                            --ttft-slo "$(awk "BEGIN {print $SLO_TTFT_MS / 1000}")"
                            --tpot-slo "$(awk "BEGIN {print $SLO_TPOT_MS / 1000}")") ;;
        colocated2)  flags=(--disagg --colocated 2 --policy cache-aware) ;;
        *) echo "unknown config $config" >&2; return 2 ;;
    esac
    mkdir -p "$dir"
    rm -f "$dir/devices.txt"
    if [[ ${#flags[@]} -gt 0 ]]; then
        banner="nanoforge conductor:"
        flags+=(--pool-memory "$POOL_MEMORY")
        [[ -n "${DEVICES:-}" ]] && { flags+=(--devices "$DEVICES"); echo "$DEVICES" >"$dir/devices.txt"; }
    fi
    $PY -m nanoforge.cli serve --model "$MODEL_DIR" --port 0 --served-model-name "$preset-random" \
        --max-model-len "$MAX_MODEL_LEN" --max-waiting 100000 --device "$DEVICE" --log-level warning "${flags[@]}" $SERVE_FLAGS \
        >"$log" 2>&1 &
    local pid=$! url=""
    for _ in $(seq 900); do  # model loads, KV-cache sizing, CUDA-graph captures: one instance after another
        url=$(grep "^$banner" "$log" | grep -o 'http://[0-9.]*:[0-9]*' | head -1 || true)
        [[ -n "$url" ]] && get "$url/health" >/dev/null 2>&1 && break
        kill -0 $pid 2>/dev/null || { tail -30 "$log"; echo "$config: the server died" >&2; return 1; }
        sleep 1
    done
    echo "== $preset / $config: $(grep "^$banner" "$log")"
    # Warm up outside the measurement (Triton autotuning and compilation on each instance's first prefill of a
    # shape). Random prompts, so nothing of the trace lands in any cache, and a seed a length, so that no warm-up
    # prompt begins with another's tokens (one seed made hits, and pool loads, of the warm-ups' own in the report).
    for len in $WARMUP_LENS; do
        $PY -m nanoforge.cli bench serve --base-url "$url" --model "$preset-random" --rate 20 --num-requests 8 \
            --input-len $len --output-len 8 --vocab-size "$VOCAB" --ignore-eos --seed "$len" \
            --out "$dir/warmup" >/dev/null
    done
    $PY -m nanoforge.cli bench serve --base-url "$url" --model "$preset-random" --trace "$OUT/trace.jsonl" \
        --length-scale "$LENGTH_SCALE" --time-scale "$TIME_SCALE" --max-input-len "$MAX_INPUT" \
        --max-output-len "$MAX_OUTPUT" --vocab-size "$VOCAB" --ignore-eos --slo-ttft-ms "$SLO_TTFT_MS" \
        --slo-tpot-ms "$SLO_TPOT_MS" --out "$dir" | tee "$dir/table.txt"
    get "$url/metrics" >"$dir/metrics.txt" || true
    { grep -o '^nanoforge serve --disagg: [a-z]* [0-9] at http://[0-9.]*:[0-9]*' "$log" || true; } |
        while read -r _ _ _ role n _ u; do get "$u/metrics" >"$dir/metrics-$role$n.txt" || true; done
    kill -TERM $pid
    wait $pid || true  # 143: the server re-raises SIGTERM once drained
}

for preset in $PRESETS; do
    rm -rf "${MODEL_DIR:?}"/*
    $PY benchmarks/random_model.py "$MODEL_DIR" "$preset" "$DEVICE"
    VOCAB=$($PY -c "from nanoforge.tokenizer import Tokenizer; print(Tokenizer.load('$MODEL_DIR').vocab_size)")
    for config in $CONFIGS; do
        run "$preset" "$config"
    done
    $PY benchmarks/disagg_report.py "$OUT/$preset" $CONFIGS | tee "$OUT/$preset/table.txt"
done
