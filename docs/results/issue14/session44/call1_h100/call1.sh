#!/usr/bin/env bash
# Session 44, call 1 (CALL_S seconds in all). On any card: the persistent kernel's layers at context 384 with
# the default (tagged, one poller, back-off cap 512 ns) against the KV preload (the attention items' first K/V
# tile loaded before their query's poll), the back-off capped at 256 and 128 ns, and a 3-stage ring on gate-and-up.
# On an H200: then (b), the engine's batch-1 decode on both presets against gpt-fast-style, and the serving GPU
# tests. On an H100: the GPU tests not run in session 43 (the tagged kernel at Qwen2's width, contexts 1 and 3,000;
# the engine with the kernel, tagged and `auto`), then the serving GPU tests.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SECONDS=0
CALL_S=${CALL_S:-560}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
left() { echo $(( CALL_S * $1 / 100 - SECONDS )); }
timeout $(left 25) python3 benchmarks/decode_layers.py --out $OUT/dl --replays 100 \
  --variants preload_kv,poll_cap256,poll_cap128,ring3+on_gate_up > $OUT/dl.log 2>&1
echo "== decode_layers rc $? at $SECONDS s"; grep -v Warn $OUT/dl.log | cut -c1-400 | tail -24
T=tests/test_kernels_decode_layers.py
if [[ $gpu == *H200* ]]; then
  timeout $(left 75) python3 benchmarks/gpu_engine.py --only decode --total $(left 72) --out $OUT/engine \
    > $OUT/engine.log 2>&1
  echo "== engine rc $? at $SECONDS s"
  grep -E "^\((b|c)\)|auto" $OUT/engine.log | cut -c1-600 | tail -30; grep -B2 -A20 Traceback $OUT/engine.log | head -30
else
  timeout $(left 70) python3 -m pytest -q -m gpu -p no:cacheprovider $T -k "(tagged_vectors_without_barriers_equal \
    and (qwen2 or -1] or 3000)) or engine_with or auto_keeps" > $OUT/pytest_kernel.log 2>&1
  echo "== kernel GPU tests rc $? at $SECONDS s"; tail -2 $OUT/pytest_kernel.log
  grep -E "^(FAILED|ERROR)|^E " $OUT/pytest_kernel.log | head
fi
timeout $(left 97) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_serve_gpu.py > $OUT/pytest_serve.log 2>&1
echo "== serve GPU tests rc $? at $SECONDS s"; tail -2 $OUT/pytest_serve.log
grep -E "^(FAILED|ERROR)|^E " $OUT/pytest_serve.log | head
