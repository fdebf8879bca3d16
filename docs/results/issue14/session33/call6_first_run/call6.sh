#!/usr/bin/env bash
# Session 33, call 6: the bf16 engine test call 5's time cut (Qwen3), the README's set-up command 1 on the GPU
# (benchmarks/gpu_first_run.sh), and the persistent decode kernel's engine tests if time is left.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
SECONDS=0
timeout 100 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_serve_gpu.py -k "bf16 and qwen3" > $OUT/pytest_qwen3.log 2>&1
echo "== bf16 qwen3 rc $? at $SECONDS s"; grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/pytest_qwen3.log | cut -c1-150 | tail -3
PY=python3 SERVE_EXTRAS=1 source benchmarks/mooncake_env.sh > $OUT/env.log 2>&1
echo "== serve extras at $SECONDS s"; tail -2 $OUT/env.log
OUT=$OUT/first LIMIT_S=250 timeout 280 bash benchmarks/gpu_first_run.sh > $OUT/first.log 2>&1
echo "== first run rc $? at $SECONDS s"; tail -5 $OUT/first.log; cat $OUT/first/first_run.json 2>/dev/null | head -12
ss -ltnp > $OUT/ports.txt 2>&1
left=$(( 470 - SECONDS ))
if (( left > 40 )); then
  timeout $left python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_kernels_decode_layers.py -k engine > $OUT/pytest_dl_engine.log 2>&1
  echo "== decode layers engine tests rc $? at $SECONDS s"; grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/pytest_dl_engine.log | cut -c1-150 | tail -6
fi
