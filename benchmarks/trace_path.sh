# Sourced (from the repository root) by the scripts that replay the Mooncake trace: sets TRACE to the first of
# $TRACE, the project's shared data (shared/ in the checkout or ../shared beside it), runs/trace/ (a GPU machine:
# ../shared does not travel with the tree, so copy synthetic_trace.jsonl there and carry runs/trace) or
# /work/shared; else the script exits 2 with one line naming what is missing.
for candidate in "${TRACE:-}" shared/data/mooncake/synthetic_trace.jsonl ../shared/data/mooncake/synthetic_trace.jsonl \
                 runs/trace/synthetic_trace.jsonl /work/shared/data/mooncake/synthetic_trace.jsonl; do
    if [[ -n "$candidate" && -f "$candidate" ]]; then TRACE=$candidate; break; fi
done
[[ -f "${TRACE:-}" ]] || { echo "no Mooncake trace found: set TRACE=path/to/trace.jsonl" >&2; exit 2; }
