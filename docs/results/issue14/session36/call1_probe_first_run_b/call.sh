#!/usr/bin/env bash
# Session 36: one call, whichever card comes. Both: the weight-stream probe's TMA parts and lean departure (never
# run on a GPU). An H200: (c) and (b) on the issue's machine (none since session 26). An H100: README command 1,
# then (b).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
SECONDS=0
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
timeout 70 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_weight_stream.py > $OUT/pytest_ws.log 2>&1
echo "== weight_stream GPU tests rc $? at $SECONDS s"; tail -3 $OUT/pytest_ws.log
timeout 120 python3 benchmarks/weight_stream.py --stages 4 --gap-us 0 --out $OUT/ws > $OUT/ws.log 2>&1
echo "== weight_stream rc $? at $SECONDS s"; grep -v Warn $OUT/ws.log | tail -40
if [[ $gpu == *H200* ]]; then
  OUT=$OUT/engine timeout $(( 535 - SECONDS )) python3 benchmarks/gpu_engine.py --only prefill,decode \
    --total $(( 515 - SECONDS )) --prefill-variants swiglu_off --decode-variants auto > $OUT/engine.log 2>&1
  echo "== engine rc $? at $SECONDS s"
else
  PY=python3 SERVE_EXTRAS=1 source benchmarks/mooncake_env.sh > $OUT/env.log 2>&1
  echo "== serve extras at $SECONDS s"; tail -2 $OUT/env.log
  OUT=$OUT/first LIMIT_S=250 timeout 280 bash benchmarks/gpu_first_run.sh > $OUT/first.log 2>&1
  echo "== first run rc $? at $SECONDS s"; tail -5 $OUT/first.log; head -12 $OUT/first/first_run.json
  OUT=$OUT/engine timeout $(( 535 - SECONDS )) python3 benchmarks/gpu_engine.py --only decode \
    --total $(( 520 - SECONDS )) --decode-variants auto --presets qwen3-0.6b > $OUT/engine.log 2>&1
  echo "== engine rc $? at $SECONDS s"
fi
grep -E "^\((b|c)\)" $OUT/engine.log | cut -c1-220; grep -B2 -A20 Traceback $OUT/engine.log | head -30
