#!/usr/bin/env bash
# Session 21, call 1, on a machine just started (cold Triton cache): README command 1 with the threaded compile of
# the skinny matmul's candidates (session 20, not yet run on a GPU), then the GPU tests not yet confirmed, the
# compile benchmark, and the decode step's kernels in order with PDL off (Llama and Qwen3 shapes).
set -uo pipefail
export PYTHONUNBUFFERED=1
began=$(date +%s)
R=$OUT/r; mkdir -p $R
el() { echo $(( $(date +%s) - began )); }
python3 -m pip show setuptools 2>/dev/null | head -2 > $R/setuptools.txt; nproc >> $R/setuptools.txt; cat $R/setuptools.txt
OUT=$R/first_run LIMIT_S=250 timeout 280 bash benchmarks/gpu_first_run.sh > $R/first_run.out 2>&1
echo "== first run rc $? at $(el) s"; tail -4 $R/first_run.out; cat $R/first_run/first_run_ports.txt
grep -iE "tun|compil|held-out|listening|ready|Uvicorn" $R/first_run/first_run.log | head -20
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 200 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_kernels_gemv.py tests/test_serve_gpu.py tests/test_train.py \
    -k "in_parallel or bf16_parts or activation_checkpointing" > $R/pytest_a.log 2>&1
echo "== pytest a rc $? at $(el) s"; grep -E "PASSED|FAILED|ERROR|passed|failed" $R/pytest_a.log | tail -14
OUT=$R/ct timeout 60 python3 benchmarks/compile_threads.py > $R/compile_threads.log 2>&1
echo "== compile_threads rc $? at $(el) s"; tail -8 $R/compile_threads.log
for p in qwen3-0.6b llama3-1b; do
  left=$(( 575 - $(el) )); (( left < 40 )) && break
  NANOFORGE_PDL=0 OUT=$R/steps_$p timeout $left python3 benchmarks/gpu_engine_steps.py --only decode --decode-preset $p > $R/steps_$p.log 2>&1
  echo "== steps $p rc $? at $(el) s"; grep -E "ms a step|timeline" $R/steps_$p.log
done
