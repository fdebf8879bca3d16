#!/usr/bin/env bash
# Session 35, call 4: weight_stream's TMA parts (its copies with barriers and alone: does the arrival's fence wait
# for cp.async copies and not for TMA's?), its GPU tests, then the README's set-up command 1 on the GPU.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_weight_stream.py 2>&1 | tail -2
echo "== weight_stream GPU tests at $SECONDS s"
timeout 90 python3 benchmarks/weight_stream.py --stages 4 --gap-us 0 --out $OUT/ws 2>&1 | grep -v Warn
echo "== weight_stream at $SECONDS s"
PY=python3 SERVE_EXTRAS=1 source benchmarks/mooncake_env.sh > $OUT/env.log 2>&1
echo "== serve extras at $SECONDS s"; tail -2 $OUT/env.log
OUT=$OUT/first LIMIT_S=250 timeout 280 bash benchmarks/gpu_first_run.sh > $OUT/first.log 2>&1
echo "== first run rc $? at $SECONDS s"; tail -5 $OUT/first.log; cat $OUT/first/first_run.json 2>/dev/null | head -12
