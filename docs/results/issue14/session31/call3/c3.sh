#!/usr/bin/env bash
# session 31 call 3: README set-up command 1 on the GPU (serve extras from wheels, no deps resolution), then the
# serving GPU tests with auto
set -u
nvidia-smi --query-gpu=name --format=csv > $OUT/gpu.txt 2>&1
SECONDS=0
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > $OUT/env.log 2>&1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >> $OUT/env.log 2>&1
echo "install rc=$? at ${SECONDS}s" >> $OUT/gpu.txt
SKIP_INSTALL=1 OUT=$OUT/first LIMIT_S=240 bash benchmarks/gpu_first_run.sh > $OUT/first.log 2>&1
echo "first run rc=$? at ${SECONDS}s" >> $OUT/gpu.txt
export PYTHONPATH=$PWD:/tmp/site
left=$(( 520 - SECONDS ))
NANOFORGE_DECODE_LAYERS=auto timeout $left python3 -m pytest -q -m gpu tests/test_serve_gpu.py tests/test_serve_api.py \
  -p no:cacheprovider > $OUT/serve.log 2>&1
echo "serve rc=$? at ${SECONDS}s" >> $OUT/gpu.txt
cat $OUT/gpu.txt $OUT/env.log | tail; tail -8 $OUT/first.log; cat $OUT/first/*.json 2>/dev/null | head -30; tail -25 $OUT/serve.log
