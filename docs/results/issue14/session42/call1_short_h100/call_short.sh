#!/usr/bin/env bash
# Session 42, the short call (CALL_S seconds in all; what was left after failed starts), `auto` the GPU's default
# in the tree: Qwen3-0.6B's layers (default traced: each hand-over read from its last program) with the poll
# back-off capped at 512 and 1,024 ns and with attention's steps of 16 keys; then auto's GPU tests (unset: the
# default) and the engine-with-the-kernel ones, as time allows.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
SECONDS=0
CALL_S=${CALL_S:-300}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
timeout $(( CALL_S * 50 / 100 )) python3 benchmarks/decode_layers.py --out $OUT/dl_qwen3 --presets qwen3-0.6b \
  --replays 100 --variants poll_cap512,poll_cap1024,attn_block_n16 > $OUT/dl_qwen3.log 2>&1
echo "== decode_layers qwen3 rc $? at $SECONDS s"; grep -v Warn $OUT/dl_qwen3.log | cut -c1-400 | tail -14
left=$(( CALL_S - 6 - SECONDS ))
T=tests/test_kernels_decode_layers.py
timeout $left python3 -m pytest -v -m gpu -p no:cacheprovider \
  $T::test_gpu_auto_keeps_the_faster_graph_of_a_decode_step_and_decodes_the_reference_tokens \
  $T::test_gpu_engine_with_layers_in_one_kernel_decodes_the_reference_tokens > $OUT/pytest_auto.log 2>&1
echo "== auto GPU tests rc $? at $SECONDS s"
grep -E " (PASSED|FAILED|ERROR)|passed|failed" $OUT/pytest_auto.log | cut -c1-200 | head -30
grep -E "^E " $OUT/pytest_auto.log | head -20
