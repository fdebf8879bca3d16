"""What a simulation run says: bench serve's summary (throughput, TTFT / TPOT / end-to-end percentiles, goodput
and the share of requests within the SLOs, computed by the same `summarize`), plus what only the simulator
sees: prefix-cache and pool hit rates, early rejections, and each instance's utilisation. Printed as tables,
written as JSON with latency CDF plots beside it (bench serve's `plot_cdf`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from nanoforge.serve.bench_serve import plot_cdf, print_table, summarize
from nanoforge.sim.cluster import Simulation


def slo_ms(config) -> dict:
    """The SLOs as bench serve's summary takes them (milliseconds)."""
    return {"ttft": config.ttft_slo * 1000 if config.ttft_slo else None,
            "tpot": config.tpot_slo * 1000 if config.tpot_slo else None}


def build_report(sim: Simulation, complete: bool = True, extra_config: dict | None = None) -> dict:
    """The run's numbers; deterministic for a seed (no wall-clock time in it)."""
    summary = summarize(sim.results, sim.makespan or 1e-9, slo_ms(sim.config))
    rejected = sum(1 for r in sim.results if r.error and r.error.startswith("rejected"))
    errors = sum(1 for r in sim.results if r.error and not r.error.startswith("rejected"))
    requests = []
    for req, res in zip(sim.requests, sim.results):
        requests.append({**dataclasses.asdict(res), "cached_tokens": req.cached_tokens,
                         "prefill": req.prefill.name if req.prefill else None,
                         "decode": req.decode.name if req.decode and sim.config.disaggregated else None})
    return {
        "config": {**dataclasses.asdict(sim.config), "label": sim.config.label(), "gpus": sim.config.gpus,
                   "requests": len(sim.replay), "max_model_len": sim.scheduler_config.max_model_len,
                   "block_size": sim.scheduler_config.block_size, "num_gpu_blocks": sim.scheduler_config.num_gpu_blocks,
                   "max_num_seqs": sim.scheduler_config.max_num_seqs,
                   "max_num_batched_tokens": sim.scheduler_config.max_num_batched_tokens, **(extra_config or {})},
        "profile": {"name": sim.profile.name, "status": sim.profile.status},
        "complete": complete,
        "summary": summary,
        "cluster": {"rejected": rejected, "rejected_by_slo": dict(sim.router.rejected), "errors": errors,
                    **sim.pool_stats()},
        "instances": sim.instance_stats(),
        "requests": requests,
    }


def print_report(report: dict) -> None:
    c, s, k = report["config"], report["summary"], report["cluster"]
    status = "" if report["profile"]["status"] == "measured" else " (derived, not measured)"
    print(f"\n{c['label']}: {c['requests']} requests, profile {report['profile']['name']}{status}")
    print_table(s, {"nanoforge_prefix_cache_hit_rate": k["prefix_hit_rate"],
                    "nanoforge_preemptions_total": sum(i["preemptions"] for i in report["instances"])})
    pool = f"pool hit rate {100 * k['pool_hit_rate']:.1f}% of prompt tokens"
    if k.get("pool_blocks_capacity"):
        pool += f" (pool of {k['pool_blocks_capacity']:,} blocks, {k['evictions']:,} evicted)"
    print(f"{pool}; rejected early {k['rejected']} (TTFT {k['rejected_by_slo']['ttft']}, "
          f"TPOT {k['rejected_by_slo']['tpot']}); errors {k['errors']}"
          + ("" if report["complete"] else "; STOPPED EARLY (too many requests missed their SLOs)"))
    print(f"\n{'instance':<10}{'routed':>8}{'busy':>7}{'steps':>9}{'prefill tok':>13}{'decode tok':>12}"
          f"{'tok/step':>10}{'peak KV':>9}{'preempt':>9}{'link':>7}")
    for i in report["instances"]:
        link = f"{100 * i['link_busy']:.0f}%" if "link_busy" in i else "-"
        print(f"{i['name']:<10}{i['routed']:>8}{100 * i['busy']:>6.0f}%{i['steps']:>9}{i['prefill_tokens']:>13,}"
              f"{i['decode_tokens']:>12,}{i['tokens_per_step']:>10.1f}{100 * i['peak_kv_blocks'] / i['kv_blocks']:>8.0f}%"
              f"{i['preemptions']:>9}{link:>7}")


def write_report(report: dict, sim: Simulation, out_dir: Path, name: str = "sim") -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out_dir / f"{name}.json", out_dir / f"{name}_cdf.png"
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    plot_cdf(sim.results, png_path)
    return [json_path, png_path]
