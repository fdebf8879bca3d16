#!/usr/bin/env bash
# Session 45, call 4 (CALL_S seconds in all), at this session's kernel (the attention items that don't hold the
# token's key poll their query rows alone): README command 1 on a GPU from this checkout (gpu_first_run.sh, the
# serve extras from the carried wheels), then the serving GPU tests (GPT-2, Llama, Qwen2, Qwen3), then the
# kernel's engine GPU tests (the engine with the kernel and with tagged vectors on Llama, Qwen2, Qwen3; `auto`).
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
SECONDS=0
CALL_S=${CALL_S:-540}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
left() { echo $(( CALL_S * $1 / 100 - SECONDS )); }
PY=python3 SERVE_EXTRAS=1 source benchmarks/mooncake_env.sh > $OUT/env.log 2>&1
OUT=$OUT/first LIMIT_S=190 timeout $(left 40) bash benchmarks/gpu_first_run.sh > $OUT/first_run_stdout.log 2>&1
echo "== first run rc $? at $SECONDS s"; tail -5 $OUT/first_run_stdout.log; cat $OUT/first/*.json 2>/dev/null | head -30
cat $OUT/first/first_run_ports.txt 2>/dev/null
export PYTHONPATH=$PWD
timeout $(left 78) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_serve_gpu.py > $OUT/pytest_serve.log 2>&1
echo "== serve GPU tests rc $? at $SECONDS s"; tail -2 $OUT/pytest_serve.log
grep -E "^(FAILED|ERROR)|^E " $OUT/pytest_serve.log | head
timeout $(left 98) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_decode_layers.py \
  -k "engine_with or auto_keeps" > $OUT/pytest_kernel.log 2>&1
echo "== kernel engine GPU tests rc $? at $SECONDS s"; tail -2 $OUT/pytest_kernel.log
grep -E "^(FAILED|ERROR)|^E " $OUT/pytest_kernel.log | head
