#!/usr/bin/env bash
# Session 40, call 1, whichever card comes: the persistent decode kernel's levers built after session 39's H200
# calls (wide first loads under tagged, poll back-off, K/V preload/prefetch under tagged, the weight ring), timed
# against the default kernel in one process; then its GPU tests (bit equality of every launch kind).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
SECONDS=0
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
OUT=$OUT/dl timeout 330 python3 benchmarks/decode_layers.py \
  --variants tagged,tagged+poll_sleep256,tagged+preload_kv,tagged+prefetch_kv2,ring4,tagged+ring4,tagged+preload_kv+ring3 \
  > $OUT/dl.log 2>&1
echo "== decode_layers bench rc $? at $SECONDS s"; grep -v Warn $OUT/dl.log | tail -40 | cut -c1-300
left=$(( 575 - SECONDS ))
timeout $left python3 -m pytest -q -m gpu -p no:cacheprovider -k "tagged or one_launch" tests/test_kernels_decode_layers.py > $OUT/pytest_dl.log 2>&1
echo "== GPU tests rc $? at $SECONDS s"; tail -25 $OUT/pytest_dl.log | cut -c1-300
