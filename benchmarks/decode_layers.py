"""A batch-1 decode step's layers: the persistent kernel against the layer-by-layer path, in one process.

    python benchmarks/decode_layers.py [--presets llama3-1b,qwen3-0.6b] [--ctx 384]   # $OUT/decode_layers.json
    python benchmarks/decode_layers.py --splits 4,8     # the kernel again, its attention phase cut 4 and 8 ways
    python benchmarks/decode_layers.py --variants barrier,ring3,ring3+on_gate_up   # A/B
    python benchmarks/decode_layers.py --smoke                                       # the CPU dry run

For each model shape (random bf16 weights, every layer) and one token at position ctx - 1 of a paged cache:
the model's forward to its final hidden state, layer by layer (the default: each projection the faster of cuBLAS
and the skinny matmul, paged attention, PDL between the kernels) and with `NANOFORGE_DECODE_LAYERS=persistent`'s
kernel (serve/layer_kernel.py), each replayed from a CUDA graph; microseconds a step, the ratio, and the share of
HBM bandwidth that reading the layers' weights and KV in that time comes to. Then one traced launch of the kernel:
where its time goes, phase by phase, summed over the layers (`decode_layers.phase_times`), each phase's work
with the rate it read its weights (phase B: the context's K and V) at. The LM head and
sampling are left out (the same in both ways). --splits times the kernel again with its attention phase cut into
other numbers of pieces a kv head (the default's 16 leave most of them empty at short contexts, and each kv
head's last piece combines all of them). --variants times it again under the kernel's switches, each against the
same layer-by-layer baseline: `ring_behind` (NANOFORGE_DECODE_RING_AHEAD=0: with `ringN`, the ring's first tile in
registers under the poll and the ring's copies started after it, where by default since session 46 the ring
takes every tile of its projections, its first stages copied before the program polls the phase's input),
`prefetch_kvN` (NANOFORGE_DECODE_PREFETCH_KV=N: phase B's first N
key tiles asked of L2 while the program waits at the barrier in front of it), `barrier` (NANOFORGE_DECODE_SYNC=barrier:
grid barriers between the phases, where the default since session 40, `tagged`, has none: the phases' vectors
polled as tagged words, and a traced launch clocks each program's polls and stores instead: a phase's "wait" is
then from the last program to store its part to the last to have the whole vector; since session 41),
`poll_sleepN` (NANOFORGE_DECODE_POLL_SLEEP_NS=N: a tagged poll's back-off, N ns doubling up to
its cap; the default 256), `poll_capN` (NANOFORGE_DECODE_POLL_SLEEP_CAP_NS=N: that back-off's cap, the default
512), `prefetch_tilesN` (NANOFORGE_DECODE_PREFETCH_TILES=N: each program's first N tiles of the next phase
asked of L2 as a phase starts, and the tile after its two in registers inside one; the default 2; 0: neither),
`ringN` (NANOFORGE_DECODE_RING=N: the weight tiles through an N-stage ring in shared
memory), `on_` and projections joined with `.` (NANOFORGE_DECODE_RING_ON: the ones the ring serves, e.g.
`on_gate_up`, `on_qkv.o.gate_up`), joined with `+`.
Each traced launch also cuts the attention phase at its marks (`phase_times`' "B ..." parts; and by context
split: each split's items' own time for each part, and which split was the last to count), and looks at each
wait from its last program to leave: its own time from its arrival, and how often it was also the last to arrive
(with tagged vectors: whether a hand-over is the last producer's own next loads and poll).
--smoke runs the tiny presets interpreted (one launch of one program).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--smoke" in sys.argv:  # before Triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("NANOFORGE_KERNELS", "triton")

import torch  # noqa: E402

from nanoforge.kernels import decode_layers as dl  # noqa: E402
from nanoforge.model.config import preset  # noqa: E402
from nanoforge.model.transformer import Transformer  # noqa: E402
from nanoforge.serve.layer_kernel import LayerKernel  # noqa: E402
from nanoforge.serve.model_runner import PagedAttention  # noqa: E402

BLOCK = 16


def layer_bytes(model: Transformer, ctx: int) -> int:
    """What one token's pass over the layers reads at least: every layer's weights and the context's K and V."""
    cfg = model.cfg
    weights = sum(p.numel() * p.element_size() for p in model.layers.parameters())
    return weights + 2 * cfg.n_layers * ctx * cfg.n_kv_heads * cfg.head_dim * model.embed.weight.element_size()


