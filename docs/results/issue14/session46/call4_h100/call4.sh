#!/usr/bin/env bash
# Session 46, call 4 (CALL_S seconds in all), at the tree that turns NANOFORGE_DECODE_RING_AHEAD on by default.
# On an H200: (b) first (the engine's batch-1 decode, both presets, against gpt-fast-style). On an H100: which
# projections the ring should serve now that it starts before each poll, and whether the L2 prefetch of the next
# phase's tiles still helps beside it (the layers, context 384). Then the tagged kernel's GPU tests (bits of every
# ring way against launches per phase) and the kernel's engine GPU tests (auto, which now times the ring kernels
# with their first tiles copied before each poll: the reference tokens on Llama, Qwen2 and Qwen3 shapes).
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SECONDS=0
CALL_S=${CALL_S:-570}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
left() { echo $(( CALL_S * $1 / 100 - SECONDS )); }
T=tests/test_kernels_decode_layers.py
if [[ $gpu == *H200* ]]; then
  timeout $(left 36) python3 benchmarks/gpu_engine.py --only decode --total $(left 33) --out $OUT/engine \
    > $OUT/engine.log 2>&1
  echo "== engine rc $? at $SECONDS s"
  grep -E "^\((b|c)\)|auto" $OUT/engine.log | cut -c1-900 | tail -30; grep -B2 -A20 Traceback $OUT/engine.log | head -30
else
  timeout $(left 20) python3 benchmarks/decode_layers.py --presets qwen3-0.6b --out $OUT/dl_qwen3 --replays 200 \
    --variants ring3+on_gate_up,ring3+on_gate_up.down,ring3+on_qkv.gate_up,ring4+on_gate_up,ring3+on_gate_up+prefetch_tiles0 \
    > $OUT/dl_qwen3.log 2>&1
  echo "== qwen3 layers rc $? at $SECONDS s"; grep -v Warn $OUT/dl_qwen3.log | grep -E "^qwen|^   ring" | cut -c1-120
  timeout $(left 33) python3 benchmarks/decode_layers.py --presets llama3-1b --out $OUT/dl_llama --replays 200 \
    --variants ring3,ring3+prefetch_tiles0,ring4 > $OUT/dl_llama.log 2>&1
  echo "== llama layers rc $? at $SECONDS s"; grep -v Warn $OUT/dl_llama.log | grep -E "^llama|^   ring" | cut -c1-120
fi
timeout $(left 55) python3 -m pytest -q -m gpu -p no:cacheprovider $T \
  -k "tagged_vectors_without_barriers_equal and (300 or 3000)" > $OUT/pytest_tagged.log 2>&1
echo "== tagged kernel GPU tests rc $? at $SECONDS s"; tail -1 $OUT/pytest_tagged.log
grep -E "^(FAILED|ERROR)|^E " $OUT/pytest_tagged.log | head
timeout $(left 99) python3 -m pytest -q -m gpu -p no:cacheprovider $T -k "engine_with or auto_keeps" \
  > $OUT/pytest_engine.log 2>&1
echo "== kernel engine GPU tests rc $? at $SECONDS s"; tail -1 $OUT/pytest_engine.log
grep -E "^(FAILED|ERROR)|^E " $OUT/pytest_engine.log | head
