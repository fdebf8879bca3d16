"""`nanoforge simulate`: the command line of the cluster simulator.

    nanoforge simulate --trace FILE (--prefill N --decode M | --colocated K) [...]   one run: table, JSON, CDFs
    nanoforge simulate capacity --trace FILE [--configs SPEC...] [...]              capacity per configuration
    nanoforge simulate sweep --trace FILE --gpus K [...]                            choose N:M for K GPUs
    nanoforge simulate profile --model-preset NAME --out PROFILE.json               measure a profile
    nanoforge simulate validate RUN_DIR --profile PROFILE.json                      vs a gpu_disagg.sh run
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from nanoforge.errors import NanoforgeError
from nanoforge.serve.bench_serve import (
    MOONCAKE_BLOCK_TOKENS,
    TraceReplay,
    Vocab,
    read_trace,
)
from nanoforge.serve.disagg.router import POLICIES
from nanoforge.sim.cluster import ClusterConfig, Simulation
from nanoforge.sim.pool import LEASE_S
from nanoforge.sim.profile import DEFAULT_PROFILE, Profile, profiles


class ByteVocab(Vocab):
    """Prompt token ids in [0, 256): any ids do (only which blocks repeat matters); these are drawn fast (random
    bytes) and, as Python's cached small ints, cost no memory beyond the lists that hold them."""

    def __init__(self):
        super().__init__(256)

    def draw(self, rng, n: int) -> list[int]:
        return list(rng.randbytes(n))


CACHED_TRACE_BLOCKS = 8192  # hash-id blocks of tokens kept for reuse while replaying (the rest are rebuilt)


# --- shared flags ----------------------------------------------------------------------------------------

def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload (a Mooncake trace, read as `nanoforge bench serve` reads it)")
    g.add_argument("--trace", help="JSONL rows: timestamp (ms), input_length, output_length, hash_ids")
    g.add_argument("--num-requests", type=int, default=None, help="the first N rows")
    g.add_argument("--speedup", type=float, default=1.0, help="arrivals X times as fast as in the trace")
    g.add_argument("--length-scale", type=float, default=1.0, help="scale input lengths and the trace's blocks")
    g.add_argument("--max-input-len", type=int, default=None, help="cap prompt tokens")
    g.add_argument("--max-output-len", type=int, default=None, help="cap output tokens")
    g.add_argument("--trace-block-tokens", type=int, default=MOONCAKE_BLOCK_TOKENS,
                   help="prompt tokens per hash id in the trace (Mooncake: 512)")
    g.add_argument("--seed", type=int, default=0, help="prompt tokens, and the random policy")


def add_cluster_arguments(p: argparse.ArgumentParser, *, shape: bool = True) -> None:
    g = p.add_argument_group("cluster")
    if shape:
        g.add_argument("--prefill", type=int, default=0, metavar="N", help="prefill instances (disaggregated)")
        g.add_argument("--decode", type=int, default=0, metavar="M", help="decode instances (disaggregated)")
        g.add_argument("--colocated", type=int, default=0, metavar="K",
                       help="instances that prefill and decode (vLLM-style), instead of --prefill/--decode")
    g.add_argument("--policy", choices=POLICIES, default="cache-aware", help="the conductor's routing")
    g.add_argument("--ttft-slo", type=float, default=None, metavar="S", help="time-to-first-token objective (s)")
    g.add_argument("--tpot-slo", type=float, default=None, metavar="S", help="time-per-output-token objective (s)")
    g.add_argument("--early-reject", action="store_true",
                   help="the conductor rejects at once what it predicts would miss an SLO (429)")
    g.add_argument("--pool-gib", type=float, default=0.0, metavar="G",
                   help="KV pool capacity (GiB, the whole cluster's: each instance holds an equal segment of it, "
                        "which its own saves fill first); 0: no pool (disaggregated: blocks only go from prefill to "
                        "decode instances)")
    g.add_argument("--pool-lease-s", type=float, default=LEASE_S, metavar="S",
                   help="how long after its last use a block in the pool cannot be evicted; a full pool turns "
                        "puts away meanwhile (mooncake_master's default_kv_lease_ttl: 10)")
    g.add_argument("--staging-gib", type=float, default=None, metavar="G",
                   help="each connector's staging buffer, which caps the blocks of one pool call (the engine's "
                        "default on a GPU: 1); default: as large as a call needs")
    g.add_argument("--link-gbs", type=float, default=None, metavar="GB/S",
                   help="the pool link's bandwidth per call, instead of the profile's (e.g. RDMA)")
    g.add_argument("--profile", default=DEFAULT_PROFILE,
                   help=f"time model: a JSON file or one of {', '.join(profiles()) or 'none shipped'}")
    g.add_argument("--block-size", type=int, default=None, help="KV block size in tokens (default: the profile's)")
    g.add_argument("--num-gpu-blocks", type=int, default=None, help="KV blocks per instance (default: the profile's)")
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None,
                   help="the context; longer requests fail (default: long enough for every request)")
    g.add_argument("--shared-gpu", action="store_true",
                   help="all instances share one GPU, which time-slices between their steps (1P+1D on one GPU)")
    g.add_argument("--pool-workers", type=int, default=1, metavar="N",
                   help="a KV connector's pool calls in flight at most, sharing its link (the engine runs 4; 1, the "
                        "default, is the model validated against the H200's runs)")
    g.add_argument("--shared-link", action="store_true",
                   help="every instance's pool calls share one link (all on one host)")
    g.add_argument("--schedule-ahead", action=argparse.BooleanOptionalAction, default=None,
                   help="instances that the engine lets schedule a step ahead (no pool saves) do (default: on "
                        "where the profile was measured on a GPU, as the engine does there)")


