#!/usr/bin/env bash
# Session 48, call 1 (CALL_S seconds in all), the first H200 since session 39: the step gathers', sampler's and
# LM head's (gemv) GPU tests and the upload lever's engine tests; then (b) the engine's batch-1 decode at the
# current default against itself with the inputs uploaded ahead (upload_ahead), the polls' back-off capped at 256 ns
# (poll_cap256) and both, both presets, against gpt-fast-style; (c) prefill against HF's SDPA forward.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SECONDS=0
CALL_S=${CALL_S:-570}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
left() { echo $(( CALL_S * $1 / 100 - SECONDS )); }
timeout $(left 16) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gather.py \
  tests/test_kernels_sampling.py tests/test_kernels_gemv.py tests/test_serve_gpu.py -k "not serve_gpu or uploaded_ahead" \
  > $OUT/pytest_kernels.log 2>&1
echo "== gather/sampling/gemv GPU tests rc $? at $SECONDS s"; tail -2 $OUT/pytest_kernels.log
grep -E "^(FAILED|ERROR)|^E " $OUT/pytest_kernels.log | head
timeout $(left 99) python3 benchmarks/gpu_engine.py --only decode,prefill --decode-variants upload_ahead,poll_cap256,upload_ahead+poll_cap256 \
  --total $(left 96) --out $OUT/engine > $OUT/engine.log 2>&1
echo "== engine rc $? at $SECONDS s"
grep -E "^\((b|c)\)|auto|tok/s" $OUT/engine.log | cut -c1-700 | tail -24; grep -B2 -A20 Traceback $OUT/engine.log | head -30
