#!/usr/bin/env bash
# Session 50, call 1: NANOFORGE_STEP_IO=mapped (graphs fetch inputs from / post tokens to host rings) on a GPU: its
# kernels' and engine's GPU tests (four families), then (b) and (c) with `again` and `mapped_io` (baselines in the
# same process), then a batch-1 Qwen3 decode step's device timeline with the lever (the gap between two graphs).
cd "$(dirname "$0")/.."
CALL_S=${CALL_S:-565} bash benchmarks/gpu_call.sh \
  "tests:22:python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_host_io.py tests/test_serve_gpu.py -k 'host_io or step_io or page_locked'" \
  "engine:88:python3 benchmarks/gpu_engine.py --only decode,prefill --decode-variants again,mapped_io --total {left} --out \$OUT/engine" \
  "steps:99:NANOFORGE_STEP_IO=mapped python3 benchmarks/gpu_engine_steps.py --only decode --decode-preset qwen3-0.6b --out \$OUT/steps"
