#!/usr/bin/env bash
# Session 39, call 1, whichever card comes: the FMA exponentials' GPU tests and timings (kernel bench, then the
# engine's prefill (c) with each mode); on an H200 also (b) with the auto decode path.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
SECONDS=0
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -k fma tests/test_kernels_paged.py > $OUT/pytest_fma.log 2>&1
echo "== fma GPU tests rc $? at $SECONDS s"; tail -8 $OUT/pytest_fma.log | cut -c1-300
timeout 120 python3 -m nanoforge kernels bench --kinds paged --out $OUT/kbench > $OUT/kbench.log 2>&1
echo "== kernels bench paged rc $? at $SECONDS s"; grep -v Warn $OUT/kbench.log | tail -40 | cut -c1-220
only=prefill; [[ $gpu == *H200* ]] && only=prefill,decode
OUT=$OUT/engine timeout $(( 585 - SECONDS )) python3 benchmarks/gpu_engine.py --only $only \
  --total $(( 565 - SECONDS )) --prefill-variants exp2_quarter,exp2_half,exp2_poly --decode-variants auto \
  > $OUT/engine.log 2>&1
echo "== engine rc $? at $SECONDS s"
grep -E "^\((a|b|c)\)|TFLOP|x HF|variant" $OUT/engine.log | cut -c1-220 | head -60
grep -B2 -A20 Traceback $OUT/engine.log | head -30
tail -30 $OUT/engine.log | cut -c1-220
