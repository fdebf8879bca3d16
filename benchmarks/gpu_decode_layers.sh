#!/usr/bin/env bash
# The persistent decode kernel (NANOFORGE_DECODE_LAYERS=persistent, kernels/decode_layers.py) on one GPU, in one
# call of under ten minutes: its GPU tests (one launch equals a launch per phase bit for bit, i.e. the barriers
# hold, at Llama-3.2-1B's, Qwen3-0.6B's and Qwen2-0.5B's widths; the engine with it decodes the reference tokens
# on the three families), then the layers alone against the layer-by-layer path with the phase trace
# (benchmarks/decode_layers.py, with the kernel's switches as variants: DL_VARIANTS), then issue 14's batch-1
# decode (b) with it against the default in the same process (benchmarks/gpu_engine.py; ENGINE_VARIANTS).
#
#   bash benchmarks/gpu_decode_layers.sh      # logs and JSON under $OUT (default ./out)
#   BUDGET_S=420 bash benchmarks/gpu_decode_layers.sh   # a shorter call: (b)'s run and the engine tests shrink
#
# A part that fails stops the ones after it that need it (the benchmarks do not run on a kernel that failed
# its tests).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
BUDGET_S=${BUDGET_S:-570}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())" \
    || { echo "gpu_decode_layers.sh needs a CUDA GPU" >&2; exit 2; }
SECONDS=0
timeout 260 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_kernels_decode_layers.py -x -k "one_launch or gives_up" \
    > "$OUT/pytest_kernel.log" 2>&1
echo "== the kernel's GPU tests: rc $? at ${SECONDS} s"; grep -E "PASSED|FAILED|ERROR| passed| failed" "$OUT/pytest_kernel.log" | tail -12
grep -q " passed" "$OUT/pytest_kernel.log" && ! grep -q " failed" "$OUT/pytest_kernel.log" || { tail -60 "$OUT/pytest_kernel.log"; exit 1; }
DL_VARIANTS=${DL_VARIANTS-}
ENGINE_VARIANTS=${ENGINE_VARIANTS-persistent,auto}
OUT="$OUT/layers" timeout 240 python3 benchmarks/decode_layers.py ${DL_VARIANTS:+--variants "$DL_VARIANTS"} \
    > "$OUT/decode_layers.log" 2>&1
echo "== decode_layers.py: rc $? at ${SECONDS} s"; tail -16 "$OUT/decode_layers.log"
total=$(( BUDGET_S - SECONDS - 60 < 230 ? BUDGET_S - SECONDS - 60 : 230 ))
if (( total >= 60 )); then  # (less is not enough for (b) on both shapes: left out, said so)
    OUT="$OUT/engine" timeout $(( total + 30 )) python3 benchmarks/gpu_engine.py --only decode --total "$total" \
        --decode-variants "$ENGINE_VARIANTS" > "$OUT/engine.log" 2>&1
    echo "== gpu_engine.py (b): rc $? at ${SECONDS} s"; grep -E "^\(b\)|Traceback|Error" "$OUT/engine.log" | tail -6
else
    echo "== gpu_engine.py (b): left out, ${total} s of BUDGET_S=${BUDGET_S} left for it (it needs 60)"
fi
left=$(( BUDGET_S - SECONDS ))
if (( left > 30 )); then
    timeout "$left" python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_kernels_decode_layers.py -k engine \
        > "$OUT/pytest_engine.log" 2>&1
    echo "== the engine's GPU tests with it: rc $? at ${SECONDS} s"
    grep -E "PASSED|FAILED|ERROR| passed| failed" "$OUT/pytest_engine.log" | tail -6
fi
