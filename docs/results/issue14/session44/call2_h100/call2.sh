#!/usr/bin/env bash
# Session 44, call 2 (CALL_S seconds in all): the GPU tests of the tree's kernels (the tagged kernel at all three
# widths, context 300; paged attention with the fused RoPE in a CUDA graph, full-size decode, whose token's key now comes to
# attend_new_key as values); then the layers at context 384 (benchmarks/decode_layers.py, both presets) of three
# trees, alternated: .gpu/old (4aa30a6, the session's start), .gpu/mid (f1c4f48: each program's first item's
# table chunk held from the launch's start), the tree (+ the item's Q/K/V polled as one tile, rotated
# in registers); then, with the time left, (b) on both presets (`auto`, the default) from the tree whose layers
# were fastest.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
SECONDS=0
CALL_S=${CALL_S:-540}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
dl() {  # dl NAME TREE UNTIL_PERCENT
  (cd $2 && PYTHONPATH=$PWD timeout $(( CALL_S * $3 / 100 - SECONDS )) python3 benchmarks/decode_layers.py \
    --out $OUT/dl_$1 --replays 100 > $OUT/dl_$1.log 2>&1)
  echo "== decode_layers $1 rc $? at $SECONDS s"; grep -v Warn $OUT/dl_$1.log | cut -c1-330 | grep -v "^wrote" | tail -12
}
PYTHONPATH=$PWD timeout $(( CALL_S * 30 / 100 )) python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/test_kernels_paged.py tests/test_kernels_decode_layers.py -k "(full_size_bf16 and fused and not prefill) or rope_and_kv_write or \
  (tagged_vectors_without_barriers_equal and 300 and not 3000)" > $OUT/pytest.log 2>&1
echo "== GPU tests rc $? at $SECONDS s"; tail -2 $OUT/pytest.log; grep -E "^(FAILED|ERROR)|^E " $OUT/pytest.log | head
dl new1 . 34
dl old1 .gpu/old 41
dl mid1 .gpu/mid 48
best=.; best_us=999999  # the engine runs from the tree whose layers (both presets' added) took least
for pair in "new1 ." "old1 .gpu/old" "mid1 .gpu/mid"; do
  set -- $pair
  us=$(awk '$1 ~ /^(llama3-1b|qwen3-0.6b)$/ {s += $3} END {printf "%d", s}' $OUT/dl_$1.log 2>/dev/null)
  [ -n "$us" ] && [ "$us" -gt 0 ] && [ "$us" -lt "$best_us" ] && best=$2 && best_us=$us
done
echo "== the engine from $best ($best_us us of layers, both presets)"
left=$(( CALL_S - 10 - SECONDS ))
[ $left -lt 100 ] && exit 0
(cd $best && PYTHONPATH=$PWD OUT=$OUT/engine timeout $left python3 benchmarks/gpu_engine.py --only decode \
  --total $(( left - 20 )) > $OUT/engine.log 2>&1)
echo "== engine rc $? at $SECONDS s"
grep -E "^\((b|c)\)|auto" $OUT/engine.log | cut -c1-600 | tail -20; grep -B2 -A20 Traceback $OUT/engine.log | head -30
