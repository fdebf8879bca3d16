#!/usr/bin/env bash
# session 31 call 1: the persistent kernel's GPU tests (with the phase-C combine), the layers alone with it, the
# prefill tiles' tests at every family's heads
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $OUT/gpu.txt 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/gpu.txt 2>&1
git log --oneline -1 >> $OUT/gpu.txt 2>&1
SECONDS=0
timeout 230 python3 -m pytest -q -m gpu tests/test_kernels_decode_layers.py -k one_launch -x -p no:cacheprovider > $OUT/dl_tests.log 2>&1
echo "dl tests rc=$? at ${SECONDS}s" >> $OUT/gpu.txt
OUT=$OUT/layers timeout 200 python3 benchmarks/decode_layers.py --variants combine_out,combine_out+preload_kv > $OUT/decode_layers.log 2>&1
echo "decode_layers rc=$? at ${SECONDS}s" >> $OUT/gpu.txt
left=$(( 570 - SECONDS ))
timeout $left python3 -m pytest -q -m gpu tests/test_kernels_paged.py -k prefill_tiles -p no:cacheprovider > $OUT/tests.log 2>&1
echo "tile tests rc=$? at ${SECONDS}s" >> $OUT/gpu.txt
cat $OUT/gpu.txt; tail -4 $OUT/dl_tests.log; tail -30 $OUT/decode_layers.log; tail -4 $OUT/tests.log
