#!/usr/bin/env bash
# Session 38, call 2, whichever card comes: the tagged ways again after the poll's fix (each word polled by one
# thread, the tile's copies from one poll), checked and timed; the engine's prefill attention against torch
# SDPA's backends; on an H200, (c) and (b).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
SECONDS=0
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider -k tagged tests/test_kernels_weight_stream.py > $OUT/pytest_ws.log 2>&1
echo "== weight_stream tagged GPU tests rc $? at $SECONDS s"; tail -6 $OUT/pytest_ws.log | cut -c1-300
timeout 150 python3 benchmarks/weight_stream.py --stages 4 --gap-us 0 --out $OUT/ws > $OUT/ws.log 2>&1
echo "== weight_stream rc $? at $SECONDS s"; grep -v Warn $OUT/ws.log | grep -v "(" | tail -40 | cut -c1-200
timeout 100 python3 .gpu/sdpa_probe.py > $OUT/sdpa.log 2>&1
echo "== sdpa probe rc $? at $SECONDS s"; tail -4 $OUT/sdpa.log | cut -c1-900
if [[ $gpu == *H200* ]]; then
  OUT=$OUT/engine timeout $(( 580 - SECONDS )) python3 benchmarks/gpu_engine.py --only prefill,decode \
    --total $(( 560 - SECONDS )) --prefill-variants swiglu_off --decode-variants auto > $OUT/engine.log 2>&1
  echo "== engine rc $? at $SECONDS s"
  grep -E "^\((b|c)\)" $OUT/engine.log | cut -c1-220; grep -B2 -A20 Traceback $OUT/engine.log | head -30
fi
