#!/usr/bin/env bash
# Session 45, call 2 (CALL_S seconds in all), at 4dcfcb6+: the persistent kernel's layers at context 384 with the
# default against fewer L2 prefetches as each phase starts (prefetch_tiles0, 1) and the polls' shorter back-off;
# then (b), the engine's batch-1 decode on both presets against gpt-fast-style.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SECONDS=0
CALL_S=${CALL_S:-560}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
left() { echo $(( CALL_S * $1 / 100 - SECONDS )); }
timeout $(left 30) python3 benchmarks/decode_layers.py --out $OUT/dl --replays 100 \
  --variants prefetch_tiles0,prefetch_tiles1,poll_sleep128+poll_cap256 > $OUT/dl.log 2>&1
echo "== decode_layers rc $? at $SECONDS s"; grep -v Warn $OUT/dl.log | cut -c1-420 | tail -24
timeout $(left 98) python3 benchmarks/gpu_engine.py --only decode --total $(left 95) --out $OUT/engine \
  > $OUT/engine.log 2>&1
echo "== engine rc $? at $SECONDS s"
grep -E "^\((b|c)\)|auto" $OUT/engine.log | cut -c1-600 | tail -30; grep -B2 -A20 Traceback $OUT/engine.log | head -30
