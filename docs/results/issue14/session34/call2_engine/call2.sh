#!/usr/bin/env bash
# Session 34, call 2: the GPU tests of 539c56e's one SwiGLU rounding (the GEMM's epilogue at full size, the skinny
# matmul at the models' shapes, in graphs), then (b) and (c) with the session's defaults.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SECONDS=0
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 110 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_kernels_matmul.py tests/test_kernels_gemv.py \
  -k "swiglu or model_shapes or split_candidate" > $OUT/pytest_swiglu.log 2>&1
echo "== swiglu GPU tests rc $? at $SECONDS s"; grep -E "FAILED|ERROR| passed| failed" $OUT/pytest_swiglu.log | cut -c1-150 | tail -8
OUT=$OUT/engine timeout $(( 575 - SECONDS )) python3 benchmarks/gpu_engine.py --only prefill,decode \
  --total $(( 540 - SECONDS )) --prefill-variants swiglu_off > $OUT/engine.log 2>&1
echo "== engine rc $? at $SECONDS s"; grep -E "^\((b|c)\)" $OUT/engine.log | cut -c1-220; grep -B2 -A20 Traceback $OUT/engine.log | head -30
