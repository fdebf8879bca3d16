#!/usr/bin/env bash
# session 31 call 2 (README next-calls #1): (c) and (b) on the H200 with session 30's defaults
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv > $OUT/gpu.txt 2>&1
timeout 570 python3 benchmarks/gpu_engine.py --only prefill,decode --total 530 \
  --prefill-variants 64x64w4s3,swiglu_epilogue --decode-variants auto,persistent,persistent_combine_out > $OUT/engine.log 2>&1
echo "engine rc=$?" >> $OUT/gpu.txt
cat $OUT/gpu.txt; tail -45 $OUT/engine.log
