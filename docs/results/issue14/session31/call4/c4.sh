#!/usr/bin/env bash
# session 31 call 4: README set-up command 1 on the GPU, as benchmarks/gpu_first_run.sh runs it (serve extras
# installed offline from ./.whl, deps resolved)
nvidia-smi --query-gpu=name --format=csv > $OUT/gpu.txt 2>&1
OUT=$OUT/first LIMIT_S=250 bash benchmarks/gpu_first_run.sh > $OUT/first.log 2>&1
echo "first run rc=$? at ${SECONDS}s" >> $OUT/gpu.txt
cat $OUT/gpu.txt; tail -8 $OUT/first.log; cat $OUT/first/*.json; cat $OUT/first/first_run_ports.txt; tail -5 $OUT/first/first_run.log
