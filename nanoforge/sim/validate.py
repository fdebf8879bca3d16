"""`nanoforge simulate validate`: the simulator's predictions against a real run of `benchmarks/gpu_disagg.sh`.

    nanoforge simulate validate RUN_DIR [RUN_DIR ...] --profile PROFILE.json [--pool-memory GIB] [--device cuda|cpu]

RUN_DIR is one preset's directory of that script's output ($OUT/PRESET): one directory per configuration
(colocated, 1p1d, 2p1d-rr, 2p1d-ca, 2p1d-ca-slo, colocated2), each with `serve.json` (bench serve's summary, its settings and
every request) and `server.log`. Each configuration is simulated on the same requests: the trace slice
($OUT/trace.jsonl) replayed with the settings bench serve recorded (length and time scales, caps, trace block
tokens, vocabulary and seed, so every prompt is the same token for token and hits the same blocks), on the cluster
the script started (one GPU shared by every instance, or one GPU each where the run holds `devices.txt`: the
script's DEVICES; the instances' context and KV blocks read from the log,
`--pool-memory` GiB of pool per instance, the connector's staging buffer of the device, the same policy and
SLOs). Printed and written as `sim_validation.json` / `.txt`: measured vs predicted TTFT p50 / p90, TPOT p50 and
request throughput, relative errors, and whether each is within `--tolerance` (15%).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from nanoforge.errors import NanoforgeError
from nanoforge.serve.bench_serve import (
    MOONCAKE_BLOCK_TOKENS,
    Request,
    TraceReplay,
    Vocab,
    metric_values,
    poisson_workload,
    read_trace,
    summarize,
)
from nanoforge.sim.cluster import ClusterConfig
from nanoforge.sim.profile import Profile

# gpu_disagg.sh's configurations: (prefill, decode) or colocated, and the conductor's policy
CONFIGS = {
    "colocated": {"colocated": 1},
    "1p1d": {"prefill": 1, "decode": 1, "policy": "round-robin"},
    "2p1d-rr": {"prefill": 2, "decode": 1, "policy": "round-robin"},
    "2p1d-ca": {"prefill": 2, "decode": 1, "policy": "cache-aware"},
    "2p1d-ca-slo": {"prefill": 2, "decode": 1, "policy": "cache-aware", "early_reject": True},
    "colocated2": {"colocated": 2, "policy": "cache-aware"},
}
STAGING_GIB = {"cuda": 1.0, "cpu": 64 / 1024}  # the KV connector's default staging buffer (EngineConfig)
METRICS = (("TTFT p50 (ms)", "ttft_ms", "p50"), ("TTFT p90 (ms)", "ttft_ms", "p90"), ("TPOT p50 (ms)", "tpot_ms", "p50"),
           ("throughput (req/s)", "request_throughput", None))
WARMUP_LENS = (128, 1024, 4096)  # gpu_disagg.sh's default WARMUP_LENS, in the order it sends them
NOT_JUDGED = {  # the instances' own TTFT and the pool calls, shown beside the judged metrics: key -> (label, what)
    "prefill_ttft_ms": ("prefill inst. TTFT", "its mean, warm-up included; the server's from before its parsing"),
    "decode_ttft_ms": ("decode inst. TTFT", "its mean from the hand-over, warm-up included; its load in it"),
    "put_call_ms_per_blocks": ("put call (ms/block)", "the prefill instances' saves, the calls"),
    "put_job_ms_per_calls": ("put job (ms)", "a save from its submission to its call's end"),
    "get_call_ms_per_blocks": ("get call (ms/block)", "the decode instances' loads, the calls"),
    "get_job_ms_per_calls": ("get job (ms)", "a load from its submission to its call's end"),
}
_INSTANCE = re.compile(r"context (\d+) tokens, (\d+) KV blocks")


def measured_step_ms(path: Path, kind: str = "decode") -> float | None:
    """An instance's mean step turn of `kind` in ms (its nanoforge_engine_step_seconds at the end), or None."""
    if not path.is_file():
        return None
    v = metric_values(path.read_text(), labelled=True)
    name = "nanoforge_engine_step_seconds"
    n, total = v.get(f'{name}_count{{kind="{kind}"}}'), v.get(f'{name}_sum{{kind="{kind}"}}')
    return 1000 * total / n if n else None


