#!/usr/bin/env bash
# Session 52, call 1. On an H200: (b) and (c) first, then the serving + paged GPU tests (the take-outs, d196ac7).
# On an H100: the serving + paged GPU tests, then the disaggregation GPU tests with the Mooncake wheel.
cd "$(dirname "$0")/.."
export PY=python3
(SERVE_EXTRAS=1 source benchmarks/mooncake_env.sh > $OUT/env.log 2>&1; echo env rc $?)
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  CALL_S=${CALL_S:-565} bash benchmarks/gpu_call.sh \
    "engine:60:python3 benchmarks/gpu_engine.py --only decode,prefill --decode-variants again --total {left} --out \$OUT/engine" \
    "tests:99:python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_serve_gpu.py tests/test_kernels_paged.py tests/test_kernels_tuning_cache.py -x -k 'greedy_equals or skinny or seeded or after_another or paged or tuning'"
else
  CALL_S=${CALL_S:-565} bash benchmarks/gpu_call.sh \
    "tests:75:python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_serve_gpu.py tests/test_kernels_paged.py tests/test_kernels_tuning_cache.py" \
    "disagg:99:source benchmarks/mooncake_env.sh && python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_disagg_gpu.py"
fi
