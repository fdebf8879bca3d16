#!/usr/bin/env bash
# Session 33, call 1: the GPU tests of what session 32 built after its last call (scalar block ids, the barrier's
# arrive/depart split, the combine's loads before its max), then the A/B: 25b6575's decode_layers.py and
# paged_attention.py (.gpu/old) against the tree, alternated twice, the tree with --variants scalar_ids,preload_kv.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD
timeout 200 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_kernels_paged.py tests/test_kernels_decode_layers.py \
  -k "block_ids or (one_launch and not qwen2) or gives_up" > "$OUT/pytest.log" 2>&1
echo "== GPU tests rc $? at ${SECONDS} s"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/pytest.log" | cut -c1-160 | tail -16
grep -q "FAILED\|ERROR" "$OUT/pytest.log" && grep -B5 -A40 "^____" "$OUT/pytest.log" | head -80
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r nanoforge benchmarks /tmp/old/ && cp .gpu/old/*.py /tmp/old/nanoforge/kernels/
run_dl() {  # $1 tree, $2 tag, $3 extra args
  (cd "$1" && PYTHONPATH="$1" OUT="$OUT/dl_$2" timeout 110 python3 benchmarks/decode_layers.py --replays 300 $3 \
     > "$OUT/dl_$2.log" 2>&1)
  echo "== $2 rc $? at ${SECONDS} s"; grep -E "^(llama|qwen)|^\S+:|parts|Error" "$OUT/dl_$2.log" | cut -c1-170
}
run_dl /tmp/old old1 ""; run_dl "$PWD" new1 "--variants scalar_ids,preload_kv"
run_dl /tmp/old old2 ""; run_dl "$PWD" new2 "--variants scalar_ids"
