#!/usr/bin/env bash
# Session 45, call 3 (CALL_S seconds in all): call 2's prefetch_tiles0 on Llama-3.2-1B's layers again (1.05x in
# call 2), with the ring `auto` chooses, and the back-off variant on Qwen3-0.6B's; then (b) on Llama with the
# engine's `auto` without the L2 prefetch (auto+pf0) against the default in one process.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SECONDS=0
CALL_S=${CALL_S:-560}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
left() { echo $(( CALL_S * $1 / 100 - SECONDS )); }
timeout $(left 22) python3 benchmarks/decode_layers.py --presets llama3-1b --out $OUT/dl_llama --replays 200 \
  --variants prefetch_tiles0,ring3+on_gate_up,ring3+on_gate_up+prefetch_tiles0,prefetch_tiles0+tagged,prefetch_tiles1+poll_cap256 \
  > $OUT/dl_llama.log 2>&1
echo "== llama layers rc $? at $SECONDS s"; grep -v Warn $OUT/dl_llama.log | cut -c1-300 | tail -12
timeout $(left 36) python3 benchmarks/decode_layers.py --presets qwen3-0.6b --out $OUT/dl_qwen3 --replays 200 \
  --variants poll_sleep128+poll_cap256,poll_cap256,prefetch_tiles0 > $OUT/dl_qwen3.log 2>&1
echo "== qwen3 layers rc $? at $SECONDS s"; grep -v Warn $OUT/dl_qwen3.log | cut -c1-300 | tail -10
timeout $(left 97) python3 benchmarks/gpu_engine.py --only decode --presets llama3-1b --decode-variants auto+pf0,again \
  --total $(left 94) --out $OUT/engine > $OUT/engine.log 2>&1
echo "== engine rc $? at $SECONDS s"
grep -E "^\((b|c)\)|auto" $OUT/engine.log | cut -c1-700 | tail -30; grep -B2 -A20 Traceback $OUT/engine.log | head -30
