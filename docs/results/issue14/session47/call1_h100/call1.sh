#!/usr/bin/env bash
# Session 47, call 1 (CALL_S seconds in all). The step gathers' and sampler's GPU tests (1995c66: a step's input
# gathers in one kernel, the sampler's per-slot gathers in its kernel); (b) the engine's batch-1 decode at that
# default against the 11 PyTorch gathers (torch_gathers), both presets, against gpt-fast-style; then where a Qwen3
# engine step's time goes (gpu_engine_steps.py --only decode) with what is left.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SECONDS=0
CALL_S=${CALL_S:-570}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
left() { echo $(( CALL_S * $1 / 100 - SECONDS )); }
timeout $(left 15) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gather.py tests/test_kernels_sampling.py \
  > $OUT/pytest_gather.log 2>&1
echo "== gather/sampling GPU tests rc $? at $SECONDS s"; tail -2 $OUT/pytest_gather.log
grep -E "^(FAILED|ERROR)|^E " $OUT/pytest_gather.log | head
timeout $(left 80) python3 benchmarks/gpu_engine.py --only decode --decode-variants torch_gathers --total $(left 77) \
  --out $OUT/engine > $OUT/engine.log 2>&1
echo "== engine rc $? at $SECONDS s"
grep -E "^\((b|c)\)|auto|tok/s" $OUT/engine.log | cut -c1-700 | tail -20; grep -B2 -A20 Traceback $OUT/engine.log | head -30
timeout $(left 99) python3 benchmarks/gpu_engine_steps.py --only decode --decode-preset qwen3-0.6b --out $OUT/steps \
  > $OUT/steps.log 2>&1
echo "== steps rc $? at $SECONDS s"; grep -v Warn $OUT/steps.log | cut -c1-200 | tail -45
