#!/usr/bin/env bash
# Session 38, call 1, whichever card comes. Both: the weight-stream probe's GPU tests (group-local barriers and
# tagged vectors, built in session 37, never run) and its benchmark with the trace; the three serve_gpu tests
# session 37's call did not reach. An H200: (c) and (b) on the issue's machine. An H100: README command 1.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
SECONDS=0
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_weight_stream.py > $OUT/pytest_ws.log 2>&1
echo "== weight_stream GPU tests rc $? at $SECONDS s"; tail -15 $OUT/pytest_ws.log | cut -c1-300
timeout 170 python3 benchmarks/weight_stream.py --stages 4 --gap-us 0 --trace --out $OUT/ws > $OUT/ws.log 2>&1
echo "== weight_stream rc $? at $SECONDS s"; grep -v Warn $OUT/ws.log | tail -80 | cut -c1-250
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -k "seeded or after_another" tests/test_serve_gpu.py \
  > $OUT/pytest_rest.log 2>&1
echo "== serve_gpu rest rc $? at $SECONDS s"; tail -4 $OUT/pytest_rest.log
if [[ $gpu == *H200* ]]; then
  OUT=$OUT/engine timeout $(( 570 - SECONDS )) python3 benchmarks/gpu_engine.py --only prefill,decode \
    --total $(( 550 - SECONDS )) --prefill-variants swiglu_off --decode-variants auto > $OUT/engine.log 2>&1
  echo "== engine rc $? at $SECONDS s"
  grep -E "^\((b|c)\)" $OUT/engine.log | cut -c1-220; grep -B2 -A20 Traceback $OUT/engine.log | head -30
else
  PY=python3 SERVE_EXTRAS=1 source benchmarks/mooncake_env.sh > $OUT/env.log 2>&1
  echo "== serve extras at $SECONDS s"; tail -2 $OUT/env.log
  OUT=$OUT/first LIMIT_S=250 timeout $(( 585 - SECONDS )) bash benchmarks/gpu_first_run.sh > $OUT/first.log 2>&1
  echo "== first run rc $? at $SECONDS s"; tail -5 $OUT/first.log; head -12 $OUT/first/first_run.json
fi
