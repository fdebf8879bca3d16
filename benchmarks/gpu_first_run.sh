#!/usr/bin/env bash
# The README's set-up command 1 on a GPU machine, from a fresh checkout, timed: install, then `nanoforge serve`
# with no model, which trains the offline default chat model (preset default-gpu on a GPU), serves it on
# 127.0.0.1:8000 and answers a first chat message through the API. Records the time from the start to that
# answer, the answer, and the server's log, then stops the server (SIGTERM).
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
nanoforge serve > "$OUT/first_run.log" 2>&1 &
pid=$!
answered=""
while kill -0 "$pid" 2>/dev/null; do
    if grep -q "^assistant:" "$OUT/first_run.log"; then answered=$(date +%s.%N); break; fi
    if (( SECONDS > LIMIT_S )); then break; fi
    sleep 1
done
# what the server listens on (psutil, since the GPU image has no `ss`): loopback only
python3 -c "import psutil; [print(c.laddr, c.pid) for c in psutil.net_connections('tcp') if c.status == 'LISTEN']" \
    > "$OUT/first_run_ports.txt" 2>&1 || ss -ltnp > "$OUT/first_run_ports.txt" 2>&1 || true
kill -TERM "$pid" 2>/dev/null; wait "$pid"; code=$?
python3 - "$OUT" "$start" "$installed" "${answered:-0}" "$code" <<'PY'
import json, re, sys
out, start, installed, answered, code = sys.argv[1], *map(float, sys.argv[2:5]), int(sys.argv[5])
log = open(f"{out}/first_run.log").read()
answer = next((l[len("assistant: "):] for l in log.splitlines() if l.startswith("assistant:")), None)
vals = [float(v) for v in re.findall(r"val loss [\d.]+ at the start -> ([\d.]+) at the end", log)]
result = {"install_s": installed - start, "seconds_to_first_answer": (answered - start) if answered else None,
          "answer": answer, "final_val_losses": vals, "server_exit_code": code,
          "eot_line": next((l for l in log.splitlines() if "held-out answers ending" in l), None)}
json.dump(result, open(f"{out}/first_run.json", "w"), indent=2)
print(json.dumps(result, indent=2))
PY
