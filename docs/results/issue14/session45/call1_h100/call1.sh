#!/usr/bin/env bash
# Session 45, call 1 (CALL_S seconds in all). On any card: the persistent kernel's layers at context 384, the
# session's start (937a88f, .gpu/old) against this tree (the attention items that don't hold the token's key poll
# their query rows alone) and its NANOFORGE_DECODE_EARLY_KV=1 variant, alternated. On an H200: then (b), the
# engine's batch-1 decode on both presets against gpt-fast-style. On an H100: the tagged kernel's GPU tests.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
SECONDS=0
CALL_S=${CALL_S:-560}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
left() { echo $(( CALL_S * $1 / 100 - SECONDS )); }
PYTHONPATH=$PWD/.gpu/old timeout $(left 14) python3 .gpu/old/benchmarks/decode_layers.py --out $OUT/old1 \
  --replays 100 > $OUT/old1.log 2>&1
echo "== old rc $? at $SECONDS s"; grep -v Warn $OUT/old1.log | cut -c1-300 | tail -14
PYTHONPATH=$PWD timeout $(left 34) python3 benchmarks/decode_layers.py --out $OUT/new1 --replays 100 \
  --variants early_kv > $OUT/new1.log 2>&1
echo "== new rc $? at $SECONDS s"; grep -v Warn $OUT/new1.log | cut -c1-400 | tail -30
PYTHONPATH=$PWD/.gpu/old timeout $(left 44) python3 .gpu/old/benchmarks/decode_layers.py --out $OUT/old2 \
  --replays 100 > $OUT/old2.log 2>&1
echo "== old again rc $? at $SECONDS s"; grep -v Warn $OUT/old2.log | cut -c1-300 | tail -14
export PYTHONPATH=$PWD
T=tests/test_kernels_decode_layers.py
if [[ $gpu == *H200* ]]; then
  timeout $(left 97) python3 benchmarks/gpu_engine.py --only decode --total $(left 94) --out $OUT/engine \
    > $OUT/engine.log 2>&1
  echo "== engine rc $? at $SECONDS s"
  grep -E "^\((b|c)\)|auto" $OUT/engine.log | cut -c1-600 | tail -30; grep -B2 -A20 Traceback $OUT/engine.log | head -30
else
  timeout $(left 97) python3 -m pytest -q -m gpu -p no:cacheprovider $T -k "tagged_vectors_without_barriers_equal" \
    > $OUT/pytest_kernel.log 2>&1
  echo "== kernel GPU tests rc $? at $SECONDS s"; tail -2 $OUT/pytest_kernel.log
  grep -E "^(FAILED|ERROR)|^E " $OUT/pytest_kernel.log | head
fi
