#!/usr/bin/env bash
# Session 33, call 4: gate-and-up + SwiGLU over a step's row counts (.gpu/sweep.py), then (c) on both shapes
# with the persistent SwiGLU epilogue as a variant.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
SECONDS=0
timeout 200 python3 .gpu/sweep.py > $OUT/sweep.log 2>&1
echo "== sweep rc $? at $SECONDS s"; cat $OUT/sweep.log | cut -c1-160
OUT=$OUT/engine timeout 330 python3 benchmarks/gpu_engine.py --only prefill --total 300 \
  --prefill-variants swiglu_persistent > $OUT/engine.log 2>&1
echo "== engine rc $? at $SECONDS s"; grep -E "^\(c\)" $OUT/engine.log | cut -c1-200; grep -B2 -A20 Traceback $OUT/engine.log | head -30
