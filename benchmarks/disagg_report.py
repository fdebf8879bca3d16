"""The table, JSON and CDF plot of one preset's runs of benchmarks/gpu_disagg.sh.

    python benchmarks/disagg_report.py OUT/PRESET CONFIG...

Reads each CONFIG/serve.json (from `nanoforge bench serve`) and CONFIG/metrics*.txt (the server's, and each
instance's, Prometheus /metrics at the end), prints one table, writes disagg.json and disagg_cdf.png beside them.
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from nanoforge.serve.bench_serve import metric_values  # noqa: E402


def scrape(path: Path) -> dict[str, float]:
    """Unlabelled samples of a Prometheus text file (the labelled early-rejection counter summed)."""
    if not path.is_file():
        return {}
    return metric_values(path.read_text(), totals=("nanoforge_early_rejections_total",))


def main(root: Path, configs: list[str]) -> None:
    runs = {}
    for config in configs:
        report = json.loads((root / config / "serve.json").read_text())
        server = scrape(root / config / "metrics.txt")
        instances = [scrape(p) for p in sorted((root / config).glob("metrics-*.txt"))]
        s = report["summary"]
        runs[config] = {
            "summary": s,
            "prefix_cache_hit_rate": server.get("nanoforge_prefix_cache_hit_rate"),
            "kv_pool_loaded_blocks": sum(i.get("nanoforge_kv_pool_loaded_blocks_total", 0) for i in instances),
            "kv_pool_saved_blocks": sum(i.get("nanoforge_kv_pool_saved_blocks_total", 0) for i in instances),
            "early_rejections": server.get("nanoforge_early_rejections_total", 0),
            "requests": report["requests"],
        }
    cols = list(runs)
    rows = [("goodput (req/s)", lambda r: r["summary"]["goodput"], "{:.2f}"),
            ("SLO attainment", lambda r: r["summary"]["slo_attainment"], "{:.1%}"),
            ("completed / failed", lambda r: f"{r['summary']['completed']}/{r['summary']['failed']}", "{}"),
            ("early rejections", lambda r: r["early_rejections"], "{:.0f}"),
            ("output tokens/s", lambda r: r["summary"]["output_token_throughput"], "{:.0f}"),
            ("prompt tokens cached", lambda r: r["prefix_cache_hit_rate"] or 0.0, "{:.1%}"),
            ("pool blocks loaded", lambda r: r["kv_pool_loaded_blocks"], "{:.0f}")]
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT")):
        for p in (50, 90, 99):
            rows.append((f"{label} p{p} (ms)", lambda r, k=key, p=p: r["summary"][k][f"p{p}"] or float("nan"),
                         "{:.1f}"))
    print(f"\n{root.name}: {runs[cols[0]]['summary']['requests']} requests, SLOs "
          f"{runs[cols[0]]['summary']['slo_ms']}")
    print(f"{'':<22}" + "".join(f"{c:>14}" for c in cols))
    for label, get, fmt in rows:
        print(f"{label:<22}" + "".join(f"{fmt.format(get(runs[c])):>14}" for c in cols))
    (root / "disagg.json").write_text(json.dumps({c: {k: v for k, v in r.items() if k != "requests"}
                                                  for c, r in runs.items()}, indent=2))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, (key, label) in zip(axes, (("ttft_ms", "time to first token (ms)"),
                                       ("tpot_ms", "time per output token (ms)"))):
        for c in cols:
            v = np.sort([r[key] for r in runs[c]["requests"] if r.get(key) is not None and r.get("error") is None])
            if len(v):
                ax.step(v, np.arange(1, len(v) + 1) / len(runs[c]["requests"]), where="post", label=c)
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of all requests")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{root.name}: latency CDFs (failed and rejected requests never reach 1)")
    fig.tight_layout()
    fig.savefig(root / "disagg_cdf.png", dpi=110)
    print(f"wrote {root / 'disagg.json'} and {root / 'disagg_cdf.png'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
