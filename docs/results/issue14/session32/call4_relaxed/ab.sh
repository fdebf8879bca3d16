#!/usr/bin/env bash
# Session 32: relaxed count resets, A/B in one call: HEAD's three kernel files (.gpu/old) against the tree.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
SECONDS=0
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r nanoforge benchmarks /tmp/old/ && cp .gpu/old/*.py /tmp/old/nanoforge/kernels/
nvidia-smi --query-gpu=name --format=csv,noheader
run_dl() {  # $1 tree, $2 tag
  (cd "$1" && PYTHONPATH="$1" OUT="$OUT/dl_$2" timeout 150 python3 benchmarks/decode_layers.py > "$OUT/dl_$2.log" 2>&1)
  echo "== $2 rc $? at ${SECONDS} s"; grep -E "^(llama|qwen)" "$OUT/dl_$2.log"
}
run_dl /tmp/old old1; run_dl "$PWD" new1; run_dl /tmp/old old2; run_dl "$PWD" new2
export PYTHONPATH=$PWD
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_decode_layers.py \
  -k "gives_up or (one_launch and 300 and not qwen2)" > "$OUT/pytest_dl.log" 2>&1
echo "== decode_layers GPU tests rc $? at ${SECONDS} s"; tail -3 "$OUT/pytest_dl.log"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gemv.py tests/test_kernels_paged.py -k "not prefill_tiles" \
  > "$OUT/pytest_gemv_paged.log" 2>&1
echo "== gemv/paged GPU tests rc $? at ${SECONDS} s"; tail -3 "$OUT/pytest_gemv_paged.log"
left=$(( 560 - SECONDS ))
if (( left > 120 )); then
  OUT="$OUT/engine" timeout $left python3 benchmarks/gpu_engine.py --only decode --total $(( left - 40 )) \
    --decode-variants auto > "$OUT/engine.log" 2>&1
  echo "== (b) rc $? at ${SECONDS} s"; grep -E "^\(b\)" "$OUT/engine.log"
fi