def _per_role(run_dir: Path, role: str, total: str, count: str) -> float | None:
    """1000 x the sum of `total` over the sum of `count` across the run's `role` instances' /metrics at the end
    (samples as written, labels included), or None where none has them."""
    totals = counts = 0.0
    for f in sorted(run_dir.glob(f"metrics-{role}*.txt")):
        v = metric_values(f.read_text(), labelled=True)
        t, n = v.get(total), v.get(count)
        if t is not None and n:
            totals, counts = totals + t, counts + n
    return 1000 * totals / counts if counts else None


def measured_call_ms(run_dir: Path, role: str, kind: str, what: str = "call", per: str = "blocks") -> float | None:
    """ms per block (`per` "blocks") or per call ("calls") of the pool calls of `kind` ("put", "get") that the
    run's `role` instances made: the calls themselves (`what` "call") or from submission to end ("job")
    (nanoforge_kv_pool_{call,job}_seconds, _call_blocks, _calls: servers from session 16 on), or None."""
    count = "kv_pool_calls" if per == "calls" else "kv_pool_call_blocks"
    return _per_role(run_dir, role, f'nanoforge_kv_pool_{what}_seconds_total{{kind="{kind}"}}',
                     f'nanoforge_{count}_total{{kind="{kind}"}}')


def measured_ttft_ms(run_dir: Path, role: str) -> float | None:
    """The `role` instances' mean TTFT in ms (nanoforge_time_to_first_token_seconds, warm-up included), or None."""
    return _per_role(run_dir, role, "nanoforge_time_to_first_token_seconds_sum",
                     "nanoforge_time_to_first_token_seconds_count")


def predicted_call_ms(instances: list[dict], role: str, kind: str, what: str = "call",
                      per: str = "blocks") -> float | None:
    """The same from the simulated instances' connectors."""
    key = f"{kind}_calls" if per == "calls" else f"{kind}_call_blocks"
    rows = [i for i in instances if i["role"] == role and i.get(key)]
    count = sum(i[key] for i in rows)
    return 1000 * sum(i[f"{kind}_{what}_s"] for i in rows) / count if count else None


def measured_decode_loads(run_dir: Path) -> int | None:
    """Blocks the run's decode instances loaded from the pool (their /metrics at the end), or None."""
    values = [metric_values(f.read_text()).get("nanoforge_kv_pool_loaded_blocks_total")
              for f in sorted(run_dir.glob("metrics-decode*.txt"))]
    values = [v for v in values if v is not None]
    return int(sum(values)) if values else None


def _value(summary: dict, key: str, sub: str | None) -> float | None:
    v = summary.get(key)
    return v.get(sub) if sub is not None and isinstance(v, dict) else v


def replay_of(run: dict, trace: Path) -> TraceReplay:
    """The requests bench serve sent, from the settings it recorded in serve.json."""
    c = run["config"]
    if not c.get("vocab_size") or c.get("tokenizer"):
        raise NanoforgeError("the run sent text through a tokenizer: only --vocab-size runs (random token ids) can be "
                             "replayed token for token", param="run")
    return TraceReplay(read_trace(trace), Vocab(c["vocab_size"]), length_scale=c.get("length_scale") or 1.0,
                       time_scale=c.get("time_scale") if c.get("time_scale") is not None else 1.0,
                       max_input_len=c.get("max_input_len"), max_output_len=c.get("max_output_len"),
                       num_requests=c.get("num_requests"),
                       block_tokens=c.get("trace_block_tokens") or MOONCAKE_BLOCK_TOKENS, seed=c.get("seed") or 0)


def warmup_of(config_dir: Path, trace_tokens: int) -> list[list[Request]]:
    """The bench serve runs gpu_disagg.sh sent before the trace (its WARMUP_LENS, each `--num-requests N --rate
    R` with the settings its last run recorded in warmup/serve.json: the runs differ only in length and seed, and
    a seed draws the same arrivals and tokens), or [] if the run kept no warm-up. The script's default lengths are
    taken when the servers' /metrics agree (the conductor's or the server's prompt tokens, less the trace's,
    are the warm-up's); else only the recorded run. Seeds: since session 50 the script seeds each length's run
    with the length (`--seed $len`: no warm-up prompt begins with another's tokens), which the recorded run shows
    as a seed equal to its length; runs before it used one seed for every length."""
    path = config_dir / "warmup" / "serve.json"
    if not path.is_file():
        return []
    c = json.loads(path.read_text())["config"]
    lens = [n for n in WARMUP_LENS if n != c["input_len"]] + [c["input_len"]]
    seen = config_dir / "metrics.txt"
    if seen.is_file():
        total = metric_values(seen.read_text()).get("nanoforge_prompt_tokens_total")
        if total is not None and total - trace_tokens != c["num_requests"] * sum(lens):
            lens = [c["input_len"]]
    vocab = Vocab(c["vocab_size"])
    seed = c.get("seed") or 0
    per_length = seed == c["input_len"]
    return [poisson_workload(c["num_requests"], c["rate"], n, c["output_len"], vocab, n if per_length else seed)
            for n in lens]


