#!/usr/bin/env bash
# session 30 call 2: the persistent decode kernel's levers (README next-calls #2)
export PYTHONPATH=$PWD
OUT=$OUT/dl BUDGET_S=${BUDGET_S:-550} bash benchmarks/gpu_decode_layers.sh > $OUT/dl.log 2>&1
tail -60 $OUT/dl.log
