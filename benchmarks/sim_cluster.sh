#!/usr/bin/env bash
# The cluster-scale results of the simulator (docs/results/sim/): on the Mooncake trace, the capacity (the highest
# arrival rate at which >= 90% of requests meet TTFT <= 2 s and TPOT <= 50 ms) of colocated K vs disaggregated N+M
# at K = 8 (4+4) and K = 16 (10+6), with and without the KV pool, with and without early rejection; and the N:M
# sweep for 8 GPUs. CPU only, ~15 minutes on 2 cores (the two searches run side by side).
#
#   bash benchmarks/sim_cluster.sh [PROFILE]          # default: the shipped h200-qwen3-0.6b; OUT=docs/results/sim
#
# LINK_GBS: the pool link per call (default 25 GB/s, one 200 Gb/s RDMA NIC, Mooncake's transport; "" uses the
# profile's measured link). POOL: the pool's GiB per GPU (64). NUM_REQUESTS: rows of the trace (1,000).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
PY=${PYTHON:-python3}
PROFILE=${1:-h200-qwen3-0.6b}
OUT=${OUT:-docs/results/sim}
TRACE=${TRACE:-}
source benchmarks/trace_path.sh  # TRACE: the Mooncake trace, or exit 2
NUM_REQUESTS=${NUM_REQUESTS:-1000}
LINK_GBS=${LINK_GBS-25}
POOL=${POOL:-64}
mkdir -p "$OUT"
common=(--trace "$TRACE" --num-requests "$NUM_REQUESTS" --profile "$PROFILE" --ttft-slo 2 --tpot-slo 0.05
        --precision 0.2 --min-speedup 0.125 --quiet ${LINK_GBS:+--link-gbs "$LINK_GBS"})
p8=$((8 * POOL)) p16=$((16 * POOL))
$PY -m nanoforge.cli simulate capacity "${common[@]}" --out "$OUT" --configs \
    8 8:reject 4+4 4+4:reject "4+4:pool=$p8" "4+4:pool=$p8,reject" \
    16 16:reject 10+6 10+6:reject "10+6:pool=$p16" "10+6:pool=$p16,reject" >"$OUT/capacity.log" 2>&1 &
capacity=$!
$PY -m nanoforge.cli simulate sweep "${common[@]}" --gpus 8 --pool-gib "$p8" --out "$OUT" >"$OUT/sweep.log" 2>&1 &
sweep=$!
wait $capacity $sweep
cat "$OUT/capacity_table.txt" "$OUT/sweep_table.txt"  # every probe: $OUT/*.log and the JSON