def recorded_gap_s(config_dir: Path, run: dict) -> float | None:
    """The seconds between the last warm-up run's end and the trace's start, from the wall clocks bench serve
    records (session 12 on; None for runs without them)."""
    path = config_dir / "warmup" / "serve.json"
    if "started_unix" not in run or not path.is_file():
        return None
    w = json.loads(path.read_text())
    if "started_unix" not in w:
        return None
    return max(0.0, run["started_unix"] - w["started_unix"] - w["summary"]["duration_s"])


def cluster_of(name: str, run: dict, log: str, *, pool_memory: float, device: str,
               own_gpus: bool = False) -> ClusterConfig:
    """The cluster gpu_disagg.sh started for configuration `name` (`own_gpus`: a GPU for each instance, its
    DEVICES; else all on one)."""
    shape = CONFIGS[name]
    instances = [(int(a), int(b)) for a, b in _INSTANCE.findall(log)]
    if not instances:
        raise NanoforgeError(f"{name}/server.log names no instance's context and KV blocks", param="run")
    c = run["config"]
    slo = {"ttft_slo": c["slo_ttft_ms"] / 1000 if c.get("slo_ttft_ms") else None,
           "tpot_slo": c["slo_tpot_ms"] / 1000 if c.get("slo_tpot_ms") else None}
    pooled = "prefill" in shape or shape.get("colocated", 1) > 1  # a --disagg cluster: the pool behind it
    return ClusterConfig(**shape, **slo, pool_gib=pool_memory * len(instances) if pooled else 0.0,
                         staging_gib=STAGING_GIB[device] if pooled else None,
                         max_model_len=min(n for n, _ in instances), num_gpu_blocks=min(b for _, b in instances),
                         shared_gpu=not own_gpus, schedule_ahead=device == "cuda")


def validate(run_dirs: Path | list[Path], profile: Profile, *, pool_memory: float, device: str,
             tolerance: float = 0.15, configs: list[str] | None = None, progress: bool = True,
             warmup_gap_s: float | None = None) -> dict:
    """Each configuration of one run directory, or of several: repeats of the same run (the same trace and
    settings). The real runs vary from run to run more than the simulator's error (session 13, 1P+1D on one
    H200, minutes apart: TTFT p50 80 and 119 ms), so with repeats the judged numbers are the medians over the
    runs, measured and predicted (each run simulated with its own warm-up), and the table shows the measured
    range beside them.

    `warmup_gap_s`: replay each run's warm-up (`warmup_of`) first, each bench serve run starting that long after
    the one before it ended, the trace that long after the last (None: the gap the run recorded, `recorded_gap_s`;
    no warm-up where it recorded none, as the runs before session 12 did not)."""
    dirs = [run_dirs] if isinstance(run_dirs, Path) else list(run_dirs)
    runs = [_validate_run(d, profile, pool_memory=pool_memory, device=device, configs=configs, progress=progress,
                          warmup_gap_s=warmup_gap_s) for d in dirs]
    rows = []
    for name in CONFIGS:
        each = [r[name] for r in runs if name in r]
        if not each:
            continue
        metrics = {}
        for label, _, _ in METRICS:
            ms = [r["metrics"][label]["measured"] for r in each]
            ps = [r["metrics"][label]["predicted"] for r in each]
            m, p = _median(ms), _median(ps)
            err = (p - m) / m if m and p is not None else None
            metrics[label] = {"measured": m, "predicted": p, "rel_error": err,
                              "ok": err is not None and abs(err) <= tolerance, "measured_runs": ms,
                              "predicted_runs": ps}
        row = {**each[0], "runs": len(each), "metrics": metrics,
               "measured_summary": [r["measured_summary"] for r in each],
               "predicted_summary": [r["predicted_summary"] for r in each]}
        for key in ("decode_step_ms", "decode_pool_loaded_blocks", *NOT_JUDGED):
            row[key] = {side: _median([r[key][side] for r in each]) for side in ("measured", "predicted")}
        row["ok"] = all(v["ok"] for v in metrics.values())
        rows.append(row)
    if not rows:
        raise NanoforgeError(f"{', '.join(map(str, dirs))}: no configuration directory with a serve.json "
                             f"({', '.join(CONFIGS)})", param="run")
    return {"run_dir": str(dirs[0]), "run_dirs": [str(d) for d in dirs],
            "profile": {"name": profile.name, "status": profile.status}, "warmup_gap_s": warmup_gap_s,
            "device": device, "pool_memory_gib": pool_memory, "tolerance": tolerance, "rows": rows,
            "ok": all(r["ok"] for r in rows)}


