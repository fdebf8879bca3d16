#!/usr/bin/env bash
# Session 33, call 3: SwiGLU in the epilogue of gate-and-up's GEMM on the persistent schedule (each program an
# SM, looping over tiles: the next tile's loads in flight during this one's epilogue), against the tiled one and
# cuBLAS + the SwiGLU kernel (.gpu/gemm.py), its GPU test, then (c) Llama with both as variants.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
SECONDS=0
timeout 200 python3 .gpu/gemm.py > $OUT/gemm.log 2>&1
echo "== gemm rc $? at $SECONDS s"; grep -v "^{" $OUT/gemm.log | tail -8
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_matmul.py -k "swiglu" > $OUT/pytest_swiglu.log 2>&1
echo "== swiglu GPU tests rc $? at $SECONDS s"; tail -3 $OUT/pytest_swiglu.log
OUT=$OUT/engine timeout 260 python3 benchmarks/gpu_engine.py --only prefill --presets llama3-1b --total 220 \
  --prefill-variants swiglu_epilogue,swiglu_persistent > $OUT/engine.log 2>&1
echo "== engine rc $? at $SECONDS s"; grep -E "^\(c\)" $OUT/engine.log | cut -c1-200; grep -B2 -A20 Traceback $OUT/engine.log | head -30
