"""Where a gpu_disagg.sh 1P+1D run's TTFT and TPOT go, measured and simulated, request by request.

    python docs/results/issue15/session12/decompose.py RUN_DIR PROFILE.json [CONFIG]

Measured (RUN_DIR/CONFIG/serve.json, every request as the client saw it; metrics-*.txt, each instance's own
histograms): TTFT; the decode part D = e2e - TTFT, which is the hand-over gap G (first token at the client ->
second token) plus (out - 2) decode tokens, so requests of 2 output tokens give G alone and a least-squares fit
D = G + t * (out - 2) gives both; the instances' TTFT histograms (the prefill instance: its arrival -> first token;
the decode instance: its arrival -> its first token, i.e. the pool load, the wait and the step computing the
prompt's last block). Simulated: the same requests through `Simulation`, the same quantities from its request
timestamps. Prints one table; nothing is written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from nanoforge.serve.bench_serve import metric_values
from nanoforge.sim.cluster import Simulation
from nanoforge.sim.profile import Profile
from nanoforge.sim.validate import cluster_of, replay_of


def hist_quantiles(path: Path, name: str, qs=(0.5, 0.9)) -> tuple[list[float], float]:
    """Quantiles (linear within buckets) and the mean of a Prometheus histogram in a /metrics dump."""
    v = metric_values(path.read_text(), labelled=True)
    edges, counts = [], []
    for k, c in v.items():
        if k.startswith(f"{name}_bucket") and "+Inf" not in k:
            edges.append(float(k.split('le="')[1].rstrip('"}')))
            counts.append(c)
    order = np.argsort(edges)
    edges, counts = np.array(edges)[order], np.array(counts)[order]
    n = v[f"{name}_count"]
    out = []
    for q in qs:
        i = int(np.searchsorted(counts, q * n))
        lo, clo = (0.0, 0.0) if i == 0 else (edges[i - 1], counts[i - 1])
        out.append(1000 * (lo + (edges[i] - lo) * (q * n - clo) / max(counts[i] - clo, 1e-9)))
    return out, 1000 * v[f"{name}_sum"] / n


def fit_gap(d_ms: np.ndarray, out: np.ndarray) -> tuple[float, float]:
    """Least squares D = G + t * (out - 2) over requests of >= 2 output tokens: (G, t) in ms."""
    m = out >= 2
    a = np.stack([np.ones(m.sum()), out[m] - 2.0], 1)
    (g, t), *_ = np.linalg.lstsq(a, d_ms[m], rcond=None)
    return g, t


def row(label: str, ttft, d, out) -> list[str]:
    ttft, d, out = map(np.asarray, (ttft, d, out))
    g, t = fit_gap(d, out)
    two = d[out == 2]
    tpot = d[out > 1] / (out[out > 1] - 1)
    tail = (d[out >= 100] - g) / (out[out >= 100] - 2)
    return [label, f"{np.median(ttft):.1f}", f"{np.percentile(ttft, 90):.1f}", f"{np.median(tpot):.2f}",
            f"{np.median(two):.1f}" if len(two) else "-", f"{g:.1f}", f"{t:.2f}", f"{np.median(tail):.2f}"]


def simulate(run_dir: Path, name: str, profile: Profile):
    run = json.loads((run_dir / name / "serve.json").read_text())
    trace = run_dir.parent / "trace.jsonl"
    replay = replay_of(run, trace if trace.is_file() else Path(run["config"]["trace"]))
    config = cluster_of(name, run, (run_dir / name / "server.log").read_text(), pool_memory=8.0, device="cuda")
    sim = Simulation(replay, config, profile)
    sim.run()
    return run, sim


def main(run_dir: str, profile: str, name: str = "1p1d") -> None:
    run_dir = Path(run_dir)
    run, sim = simulate(run_dir, name, Profile.load(profile))
    reqs = [r for r in run["requests"] if r["error"] is None]
    m_ttft = [r["ttft_ms"] for r in reqs]
    m_d = [r["e2e_ms"] - r["ttft_ms"] for r in reqs]
    m_out = [r["output_len"] for r in reqs]
    s = sorted((r for r in sim.requests if r.error is None), key=lambda r: r.index)
    s_ttft = [1000 * (r.first_token - r.arrival) for r in s]
    s_d = [1000 * (r.finish - r.first_token) for r in s]
    s_out = [r.output_len for r in s]
    head = ["", "TTFT p50", "TTFT p90", "TPOT p50", "G (out=2) p50", "G fit", "t fit", "t (out>=100) p50"]
    rows = [head, row("measured", m_ttft, m_d, m_out), row("simulated", s_ttft, s_d, s_out)]
    widths = [max(len(r[i]) for r in rows) + 2 for i in range(len(head))]
    for r in rows:
        print("".join(c.rjust(w) for c, w in zip(r, widths)))
    # the instances' own view (measured histograms vs the simulated requests' timestamps)
    hop = sim.profile.frontend["handover_s"]
    sp = [1000 * (r.engine_first_token - r.reached_prefill) for r in s]
    sd = [1000 * (r.decode_first - r.decode_start - hop) for r in s if r.decode_first is not None]
    sa = [1000 * (r.first_token - r.engine_first_token) for r in s]
    for label, f, metric, sim_ms in (("prefill instance TTFT", "metrics-prefill1.txt", "time_to_first_token", sp),
                                     ("decode instance TTFT", "metrics-decode1.txt", "time_to_first_token", sd)):
        path = run_dir / name / f
        if path.is_file():
            (p50, p90), mean = hist_quantiles(path, f"nanoforge_{metric}_seconds")
            print(f"{label:<24} measured p50 {p50:6.1f} p90 {p90:6.1f} mean {mean:6.1f} | simulated p50 "
                  f"{np.median(sim_ms):6.1f} p90 {np.percentile(sim_ms, 90):6.1f} mean {np.mean(sim_ms):6.1f}")
    print(f"{'prefill first token -> client (sim: save + answer)':<24} p50 {np.median(sa):.1f} mean {np.mean(sa):.1f}")


if __name__ == "__main__":
    main(*sys.argv[1:])
