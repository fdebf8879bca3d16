#!/usr/bin/env bash
# Session 49, call 2: the persistent kernel's engine GPU tests (Qwen2/Qwen3 not since session 46), the rest of the
# serving GPU tests (bf16 near-ties, the cache sized from the budget), then a Qwen3-0.6B engine step's ops.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SECONDS=0
CALL_S=${CALL_S:-570}
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
left() { echo $(( CALL_S * $1 / 100 - SECONDS )); }
timeout $(left 45) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_decode_layers.py \
  -k "engine or auto" > $OUT/pytest_layers.log 2>&1
echo "== kernel engine tests rc $? at $SECONDS s"; tail -2 $OUT/pytest_layers.log
grep -E "^(FAILED|ERROR)|^E " $OUT/pytest_layers.log | head
timeout $(left 75) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_serve_gpu.py \
  -k "bf16 or cache_from" > $OUT/pytest_bf16.log 2>&1
echo "== bf16 tests rc $? at $SECONDS s"; tail -2 $OUT/pytest_bf16.log
grep -E "^(FAILED|ERROR)|^E " $OUT/pytest_bf16.log | head
timeout $(left 99) python3 benchmarks/gpu_engine_steps.py --only decode --decode-preset qwen3-0.6b --out $OUT/steps \
  > $OUT/steps.log 2>&1
echo "== steps rc $? at $SECONDS s"; tail -40 $OUT/steps.log | cut -c1-200
