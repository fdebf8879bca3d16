#!/usr/bin/env bash
# One device call of several steps, each ended at its share of the call's time: how a lent GPU is spent (a
# machine held for minutes, one command a call of under ten; a step that overruns must not eat the next ones).
#
#   CALL_S=570 OUT=out bash benchmarks/gpu_call.sh NAME:PCT:COMMAND [NAME:PCT:COMMAND ...]
#
#   CALL_S=570 bash benchmarks/gpu_call.sh \
#       "tests:25:python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_serve_gpu.py" \
#       "engine:99:python3 benchmarks/gpu_engine.py --only decode,prefill --total {left} --out \$OUT/engine"
#
# Step NAME runs COMMAND (bash, from the checkout's root) under a timeout that ends it PCT percent of CALL_S
# after the call began; `{left}` in COMMAND becomes the seconds left until then, less 3% of the call (a
# benchmark's own --total, so that it writes its JSON before the timeout). Its output goes to $OUT/NAME.log. After
# each step: "== NAME rc N at S s" (rc 124: the timeout ended it), the log's last TAIL lines (default 12, each cut
# at 300 characters) and its failures (pytest's FAILED / ERROR / E lines, Python tracebacks). The GPU's name
# comes first. The exit status is the number of steps that did not exit 0.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
CALL_S=${CALL_S:-570}
TAIL=${TAIL:-12}
export OUT=${OUT:-out}
mkdir -p "$OUT"
SECONDS=0
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name --format=csv,noheader | head -1
else
    echo "no GPU here"
fi
failed=0
for step in "$@"; do
    name=${step%%:*}; rest=${step#*:}; pct=${rest%%:*}; cmd=${rest#*:}
    if [[ -z "$name" || "$cmd" == "$rest" || ! "$pct" =~ ^[0-9]+$ || "$pct" -gt 100 ]]; then
        echo "gpu_call.sh: '$step' is not NAME:PCT:COMMAND with PCT a whole percent of CALL_S" >&2
        exit 2
    fi
    until_s=$(( CALL_S * pct / 100 - SECONDS ))
    if (( until_s <= 0 )); then
        echo "== $name skipped: its share ended at $(( CALL_S * pct / 100 )) s, the call is at $SECONDS s"
        failed=$(( failed + 1 ))
        continue
    fi
    left=$(( until_s - CALL_S * 3 / 100 ))
    timeout "$until_s" bash -c "${cmd//\{left\}/$(( left > 1 ? left : 1 ))}" > "$OUT/$name.log" 2>&1
    rc=$?
    echo "== $name rc $rc at $SECONDS s"
    tail -n "$TAIL" "$OUT/$name.log" | cut -c1-300
    grep -E "^(FAILED|ERROR)|^E |Traceback" "$OUT/$name.log" | head -12
    (( rc == 0 )) || failed=$(( failed + 1 ))
done
exit "$failed"
