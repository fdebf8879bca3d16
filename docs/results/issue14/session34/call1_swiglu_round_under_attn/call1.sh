#!/usr/bin/env bash
# Session 34, call 1: the one SwiGLU rounding (539c56e) -- its GPU tests, its GEMM against 539c56e^'s kernels
# alternated twice -- then the attention phase's L2 asks (NANOFORGE_DECODE_UNDER_ATTN_MB) with gpu_decode_layers.sh.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name --format=csv,noheader
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r nanoforge /tmp/old/ && cp .gpu/old/*.py /tmp/old/nanoforge/kernels/
for i in 1 2; do
  (cd /tmp/old && PYTHONPATH=/tmp/old OUT=$OUT timeout 90 python3 $OLDPWD/.gpu/gemm.py old$i) 2>&1 | grep -v Warn
  PYTHONPATH=$PWD OUT=$OUT timeout 90 python3 .gpu/gemm.py new$i 2>&1 | grep -v Warn
  echo "== gemm round $i at $SECONDS s"
done
PYTHONPATH=$PWD timeout 150 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_kernels_matmul.py \
  tests/test_kernels_gemv.py tests/test_kernels_swiglu.py -k "swiglu or gpu" > $OUT/pytest_swiglu.log 2>&1
echo "== swiglu GPU tests rc $? at $SECONDS s"; grep -E "FAILED|ERROR| passed| failed" $OUT/pytest_swiglu.log | cut -c1-150 | tail -8
OUT=$OUT/dl BUDGET_S=$(( 575 - SECONDS )) bash benchmarks/gpu_decode_layers.sh
echo "== done at $SECONDS s"