def _median(values: list) -> float | None:
    """The median (of two, their mean); None if any is missing."""
    if not values or any(v is None for v in values):
        return None
    v, mid = sorted(values), len(values) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def _validate_run(run_dir: Path, profile: Profile, *, pool_memory: float, device: str, configs, progress: bool,
                  warmup_gap_s: float | None) -> dict:
    """config -> its row (measured and predicted metrics, unjudged) for one run directory."""
    from nanoforge.sim.commands import simulate

    trace = run_dir.parent / "trace.jsonl"
    rows = {}
    for name in configs or list(CONFIGS):
        d = run_dir / name
        if not (d / "serve.json").is_file():
            continue
        run = json.loads((d / "serve.json").read_text())
        path = trace if trace.is_file() else Path(run["config"]["trace"])
        replay = replay_of(run, path)
        log = (d / "server.log").read_text() if (d / "server.log").is_file() else ""
        config = cluster_of(name, run, log, pool_memory=pool_memory, device=device,
                            own_gpus=(d / "devices.txt").is_file())
        trace_tokens = sum(replay.input_len(i) for i in range(len(replay)))
        gap = warmup_gap_s if warmup_gap_s is not None else recorded_gap_s(d, run)
        warmup = None if gap is None else (warmup_of(d, trace_tokens), gap)
        sim, _ = simulate(replay, config, profile, progress=progress, desc=name, warmup=warmup)
        predicted = summarize(sim.results, sim.makespan or 1e-9, run["summary"].get("slo_ms") or {})
        measured = run["summary"]
        metrics = {label: {"measured": _value(measured, key, sub), "predicted": _value(predicted, key, sub)}
                   for label, key, sub in METRICS}
        instances = sim.instance_stats()
        predicted_loads = sum(i.get("loaded_blocks", 0) for i in instances if i["role"] == "decode")
        loads = {"measured": measured_decode_loads(d), "predicted": predicted_loads if config.disaggregated else None}
        decoder = next(i for i in instances if i["role"] != "prefill")  # the (first) decoding instance
        decoding = {"colocated": "metrics.txt", "colocated2": "metrics-both1.txt"}.get(name, "metrics-decode1.txt")
        steps = {"measured": measured_step_ms(d / decoding),
                 "predicted": decoder["step_ms"].get("decode")}
        calls = {f"{kind}_{what}_ms_per_{per}": {"measured": measured_call_ms(d, role, kind, what, per),
                                                "predicted": predicted_call_ms(instances, role, kind, what, per)}
                 for role, kind in (("prefill", "put"), ("decode", "get"))
                 for what, per in (("call", "blocks"), ("job", "calls"))}
        for role in ("prefill", "decode"):
            ttfts = [i["ttft_ms"] for i in instances if i["role"] == role and i["ttft_ms"] is not None]
            calls[f"{role}_ttft_ms"] = {"measured": measured_ttft_ms(d, role),
                                        "predicted": sum(ttfts) / len(ttfts) if ttfts else None}
        rows[name] = {"config": name, "cluster": config.label(), "requests": len(replay), "metrics": metrics,
                      "decode_step_ms": steps, "decode_pool_loaded_blocks": loads, **calls,
                      "measured_summary": measured, "predicted_summary": predicted}
    return rows


