#!/usr/bin/env bash
# Session 49, call 1 (CALL_S seconds in all): the serving GPU tests not run at the current code (the residual-in-GEMM
# lever, the skinny matmul, weights prefetched under attention, other prefill tiles; four families), then (b) and (c)
# with the default run twice (again) and the residual-in-GEMM lever on prefill, baselines in the same process.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SECONDS=0
CALL_S=${CALL_S:-570}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
left() { echo $(( CALL_S * $1 / 100 - SECONDS )); }
timeout $(left 22) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_serve_gpu.py \
  -k "residual_added or skinny or prefetched or prefill_tiles" > $OUT/pytest_serve.log 2>&1
echo "== serve GPU tests rc $? at $SECONDS s"; tail -2 $OUT/pytest_serve.log
grep -E "^(FAILED|ERROR)|^E " $OUT/pytest_serve.log | head
timeout $(left 32) python3 .gpu/attn_probe.py > $OUT/attn_probe.log 2>&1
echo "== attn probe rc $? at $SECONDS s"; tail -40 $OUT/attn_probe.log | cut -c1-300
timeout $(left 99) python3 benchmarks/gpu_engine.py --only decode,prefill --decode-variants again \
  --prefill-variants residual_gemm --total $(left 96) --out $OUT/engine > $OUT/engine.log 2>&1
echo "== engine rc $? at $SECONDS s"
grep -E "^\((b|c)\)|auto|tok/s|WARN" $OUT/engine.log | cut -c1-700 | tail -24; grep -B2 -A20 Traceback $OUT/engine.log | head -30