def phase_bytes(model: Transformer, ctx: int) -> dict[str, int]:
    """What each of the kernel's phases reads at least over all layers: A W_qkv, B the context's K and V, C W_o,
    D W_gate and W_up, E W_down (`decode_layers`' phases)."""
    a = model.layers[0].attn
    mlp = model.layers[0].mlp
    size = model.embed.weight.element_size()
    kv = 2 * ctx * model.cfg.n_kv_heads * model.cfg.head_dim * size
    one = {"A": a.wqkv.weight.numel() * size, "B": kv, "C": a.wo.weight.numel() * size,
           "D": mlp.w_in.weight.numel() * size, "E": mlp.w_out.weight.numel() * size}
    return {k: v * model.cfg.n_layers for k, v in one.items()}


def phase_rates(ph: dict, nbytes: dict[str, int]) -> dict[str, float]:
    """TB/s at which each phase of a trace (`phase_times`) read its bytes (`phase_bytes`), where it took time."""
    return {k: n / ph[f"{k} work"] / 1e6 for k, n in nbytes.items() if ph[f"{k} work"] > 0}


def phase_line(ph: dict, rates: dict[str, float]) -> str:
    """A trace's phases in words: each phase's work with its rate (`phase_rates`), then the barriers' waits
    (phase B's parts are `attention_parts`')."""
    work = ", ".join(f"{k} work {ph[f'{k} work']:.1f}" + (f" ({rates[k]:.2f} TB/s)" if k in rates else "")
                     for k in "ABCDE")
    waits = ", ".join(f"{k} wait {ph[f'{k} wait']:.1f}" for k in "ABCDE")
    return f"{work}; {waits}; total {ph['total']:.1f}"


def handover_line(ph: dict) -> str:
    """Each phase's waits as their last program to leave saw them (`phase_times`' "last tail" and "last self")."""
    return ", ".join(f"{k} {ph[f'{k} last tail']:.1f} ({100 * ph[f'{k} last self']:.0f}%)" for k in "ABCDE")


