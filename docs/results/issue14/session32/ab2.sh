#!/usr/bin/env bash
# Session 32, second A/B: 25b6575's decode_layers.py and paged_attention.py (.gpu/old) against the tree (the
# combine's loads before its barrier; the next phase's first tile loaded after the arrival), alternated twice;
# the tree's NANOFORGE_DECODE_PRELOAD_KV=1 as a variant; then the kernel's GPU tests.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
SECONDS=0
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r nanoforge benchmarks /tmp/old/ && cp .gpu/old/*.py /tmp/old/nanoforge/kernels/
nvidia-smi --query-gpu=name --format=csv,noheader
run_dl() {  # $1 tree, $2 tag, $3 extra args
  (cd "$1" && PYTHONPATH="$1" OUT="$OUT/dl_$2" timeout 120 python3 benchmarks/decode_layers.py --replays 300 $3 \
     > "$OUT/dl_$2.log" 2>&1)
  echo "== $2 rc $? at ${SECONDS} s"; grep -E "^(llama|qwen)|preload_kv:|parts" "$OUT/dl_$2.log" | cut -c1-150
}
run_dl /tmp/old old1 ""; run_dl "$PWD" new1 "--variants preload_kv"; run_dl /tmp/old old2 ""; run_dl "$PWD" new2 ""
export PYTHONPATH=$PWD
left=$(( 270 - SECONDS ))
if (( left > 40 )); then
  timeout $left python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_kernels_decode_layers.py \
    -k "one_launch and 300 and not qwen2" > "$OUT/pytest_dl.log" 2>&1
  echo "== decode_layers GPU tests rc $? at ${SECONDS} s"; grep -E "PASSED|FAILED|passed|failed" "$OUT/pytest_dl.log" | tail -4
fi
