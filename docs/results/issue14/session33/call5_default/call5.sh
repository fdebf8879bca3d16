#!/usr/bin/env bash
# Session 33, call 5, with the persistent SwiGLU epilogue the default from 1,024 rows: its GPU tests (the GEMM at
# full size, the engine in bf16 on the four families), then (a) and (c) with `swiglu_off` (the old default) as
# the same-process variant, then one prefill step's kernels.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_kernels_matmul.py tests/test_serve_gpu.py \
  -k "swiglu or bf16" > $OUT/pytest.log 2>&1
echo "== GPU tests rc $? at $SECONDS s"; grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/pytest.log | cut -c1-150 | tail -12
OUT=$OUT/engine timeout 330 python3 benchmarks/gpu_engine.py --only throughput,prefill --total 300 \
  --prefill-variants swiglu_off > $OUT/engine.log 2>&1
echo "== engine rc $? at $SECONDS s"; grep -E "^\((a|c)\)" $OUT/engine.log | cut -c1-220; grep -B2 -A20 Traceback $OUT/engine.log | head -30
left=$(( 560 - SECONDS ))
if (( left > 40 )); then
  OUT=$OUT/steps timeout $left python3 benchmarks/gpu_engine_steps.py --only steps > $OUT/steps.log 2>&1
  echo "== steps rc $? at $SECONDS s"; grep -v Warn $OUT/steps.log | tail -3
  python3 -c "
import json, os
d = json.load(open(os.environ['OUT'] + '/steps/diag.json'))
for r in d.get('eager_step_kernels', [])[:12]: print(r)"
fi