def decode_inputs(model: Transformer, ctx: int) -> dict:
    """One token at position ctx - 1 over a paged cache of random K and V (the token's slot rewritten each run)."""
    cfg, dev, dtype = model.cfg, model.embed.weight.device, model.embed.weight.dtype
    blocks = -(-ctx // BLOCK)
    shape = (cfg.n_layers, blocks + 1, BLOCK, cfg.n_kv_heads, cfg.head_dim)
    pos = ctx - 1
    cs = model.rope_table(ctx, dtype)[pos:pos + 1]
    return dict(k=torch.randn(shape, device=dev).to(dtype), v=torch.randn(shape, device=dev).to(dtype),
                table=torch.arange(blocks, device=dev, dtype=torch.int32)[None], slot=torch.tensor([pos], device=dev),
                seq_lens=torch.tensor([ctx], device=dev, dtype=torch.int32),
                cu=torch.tensor([0, 1], device=dev, dtype=torch.int32), cs=cs,
                rope=(cs[None, :, 0:1], cs[None, :, 1:2]),
                ids=torch.tensor([[7]], device=dev), positions=torch.tensor([[pos]], device=dev))


def step_fn(model: Transformer, c: dict, kernel: LayerKernel | None):
    """A function running the decode step's forward to the final hidden state, layer by layer or in the kernel."""

    def step():
        attn = PagedAttention(c["k"], c["v"], c["slot"], c["table"], c["seq_lens"], c["cu"], max_q_len=1,
                              layer_kernel=kernel)
        return model(c["ids"], c["positions"], attn, return_hidden=True, rope=c["rope"])

    return step


def time_us(fn, device, replays: int) -> float:
    """Median microseconds of fn replayed from a CUDA graph (eagerly on the CPU)."""
    fn()  # compile, autotune, choose
    if device.type != "cuda":
        return float("nan")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1000 * start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def plot(rows: dict, path: Path) -> None:
    """Each shape's step both ways, the kernel's bar split into its phases' work and barrier waits (from the
    trace); nothing without a trace (the CPU smoke run) or without matplotlib."""
    traced = {name: r for name, r in rows.items() if "phases_us" in r}
    if not traced:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for i, (name, r) in enumerate(traced.items()):
        ax.bar(i - 0.2, r["layer_by_layer_us"], 0.4, color="0.6", label="layer by layer" if i == 0 else None)
        bottom = 0.0
        for j, part in enumerate(p for p in r["phases_us"] if p.endswith(("work", "wait"))):
            t = r["phases_us"][part]
            ax.bar(i + 0.2, t, 0.4, bottom=bottom, color=plt.cm.tab10(j % 10), label=part if i == 0 else None)
            bottom += t
    ax.set_xticks(range(len(traced)), list(traced))
    ax.set_ylabel("us a step (layers only)")
    ax.set_title("batch-1 decode layers: one persistent kernel, phase by phase")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


SWITCHES = {"tagged": {"NANOFORGE_DECODE_SYNC": "tagged"},  # --variants' parts without a number
            "barrier": {"NANOFORGE_DECODE_SYNC": "barrier"},
            "ring_ahead": {"NANOFORGE_DECODE_RING_AHEAD": "1"},
            "ring_behind": {"NANOFORGE_DECODE_RING_AHEAD": "0"}}
COUNTS = {  # --variants' parts with a number: (switch, lowest, highest)
    "prefetch_kv": ("NANOFORGE_DECODE_PREFETCH_KV", 1, 4), "poll_sleep": ("NANOFORGE_DECODE_POLL_SLEEP_NS", 0, 4096),
    "poll_cap": ("NANOFORGE_DECODE_POLL_SLEEP_CAP_NS", 0, 16384), "ring": ("NANOFORGE_DECODE_RING", 2, 6),
    "prefetch_tiles": ("NANOFORGE_DECODE_PREFETCH_TILES", 0, 16)}


def variant_env(name: str) -> dict[str, str]:
    """The switches of a --variants entry (parts joined with +, each a SWITCHES name or a COUNTS prefix with
    its number), or ValueError naming the part it cannot read."""
    env = {}
    for part in name.split("+"):
        count = next(((var, part[len(p):]) for p, (var, lo, top) in COUNTS.items() if part.startswith(p)
                      and part[len(p):].isdigit() and lo <= int(part[len(p):]) <= top), None)
        on = part[3:].split(".") if part.startswith("on_") else []
        if part in SWITCHES:
            env.update(SWITCHES[part])
        elif on and set(on) <= set(dl.RING_TARGETS):  # the projections the ring serves
            env["NANOFORGE_DECODE_RING_ON"] = ",".join(on)
        elif count:
            env[count[0]] = count[1]
        else:
            names = [*SWITCHES, *(f"{p}{lo} .. {p}{top}" for p, (_, lo, top) in COUNTS.items()),
                     f"on_ with {'.'.join(dl.RING_TARGETS)} or some of them"]
            raise ValueError(f"--variants: {part!r} is not {', '.join(names[:-1])} or {names[-1]}")
    return env


def traced_phases(model: Transformer, kernel: LayerKernel, c: dict, device) -> dict:
    """One launch of the kernel with its clock traced at every barrier (tagged: at each poll's end and each phase's
    last store): microseconds per phase over the layers."""
    programs = torch.cuda.get_device_properties(device).multi_processor_count
    trace = torch.zeros(dl.trace_rows(model.cfg.n_layers), programs, dtype=torch.int64, device=device)
    x = model.embed(torch.tensor([7], device=device))
    with torch.inference_mode():
        dl.decode_layers(kernel.layers, x, c["cs"].reshape(2, -1), c["k"], c["v"], c["table"][0], c["seq_lens"],
                         c["slot"], trace=trace)
    torch.cuda.synchronize()
    return dl.phase_times(trace, model.cfg.n_kv_heads * dl.CONTEXT_SPLITS)


def ours_with(model, kernel: LayerKernel, c: dict, device, replays: int, base_fn, base_us: float, *,
              splits: int | None = None, env: dict | None = None, default_fn=None) -> dict:
    """The kernel timed (and, on a GPU, traced) with its attention phase cut into `splits` pieces a kv head, or
    under the switches `env` (read at each launch); with `default_fn` (the kernel without them), whether the
    two give the same bits (switches that change no sum must)."""
    saved, saved_env = (dl.CONTEXT_SPLITS, dl.INTERPRET_SPLITS), {k: os.environ.get(k) for k in env or {}}
    if splits is not None:
        dl.CONTEXT_SPLITS = dl.INTERPRET_SPLITS = splits  # (read at each launch; the interpreter's count on the CPU)
    os.environ.update(env or {})
    try:
        fn = step_fn(model, c, kernel)
        with torch.inference_mode():
            us = time_us(fn, device, replays)
            diff = (base_fn() - fn()).abs().max().item()
            same = None if default_fn is None else torch.equal(default_fn(), fn())
        out = {"one_kernel_us": us, "ratio": base_us / us, "max_abs_difference": diff, "bits_equal_default": same,
               "sync": dl.sync_mode()}
        if device.type == "cuda":
            out["phases_us"] = traced_phases(model, kernel, c, device)
        return out
    finally:
        dl.CONTEXT_SPLITS, dl.INTERPRET_SPLITS = saved
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def attention_parts(ph: dict) -> str:
    """Phase B's parts of a trace, in words."""
    return ", ".join(f"{p} {ph[f'B {p}']:.1f}" for p in dl.B_POINTS + ("rest",))


def attention_splits(ph: dict) -> str:
    """Phase B's items by context split (`phase_times`' "by split"), in words: each part's own time a layer
    and how often the split was the last to count."""
    parts = [f"{p} " + " ".join("-" if v is None else f"{v:.2f}" for v in ph[f"B {p} by split"])
             for p in dl.B_POINTS[:3]]
    last = " ".join(f"{100 * v:.0f}%" for v in ph["B last counted by split"])
    return "; ".join(parts) + f"; the last to count {last}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="llama3-1b,qwen3-0.6b")
    ap.add_argument("--ctx", type=int, default=384, help="the step's context, its token included")
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--splits", default="", help="comma-separated context splits of the attention phase to time "
                    f"the kernel at too, e.g. 4,8 (its default: {dl.CONTEXT_SPLITS})")
    ap.add_argument("--variants", default="", help="comma-separated switch sets to time the kernel under too: "
                    "tagged, barrier, ring_ahead, ring_behind, prefetch_kvN (N 1-4), poll_sleepN (N 0-4096 ns), "
                    "poll_capN (N 0-16384 ns), ringN (N 2-6), prefetch_tilesN (N 0-16), on_P.Q (the ring on "
                    "projections P and Q of qkv, o, gate_up, down), joined with + (e.g. ring3+on_gate_up)")
    ap.add_argument("--smoke", action="store_true", help="tiny presets on the CPU, interpreted")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args()
    splits = [int(v) if v.strip().isdigit() else 0 for v in args.splits.split(",") if v.strip()]
    if any(v < 1 or v > 64 for v in splits):
        print(f"--splits: each a whole number from 1 to 64, not {args.splits!r}", file=sys.stderr)
        sys.exit(2)
    try:
        variants = {v.strip(): variant_env(v.strip()) for v in args.variants.split(",") if v.strip()}
    except ValueError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
    if args.smoke:
        presets, device, dtype, ctx, replays = ["tiny-llama", "tiny-qwen3"], torch.device("cpu"), torch.float32, 40, 1
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA GPU (or --smoke for the CPU dry run)", file=sys.stderr)
            sys.exit(2)
        presets, device, dtype = args.presets.split(","), torch.device("cuda"), torch.bfloat16
        ctx, replays = args.ctx, args.replays
    from benchmarks.gpu_engine import peaks

    hbm = peaks(device)[1]
    rows = {}
    print(f"{'shape':<12} {'layer by layer us':>18} {'one kernel us':>14} {'ratio':>6} {'HBM (ours)':>11} "
          f"{'HBM (base)':>11}")
    for name in presets:
        torch.manual_seed(0)
        with torch.no_grad(), torch.device(device):
            model = Transformer(preset(name, max_seq_len=max(ctx, 64))).to(dtype).eval()
        c = decode_inputs(model, ctx)
        base_fn = step_fn(model, c, None)
        kernel = LayerKernel(model)
        ours_fn = step_fn(model, c, kernel)
        with torch.inference_mode():
            base_us = time_us(base_fn, device, replays)
            ours_us = time_us(ours_fn, device, replays)
            same = (base_fn() - ours_fn()).abs().max().item()
        b = layer_bytes(model, ctx)
        r = rows[name] = {"ctx": ctx, "layer_by_layer_us": base_us, "one_kernel_us": ours_us,
                          "ratio": base_us / ours_us, "bytes": b, "hbm_fraction": b / (ours_us * 1e-6) / hbm,
                          "baseline_hbm_fraction": b / (base_us * 1e-6) / hbm, "max_abs_difference": same,
                          "prefetch_tiles": dl.prefetch_tiles()}
        print(f"{name:<12} {base_us:>18.1f} {ours_us:>14.1f} {r['ratio']:>5.2f}x {100 * r['hbm_fraction']:>10.1f}% "
              f"{100 * r['baseline_hbm_fraction']:>10.1f}%")
        if device.type == "cuda":  # one traced launch: the phases' time
            r["phases_us"] = traced_phases(model, kernel, c, device)
            r["phase_tb_s"] = phase_rates(r["phases_us"], phase_bytes(model, ctx))
            print(f"   phases, {dl.sync_mode()} (us over all layers, the rate each read its weights or K/V at): "
                  + phase_line(r["phases_us"], r["phase_tb_s"]))
            print("   attention phase's parts: " + attention_parts(r["phases_us"]))
            print("   its items by context split 0, 1, ... (us a layer, each item's own): "
                  + attention_splits(r["phases_us"]))
            print("   each wait's last program to leave, from its own arrival (us over all layers; how often it was "
                  "also the last to arrive): " + handover_line(r["phases_us"]))
        runs = [("splits", n, {"splits": n}) for n in splits]
        runs += [("variants", v, {"env": e, "default_fn": ours_fn}) for v, e in variants.items()]
        for group, key, how in runs:  # (session 26: the attention phase 11.3 us a Qwen3 layer)
            t = r.setdefault(group, {})[key] = ours_with(model, kernel, c, device, replays, base_fn, base_us, **how)
            ph = t.get("phases_us")
            label = f"{key} splits" if group == "splits" else key
            print(f"   {label}: {t['one_kernel_us']:.1f} us ({t['ratio']:.2f}x)"
                  + ("" if t["bits_equal_default"] is None
                     else f", bits equal to the default's: {t['bits_equal_default']}")
                  + (
                f"; attention phase {ph['B work']:.1f} us ({attention_parts(ph)}), {t['sync']} waits "
                f"{sum(v for p, v in ph.items() if p.endswith('wait')):.1f} us" if ph else ""))
        r["barrier_timeouts"] = dl.barrier_timeouts(device)  # not 0: its numbers are wrong (a barrier gave up)
        if r["barrier_timeouts"]:
            print(f"   {r['barrier_timeouts']} barrier wait(s) gave up: the one-kernel numbers are wrong")
        del model, kernel
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_layers.json").write_text(json.dumps(rows, indent=1))
    plot(rows, out / "decode_layers.png")
    png = " and decode_layers.png" if (out / "decode_layers.png").exists() else ""
    print(f"wrote {out / 'decode_layers.json'}{png}")


if __name__ == "__main__":
    main()