def replay_from_args(args) -> TraceReplay:
    if not args.trace:
        raise NanoforgeError("give --trace FILE (a Mooncake trace, JSONL)", param="trace")
    for name in ("num_requests", "max_input_len", "max_output_len", "trace_block_tokens"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise NanoforgeError(f"--{name.replace('_', '-')} must be >= 1, got {v}", param=name)
    if not args.speedup > 0:
        raise NanoforgeError(f"--speedup must be > 0, got {args.speedup}", param="speedup")
    return TraceReplay(read_trace(args.trace), ByteVocab(), length_scale=args.length_scale,
                       time_scale=1 / args.speedup, max_input_len=args.max_input_len,
                       max_output_len=args.max_output_len, num_requests=args.num_requests,
                       block_tokens=args.trace_block_tokens, seed=args.seed, cache_blocks=CACHED_TRACE_BLOCKS)


def config_from_args(args, **shape) -> ClusterConfig:
    shape = shape or {"prefill": args.prefill, "decode": args.decode, "colocated": args.colocated}
    config = ClusterConfig(**shape, policy=args.policy, ttft_slo=args.ttft_slo, tpot_slo=args.tpot_slo,
                           early_reject=args.early_reject, pool_gib=args.pool_gib, pool_lease_s=args.pool_lease_s,
                           staging_gib=args.staging_gib,
                           link_gbs=args.link_gbs, block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
                           max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                           max_model_len=args.max_model_len, shared_gpu=args.shared_gpu,
                           shared_link=args.shared_link, pool_workers=args.pool_workers,
                           schedule_ahead=args.schedule_ahead, seed=args.seed)
    config.check()
    return config


def simulate(replay: TraceReplay, config: ClusterConfig, profile: Profile, *, progress: bool = True,
             stop_after_failures: int | None = None, desc: str | None = None,
             warmup: tuple[list, float] | None = None) -> tuple[Simulation, bool]:
    """One run, with a progress bar over the requests (rate and ETA) unless `progress` is False; `warmup`:
    (runs, gap in seconds) sent first (`Simulation.warm_up`)."""
    sim = Simulation(replay, config, profile)
    if warmup is not None:
        sim.warm_up(*warmup)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(replay), unit="req", desc=desc or config.label(), leave=False, mininterval=0.5)

        def tick(req):
            bar.update()
            if bar.n % 50 == 0:
                bar.set_postfix_str(f"t={sim.clock.now:.0f}s sim", refresh=False)

        sim.on_progress = tick
    try:
        complete = sim.run(stop_after_failures=stop_after_failures)
    finally:
        if bar is not None:
            bar.close()
    return sim, complete


# --- simulate ----------------------------------------------------------------------------------------------

def add_run_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p)
    add_cluster_arguments(p)
    p.add_argument("--out", default="runs/sim", help="directory for sim.json and sim_cdf.png")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run_cli(args) -> int:
    from nanoforge.sim.report import build_report, print_report, write_report

    profile = Profile.load(args.profile)
    config = config_from_args(args)
    replay = replay_from_args(args)
    start = time.perf_counter()
    sim, complete = simulate(replay, config, profile, progress=not args.quiet)
    wall = time.perf_counter() - start
    report = build_report(sim, complete, {"trace": str(args.trace), "speedup": args.speedup,
                                          "length_scale": args.length_scale})
    print_report(report)
    paths = write_report(report, sim, Path(args.out))
    print(f"\nsimulated {sim.makespan:,.0f} s of serving in {wall:.1f} s; wrote {paths[0]} and {paths[1]}")
    return 0


