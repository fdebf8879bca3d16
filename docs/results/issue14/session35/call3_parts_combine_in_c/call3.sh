#!/usr/bin/env bash
# Session 35, call 3: (1) weight_stream's parts (what the weight phases wait on); (2) phase C combining attention's
# partials (a0c...): the persistent kernel's GPU tests, then its layers against 32df957's (.gpu/old) alternated
# twice at context 384, once at 3000; (3) the engine with it on the three families.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name --format=csv,noheader
PYTHONPATH=$PWD timeout 120 python3 benchmarks/weight_stream.py --stages 4 --out $OUT/ws 2>&1 | grep -v Warn
echo "== weight_stream rc ${PIPESTATUS[0]} at $SECONDS s"
PYTHONPATH=$PWD timeout 200 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_kernels_decode_layers.py \
  -k "one_launch or gives_up" > "$OUT/pytest.log" 2>&1
echo "== GPU tests rc $? at ${SECONDS} s"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/pytest.log" | cut -c1-160 | tail -12
grep -q "FAILED\|ERROR" "$OUT/pytest.log" && grep -B5 -A40 "^____" "$OUT/pytest.log" | head -60
OLD=$PWD/.gpu/old
run_dl() {  # $1 tree, $2 tag, $3 extra args
  (cd "$1" && PYTHONPATH="$1" OUT="$OUT/dl_$2" timeout 100 python3 benchmarks/decode_layers.py --replays 300 $3 \
     > "$OUT/dl_$2.log" 2>&1)
  echo "== $2 rc $? at ${SECONDS} s"; grep -E "^(llama|qwen)|^\S+:|parts|Error" "$OUT/dl_$2.log" | cut -c1-200
}
run_dl $OLD old1 ""; run_dl "$PWD" new1 ""
run_dl $OLD old2 ""; run_dl "$PWD" new2 ""
run_dl $OLD old3k "--ctx 3000"; run_dl "$PWD" new3k "--ctx 3000"
left=$(( 570 - SECONDS ))
(( left > 40 )) && PYTHONPATH=$PWD timeout $left python3 -m pytest -v -m gpu -p no:cacheprovider \
  tests/test_kernels_decode_layers.py -k engine > "$OUT/pytest_engine.log" 2>&1
echo "== engine tests rc $? at ${SECONDS} s"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/pytest_engine.log" | cut -c1-160 | tail -5
