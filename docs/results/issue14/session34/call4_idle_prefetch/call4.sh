#!/usr/bin/env bash
# Session 34, call 4: NANOFORGE_DECODE_IDLE_PREFETCH_MB (the attention phase's idle programs ask L2 for the weights
# after attention): the one-launch GPU test (Qwen3 at contexts 1, 300, 3000; Llama at 300) (bit for bit a launch per phase, with it among the
# launches), the layers alone at 24 and 40 MiB against the default, then (b) on Qwen3 with it if time is left.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SECONDS=0
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_kernels_decode_layers.py -x \
  -k "one_launch and (llama3-1b-300 or qwen3)" > $OUT/pytest.log 2>&1
rc=$?; echo "== one-launch tests rc $rc at $SECONDS s"; grep -E "PASSED|FAILED|ERROR| passed| failed" $OUT/pytest.log | cut -c1-150 | tail -4
(( rc == 0 )) || { tail -40 $OUT/pytest.log; exit 1; }
OUT=$OUT/layers timeout 150 python3 benchmarks/decode_layers.py --variants idle_prefetch24,idle_prefetch40 > $OUT/layers.log 2>&1
echo "== decode_layers.py rc $? at $SECONDS s"; tail -14 $OUT/layers.log
left=$(( 370 - SECONDS ))
if (( left > 90 )); then
  OUT=$OUT/engine timeout $(( left + 20 )) python3 benchmarks/gpu_engine.py --only decode --presets qwen3-0.6b \
    --total $left --decode-variants persistent,persistent_idle_prefetch24 > $OUT/engine.log 2>&1
  echo "== (b) rc $? at $SECONDS s"; grep -E "^\(b\)" $OUT/engine.log | cut -c1-220
fi
