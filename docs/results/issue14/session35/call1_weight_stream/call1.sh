#!/usr/bin/env bash
# Session 35, call 1: kernels/weight_stream.py's first GPU run: its GPU tests, then the benchmark at both shapes.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
python3 -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)"
PYTHONPATH=$PWD timeout 200 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_kernels_weight_stream.py \
  > $OUT/pytest_ws.log 2>&1
echo "== weight_stream GPU tests rc $? at $SECONDS s"; grep -E "PASS|FAIL|ERROR| passed| failed|Error" $OUT/pytest_ws.log | cut -c1-200 | tail -20
PYTHONPATH=$PWD timeout $(( 560 - SECONDS )) python3 benchmarks/weight_stream.py --out $OUT/ws 2>&1 | grep -v Warn
echo "== bench rc ${PIPESTATUS[0]} at $SECONDS s"