def table(report: dict) -> str:
    tol = report["tolerance"]
    dirs = report.get("run_dirs") or [report["run_dir"]]
    repeats = any(r.get("runs", 1) > 1 for r in report["rows"])
    where = dirs[0] if len(dirs) == 1 else f"{len(dirs)} runs: {', '.join(dirs)}; medians, measured range beside"
    lines = [(f"simulator vs measured, {where} (profile {report['profile']['name']}, "
             f"{report['profile']['status']}; pass: within {100 * tol:.0f}%)"),
             f"{'config':<13}{'metric':<20}{'measured':>10}{'predicted':>11}{'error':>9}  pass"
             + ("  measured range (spread)" if repeats else "")]
    num = (lambda x: "-" if x is None else f"{x:.2f}")
    for r in report["rows"]:
        for label, v in r["metrics"].items():
            err = "-" if v["rel_error"] is None else f"{100 * v['rel_error']:+.1f}%"
            line = (f"{r['config']:<13}{label:<20}{num(v['measured']):>10}{num(v['predicted']):>11}{err:>9}  "
                    f"{'yes' if v['ok'] else 'NO '}")
            runs = v.get("measured_runs") or []
            if repeats and len(runs) > 1 and None not in runs and v["measured"]:
                lo, hi = min(runs), max(runs)
                line += f"  {lo:.2f}-{hi:.2f} ({100 * (hi - lo) / v['measured']:.0f}%)"
            lines.append(line.rstrip())
        for label, key, fmt, what in (("decode step (ms)", "decode_step_ms", ".2f", "the decoding instance's steps"),
                                      ("pool blocks loaded", "decode_pool_loaded_blocks", "", "the decode instances' loads"),
                                      *((label, key, ".3f", what) for key, (label, what) in NOT_JUDGED.items())):
            v = r.get(key) or {}
            if v.get("measured") is not None and v.get("predicted") is not None:
                err = f"{100 * (v['predicted'] - v['measured']) / v['measured']:+.1f}%" if v["measured"] else "-"
                lines.append(f"{r['config']:<13}{label:<20}{v['measured']:>10{fmt}}{v['predicted']:>11{fmt}}{err:>9}  "
                             f"(not judged: {what})")
    passed = sum(v["ok"] for r in report["rows"] for v in r["metrics"].values())
    total = sum(len(r["metrics"]) for r in report["rows"])
    lines.append(f"{passed} of {total} within {100 * tol:.0f}%")
    return "\n".join(lines)


# --- the command line ------------------------------------------------------------------------------------------

def add_cli_arguments(p) -> None:
    from nanoforge.sim.profile import DEFAULT_PROFILE

    p.add_argument("run_dir", metavar="RUN_DIR", nargs="+",
                   help="one preset's output of benchmarks/gpu_disagg.sh ($OUT/PRESET), or several: repeats of the "
                        "same run (benchmarks/gpu_validate.sh), judged by their medians")
    p.add_argument("--profile", default=DEFAULT_PROFILE, help="the profile measured on the same model and device")
    p.add_argument("--pool-memory", type=float, default=8.0, metavar="GIB",
                   help="the run's POOL_MEMORY: pool GiB per instance (gpu_disagg.sh's default: 8)")
    p.add_argument("--device", choices=sorted(STAGING_GIB), default=None,
                   help="the run's device (default: cuda if $OUT/gpu.txt names a GPU, else cpu)")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=None)
    p.add_argument("--tolerance", type=float, default=0.15)
    p.add_argument("--out", default=None, help="directory for sim_validation.json/.txt (default: RUN_DIR; with "
                                               "several, the folder they have in common)")
    p.add_argument("--warmup-gap-s", type=float, default=None, metavar="S",
                   help="replay the run's warm-up first (gpu_disagg.sh's WARMUP_LENS), each bench serve run S seconds "
                        "after the one before it ended (its blocks lease pool room); default: the gap the run "
                        "recorded, or no warm-up where it recorded none")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run_cli(args) -> int:
    dirs = [Path(d) for d in args.run_dir]
    for d in dirs:
        if not d.is_dir():
            raise NanoforgeError(f"no run directory {d}", param="run_dir")
    run_dir = dirs[0]
    if args.warmup_gap_s is not None and not args.warmup_gap_s >= 0:
        raise NanoforgeError(f"--warmup-gap-s must be >= 0, got {args.warmup_gap_s}", param="warmup_gap_s")
    if not args.pool_memory > 0 or not args.tolerance > 0:
        raise NanoforgeError(f"--pool-memory and --tolerance must be > 0, got {args.pool_memory}, {args.tolerance}",
                             param="pool_memory")
    device = args.device
    if device is None:
        gpu = run_dir.parent / "gpu.txt"
        device = "cuda" if gpu.is_file() and gpu.read_text().strip() else "cpu"
    report = validate(dirs, Profile.load(args.profile), pool_memory=args.pool_memory, device=device,
                      tolerance=args.tolerance, configs=args.configs, progress=not args.quiet,
                      warmup_gap_s=args.warmup_gap_s)
    text = table(report)
    print(text)
    out = Path(args.out) if args.out else run_dir if len(dirs) == 1 else Path(os.path.commonpath(dirs))
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim_validation.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "sim_validation.txt").write_text(text + "\n")
    print(f"wrote {out / 'sim_validation.json'} and {out / 'sim_validation.txt'}")
    return 0
