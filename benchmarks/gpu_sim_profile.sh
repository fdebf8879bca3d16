#!/usr/bin/env bash
# The cluster simulator's profile of the real engine on this GPU (`nanoforge simulate profile`), for each model shape
# in PRESETS: prefill step time against tokens and cached prefix, decode step time against batch and context (CUDA
# graphs, as served), the KV transfer through the real Mooncake Store on loopback (--pool), and what the server and
# the conductor add (--frontend, through nanoforge serve and serve --disagg on loopback). ~4 minutes a preset.
#
#   bash benchmarks/gpu_sim_profile.sh                    # $OUT/h200-qwen3-0.6b.json (+ .log)
#   PRESETS="qwen3-0.6b llama3-1b" bash benchmarks/gpu_sim_profile.sh   # both shapes, ~8 minutes
#   PRESETS=tiny-qwen3 DEVICE=cpu QUICK=1 OUT=out/profile-cpu bash benchmarks/gpu_sim_profile.sh   # CPU dry run, ~1 min
#
# The model is built as benchmarks/gpu_disagg.sh builds it (benchmarks/random_model.py: the preset's shape, random
# weights, its 8,192-token BPE vocabulary), so the profile times the same model that gpu_disagg.sh serves and
# `nanoforge simulate validate` can compare the two. BUDGET_S bounds the engine's timed steps per preset (the most
# expensive grid points are left out past it, and listed in the JSON). Mooncake Store comes from what is carried
# (.whl, .deb; see benchmarks/mooncake_env.sh); all its traffic stays on 127.0.0.1.
#
# Then, to ship a profile: cp $OUT/h200-qwen3-0.6b.json nanoforge/sim/profiles/   (the default profile's name)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

PY=${PYTHON:-python3}
OUT=${OUT:-out}
PRESETS=${PRESETS:-qwen3-0.6b}
DEVICE=${DEVICE:-cuda}
BUDGET_S=${BUDGET_S:-75}
REPEATS=${REPEATS:-3}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-40960}
GPU_NAME=${GPU_NAME:-h200}
QUICK=${QUICK:-0}
mkdir -p "$OUT"

SERVE_EXTRAS=1 source benchmarks/mooncake_env.sh  # the frontend runs nanoforge serve
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt" || true

MODEL_DIR=$(mktemp -d)
trap 'rm -rf "$MODEL_DIR"' EXIT
extra=()
if [[ "$QUICK" == 1 ]]; then extra=(--quick --max-model-len 512); GPU_NAME=cpu; else extra=(--max-model-len "$MAX_MODEL_LEN"); fi
for preset in $PRESETS; do
    rm -rf "${MODEL_DIR:?}"/*
    $PY benchmarks/random_model.py "$MODEL_DIR" "$preset" "$DEVICE"
    start=$(date +%s)
    $PY -m nanoforge.cli simulate profile --model "$MODEL_DIR" --device "$DEVICE" --pool --frontend --budget-s "$BUDGET_S" \
        --repeats "$REPEATS" --name "$GPU_NAME-$preset" --out "$OUT/$GPU_NAME-$preset.json" "${extra[@]}" 2>&1 |
        grep -v -e '^WARNING: Logging before InitGoogleLogging' -e 'transfer_metadata.cpp' | tee "$OUT/$GPU_NAME-$preset.log"
    echo "== $preset: $(( $(date +%s) - start )) s"
done
