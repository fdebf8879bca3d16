#!/usr/bin/env bash
# The cluster simulator's validation on one H200, in as few device calls as it takes: a profile of the engine
# (gpu_sim_profile.sh) and repeats of gpu_disagg.sh's colocated and 1P+1D runs of the validation slice (rows
# 3,000-3,199 of the Mooncake trace, docs/results/issue12/session10/trace.jsonl, as in every validation since
# session 9), then `nanoforge simulate validate` over the repeats (medians, and the measured range beside them),
# everything packed into $OUT/validate.tgz: the device tool brings back at most 8 files.
#
#   bash benchmarks/gpu_validate.sh                           # the profile + 2 repeats, ~9 minutes on an H200
#   PROFILE=0 FIRST=3 REPEATS=2 bash benchmarks/gpu_validate.sh  # 2 more repeats (rep3, rep4), another call
#   then, here:  nanoforge simulate validate out/rep*/qwen3-0.6b --profile out/profile/h200-qwen3-0.6b.json
#
# Why repeats: on one H200 two runs of 1P+1D minutes apart measured TTFT p50 80 and 119 ms (session 13), more
# than the 15% the simulator is judged by. Settings pass through to the two scripts (PRESETS, DEVICE, QUICK,
# SERVE_FLAGS, ...); a CPU dry run, ~3 minutes:
#   PRESETS=tiny-qwen3 DEVICE=cpu QUICK=1 NUM_REQUESTS=16 LENGTH_SCALE=0.01 MAX_INPUT=100 MAX_OUTPUT=12 \
#       MAX_MODEL_LEN=128 TIME_SCALE=0.05 WARMUP_LENS=32 POOL_MEMORY=0.05 REPEATS=1 bash benchmarks/gpu_validate.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

PY=${PYTHON:-python3}
OUT=${OUT:-out}
PRESETS=${PRESETS:-qwen3-0.6b}
PROFILE=${PROFILE:-1}
FIRST=${FIRST:-1}
REPEATS=${REPEATS:-2}
export PRESETS TRACE=${TRACE:-docs/results/issue12/session10/trace.jsonl} TRACE_START=${TRACE_START:-0}
export NUM_REQUESTS=${NUM_REQUESTS:-200} CONFIGS=${CONFIGS:-"colocated 1p1d"}
mkdir -p "$OUT"
began=$(date +%s)
pack() {  # written beside $OUT, then moved in: tar reads $OUT
    tar -C "$OUT" --exclude validate.tgz -czf "${TMPDIR:-/tmp}/validate.$$.tgz" . && mv "${TMPDIR:-/tmp}/validate.$$.tgz" "$OUT/validate.tgz"
}
git log --oneline -1 >"$OUT/commit.txt" 2>/dev/null || true

if [[ "$PROFILE" == 1 ]]; then
    OUT="$OUT/profile" bash benchmarks/gpu_sim_profile.sh >"$OUT/profile.log" 2>&1
    echo "== profile: rc $?, $(( $(date +%s) - began )) s"; tail -5 "$OUT/profile.log"
    pack
fi
for ((i = FIRST; i < FIRST + REPEATS; i++)); do
    OUT="$OUT/rep$i" bash benchmarks/gpu_disagg.sh >"$OUT/rep$i.log" 2>&1
    echo "== repeat $i: rc $?, $(( $(date +%s) - began )) s"; grep -E "TTFT p50|TTFT p90|TPOT p50" "$OUT/rep$i.log"
    pack  # what is done comes back even if a later repeat runs out of time
done
for preset in $PRESETS; do
    profile=$(ls "$OUT"/profile/*-"$preset".json 2>/dev/null | head -1)
    runs=("$OUT"/rep*/"$preset")
    if [[ -n "$profile" && -d "${runs[0]}" ]]; then
        $PY -m nanoforge.cli simulate validate "${runs[@]}" --profile "$profile" --quiet --out "$OUT/$preset" \
            --configs $CONFIGS 2>&1 | tee "$OUT/validate-$preset.log"
    fi
done
pack
echo "== $(( $(date +%s) - began )) s; everything in $OUT/validate.tgz"
