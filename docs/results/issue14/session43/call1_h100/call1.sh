#!/usr/bin/env bash
# Session 43, call 1 (CALL_S seconds in all): the GPU tests of paged attention's decode and split combine and the
# tagged kernel's (Qwen3's and Llama's widths, context 300: every switch, the counted hand-overs too); the layers
# of both shapes with the split combine unrolled (936ac3d) and the token's key in the last split (1921e7e), with,
# as variants, the poll back-off capped at 512 ns and a thread's words polled in one loop (pack 32); the
# same layers at 936ac3d (.gpu/mid: the combine alone) and at 4f7d4ac (.gpu/old: the combine a tl.sum over
# splits); the counted hand-overs (c5beae1), alone and with the cap at 512 (apart: a wrong count would spin each
# wait to its limit); then (b), the engine's batch-1 decode with `auto` the default, against gpt-fast-style, with
# the cap at 512 a variant.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
SECONDS=0
CALL_S=${CALL_S:-560}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
dl() {  # dl NAME TREE UNTIL_PERCENT [VARIANTS]
  (cd $2 && PYTHONPATH=$PWD timeout $(( CALL_S * $3 / 100 - SECONDS )) python3 benchmarks/decode_layers.py \
    --out $OUT/dl_$1 --replays 100 ${4:+--variants $4} > $OUT/dl_$1.log 2>&1)
  echo "== decode_layers $1 rc $? at $SECONDS s"; grep -v Warn $OUT/dl_$1.log | cut -c1-400 | tail -16
}
T=tests/test_kernels_decode_layers.py
PYTHONPATH=$PWD timeout $(( CALL_S * 30 / 100 )) python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/test_kernels_paged.py $T -k "(full_size_bf16 and not prefill) or cuda_graph or \
  (tagged_vectors_without_barriers_equal and 300 and not 3000 and (qwen3 or llama))" > $OUT/pytest.log 2>&1
echo "== GPU tests rc $? at $SECONDS s"; tail -2 $OUT/pytest.log; grep -E "^(FAILED|ERROR)|^E " $OUT/pytest.log | head
dl new . 50 poll_cap512,poll_pack32
dl mid .gpu/mid 60
dl old .gpu/old 70
dl count . 88 handover_count,handover_count+poll_cap512
left=$(( CALL_S - 10 - SECONDS ))
[ $left -lt 90 ] && exit 0
PYTHONPATH=$PWD OUT=$OUT/engine timeout $left python3 benchmarks/gpu_engine.py --only decode --total $(( left - 25 )) \
  --decode-variants poll_cap512 > $OUT/engine.log 2>&1
echo "== engine rc $? at $SECONDS s"
grep -E "^\((b|c)\)|auto" $OUT/engine.log | cut -c1-600 | tail -30; grep -B2 -A20 Traceback $OUT/engine.log | head -30
