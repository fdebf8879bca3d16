#!/usr/bin/env bash
# Session 39, call 3, whichever card comes: the tagged persistent decode kernel (NANOFORGE_DECODE_SYNC=tagged)
# checked and timed against the barriers; then prefill attention's 256-row tiles (the sweep) and the paged bench.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
SECONDS=0
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -k tagged tests/test_kernels_decode_layers.py > $OUT/pytest_tagged.log 2>&1
echo "== tagged GPU tests rc $? at $SECONDS s"; tail -15 $OUT/pytest_tagged.log | cut -c1-300
OUT=$OUT/dl timeout 150 python3 benchmarks/decode_layers.py --variants tagged > $OUT/dl.log 2>&1
echo "== decode_layers bench rc $? at $SECONDS s"; grep -v Warn $OUT/dl.log | tail -14 | cut -c1-250
left=$(( 560 - SECONDS ))
if (( left > 100 )); then
  OUT=$OUT/sweep timeout $(( left - 10 )) python3 benchmarks/gpu_kernels_attention.py --prefill-sweep > $OUT/sweep.log 2>&1
  echo "== prefill sweep rc $? at $SECONDS s"; grep -E "sweep,|default|best|BLOCK_M 256" $OUT/sweep.log | cut -c1-160
fi