def add_verbs(verbs) -> None:
    """`simulate profile | capacity | sweep | validate`."""
    p = verbs.add_parser("capacity", help="the highest arrival-rate scale at which >= 90%% of requests meet both "
                                          "SLOs, per configuration (bisection); table, JSON, plot")
    add_workload_arguments(p)
    add_cluster_arguments(p)
    _add_search_arguments(p)
    p.add_argument("--configs", nargs="+", metavar="SPEC", default=None,
                   help="configurations: K (colocated) or N+M, optionally :pool=G,reject,noreject,policy=P "
                        "(default: the one --prefill/--decode/--colocated give)")
    p.add_argument("--out", default="runs/sim", help="directory for capacity.json and capacity.png")
    p.set_defaults(func=run_capacity)

    p = verbs.add_parser("sweep", help="choose N:M for K GPUs: the capacity of every N prefill + (K - N) decode, "
                                       "and of K colocated instances")
    add_workload_arguments(p)
    add_cluster_arguments(p, shape=False)
    _add_search_arguments(p)
    p.add_argument("--gpus", type=int, required=True, metavar="K", help="instances in all")
    p.add_argument("--out", default="runs/sim", help="directory for sweep.json and sweep.png")
    p.set_defaults(func=run_sweep)

    p = verbs.add_parser("profile", help="measure a time-model profile on the real engine (random weights)")
    from nanoforge.sim.measure import add_cli_arguments
    from nanoforge.sim.measure import run_cli as run_profile

    add_cli_arguments(p)
    p.set_defaults(func=run_profile)

    p = verbs.add_parser("validate", help="predictions vs a real run of benchmarks/gpu_disagg.sh (TTFT p50/p90, "
                                          "TPOT p50, throughput; pass within 15%%)")
    from nanoforge.sim.validate import add_cli_arguments as add_validate_arguments
    from nanoforge.sim.validate import run_cli as run_validate

    add_validate_arguments(p)
    p.set_defaults(func=run_validate)


def _add_search_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("capacity search")
    g.add_argument("--target", type=float, default=0.9, help="the share of requests that must meet both SLOs")
    g.add_argument("--precision", type=float, default=0.05, help="stop bisecting when the bracket is this tight")
    g.add_argument("--min-speedup", type=float, default=1 / 64,
                   help="give up below this speedup (the capacity is then reported as below it)")
    g.add_argument("--quiet", action="store_true", help="no progress bars (one line per probe still)")


def _search_setup(args):
    if args.ttft_slo is None or args.tpot_slo is None:
        raise NanoforgeError("capacity is measured against both SLOs: give --ttft-slo and --tpot-slo",
                             param="ttft_slo")
    if not 0 < args.min_speedup <= 1:
        raise NanoforgeError(f"--min-speedup must be in (0, 1], got {args.min_speedup}", param="min_speedup")
    if not 0 < args.target <= 1 or not args.precision > 0:
        raise NanoforgeError(f"--target must be in (0, 1] and --precision > 0, got {args.target}, {args.precision}",
                             param="target")
    from nanoforge.sim.capacity import Probe

    profile = Profile.load(args.profile)
    base = replay_from_args(args)
    rows = base.rows
    span = base.arrival_s(len(base) - 1) if len(base) > 1 else 1.0
    rate_at_1 = len(base) / span * args.speedup if span > 0 else float("inf")

    def make_replay(speedup: float) -> TraceReplay:
        return TraceReplay(rows, ByteVocab(), length_scale=args.length_scale, time_scale=1 / (args.speedup * speedup),
                           max_input_len=args.max_input_len, max_output_len=args.max_output_len,
                           block_tokens=args.trace_block_tokens, seed=args.seed, cache_blocks=CACHED_TRACE_BLOCKS)

    return profile, Probe(make_replay, profile, args.target, bars=not args.quiet,
                                 say=lambda line: print(line, flush=True)), rate_at_1


def _workload(args, rate_at_1: float, profile: Profile) -> dict:
    return {"trace": str(args.trace), "num_requests": args.num_requests, "length_scale": args.length_scale,
            "base_speedup": args.speedup, "request_rate_at_speedup_1": rate_at_1, "ttft_slo_s": args.ttft_slo,
            "tpot_slo_s": args.tpot_slo, "target": args.target, "precision": args.precision,
            "profile": {"name": profile.name, "status": profile.status}}


