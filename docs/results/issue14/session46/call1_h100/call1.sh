#!/usr/bin/env bash
# Session 46, call 1 (CALL_S seconds in all). On any card: the persistent kernel's layers at context 384 with
# NANOFORGE_DECODE_FIRST_TILE=after (session 45's lever, untimed) against the default, both presets. On an H200:
# then (b) with first_after as an engine variant. On an H100: the kernel's engine GPU tests (9 of 13 not run in s45).
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SECONDS=0
CALL_S=${CALL_S:-570}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
left() { echo $(( CALL_S * $1 / 100 - SECONDS )); }
timeout $(left 24) python3 benchmarks/decode_layers.py --out $OUT/dl --replays 200 \
  --variants first_after,first_after+poll_cap256,poll_cap256 > $OUT/dl.log 2>&1
echo "== layers rc $? at $SECONDS s"; grep -v Warn $OUT/dl.log | cut -c1-300 | tail -24
T=tests/test_kernels_decode_layers.py
if [[ $gpu == *H200* ]]; then
  timeout $(left 97) python3 benchmarks/gpu_engine.py --only decode --decode-variants first_after \
    --total $(left 94) --out $OUT/engine > $OUT/engine.log 2>&1
  echo "== engine rc $? at $SECONDS s"
  grep -E "^\((b|c)\)|auto|first" $OUT/engine.log | cut -c1-600 | tail -30; grep -B2 -A20 Traceback $OUT/engine.log | head -30
else
  timeout $(left 98) python3 -m pytest -q -m gpu -p no:cacheprovider $T -k "engine_with or auto_keeps" \
    > $OUT/pytest_kernel.log 2>&1
  echo "== kernel engine GPU tests rc $? at $SECONDS s"; tail -2 $OUT/pytest_kernel.log
  grep -E "^(FAILED|ERROR)|^E |passed|failed" $OUT/pytest_kernel.log | head
fi
