"""Batch-1 decode's weight phases streamed through shared memory against through registers, on one GPU (issue 14's
next lever, measured before it is built into the persistent decode kernel; kernels/weight_stream.py):

    python benchmarks/weight_stream.py [--presets llama3-1b,qwen3-0.6b] [--stages 2,4,6] [--gap-us 0,10] [--trace]

For each shape, its layers' four weight phases (Q/K/V, attention-out, gate-and-up, MLP-down; random bf16
weights) in one persistent launch of a program an SM, a grid barrier after each phase, each phase's input the
phase before's output, and between Q/K/V and attention-out the attention phase's stand-in: --gap-us microseconds
in which the kernel reads nothing, between two barriers (decode_layers.py's attention phase: ~10 us a
Qwen3-0.6B layer at context 384 on an H100; each gap a run of its own). Through registers as decode_layers.py's
tiles go (the baseline: two tiles in registers, the phase's first loaded during the barrier's wait), then
through a ring of each --stages count of 32 KB shared-memory stages kept filled across phases and barriers, by
cp.async (`ringN`) and by TMA (`tmaN`), and each ring again with the barriers' lean departure (`-lean`: one
thread's acquire polls, no re-read or atomic after them) and with no barrier at all (`-tagged`: each vector
stored as words tagged with its phase, the next phase's load waiting for the tags, NCCL's LL protocol; its launch
inputs tagged beforehand). Each way is checked bit for bit against the baseline
and within bf16's rounding of a float64 reference, then timed (triton's do_bench: L2 cleared before every
launch). Then the ring's kernel with parts left out, to split the time (`PARTS`: no tile at all, the barriers
alone; copies without reductions; no grid barriers; copies alone; the two barriers around the gap local to
groups of 16 programs, `group-*`; numbers then wrong, not checked). --trace: one launch of each ring of the first
--stages count traced, and of `group-ring4` at 4 (each program's clock at every barrier and at each phase's first
and last tile): each phase's work, when its first and last tiles were in once the barrier in front of it let the
program go (near 0: the copies went on through the barrier), each barrier's wait (a local one's, its group's). Prints a
table (us a launch and a layer; the weights' TB/s and share of the GPU's HBM peak over the time less the gaps;
the ratio to the baseline) and writes weight_stream.json and weight_stream.png under --out. For scale:
decode_layers.py's trace of the whole persistent kernel on an H100 (session 34) had these four phases at
~1.7-2.6 TB/s, barrier waits included ~16.5 us a Qwen3-0.6B layer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from nanoforge.model.config import preset  # noqa: E402


# each ring's ways: (name suffix, sync): decode_layers' barriers, their lean departure, none (tagged vectors)
RING_WAYS = {"": 1, "-lean": 2, "-tagged": 4}
# the ring's kernel with parts left out: (name, stages, tma, work, sync, what it times); work 0 no tiles, 2 tiles
# copied only; sync 0 no grid barriers, 2 their lean departure (kernels/weight_stream.py's `_depart_lean`), 3 the
# two barriers around the attention phase's stand-in local to groups of programs (as a kv head's attention and
# its columns of attention-out could be: what a layer of three grid barriers would cost)
PARTS = [("barriers", 2, False, 0, 1, "no tile: five grid barriers a layer, the vectors' loads, the gap"),
         ("copies4", 4, False, 2, 1, "ring4's copies and barriers, no tile read or reduced"),
         ("nosync4", 4, False, 1, 0, "ring4 without grid barriers: copies and reductions"),
         ("nosync-tma4", 4, True, 1, 0, "tma4 without grid barriers"),
         ("stream4", 4, False, 2, 0, "ring4's copies alone"),
         ("copies-tma4", 4, True, 2, 1, "tma4's copies and barriers, no tile read or reduced"),
         ("stream-tma4", 4, True, 2, 0, "tma4's copies alone"),
         ("lean-copies4", 4, False, 2, 2, "copies4 with the barriers' lean departure"),
         ("lean-copies-tma4", 4, True, 2, 2, "copies-tma4 with the barriers' lean departure"),
         ("group-barriers", 2, False, 0, 3, "barriers, the two around the gap local to groups of 16 programs"),
         ("group-copies4", 4, False, 2, 3, "copies4, the two barriers around the gap local to groups of 16"),
         ("group-ring4", 4, False, 1, 3, "ring4, the two barriers around the gap local to groups of 16")]


def make(widths: list[tuple[int, int]], layers: int, device) -> tuple[list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    ws = [(torch.randn(layers, n, k, generator=gen, device=device) / k**0.5).bfloat16() for n, k in widths]
    x = torch.randn(widths[0][1], generator=gen, device=device).bfloat16()
    return ws, x


def run(ws, x, stages: int, tma: bool, gap_ns: int, widths, work: int = 1, sync: int = 1,
        trace: torch.Tensor | None = None) -> tuple[list[torch.Tensor], int, callable]:
    """The four vectors after one launch, the barrier waits that gave up, and a launch to time (`trace`: each
    launch's events written there). sync 4: the vectors are tagged words, read back as bf16; launches numbered 0
    and 1 in turn (consecutive ones' tags differ, which is all a launch needs), each input tagged beforehand, so
    that a launch copies its input as the other ways do."""
    from nanoforge.kernels.weight_stream import count_words, descriptors, stream_layers, tag_words, untag

    descs = descriptors(ws)  # (once, not in the timed launches)
    tagged = sync == 4
    v = [torch.zeros(widths[p - 1][0], device=x.device, dtype=torch.int32 if tagged else torch.bfloat16)
         for p in range(4)]
    counts = torch.zeros(count_words(torch.cuda.get_device_properties(x.device).multi_processor_count),
                         dtype=torch.int32, device=x.device)
    inputs = [tag_words(x, epoch, ws[0].shape[0]) if tagged else x for epoch in (0, 1)]
    launches = [0]

    def launch():
        epoch = launches[0] % 2
        counts.zero_()
        v[0].copy_(inputs[epoch])
        stream_layers(ws, v, stages, counts, tma=tma, gap_ns=gap_ns, descs=descs, work=work, sync=sync, trace=trace,
                      epoch=epoch)
        launches[0] += 1

    launch()
    torch.cuda.synchronize()
    return [untag(t) if tagged else t.clone() for t in v], int(counts[1]), launch


def trace_rings(ws, x, ways: dict, parts: dict, stages: int, gap_ns: int, widths, layers: int, name: str,
                gap: float) -> dict:
    """One traced launch (after the timed ones) of each ring of `stages` (cp.async, TMA; decode_layers' barrier
    and the lean one) and of the `group-ring4` part (sync 3: its two local barriers' waits each group's own), read
    by `phase_trace`, printed a line each: the layer's time traced (and untraced, from the timed runs: what the
    clock's stores cost), each phase's work and when its first and last tiles were in after the barrier in front
    of it (near 0: the copies went on through the barrier), each barrier's wait."""
    from triton.testing import do_bench

    from nanoforge.kernels.weight_stream import EVENTS, GROUP_PROGRAMS, phase_trace

    programs = torch.cuda.get_device_properties(x.device).multi_processor_count
    out = {}
    runs = [(f"{kind}{stages}{suffix}", kind == "tma", sync, ways) for suffix, sync in RING_WAYS.items()
            if sync != 4 for kind in ("ring", "tma")] + [("group-ring4", False, 3, parts)] * (stages == 4)
    for way, tma, sync, untraced in runs:
        t = torch.zeros(EVENTS * layers, programs, dtype=torch.int64, device=x.device)
        _, _, launch = run(ws, x, stages, tma, gap_ns, widths, sync=sync, trace=t)
        traced_us = do_bench(launch, warmup=10, rep=100, return_mode="median") * 1e3 / layers  # (warm after it)
        t.zero_()
        launch()
        torch.cuda.synchronize()
        got = out[way] = phase_trace(t, GROUP_PROGRAMS if sync == 3 else None) | {
            "traced_us_per_layer": traced_us, "untraced_us_per_layer": untraced[way]["us_per_layer"]}
        phases = "  ".join(f"{ph} " + "/".join(f"{got[f'phase {p}'][k]:.2f}" for k in ("work_us", "stall_us",
                                                                                            "last_tile_us"))
                           for p, ph in enumerate(("qkv", "o", "gate-up", "down")))
        waits = " ".join(f"{got[f'barrier {b}']['wait_us']:.2f}" for b in range(5))
        print(f"{name:<12} {gap:>6.1f} {way + ' trace':<16} layer {got['layer_us']:.2f} us (do_bench traced "
              f"{traced_us:.2f}, untraced {got['untraced_us_per_layer']:.2f}); us work/first/last tile in: {phases}; "
              f"barrier waits {waits}", flush=True)
    return out


def plot(rows: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 3.6))
    names = list(rows)
    ways = list(rows[names[0]]["ways"])
    width = 0.8 / len(ways)
    for j, way in enumerate(ways):
        ax.bar([i + (j - (len(ways) - 1) / 2) * width for i in range(len(names))],
               [rows[n]["ways"][way]["us_per_layer"] for n in names], width, label=way)
    for i, n in enumerate(names):
        ax.hlines(rows[n]["hbm_bound_us_per_layer"], i - 0.45, i + 0.45, colors="k", linestyles="dashed",
                  label="HBM peak (+ the gap)" if i == 0 else None)
    ax.set_xticks(range(len(names)), names, fontsize=7)
    ax.set_ylabel("us a layer (four weight phases + the gap)")
    ax.set_title("decode's weight phases: registers against a shared-memory ring")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="llama3-1b,qwen3-0.6b")
    ap.add_argument("--stages", default="2,4,6", help="comma-separated ring depths (2-6 stages of 32 KB)")
    ap.add_argument("--layers", type=int, default=0, help="layers (default: the preset's)")
    ap.add_argument("--gap-us", default="0,10", help="comma-separated waits standing in for the attention phase")
    ap.add_argument("--trace", action="store_true",
                    help="also trace one launch of each ring of the first --stages, and of group-ring4 at 4 "
                         "(`phase_trace`: each phase's work and when its first and last tiles were in after its "
                         "barrier, each barrier's wait)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args()
    stages = [int(s) if s.strip().isdigit() else 0 for s in args.stages.split(",") if s.strip()]
    try:
        presets = [preset(p.strip()) for p in args.presets.split(",") if p.strip()]
    except (ValueError, KeyError) as e:
        print(f"--presets: {e}", file=sys.stderr)
        sys.exit(2)
    if not stages or any(s < 2 or s > 6 for s in stages):
        print(f"--stages: whole numbers from 2 to 6, not {args.stages!r}", file=sys.stderr)
        sys.exit(2)
    gaps = [float(g) if g.strip().replace(".", "", 1).isdigit() else -1.0 for g in args.gap_us.split(",") if g.strip()]
    if not gaps or any(g < 0 or g > 1000 for g in gaps):
        print(f"--gap-us: numbers from 0 to 1,000, not {args.gap_us!r}", file=sys.stderr)
        sys.exit(2)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8:
        print("needs a CUDA GPU with cp.async (sm_80 or later); on the CPU, `nanoforge kernels inspect "
              "weight_stream_ring` compiles it", file=sys.stderr)
        sys.exit(2)
    from triton.testing import do_bench

    from benchmarks.gpu_engine import peaks
    from nanoforge.kernels.weight_stream import layer_widths, reference

    device = torch.device("cuda")
    hbm = peaks(device)[1]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, t0, bad_parts = {}, time.time(), []
    print(f"{torch.cuda.get_device_name()}, HBM peak {hbm / 1e12:.2f} TB/s")
    print(f"{'shape':<12} {'gap us':>6} {'way':<16} {'us a launch':>12} {'us a layer':>11} {'TB/s':>6} {'HBM':>6} "
          f"{'ratio':>6}   (TB/s and HBM: the weights' bytes over the time less the gaps)")
    runs = [(name.strip(), cfg, gap) for name, cfg in zip(args.presets.split(","), presets) for gap in gaps]
    for i, (name, cfg, gap) in enumerate(runs):
        layers = args.layers or cfg.n_layers
        widths = layer_widths(cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.d_ff)
        ws, x = make(widths, layers, device)
        nbytes = sum(w.numel() * w.element_size() for w in ws)
        want = reference(ws, x)
        # bf16 after each of 4 x layers phases: the kernel's fp32 sums round a few elements the other way from
        # float64's, and those ulps travel down the chain (~2.7e-2 after Qwen3-0.6B's 112 phases)
        tolerance = 4e-3 * (4 * layers) ** 0.5
        gap_ns = int(gap * 1000)

        def rate(moved: int, us: float) -> float:  # bytes a second over a launch's time less the stand-in's gaps
            return moved / (us - gap * layers) * 1e6

        base = None
        ways = {}
        for way, depth, tma, sync in [("registers", 0, False, 1)] + [
                (f"{kind}{s}{suffix}", s, kind == "tma", sync)
                for suffix, sync in RING_WAYS.items() for kind in ("ring", "tma") for s in stages]:
            got, gave_up, launch = run(ws, x, depth, tma, gap_ns, widths, sync=sync)
            base = got if base is None else base
            err = max(float((g.double() - w).norm() / w.norm()) for g, w in zip(got, want))
            same = all(torch.equal(g, b) for g, b in zip(got, base))
            us = do_bench(launch, warmup=10, rep=200, return_mode="median") * 1e3
            ways[way] = {"stages": depth, "copies": "tma" if tma else "cp.async" if depth else "registers",
                         "barrier": {2: "lean", 4: "tagged vectors"}.get(sync, "decode_layers'"), "us": us,
                         "us_per_layer": us / layers, "weights_tb_s": rate(nbytes, us) / 1e12,
                         "hbm_fraction": rate(nbytes, us) / hbm,
                         "ratio": ways["registers"]["us"] / us if ways else 1.0, "bitwise_equal_to_registers": same,
                         "relative_error": err, "tolerance": tolerance,
                         "barrier_give_ups": gave_up}
            r = ways[way]
            print(f"{name:<12} {gap:>6.1f} {way:<16} {us:>12.1f} {r['us_per_layer']:>11.2f} {r['weights_tb_s']:>6.2f} "
                  f"{r['hbm_fraction']:>6.1%} {r['ratio']:>5.2f}x" + ("" if same else "  NOT EQUAL")
                  + (f"  rel.err {err:.1e}" if err > tolerance else "") + (f"  {gave_up} give-ups" if gave_up else ""),
                  flush=True)
        # what the time goes to: the ring's kernel with parts left out (its numbers then wrong, not checked)
        parts = {}
        for part, depth, tma, work, sync, note in PARTS:
            _, gave_up, launch = run(ws, x, depth, tma, gap_ns, widths, work=work, sync=sync)
            us = do_bench(launch, warmup=10, rep=200, return_mode="median") * 1e3
            moved = nbytes if work else 0
            parts[part] = {"stages": depth, "copies": "tma" if tma else "cp.async", "work": work, "sync": sync,
                           "us": us, "us_per_layer": us / layers, "barrier_give_ups": gave_up,
                           "weights_tb_s": rate(moved, us) / 1e12 if moved else None}
            tb = f"{rate(moved, us) / 1e12:>6.2f} {rate(moved, us) / hbm:>6.1%}" if moved \
                else f"{'':>6} {'':>6}"
            print(f"{name:<12} {gap:>6.1f} {part:<16} {us:>12.1f} {us / layers:>11.2f} {tb} {'':>6}   "
                  f"({note})" + (f"  {gave_up} give-ups" if gave_up else ""), flush=True)
            bad_parts += [f"{name} gap {gap:g} us {part}"] * bool(gave_up)
        traces = trace_rings(ws, x, ways, parts, stages[0], gap_ns, widths, layers, name, gap) if args.trace else {}
        rows[f"{name} gap {gap:g} us"] = {
            "shape": name, "gap_us": gap, "layers": layers, "widths": widths, "bytes": nbytes, "hbm_peak": hbm,
            "hbm_bound_us_per_layer": nbytes / hbm / layers * 1e6 + gap, "ways": ways, "parts": parts,
            "traces": traces}
        done, elapsed = i + 1, time.time() - t0
        print(f"  [{done}/{len(runs)} runs, {elapsed:.0f} s; ~{elapsed / done * (len(runs) - done):.0f} s to go]",
              flush=True)
    (out / "weight_stream.json").write_text(json.dumps(rows, indent=1))
    plot(rows, out / "weight_stream.png")
    print(f"wrote {out / 'weight_stream.json'} and weight_stream.png")
    bad = [f"{n} {w}" for n, r in rows.items() for w, v in r["ways"].items()
           if not v["bitwise_equal_to_registers"] or v["relative_error"] > v["tolerance"] or v["barrier_give_ups"]]
    bad += bad_parts
    if bad:
        raise AssertionError(f"wrong results: {', '.join(bad)}")  # a bug: a traceback, exit 1


if __name__ == "__main__":
    main()
