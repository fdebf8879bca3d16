"""Capacity: the highest arrival-rate scale at which a cluster still meets its SLOs, and the N:M sweep.

A configuration's capacity is the largest `speedup` (the trace's arrivals that many times as fast) at which
at least `target` (90%) of the requests meet both SLOs (rejected and failed requests count as missing them).
Found by doubling (or halving) from 1 until the answer changes, then bisecting (geometrically) until the
bracket is within `precision`. A probe stops as soon as more than (1 - target) of the requests have missed,
so overloaded probes cost little. The search assumes that attainment falls as the rate rises, which holds
for queueing but is not guaranteed (early rejection, cache effects); the probes are all in the JSON.

    nanoforge simulate capacity --trace T --ttft-slo S --tpot-slo S [--configs SPEC ...] [...]
    nanoforge simulate sweep --trace T --gpus K --ttft-slo S --tpot-slo S [...]

A SPEC is `K` (K colocated instances) or `N+M` (N prefill + M decode), optionally followed by
`:option,option...`: `pool=G` (KV pool of G GiB; `pool=0`: none), `reject` / `noreject` (early rejection),
`policy=P`; options not given come from the flags.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

from nanoforge.errors import NanoforgeError
from nanoforge.serve.bench_serve import TraceReplay
from nanoforge.serve.disagg.router import POLICIES
from nanoforge.sim.cluster import ClusterConfig
from nanoforge.sim.profile import Profile


def parse_spec(spec: str, base: ClusterConfig) -> ClusterConfig:
    """A configuration from a SPEC (see the module's docstring), the rest as in `base`."""
    shape, _, options = spec.partition(":")
    bad = NanoforgeError(f"a configuration is K (colocated), N+M (prefill + decode), optionally :pool=G,reject,"
                         f"noreject,policy=P; got {spec!r}", param="configs")
    try:
        if "+" in shape:
            n, m = (int(x) for x in shape.split("+"))
            fields = {"prefill": n, "decode": m, "colocated": 0}
        else:
            fields = {"prefill": 0, "decode": 0, "colocated": int(shape)}
    except ValueError:
        raise bad from None
    for option in filter(None, options.split(",")):
        key, _, value = option.partition("=")
        if key == "pool" and value:
            try:
                fields["pool_gib"] = float(value)
            except ValueError:
                raise bad from None
        elif key in ("reject", "noreject") and not value:
            fields["early_reject"] = key == "reject"
        elif key == "policy" and value in POLICIES:
            fields["policy"] = value
        else:
            raise bad
    config = dataclasses.replace(base, **fields)
    config.check()
    return config


class Probe:
    """Runs the simulation of one configuration at one speedup."""

    def __init__(self, make_replay, profile: Profile, target: float, bars: bool = True, say=print):
        """`bars`: a progress bar per probe; `say`: where each probe's one-line result goes (None: nowhere)."""
        self.make_replay, self.profile, self.target, self.bars, self.say = make_replay, profile, target, bars, say

    def __call__(self, config: ClusterConfig, speedup: float) -> dict:
        from nanoforge.sim.commands import simulate
        from nanoforge.sim.report import build_report

        replay: TraceReplay = self.make_replay(speedup)
        allowed = math.floor((1 - self.target) * len(replay) + 1e-9)
        start = time.perf_counter()
        sim, complete = simulate(replay, config, self.profile, progress=self.bars,
                                 stop_after_failures=allowed, desc=f"{config.label()} x{speedup:.3g}")
        report = build_report(sim, complete)
        s = report["summary"]
        ok = complete and s["slo_attainment"] >= self.target
        probe = {"speedup": speedup, "ok": ok, "complete": complete,
                 "slo_attainment": s["slo_attainment"] if complete else None, "wall_s": time.perf_counter() - start}
        if complete:
            probe["summary"] = {k: s[k] for k in ("request_throughput", "goodput", "ttft_ms", "tpot_ms")}
            probe["cluster"] = {k: report["cluster"][k] for k in ("rejected", "prefix_hit_rate", "pool_hit_rate")}
            probe["instances"] = [{k: i[k] for k in ("name", "busy", "link_busy") if k in i}
                                  for i in report["instances"]]
        if self.say is not None:
            got = f"{100 * s['slo_attainment']:.1f}%" if complete else f"> {allowed} missed, stopped"
            self.say(f"  {config.label()} at x{speedup:.3g}: {got} within SLOs -> {'ok' if ok else 'over'} "
                     f"({probe['wall_s']:.0f} s)")
        return probe


def find_capacity(probe: Probe, config: ClusterConfig, *, precision: float = 0.05, start: float = 1.0,
                  lowest: float = 1 / 64, highest: float = 1024.0) -> dict:
    """The capacity of `config` (see the module's docstring); every probe is kept."""
    probes = []

    def ok(speedup: float) -> bool:
        probes.append(probe(config, speedup))
        return probes[-1]["ok"]

    lo = hi = None
    s = start
    if ok(s):
        lo = s
        while hi is None and s < highest:
            s *= 2
            if ok(s):
                lo = s
            else:
                hi = s
    else:
        hi = s
        while lo is None and s > lowest:
            s /= 2
            if ok(s):
                lo = s
            else:
                hi = s
    if lo is not None and hi is not None:
        while hi / lo > 1 + precision:
            mid = math.sqrt(lo * hi)
            if ok(mid):
                lo = mid
            else:
                hi = mid
    best = max((p for p in probes if p["ok"]), key=lambda p: p["speedup"], default=None)
    return {"config": dataclasses.asdict(config), "label": config.label(), "gpus": config.gpus,
            "capacity_speedup": lo or 0.0, "first_failing_speedup": hi, "at_capacity": best,
            "probes": sorted(probes, key=lambda p: p["speedup"])}


def capacity_table(results: list[dict], rate_at_1: float) -> str:
    """One line per configuration: its capacity (speedup and requests/s) and the run at capacity."""
    lines = [(f"{'configuration':<52}{'GPUs':>5}{'capacity':>10}{'req/s':>8}{'goodput':>9}{'TTFT p90':>10}"
             f"{'TPOT p90':>10}{'cache hit':>10}{'rejected':>9}")]
    for r in results:
        a = r["at_capacity"]
        if a is None:
            lowest = min(p["speedup"] for p in r["probes"])
            lines.append(f"{r['label']:<52}{r['gpus']:>5}{'< x' + format(lowest, '.3g'):>10}"
                         f"{'< ' + format(rate_at_1 * lowest, '.2f'):>8}")
            continue
        s, c, cap = a["summary"], a["cluster"], r["capacity_speedup"]
        lines.append(f"{r['label']:<52}{r['gpus']:>5}{'x' + format(cap, '.3g'):>10}{rate_at_1 * cap:>8.2f}"
                     f"{s['goodput']:>9.2f}{s['ttft_ms']['p90'] / 1000:>9.2f}s{s['tpot_ms']['p90']:>8.0f}ms"
                     f"{100 * c['prefix_hit_rate']:>9.1f}%{c['rejected']:>9}")
    return "\n".join(lines)


def plot_capacity(results: list[dict], rate_at_1: float, path: Path, title: str) -> None:
    """Left: capacity per configuration; right: SLO attainment against the arrival rate, probe by probe."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(15, max(4, 0.45 * len(results) + 1.5)))
    labels = [r["label"] for r in results]
    rates = [rate_at_1 * r["capacity_speedup"] for r in results]
    left.barh(range(len(results)), rates, color=["tab:orange" if r["config"]["colocated"] else "tab:blue"
                                                 for r in results])
    left.set_yticks(range(len(results)), labels, fontsize=8)
    left.invert_yaxis()
    left.set_xlabel("capacity (requests/s with >= 90% of requests within both SLOs)")
    for i, v in enumerate(rates):
        left.text(v, i, f" {v:.2f}", va="center", fontsize=8)
    for r in results:
        pts = [(rate_at_1 * p["speedup"], p["slo_attainment"]) for p in r["probes"] if p["complete"]]
        if pts:
            right.plot(*zip(*pts), marker="o", ms=3, label=r["label"])
    right.axhline(0.9, color="gray", ls="--", lw=1)
    right.set_xscale("log")
    right.set_xlabel("arrival rate (requests/s)")
    right.set_ylabel("fraction of requests within both SLOs")
    right.set_ylim(0, 1.02)
    right.grid(alpha=0.3)
    right.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(results: list[dict], colocated: dict | None, rate_at_1: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    xs = [r["config"]["prefill"] for r in results]
    ax.plot(xs, [rate_at_1 * r["capacity_speedup"] for r in results], marker="o", label="N prefill + (K - N) decode")
    if colocated is not None:
        ax.axhline(rate_at_1 * colocated["capacity_speedup"], color="tab:orange", ls="--",
                   label=f"{colocated['gpus']} colocated")
    ax.set_xlabel("prefill instances N")
    ax.set_ylabel("capacity (requests/s)")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")
