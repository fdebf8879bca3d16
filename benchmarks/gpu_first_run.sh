#!/usr/bin/env bash
# The README's set-up command 1 on a GPU machine, from a fresh checkout, timed: install, then `nanoforge serve`
# with no model, which trains the offline default chat model (preset default-gpu on a GPU), serves it on
# 127.0.0.1:8000 and answers a first chat message through the API. Records the time from the start to that
# answer, the answer, and the server's log, then stops the server (SIGTERM). Then the same command once more
# (RESTART=0: not), timed as a restart: the model is trained by then, and the engine's tuning is on disk.
#
#   bash benchmarks/gpu_first_run.sh          # files under $OUT (default ./out)
#
# The machine's own torch is kept (the README's torch==2.13.0 pin is for CPU machines); with no network, the
# serve extras (fastapi, uvicorn, pydantic, ...) come from wheels in ./.whl, installed offline. Fill it where
# the package registry can be reached, dependencies included (fastapi 0.165 needs opentelemetry-api and
# annotated-doc, openai 3.63 httpx2: a folder of the direct wheels alone fails the install, as in session 31):
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl \
#       fastapi uvicorn prometheus_client httpx openai
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
LIMIT_S=${LIMIT_S:-540}
mkdir -p "$OUT"
SECONDS=0
start=$(date +%s.%N)
[[ -n ${SKIP_INSTALL:-} ]] || python3 -m pip install -q --no-index --find-links .whl --no-build-isolation -e ".[serve]" 2>&1 | tail -3
installed=$(date +%s.%N)
serve() {  # $1: the log's name. Sets answered (the time of the first answer, or empty) and code (the exit code)
    nanoforge serve > "$OUT/$1.log" 2>&1 &
    local pid=$! until=$(( SECONDS + LIMIT_S ))
    answered=""
    while kill -0 "$pid" 2>/dev/null; do
        if grep -q "^assistant:" "$OUT/$1.log"; then answered=$(date +%s.%N); break; fi
        if (( SECONDS > until )); then break; fi
        sleep 1
    done
    # what the server listens on (psutil, since the GPU image has no `ss`): loopback only
    python3 -c "import psutil; [print(c.laddr, c.pid) for c in psutil.net_connections('tcp') if c.status == 'LISTEN']" \
        > "$OUT/$1_ports.txt" 2>&1 || ss -ltnp > "$OUT/$1_ports.txt" 2>&1 || true
    kill -TERM "$pid" 2>/dev/null; wait "$pid"; code=$?
}
serve first_run
first_answered=${answered:-0} first_code=$code
# the same command again (RESTART=0: not): the model is trained now, and the engine's start reads back the skinny
# matmul's tuning from disk (kernels/tuning_cache.py); restart_s is what a server restart costs
restarted=0 restart_answered=0
if [[ ${RESTART:-1} == 1 ]]; then
    restarted=$(date +%s.%N); serve restart; restart_answered=${answered:-0}
fi
python3 - "$OUT" "$start" "$installed" "$first_answered" "$first_code" "$restarted" "$restart_answered" <<'PY'
import json, re, sys
out, start, installed, answered, code, restarted, restart_answered = sys.argv[1], *map(float, sys.argv[2:])
log = open(f"{out}/first_run.log").read()
answer = next((l[len("assistant: "):] for l in log.splitlines() if l.startswith("assistant:")), None)
vals = [float(v) for v in re.findall(r"val loss [\d.]+ at the start -> ([\d.]+) at the end", log)]


def start_line(text):  # the server's "engine started in X s (Y s tuning the skinny matmul)"
    m = re.search(r"engine started in ([\d.]+) s \(([\d.]+) s tuning", text)
    return {"engine_start_s": float(m[1]), "tuning_s": float(m[2])} if m else None


result = {"install_s": installed - start, "seconds_to_first_answer": (answered - start) if answered else None,
          "answer": answer, "final_val_losses": vals, "server_exit_code": int(code),
          "eot_line": next((l for l in log.splitlines() if "held-out answers ending" in l), None),
          "first_start": start_line(log)}
if restarted:
    result["restart_seconds_to_first_answer"] = (restart_answered - restarted) if restart_answered else None
    result["restart_start"] = start_line(open(f"{out}/restart.log").read())
json.dump(result, open(f"{out}/first_run.json", "w"), indent=2)
print(json.dumps(result, indent=2))
PY
