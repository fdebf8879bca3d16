#!/usr/bin/env bash
# session 30 call 1: prefill
set -u
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $OUT/gpu.txt 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/gpu.txt 2>&1
SECONDS=0
timeout 130 python3 -m pytest -q -m gpu tests/test_kernels_paged.py tests/test_kernels_matmul.py \
  -k "full_size or prefill_tiles or swiglu_epilogue or preload" -x -p no:cacheprovider > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s" >> $OUT/gpu.txt
timeout 120 python3 benchmarks/gpu_kernels_attention.py --prefill-sweep > $OUT/sweep.log 2>&1
echo "sweep rc=$? at ${SECONDS}s" >> $OUT/gpu.txt
left=$(( 560 - SECONDS )); tot=$(( left - 40 ))
timeout $left python3 benchmarks/gpu_engine.py --only prefill --total $tot \
  --prefill-variants swiglu_epilogue,128x64w8s3,128x128w8s3 > $OUT/engine.log 2>&1
echo "engine rc=$? at ${SECONDS}s" >> $OUT/gpu.txt
ls $OUT >> $OUT/gpu.txt
