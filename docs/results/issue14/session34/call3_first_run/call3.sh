#!/usr/bin/env bash
# Session 34, call 3: the README's set-up command 1 on the GPU (benchmarks/gpu_first_run.sh) after 539c56e changed
# the compiled SwiGLU epilogues, then the skinny matmul's graph-replay tests call 2's time cut, then the bf16 engine.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
SECONDS=0
PY=python3 SERVE_EXTRAS=1 source benchmarks/mooncake_env.sh > $OUT/env.log 2>&1
echo "== serve extras at $SECONDS s"; tail -2 $OUT/env.log
OUT=$OUT/first LIMIT_S=250 timeout 280 bash benchmarks/gpu_first_run.sh > $OUT/first.log 2>&1
echo "== first run rc $? at $SECONDS s"; tail -5 $OUT/first.log; cat $OUT/first/first_run.json 2>/dev/null | head -12
timeout 120 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_kernels_gemv.py -k "split_candidate" > $OUT/pytest_split.log 2>&1
echo "== split candidates rc $? at $SECONDS s"; grep -E "FAILED|ERROR| passed| failed" $OUT/pytest_split.log | cut -c1-150 | tail -4
left=$(( 530 - SECONDS ))
if (( left > 40 )); then
  timeout $left python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_serve_gpu.py -k "bf16" > $OUT/pytest_bf16.log 2>&1
  echo "== bf16 engine rc $? at $SECONDS s"; grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/pytest_bf16.log | cut -c1-150 | tail -6
fi
