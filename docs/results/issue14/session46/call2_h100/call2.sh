#!/usr/bin/env bash
# Session 46, call 2 (CALL_S seconds in all). On any card: the persistent kernel's layers at context 384 with the
# ring taking every tile, its first stages copied before each poll (NANOFORGE_DECODE_RING_AHEAD=1), against the
# ring as it was and the default, both presets; the tagged kernel's GPU tests (they launch ring_ahead too); then
# (b), the engine's batch-1 decode, with `auto` (which times the ring kernels) and ring_ahead as a variant.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SECONDS=0
CALL_S=${CALL_S:-570}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
left() { echo $(( CALL_S * $1 / 100 - SECONDS )); }
timeout $(left 33) python3 benchmarks/decode_layers.py --out $OUT/dl --replays 200 \
  --variants ring3+on_gate_up,ring3+on_gate_up+ring_ahead,ring3,ring3+ring_ahead,ring4+ring_ahead,ring2+ring_ahead \
  > $OUT/dl.log 2>&1
echo "== layers rc $? at $SECONDS s"; grep -v Warn $OUT/dl.log | cut -c1-260 | tail -30
timeout $(left 45) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_decode_layers.py \
  -k "tagged_vectors_without_barriers_equal and 300" > $OUT/pytest_kernel.log 2>&1
echo "== tagged kernel GPU tests rc $? at $SECONDS s"; tail -2 $OUT/pytest_kernel.log
grep -E "^(FAILED|ERROR)|^E " $OUT/pytest_kernel.log | head
timeout $(left 98) python3 benchmarks/gpu_engine.py --only decode --decode-variants auto+ring_ahead \
  --total $(left 95) --out $OUT/engine > $OUT/engine.log 2>&1
echo "== engine rc $? at $SECONDS s"
grep -E "^\((b|c)\)|auto" $OUT/engine.log | cut -c1-900 | tail -30; grep -B2 -A20 Traceback $OUT/engine.log | head -30
