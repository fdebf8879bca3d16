"""Where a gpu_disagg.sh run's TTFT goes, request by request and over the run, measured and simulated.

    python docs/results/issue15/session12/ttft_decompose.py RUN_DIR PROFILE.json [CONFIG] [--no-warmup] [--link-gbs G]

Measured (RUN_DIR/CONFIG/serve.json: every request's arrival and TTFT at the client; metrics-*.txt: each
instance's own TTFT histogram and pool counters, warm-up included): TTFT binned by arrival; the mean of the
prefill instance's TTFT (its arrival -> its first token) against the conductor's, whose difference is the
conductor's own time plus the wait for the save. Simulated: the same requests through `Simulation` (as
`simulate validate` runs them), each request's TTFT split into

    front   arrival -> the prefill instance has it (Profile.request_time + frontend.handover_s)
    queue   -> the first step that schedules a chunk of its prompt
    compute -> the step that samples its first token ends
    save    -> the prefill instance answers: its put's wait for the link (save_wait) and its transfer (save_xfer)

and the pool's timeline (blocks held, puts written / turned away, per 1 s of arrivals). Prints tables; writes
nothing.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from nanoforge.serve.bench_serve import metric_values
from nanoforge.sim import instance as sim_instance
from nanoforge.sim import pool as sim_pool
from nanoforge.sim.cluster import Simulation
from nanoforge.sim.profile import Profile
from nanoforge.sim import validate
from nanoforge.sim.validate import cluster_of, replay_of

BIN_S = 2.0
GAP_S = 2.0  # the warm-up's client turnaround assumed here (not recorded by the runs): see ttft.md


def instrument():
    """Record, without changing the model: when each request's first prompt chunk is scheduled, and when each
    put is submitted, starts on the link and ends (with what it wrote and what the pool turned away)."""
    first_sched: dict[str, float] = {}
    puts: list[dict] = []
    launch, submit, nxt, done = (sim_instance.SimInstance._launch, sim_pool.SimConnector._submit,
                                 sim_pool.SimConnector._next, sim_pool.SimConnector._done)

    def _launch(self, now):
        n = len(self.in_flight)
        ok = launch(self, now)
        if ok and len(self.in_flight) > n and self.role != "decode":
            for it in self.in_flight[-1][0].scheduled:
                first_sched.setdefault(f"{self.name}/{it.seq.request_id}", now)
        return ok

    def _submit(self, job):
        if job.kind == "put":
            job.t_submit = self.sim.clock.now
            puts.append({"job": job, "inst": self})
        submit(self, job)

    def _next(self, now):
        job = (self.loads or self.queue)[0] if (self.loads or self.queue) else None
        turned = self.pool.counters["turned_away"]
        nxt(self, now)
        if job is not None and job.kind == "put":
            job.t_start, job.turned = now, self.pool.counters["turned_away"] - turned

    def _done(self, now, job):
        if job.kind == "put":
            job.t_end = now
        done(self, now, job)

    sim_instance.SimInstance._launch, sim_pool.SimConnector._submit = _launch, _submit
    sim_pool.SimConnector._next, sim_pool.SimConnector._done = _next, _done
    return first_sched, puts


def simulate(run_dir: Path, name: str, profile: Profile, warmup: bool, flags=()):
    run = json.loads((run_dir / name / "serve.json").read_text())
    trace = run_dir.parent / "trace.jsonl"
    replay = replay_of(run, trace if trace.is_file() else Path(run["config"]["trace"]))
    config = cluster_of(name, run, (run_dir / name / "server.log").read_text(), pool_memory=8.0, device="cuda")
    if "--link-gbs" in flags:  # a diagnosis only: every pool call at this bandwidth
        config.link_gbs = float(flags[flags.index("--link-gbs") + 1])
    first_sched, puts = instrument()
    sim = Simulation(replay, config, profile)
    if warmup:
        tokens = sum(replay.input_len(i) for i in range(len(replay)))
        sim.warm_up(validate.warmup_of(run_dir / name, tokens), GAP_S)
    jobs, warm = {}, []
    sim.warm_ttfts = warm
    orig_end = sim._end

    def _end(now, req, error):  # keep each request's put before _end drops it
        jobs[req.index] = req.save_job
        if req.warmup:
            warm.append((req.arrival, 1000 * (req.first_token - req.arrival), req.input_len))
        orig_end(now, req, error)

    sim._end = _end
    sim.run()
    return run, sim, first_sched, puts, jobs


def pct(a, q):
    return float(np.percentile(a, q)) if len(a) else float("nan")


def main(run_dir: str, profile: str, name: str = "1p1d", *flags: str) -> None:
    run_dir = Path(run_dir)
    prof = Profile.load(profile)
    run, sim, first_sched, puts, jobs = simulate(run_dir, name, prof, "--no-warmup" not in flags, flags)
    reqs = run["requests"]
    hop = prof.frontend["handover_s"]
    rows = []
    for r in sorted(sim.requests, key=lambda r: r.index):
        if r.error is not None:
            continue
        m = reqs[r.index]
        t0 = first_sched.get(f"{r.prefill.name}/{r.index}", r.reached_prefill)
        job = jobs.get(r.index)
        ts = getattr(job, "t_start", None)
        rows.append({"i": r.index, "arrival": r.arrival - sim.t0, "m_ttft": m["ttft_ms"], "s_ttft": 1000 * (r.first_token - r.arrival),
                     "front": 1000 * (r.reached_prefill - r.arrival), "queue": 1000 * (t0 - r.reached_prefill),
                     "compute": 1000 * (r.engine_first_token - t0),
                     "save": 1000 * (r.first_token - r.engine_first_token),
                     "save_wait": 1000 * (ts - job.t_submit) if ts is not None else 0.0,
                     "save_xfer": 1000 * (job.t_end - ts) if ts is not None else 0.0,
                     "written": len(job.written) if job is not None else 0,
                     "turned": getattr(job, "turned", 0) if job is not None else 0,
                     "input": r.input_len, "cached": r.cached_tokens})
    w = run_dir / name / "warmup" / "serve.json"
    if w.is_file() and sim.warm_ttfts:
        wm = json.loads(w.read_text())
        n = wm["config"]["input_len"]
        ws = [t for _, t, i in sorted(sim.warm_ttfts) if i == n]
        print(f"warm-up run of {n} tokens ({len(ws)} requests), TTFT in arrival order (ms):")
        print("  measured  " + " ".join(f"{x['ttft_ms']:6.1f}" for x in wm["requests"]))
        print("  simulated " + " ".join(f"{t:6.1f}" for t in ws))
        print(f"  mean: measured {np.mean([x['ttft_ms'] for x in wm['requests']]):.1f}, simulated {np.mean(ws):.1f}")
    keys = ("m_ttft", "s_ttft", "front", "queue", "compute", "save", "save_wait", "save_xfer")
    print(f"{name}: {len(rows)} requests; TTFT components, simulated (ms)")
    print(f"{'':<10}" + "".join(f"{k:>10}" for k in keys))
    for label, f in (("mean", np.mean), ("p50", np.median), ("p90", lambda a: np.percentile(a, 90))):
        print(f"{label:<10}" + "".join(f"{f([x[k] for x in rows]):>10.1f}" for k in keys))
    print(f"\nby arrival ({BIN_S:g} s bins): measured TTFT p50/p90 | simulated p50/p90 | sim means: queue compute "
          f"save | puts: blocks written, turned away")
    bins = defaultdict(list)
    for x in rows:
        bins[int(x["arrival"] // BIN_S)].append(x)
    for b in sorted(bins):
        xs = bins[b]
        m, s = [x["m_ttft"] for x in xs], [x["s_ttft"] for x in xs]
        print(f"{b * BIN_S:4.0f}-{(b + 1) * BIN_S:<4.0f} n={len(xs):3d}  {np.median(m):6.1f} {pct(m, 90):6.1f} | "
              f"{np.median(s):6.1f} {pct(s, 90):6.1f} | {np.mean([x['queue'] for x in xs]):6.1f} "
              f"{np.mean([x['compute'] for x in xs]):6.1f} {np.mean([x['save'] for x in xs]):6.1f} | "
              f"{sum(x['written'] for x in xs):6d} {sum(x['turned'] for x in xs):6d}")
    # the tail: which requests make p90, measured and simulated
    for label, k in (("measured", "m_ttft"), ("simulated", "s_ttft")):
        cut = pct([x[k] for x in rows], 90)
        tail = [x for x in rows if x[k] >= cut]
        print(f"{label} TTFT >= p90 ({cut:.1f} ms): {len(tail)} requests, arrivals "
              + ", ".join(f"{x['arrival']:.1f}" for x in sorted(tail, key=lambda x: x["arrival"])))
        print(f"   their mean sim components: queue {np.mean([x['queue'] for x in tail]):.1f} compute "
              f"{np.mean([x['compute'] for x in tail]):.1f} save {np.mean([x['save'] for x in tail]):.1f}; "
              f"input {np.mean([x['input'] for x in tail]):.0f}, measured {np.mean([x['m_ttft'] for x in tail]):.1f}, "
              f"sim {np.mean([x['s_ttft'] for x in tail]):.1f}")
    # measured instance means vs simulated (the conductor's TTFT histogram counts the warm-up too)
    d = run_dir / name
    for f in sorted(d.glob("metrics*.txt")):
        v = metric_values(f.read_text())
        n, tot = v.get("nanoforge_time_to_first_token_seconds_count"), v.get("nanoforge_time_to_first_token_seconds_sum")
        pool = {k.removeprefix("nanoforge_kv_pool_").removesuffix("_total"): int(val) for k, val in v.items()
                if k.startswith("nanoforge_kv_pool_") and k.endswith("_total")}
        print(f"measured {f.name}: TTFT mean {1000 * tot / n:.1f} ms over {n:.0f} requests (warm-up included); {pool}")
    for inst in sim.instances:
        c = inst.connector.counters if inst.connector else {}
        print(f"simulated {inst.name}: {c}")
    print(f"simulated pool: {sim.pool.counters if sim.pool else None}, capacity {sim.pool.capacity if sim.pool else None}")


if __name__ == "__main__":
    main(*sys.argv[1:])