def run_capacity(args) -> int:
    from nanoforge.sim.capacity import (
        capacity_table,
        find_capacity,
        parse_spec,
        plot_capacity,
        write_json,
    )

    base = config_from_args(args) if args.configs is None else None
    profile, probe, rate_at_1 = _search_setup(args)
    if args.configs is not None:
        template = config_from_args(args, prefill=0, decode=0, colocated=1)
        configs = [parse_spec(spec, template) for spec in args.configs]
    else:
        configs = [base]
    start = time.perf_counter()
    results = []
    for config in configs:
        print(f"{config.label()}:", flush=True)
        results.append(find_capacity(probe, config, precision=args.precision, lowest=args.min_speedup))
    table = capacity_table(results, rate_at_1)
    print("\n" + table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "capacity_table.txt").write_text(table + "\n")
    write_json(out / "capacity.json", {"workload": _workload(args, rate_at_1, profile), "results": results})
    title = (f"capacity under TTFT <= {args.ttft_slo:g} s and TPOT <= {args.tpot_slo:g} s for "
             f"{100 * args.target:.0f}% of requests ({profile.name}{'' if profile.status == 'measured' else ', derived'})")
    plot_capacity(results, rate_at_1, out / "capacity.png", title)
    print(f"\n{sum(len(r['probes']) for r in results)} simulations in {time.perf_counter() - start:.0f} s; wrote "
          f"{out / 'capacity.json'} and {out / 'capacity.png'}")
    return 0


def run_sweep(args) -> int:
    import dataclasses

    from nanoforge.sim.capacity import (
        capacity_table,
        find_capacity,
        plot_sweep,
        write_json,
    )

    if args.gpus < 2:
        raise NanoforgeError(f"--gpus must be >= 2 (at least one prefill and one decode instance), got {args.gpus}",
                             param="gpus")
    profile, probe, rate_at_1 = _search_setup(args)
    template = config_from_args(args, prefill=1, decode=args.gpus - 1, colocated=0)
    start = time.perf_counter()
    results = []
    for n in range(1, args.gpus):
        config = dataclasses.replace(template, prefill=n, decode=args.gpus - n)
        print(f"{config.label()}:", flush=True)
        results.append(find_capacity(probe, config, precision=args.precision, lowest=args.min_speedup))
    colocated = dataclasses.replace(template, prefill=0, decode=0, colocated=args.gpus)
    print(f"{colocated.label()}:", flush=True)
    baseline = find_capacity(probe, colocated, precision=args.precision, lowest=args.min_speedup)
    table = capacity_table([*results, baseline], rate_at_1)
    print("\n" + table)
    best = max(results, key=lambda r: r["capacity_speedup"])
    n, m = best["config"]["prefill"], best["config"]["decode"]
    ratio = best["capacity_speedup"] / baseline["capacity_speedup"] if baseline["capacity_speedup"] else float("inf")
    print(f"\nbest split for {args.gpus} GPUs: {n} prefill + {m} decode, {rate_at_1 * best['capacity_speedup']:.2f} "
          f"req/s ({ratio:.2f}x the {args.gpus} colocated instances)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep_table.txt").write_text(f"{table}\n\nbest split for {args.gpus} GPUs: {n} prefill + {m} decode, "
                                         f"{rate_at_1 * best['capacity_speedup']:.2f} req/s ({ratio:.2f}x the "
                                         f"{args.gpus} colocated instances)\n")
    write_json(out / "sweep.json", {"workload": _workload(args, rate_at_1, profile), "gpus": args.gpus,
                                    "best": {"prefill": n, "decode": m, "capacity_speedup": best["capacity_speedup"],
                                             "vs_colocated": ratio},
                                    "results": results, "colocated": baseline})
    plot_sweep(results, baseline, rate_at_1, out / "sweep.png",
               f"N:M for {args.gpus} GPUs, TTFT <= {args.ttft_slo:g} s, TPOT <= {args.tpot_slo:g} s "
               f"({profile.name}{'' if profile.status == 'measured' else ', derived'})")
    print(f"{sum(len(r['probes']) for r in [*results, baseline])} simulations in {time.perf_counter() - start:.0f} s; "
          f"wrote {out / 'sweep.json'} and {out / 'sweep.png'}")
    return 0
