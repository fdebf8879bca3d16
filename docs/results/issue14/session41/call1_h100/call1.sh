#!/usr/bin/env bash
# Session 41 call 1 (budget-aware: CALL_S seconds in all): the tagged and auto GPU tests (with session 41's tagged
# combine and tagged trace), the layers with the tagged combine and the ring on gate-and-up (the default traced
# tagged for the first time), then (b) with auto and auto + the tagged combine.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
SECONDS=0
CALL_S=${CALL_S:-540}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
timeout $(( CALL_S * 35 / 100 )) python3 -m pytest -q -m gpu -p no:cacheprovider -k "tagged or auto" \
  tests/test_kernels_decode_layers.py > $OUT/pytest_dl.log 2>&1
echo "== decode_layers GPU tests rc $? at $SECONDS s"; tail -4 $OUT/pytest_dl.log
grep -E "^(FAILED|ERROR)" $OUT/pytest_dl.log | head
timeout $(( CALL_S * 65 / 100 - SECONDS )) python3 benchmarks/decode_layers.py --out $OUT/dl \
  --variants barrier,combine_tagged,ring3+on_gate_up,combine_tagged+ring3+on_gate_up > $OUT/dl.log 2>&1
echo "== decode_layers rc $? at $SECONDS s"; grep -v Warn $OUT/dl.log | tail -30
left=$(( CALL_S - 10 - SECONDS ))
OUT=$OUT/engine timeout $left python3 benchmarks/gpu_engine.py --only decode --total $(( left - 25 )) \
  --decode-variants auto,auto+combine_tagged > $OUT/engine.log 2>&1
echo "== engine rc $? at $SECONDS s"
grep -E "^\((b|c)\)|auto" $OUT/engine.log | cut -c1-240 | tail -30; grep -B2 -A20 Traceback $OUT/engine.log | head -30
