#!/usr/bin/env bash
# Session 51, call 1. On an H200: (b) and (c) first (the rows the targets are set on), then the serving GPU tests
# of the default paths (the padding change, 570fba2). On an H100: the serving GPU tests, all 25.
cd "$(dirname "$0")/.."
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  CALL_S=${CALL_S:-565} bash benchmarks/gpu_call.sh \
    "engine:62:python3 benchmarks/gpu_engine.py --only decode,prefill --decode-variants again --total {left} --out \$OUT/engine" \
    "tests:99:python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_serve_gpu.py -k 'greedy_equals or skinny or seeded or after_another'"
else
  CALL_S=${CALL_S:-565} bash benchmarks/gpu_call.sh \
    "tests:62:python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_serve_gpu.py -k 'greedy_equals or skinny or seeded or after_another'" \
    "tests2:99:python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_serve_gpu.py -k 'not (greedy_equals or skinny or seeded or after_another)'"
fi
