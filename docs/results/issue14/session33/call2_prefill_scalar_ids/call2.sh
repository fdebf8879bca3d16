#!/usr/bin/env bash
# Session 33, call 2: (c) Llama-3.2-1B prefill with the scalar block ids and the SwiGLU epilogue as variants (each
# the engine again in one process, HF's SDPA forward the reference), then one eager 16K-token prefill step's
# kernels (gpu_engine_steps.py --only steps).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
SECONDS=0
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=$OUT/engine timeout 300 python3 benchmarks/gpu_engine.py --only prefill --presets llama3-1b --total 260 \
  --prefill-variants scalar_ids,swiglu_epilogue,scalar_ids+swiglu_epilogue > $OUT/engine.log 2>&1
echo "== engine rc $? at $SECONDS s"; grep -E "^\(c\)" $OUT/engine.log | cut -c1-200; grep -B2 -A20 Traceback $OUT/engine.log | head -40
OUT=$OUT/steps timeout 200 python3 benchmarks/gpu_engine_steps.py --only steps > $OUT/steps.log 2>&1
echo "== steps rc $? at $SECONDS s"; grep -v Warn $OUT/steps.log | tail -12
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/steps/diag.json"))
for r in d.get("eager_step_kernels", []): print(r)
PY
