"""Batch-1 decode's layers in one persistent kernel: every layer of a Llama / Qwen model, one launch a step.

A batch-1 decode step reads each weight once, so it should take as long as HBM takes to stream the weights.
Launched kernel by kernel it does not: Llama-3.2-1B's layer is seven kernels of 1.5-21 us (61.6 us where its
121.6 MB stream in ~30 at 4 TB/s), Qwen3-0.6B's seven of 2.1-8 us (40.8 where 31.5 MB take ~8). Each kernel
ramps up, drains, and leaves SMs idle while its few programs finish. Here one grid of one program per SM runs
the whole stack, each piece of a layer a phase that every program takes a share of, the phases separated by
grid-wide barriers (an arrival count in global memory; all programs are resident at once, as there are no more
of them than SMs):

    A  x = x + pending; h = rms_norm(x); qkv = h W_qkv^T (+ bias)          tiles of W_qkv's rows
    B  q/k norms (Qwen3), RoPE, the token's K/V into the paged cache,      (kv head, context split) pairs; each
       attention over the context                                           kv head's last split combines them
    C  o = attn W_o^T                                                       tiles of W_o's rows
    D  x = x + o; h = rms_norm(x); a = silu(h W_gate^T) * (h W_up^T)        tiles of gate rows with their up rows
    E  pending = a W_down^T                                                 tiles of W_down's rows

A program's tile is a few rows of W across all of K (~32 KB of bf16), loaded while the one before it is
reduced; before a barrier each program asks L2 for its first tiles of the next phase's weights (no phase writes
them; NANOFORGE_DECODE_PREFETCH_TILES), so the wait overlaps the stream. Every program computes the norm's
statistics itself from the vector (a few KB from L2) and program 0 stores the residual sum. Roundings are
those of the kernels the layer-by-layer path runs (`rmsnorm.add_rms_norm`, `gemv`'s epilogue, `paged_attention`'s
fused RoPE and split combine), so the two differ only in the order fp32 sums are added.

Under the Triton interpreter, which runs programs one after another (none could wait for another at a barrier),
the launch has one program, which passes every barrier at its own arrival: the code a GPU runs, one program
doing every tile. With `persistent=False` the host launches one phase of one layer at a time instead, the
kernel boundaries standing in for the barriers (three programs under the interpreter, sharing out the tiles as
on a GPU). The CPU tests check the two against each other bit for bit and against the model's own forward.

With NANOFORGE_DECODE_SYNC=tagged (`sync_mode`) there are no barriers: each phase stores its output vector to
its layer's place as 32-bit words, a 16-bit value and the launch's tag, and each phase that reads a vector polls
it, every thread loading its own words again until each carries the tag (`_poll`); every program keeps the
residual stream in registers. The same sums in the same order: the two ways give the same bits.

A barrier that waits too long (SPIN_LIMIT polls, seconds: a program that never arrives, which is a bug) gives
up instead of hanging the GPU: it counts the failure (`barrier_timeouts`) and lets every later barrier of the
launch pass at once, so the launch ends, with wrong numbers. The engine checks the count after its warm-up.

The caller (`serve/layer_kernel.py`) stacks the layers' weights and decides when this applies.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from nanoforge.errors import NanoforgeError
from nanoforge.kernels import pdl
from nanoforge.kernels.dispatch import arrival_counters, capturing, env_choice, env_count, interpreting, sm_count
from nanoforge.kernels.flash_attention import LOG2E
from nanoforge.kernels.gemv import _epilogue
from nanoforge.kernels.paged_attention import (
    _NEG_BIG, _norm_rope_rows, attend_new_key, attend_span, combine_heads, combined_heads, split_span,
)

def _cuda_options():
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # a Triton without the NVIDIA backend
        return None
    return CUDAOptions


PHASES = 5
B_MARKS = 4  # points of phase B a trace clocks (`_attention`): query rotated, keys attended, counted, combined
_PHASES, _B_MARKS = tl.constexpr(PHASES), tl.constexpr(B_MARKS)
TILE_ELEMENTS = 16384  # of W a program loads at once (32 KB of bf16): rows x K
CONTEXT_SPLITS = 16  # attention's pieces per kv head (8 kv heads x 16 = 128 programs busy on 132 SMs)
ATTN_BLOCK_N = 64  # keys a step of attention's loop
INTERPRET_PROGRAMS = 3  # programs under the interpreter: each takes more than one tile, as on a GPU
WARPS = 8  # a program's warps on a GPU (one under the interpreter)
_WARPS = tl.constexpr(WARPS)
INTERPRET_SPLITS = 4
# A persistent launch is cooperative where Triton can ask for it (NANOFORGE_DECODE_COOPERATIVE=1, the default):
# the driver then starts every program at once or fails the launch, so that two such kernels on one GPU (two
# engines' streams) cannot each hold SMs that the other's waiting programs need. Without it (=0, or an older
# Triton), one program an SM is what keeps them all resident, which holds while one engine uses the GPU.
_CAN_COOPERATE = "launch_cooperative_grid" in getattr(_cuda_options(), "__dataclass_fields__", {})


def _cooperative() -> dict:
    on = env_choice("NANOFORGE_DECODE_COOPERATIVE", ("1", "0")) == "1"
    return {"launch_cooperative_grid": True} if on and _CAN_COOPERATE else {}


SPIN_LIMIT = 1 << 22  # a barrier's polls (~0.5 us each) before it gives up: a bug, not a state (waits take us)
_GAVE_UP = tl.constexpr(1 << 30)  # a barrier's count after a program gave up: past every target of the launch
_TIMEOUTS: dict[str, torch.Tensor] = {}  # per device: programs that gave up waiting at a barrier, since last read


def _device_key(device: torch.device) -> str:
    """One name a device: `cuda` is the current CUDA device's `cuda:N`."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def _timeouts(device: torch.device) -> torch.Tensor:
    key = _device_key(device)
    if key not in _TIMEOUTS:  # made at a device's first launch, which is eager (the engine warms up first), as a
        if capturing(device):  # normal tensor (`barrier_timeouts` resets it in any mode); never from a graph's pool
            raise RuntimeError("decode_layers: first launched inside a CUDA graph capture; launch it eagerly first")
        with torch.inference_mode(False):
            _TIMEOUTS[key] = torch.zeros(1, device=device, dtype=torch.int32)
    return _TIMEOUTS[key]


def barrier_timeouts(device: torch.device) -> int:
    """How many times a persistent launch's program gave up waiting at a barrier on this device since the last
    call (reset here; it syncs): anything but 0 means those launches computed wrong numbers."""
    have = _TIMEOUTS.get(_device_key(torch.device(device)))
    if have is None:
        return 0
    n = int(have.item())
    have.zero_()
    return n


@dataclass
class Layers:
    """Every layer's weights, stacked (L first): what the kernel indexes by layer."""

    attn_norm: torch.Tensor  # (L, D)
    wqkv: torch.Tensor  # (L, Hq*Dh + 2*Hkv*Dh, D)
    bqkv: torch.Tensor | None  # (L, Hq*Dh + 2*Hkv*Dh)
    q_norm: torch.Tensor | None  # (L, Dh)
    k_norm: torch.Tensor | None  # (L, Dh)
    wo: torch.Tensor  # (L, D, Hq*Dh)
    mlp_norm: torch.Tensor  # (L, D)
    w_in: torch.Tensor  # (L, 2F, D): gate rows, then up rows
    w_out: torch.Tensor  # (L, D, F)
    n_heads: int
    n_kv_heads: int
    head_dim: int
    eps: float
    # NANOFORGE_DECODE_SYNC=tagged's buffers, made at the first such launch on a device (`_tagged_buffers`)
    tagged: dict = field(default_factory=dict)


def sync_mode() -> str:
    """NANOFORGE_DECODE_SYNC: how a persistent launch's phases wait for the ones before them. `tagged` (the
    default since session 40): no barrier; each vector a phase writes is stored as 32-bit words, a 16-bit value
    and the launch's tag, and a phase that reads one loads each word again until it carries the tag (flags in
    the data, as NCCL's LL protocol: session 38's probe, kernels/weight_stream.py, took Qwen3-0.6B's weight
    phases 1.23x faster than the best barrier; session 40, an H100, with the polls' back-off: Qwen3-0.6B's layers
    1.08x the barriers', Llama-3.2-1B's 1.01x). fp16 and bf16 models (traced too, since session 41); launches per
    phase or fp32, barriers. `barrier`: a grid barrier after each phase, five a layer."""
    return env_choice("NANOFORGE_DECODE_SYNC", ("tagged", "barrier"))


def _tagged_buffers(w: Layers, dev: torch.device, ty: torch.dtype, programs: int) -> tuple[torch.Tensor, ...]:
    """A tagged launch's buffers for these layers on this device: every layer's tagged vectors (zeros: no
    launch's tag), each program's copy of Q/K/V's layout for its attention items, and [0, hkv) the attention
    splits' counts, hkv the launches so far (the tag), hkv + 1 the programs finished. Made at the first tagged
    launch, which is eager (as `_timeouts`' count): a graph captured later launches with them."""
    key = (_device_key(dev), programs)
    if key not in w.tagged:
        if capturing(dev):
            raise RuntimeError("decode_layers: first launched tagged inside a CUDA graph capture; launch it eagerly "
                               "first")
        n_layers, n_qkv, d = w.wqkv.shape
        words = n_qkv + w.n_heads * w.head_dim + d + w.w_out.shape[2] + d
        with torch.inference_mode(False):
            w.tagged[key] = (torch.zeros(n_layers * words, device=dev, dtype=torch.int32),
                             torch.zeros(programs, n_qkv, device=dev, dtype=ty),
                             torch.zeros(w.n_kv_heads + 2, device=dev, dtype=torch.int32))
    return w.tagged[key]


def prefetch_tiles() -> int:
    """NANOFORGE_DECODE_PREFETCH_TILES (default 2): how many of its tiles of the next phase's weights each program
    asks L2 for before a barrier (tagged launches: as a phase starts, before its poll), ~32 KB each, 4.2 MB a tile
    over 132 SMs; inside a phase each program also asks for the tile after the two its registers hold. 0: neither
    (session 45, an H100, tagged: Llama-3.2-1B's layers 1.05x, the gain the ring on gate-and-up already gives and
    not on top of it; Qwen3-0.6B's 0.96x)."""
    return env_count("NANOFORGE_DECODE_PREFETCH_TILES", 2, 0, 16)


def prefetch_kv_tiles() -> int:
    """NANOFORGE_DECODE_PREFETCH_KV (default 0, off: session 30's H100 saw it move nothing, asked for before the
    arrival; since session 32 after it; session 40, an H100, 2 tiles against tagged launches without: 1.02x on
    Llama-3.2-1B's layers, 0.99x on Qwen3-0.6B's): how many 64-key tiles of each attention item's K and V every
    program asks L2 for while it waits at the barrier in front of attention (from 0 to 4)."""
    return env_count("NANOFORGE_DECODE_PREFETCH_KV", 0, 0, 4)


def ring_ahead() -> bool:
    """NANOFORGE_DECODE_RING_AHEAD (`1`, the default; `0`): in a tagged launch, each projection the ring serves
    (NANOFORGE_DECODE_RING, _RING_ON) takes all its tiles through the ring, whose first stages are copied before
    the program polls the phase's input (the pipelined loop's first pass polls: `_tagged_phase`), where `0` loads
    the first tile into registers under the poll and starts the ring once the poll is done. RING - 1 tiles of
    the phase are then in flight while the program waits for the vector (Qwen3-0.6B's phases are 1-3 tiles a
    program), not one (32 KB). Session 46 (an H100) first timed NANOFORGE_DECODE_FIRST_TILE=after, the first
    tile loaded only once the poll was done: Qwen3-0.6B's layers 0.91x (724.6 -> 796.9 us), Llama-3.2-1B's
    0.98x (taken out): what a program has in flight when its poll ends is what it reduces at once. Then this
    (context 384): Qwen3's layers with a 3-stage ring on gate-and-up 696.7 and 694.7 us against 719.1 the old
    way (1.03x), on every projection 715.1 against 765.2 (1.07x); Llama's 911.6 against 910.0; the engine's
    `auto` 1,194 tok/s on Qwen3 against 1,157 (1.03x), 897 on Llama against 892."""
    return env_choice("NANOFORGE_DECODE_RING_AHEAD", ("1", "0")) == "1"


def _rows_per_tile(k: int) -> int:
    return max(1, min(64, TILE_ELEMENTS // triton.next_power_of_2(k)))


def shape_constants(d: int, n_qkv: int, hq: int, hkv: int, dh: int, f: int, splits: int) -> dict:
    """The kernel's constexprs that follow from a model's shape (and the context's split count): widths, their
    powers of two, and the rows of each projection's tiles."""
    p2 = triton.next_power_of_2
    group = hq // hkv
    return dict(D=d, DP=p2(d), NQKV=n_qkv, HQ=hq, HKV=hkv, GROUP=group, GROUP_P2=p2(group), DH=dh, BLOCK_D=p2(dh),
                BLOCK_M=max(16, p2(group)), F=f, FP=p2(f), AP=p2(hq * dh), BN_QKV=_rows_per_tile(d),
                BN_O=_rows_per_tile(hq * dh), BN_IN=max(1, _rows_per_tile(d) // 2), BN_OUT=_rows_per_tile(f),
                SPLITS=splits, SPLITS_P2=p2(splits), ITEM_P2=p2(group * dh + 2 * dh))


def decode_layers(w: Layers, x: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  table: torch.Tensor, seq_len: torch.Tensor, slot: torch.Tensor, *,
                  persistent: bool | None = None, programs: int | None = None,
                  trace: torch.Tensor | None = None, ring: int | None = None,
                  ring_on: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token (x: (1, D), after the embedding) through every layer: (the residual stream, the last MLP's
    output), to be added inside the final norm as the layer-by-layer path leaves them. cos_sin: (2, Dh) of the
    token's position; caches (L, blocks, block_size, Hkv, Dh); table: the sequence's block table row; seq_len
    (1,) int32 with the token counted; slot (1,) the token's cache slot. `persistent`: one launch (the default)
    or a launch per phase and layer. `programs`: the grid (default one an SM; under the interpreter one for a
    persistent launch, as a second could not get past its first barrier until it gives up, which is what the
    tests of the give-up use, and three for launches per phase). `trace`: int64 (`trace_rows(L)`, programs)
    of the GPU's nanosecond clock, each program's start and, per phase, its arrival at the barrier and its
    departure, then per layer phase B's marks (`phase_times` reads it; a diagnostic, persistent launches only).
    A tagged launch has no barrier: its "arrival" after a phase is the program's clock once it has stored its
    part of the phase's vector, its "departure" once it has polled the whole vector the next phase reads (phase
    B: its item's Q/K/V words, the query rows alone but in a head's last split; a program with no item, at B's
    start), so that a phase's "wait" runs from the last program to store its part to the last to have read it all.
    `ring`, `ring_on`: the weight ring's stages and the projections it serves (default: the environment's,
    `ring_stages`, `ring_targets`)."""
    n_layers, n_qkv, d = w.wqkv.shape
    hq, hkv, dh = w.n_heads, w.n_kv_heads, w.head_dim
    f = w.w_out.shape[2]
    dev, ty = x.device, x.dtype
    interp = interpreting()
    persistent = True if persistent is None else persistent
    if programs is None:  # one an SM; interpreted: one for a persistent launch, more for launches per phase
        programs = sm_count(dev) if not interp else 1 if persistent else INTERPRET_PROGRAMS
    prefetch, ahead = not interp and pdl.hopper(dev), prefetch_tiles()
    splits, block_n = (INTERPRET_SPLITS, 16) if interp else (CONTEXT_SPLITS, ATTN_BLOCK_N)  # small: tests reach
    # every branch (full and masked key tiles, empty splits) with short contexts
    xs = torch.empty(2, d, device=dev, dtype=ty)  # the residual stream: [0] between layers, [1] inside one
    pending = torch.empty(d, device=dev, dtype=ty)  # (layer 0 reads x and adds nothing)
    x_in = x.reshape(d)
    if x_in.stride(0) != 1:
        x_in = x_in.contiguous()
    qkv = torch.empty(n_layers, n_qkv, device=dev, dtype=ty)  # a layer's own: read back by plain loads
    attn = torch.empty(hq * dh, device=dev, dtype=ty)
    o = torch.empty(d, device=dev, dtype=ty)
    act = torch.empty(f, device=dev, dtype=ty)
    o_part = torch.empty(hq * splits * dh, device=dev, dtype=torch.float32)
    lse_part = torch.empty(hq * splits, device=dev, dtype=torch.float32)
    counts = arrival_counters(dev, hkv + 2)  # [0, hkv): attention's splits; hkv, hkv + 1: the barrier
    timeouts = _timeouts(dev)
    tagged = persistent and sync_mode() == "tagged" and ty in (torch.bfloat16, torch.float16)
    tags, scratch, ws = _tagged_buffers(w, dev, ty, programs) if tagged else (counts, x_in, counts)
    meta = dict(**shape_constants(d, n_qkv, hq, hkv, dh, f, splits), BLOCK_N=block_n, BLOCK_SIZE=k_cache.shape[2],
                HAS_BIAS=w.bqkv is not None, QK_NORM=w.q_norm is not None, PERSISTENT=persistent,
                PREFETCH=prefetch, PREFETCH_TILES=ahead, AHEAD=prefetch and ahead > 0, TRACE=trace is not None,
                ONE_POLLER=not interp, PREFETCH_KV=prefetch_kv_tiles() if prefetch else 0,
                TAGGED=tagged, BARRIERS=persistent and not tagged, RING_AHEAD=tagged and ring_ahead(),
                **ring_constants(ring, ring_on))
    rows = trace_rows(n_layers)
    if trace is not None and (not persistent or trace.shape != (rows, programs)):
        raise ValueError(f"decode_layers: a trace is ({rows}, {programs}) int64, of a persistent launch")
    none = w.attn_norm  # any tensor, for the pointers a model does not have
    args = (x_in, xs, pending, qkv, attn, o, act, o_part, lse_part, counts, timeouts, tags, scratch, ws,
            w.attn_norm, w.wqkv, w.bqkv if w.bqkv is not None else none,
            w.q_norm if w.q_norm is not None else none, w.k_norm if w.k_norm is not None else none,
            w.wo, w.mlp_norm, w.w_in, w.w_out, k_cache, v_cache, table, seq_len, slot, cos_sin,
            *k_cache.stride()[:4], *v_cache.stride()[:4], float(w.eps), dh ** -0.5 * LOG2E,
            trace if trace is not None else counts, SPIN_LIMIT, poll_sleep_arg())
    warps = 1 if interp else WARPS
    if persistent:
        _decode_layers_kernel[(programs,)](*args, 0, n_layers, PHASE=-1, **meta, num_warps=warps,
                                           **_cooperative())
    else:
        for layer in range(n_layers):
            for phase in range(PHASES):
                _decode_layers_kernel[(programs,)](*args, layer, 1, PHASE=phase, **meta, num_warps=warps)
    return xs[0].view_as(x), pending.view_as(x)


def trace_rows(n_layers: int) -> int:
    """Rows of a trace of n_layers: the start, each phase's arrival and departure, then phase B's marks."""
    return 1 + (2 * PHASES + B_MARKS) * n_layers


B_POINTS = ("query", "keys", "counted", "combined")  # what phase B's marks end (`_attention`)


def grid_steps(start: torch.Tensor, arrive: torch.Tensor, leave: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A persistent launch's steps as the grid sees them, from each program's clock at its start (programs,) and
    at each grid barrier's arrival and departure (steps, programs): per step, the last departure from the barrier
    before it (the last start, for the first), its "work" (from there to the last arrival at its own barrier:
    its slowest program) and its barrier's "wait" (from that arrival to the last departure)."""
    last_arrival, last_departure = arrive.max(1).values, leave.max(1).values
    before = torch.cat([start.max()[None], last_departure[:-1]])
    return before, last_arrival - before, last_departure - last_arrival


def phase_times(trace: torch.Tensor, items: int | None = None, splits: int = CONTEXT_SPLITS) -> dict:
    """Microseconds per phase from a `decode_layers` trace, summed over the layers: "work" from the last program
    to leave the barrier before (or to start) to the last to arrive at the one after it (the phase as the grid
    sees it: its slowest program), "wait" from that arrival to the last program's departure (the barrier's own
    cost), and the launch's "total" from the first program's start to the last departure. Phase B's work is
    cut at its marks the same way, each from the last program past the point before to the last past it ("B
    query": the query normalised and rotated; "B keys": the context attended; "B counted": the partials stored
    and counted; "B combined": the last split's combine; "B rest": from there to the last arrival). A tagged
    launch's trace reads the same way (`decode_layers`' `trace`): "wait" is then a vector's hand-over, from the
    last program to store its part to the last to have polled it whole (phase A's to B can be negative: an
    attention item waits only for its kv head's words). Each wait is also looked at from its last program to
    leave: "X last tail" sums, over the layers, that program's own time from its arrival to its departure (its
    last store of phase X to its poll's end; in a launch with barriers, its own wait), and "X last self" is the
    share of phase X's waits whose last to leave was also the last to arrive (with tagged vectors, the last
    producer of a vector the last to have it whole: its own next loads and its poll are then the hand-over).

    `items` (kv heads x `splits`, where each program has at most one: program p the item of split p % splits):
    phase B by split too, which of them is on the phase's path: "B <part> by split", each split's own time for
    that part (from its item's point before to its own mark: for the query, from its poll's end), averaged over
    the layers and kv heads, and "B last counted by split", the share of the layers whose last item to count
    (the one whose head's combine ends the phase, unless another head's combine runs longer) was of that split."""
    t = trace.double().cpu() / 1e3
    layers = (t.shape[0] - 1) // (2 * PHASES + B_MARKS)
    steps = PHASES * layers
    start, arrive, leave = t[0], t[1:1 + 2 * steps:2], t[2:2 + 2 * steps:2]
    before, work, wait = grid_steps(start, arrive, leave)
    names = "ABCDE"
    out = {f"{names[p]} work": float(work[p::PHASES].sum()) for p in range(PHASES)}
    out |= {f"{names[p]} wait": float(wait[p::PHASES].sum()) for p in range(PHASES)}
    last = leave.argmax(1, keepdim=True)  # (steps, 1): each step's last program to leave
    tail = (leave.gather(1, last) - arrive.gather(1, last))[:, 0]
    self_last = (arrive.gather(1, last)[:, 0] == arrive.max(1).values).double()
    out |= {f"{names[p]} last tail": float(tail[p::PHASES].sum()) for p in range(PHASES)}
    out |= {f"{names[p]} last self": float(self_last[p::PHASES].mean()) for p in range(PHASES)}
    marks = t[1 + 2 * steps:].reshape(layers, B_MARKS, -1).max(2).values  # (0: no program got there: never last)
    points = torch.cat([before[1::PHASES, None], marks, (before + work)[1::PHASES, None]], 1)  # (+ work: its arrival)
    for name, d in zip(B_POINTS + ("rest",), (points[:, 1:] - points[:, :-1]).unbind(1)):
        out[f"B {name}"] = float(d.sum())
    out["total"] = float(leave.max() - start.min())
    out["layers"] = layers
    if items is not None and 0 < items <= t.shape[1]:
        clocks = t[1 + 2 * steps:].reshape(layers, B_MARKS, -1)[:, :, :items]  # (layers, marks, items)
        clocks = torch.cat([leave[0::PHASES, None, :items], clocks], 1)  # from the item's poll's end on
        own = clocks.diff(dim=1).masked_fill((clocks[:, 1:] == 0) | (clocks[:, :-1] == 0), float("nan"))
        split = torch.arange(items) % splits
        for m, name in enumerate(B_POINTS):  # (None: no item of the split got from the point before to there)
            means = [own[:, m, split == s].nanmean().item() for s in range(splits)]
            out[f"B {name} by split"] = [None if math.isnan(v) else v for v in means]
        last = clocks[:, 1 + B_POINTS.index("counted")].argmax(1) % splits  # (clocks[:, 0]: the poll's end)
        out["B last counted by split"] = [float((last == s).double().mean()) for s in range(splits)]
    return out


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------


def poll_one_thread_ptx(load: str = "ld.relaxed.gpu.global", give_up: str = "") -> str:
    """PTX in which thread 0 of a program polls a count at $1 (each poll a `load`) until it reaches $2 or $3 polls
    have gone by, then, if they have, runs `give_up`; $0 the last count read ($2 in the other threads, which
    return at once). `POLL_ONE_THREAD` (decode_layers.py's barrier) and kernels/weight_stream.py's lean one."""
    return f"""{{
    .reg .pred nfSkip, nfDone, nfMore;
    .reg .u32 nfTid;
    .reg .s32 nfSpins;
    mov.u32 nfTid, %tid.x;
    mov.s32 $0, $2;
    setp.ne.u32 nfSkip, nfTid, 0;
    @nfSkip bra NF_POLL_DONE;
    mov.s32 nfSpins, 0;
    NF_POLL_AGAIN:
    {load}.s32 $0, [$1];
    setp.ge.s32 nfDone, $0, $2;
    @nfDone bra NF_POLL_DONE;
    add.s32 nfSpins, nfSpins, 1;
    setp.lt.s32 nfMore, nfSpins, $3;
    @nfMore bra NF_POLL_AGAIN;{give_up}
    NF_POLL_DONE:
    }}"""


POLL_ONE_THREAD = tl.constexpr(poll_one_thread_ptx())  # `_poll_one_thread`'s


POLL_SLEEP_CAP_NS = 512  # a poll's back-off doubles up to this by default (NANOFORGE_DECODE_POLL_SLEEP_CAP_NS)


def poll_tags_ptx(pack: int) -> str:
    """PTX in which a thread takes `pack` tagged words (outputs $0.., addresses, the words as first loaded, the
    tag, a spin limit, a back-off: `pack` operands each) and loads the stale ones again (predicated, all in flight
    at once) until each carries the tag in its high 16 bits or the limit's rounds have gone by (`_poll`). A
    back-off of s > 0 ns sleeps s before the first reload, 2s before the next, ... up to a cap c (fewer loads of L2
    from programs that came early, while others still stream their weights through it); the operand is s | c << 16
    (`poll_sleep_arg`)."""
    n = pack
    out = [f"${i}" for i in range(n)]
    addr, first, tag, limit, sleep = ([f"${i}" for i in range(k * n, (k + 1) * n)] for k in range(1, 6))
    stale = [f"nfS{i}" for i in range(n)]
    lines = [f"mov.b32 {o}, {f};" for o, f in zip(out, first)]
    lines += ["mov.s32 nfN, 0;", f"and.b32 nfZ, {sleep[0]}, 65535;", f"shr.u32 nfC, {sleep[0]}, 16;",
              "NF_TAGS_AGAIN:"]
    for o, st in zip(out, stale):
        lines += [f"shr.u32 nfT, {o}, 16;", f"setp.ne.u32 {st}, nfT, {tag[0]};"]
    lines += [f"or.pred nfAny, {stale[0]}, {stale[0]};"] + [f"or.pred nfAny, nfAny, {st};" for st in stale[1:]]
    lines += ["@!nfAny bra NF_TAGS_DONE;", f"setp.ge.s32 nfAny, nfN, {limit[0]};", "@nfAny bra NF_TAGS_DONE;",
              "add.s32 nfN, nfN, 1;", "setp.ne.u32 nfAny, nfZ, 0;", "@nfAny nanosleep.u32 nfZ;",
              "shl.b32 nfZ, nfZ, 1;", "min.u32 nfZ, nfZ, nfC;"]
    lines += [f"@{st} ld.relaxed.gpu.global.u32 {o}, [{a}];" for st, o, a in zip(stale, out, addr)]
    lines += ["bra NF_TAGS_AGAIN;", "NF_TAGS_DONE:"]
    regs = f".reg .pred {', '.join(stale)}, nfAny;\n.reg .u32 nfT, nfZ, nfC;\n.reg .s32 nfN;"
    return "{\n" + regs + "\n" + "\n".join(lines) + "\n}"


def poll_constraints(pack: int) -> str:
    """`poll_tags_ptx(pack)`'s operands: the words out, their addresses, the words in, the tags, the limits, the
    back-offs."""
    return ",".join(["=r"] * pack + ["l"] * pack + ["r"] * 4 * pack)


def ring_stages() -> int:
    """NANOFORGE_DECODE_RING (default 0: off): the projections' weight tiles after each program's first stream
    through a ring of this many stages in shared memory (Triton's pipelined loop, cp.async; 2 to 6), where by
    default two tiles are held in registers and a third asked of L2. Session 40 (an H100): Llama-3.2-1B's layers
    1.04x with 3 stages, Qwen3-0.6B's 0.90x (its kernel spills with them), so the engine's `auto` times the kernel
    with a 3-stage ring too where this is unset (`decode_layers(ring=)` overrides it). Since session 46 the ring
    takes every tile of its projections and starts before each poll (`ring_ahead`): Qwen3's layers 1.03-1.04x
    with it on gate-and-up, 1.07x on every projection against the old way."""
    value = env_count("NANOFORGE_DECODE_RING", 0, 0, 6)
    if value == 1:
        raise NanoforgeError("NANOFORGE_DECODE_RING must be 0 (off) or 2 to 6 stages, not 1",
                             param="NANOFORGE_DECODE_RING")
    return value


RING_TARGETS = ("qkv", "o", "gate_up", "down")  # the projections a ring can serve, in a layer's order


def ring_targets(value: str | None = None) -> frozenset:
    """NANOFORGE_DECODE_RING_ON (or `value`): which projections stream through the ring where NANOFORGE_DECODE_RING
    asks for one: `all` (the default) or a comma-separated set of RING_TARGETS (Q/K/V, attention-out, the fused
    gate-and-up, MLP-down), e.g. `gate_up` (each layer's largest alone); anything else is one line naming the
    problem. Compiled for sm_90 by Triton 3.6 with a 3-stage ring, Qwen3-0.6B's kernel spills 56 bytes a thread
    on every projection, none on gate_up alone, none on qkv,o,gate_up, 24 on qkv,gate_up,down and 64 on
    o,gate_up,down (register allocation is the whole kernel's). With the ring ahead of the polls (`ring_ahead`,
    session 46's default), no first tile is held in registers across a poll, and none of those spills (Qwen3
    with a 3-stage ring on every projection: 255 registers, Llama-3.2-1B's 232)."""
    if value is None:
        value = os.environ.get("NANOFORGE_DECODE_RING_ON", "all")
    value = value.lower().replace(" ", "")
    if value == "all":
        return frozenset(RING_TARGETS)
    parts = frozenset(value.split(","))
    if not parts <= set(RING_TARGETS):
        raise NanoforgeError(f"NANOFORGE_DECODE_RING_ON must be all or a comma-separated set of "
                             f"{', '.join(RING_TARGETS)}, not {value!r}", param="NANOFORGE_DECODE_RING_ON")
    return parts


def ring_constants(ring: int | None = None, ring_on: str | None = None) -> dict:
    """The kernel's rings, each projection's stages (RING_QKV, RING_O, RING_IN: gate-and-up's, RING_OUT:
    MLP-down's; 0 where it has none), from `ring` and `ring_on` or, where None, the environment's
    (`ring_stages`, `ring_targets`)."""
    stages = ring_stages() if ring is None else ring
    on = ring_targets(ring_on)
    return {key: stages if target in on else 0
            for key, target in zip(("RING_QKV", "RING_O", "RING_IN", "RING_OUT"), RING_TARGETS)}


def poll_sleep_ns() -> int:
    """NANOFORGE_DECODE_POLL_SLEEP_NS (default 256; 0: none): a tagged poll's first back-off between rounds of
    reloads (doubling up to POLL_SLEEP_CAP_NS). Session 40 (an H100): 256 ns took Llama-3.2-1B's tagged layers
    from 1,098 to 1,056 us and Qwen3-0.6B's from 885 to 854 (512: no better than none): the early programs'
    polling of L2 slowed the programs still streaming their weights."""
    return env_count("NANOFORGE_DECODE_POLL_SLEEP_NS", 256, 0, 4096)


def poll_sleep_cap_ns() -> int:
    """NANOFORGE_DECODE_POLL_SLEEP_CAP_NS (default POLL_SLEEP_CAP_NS, 512; 0 to 16,384): the longest a tagged
    poll's back-off grows to. Session 41's trace (an H100) put 12 us of each Qwen3-0.6B layer's 30 in the vectors'
    hand-overs, from the last program to store its part to the last to have polled the whole: a program that
    came early and has backed off to the cap sees the last word up to the cap late. 512 since session 43 (an
    H100: against 2,048, Qwen3-0.6B's layers 1.045x, Llama-3.2-1B's 1.03x; session 42: 1,024 1.01x on Qwen3)."""
    return env_count("NANOFORGE_DECODE_POLL_SLEEP_CAP_NS", POLL_SLEEP_CAP_NS, 0, 16384)


def poll_sleep_arg() -> int:
    """The kernel's `poll_sleep` argument: the first back-off (`poll_sleep_ns`) low, the cap (`poll_sleep_cap_ns`)
    in the high 16 bits, as `poll_tags_ptx` reads it."""
    return poll_sleep_ns() | poll_sleep_cap_ns() << 16


# a poll takes as many words a thread into one loop as a vector of its width gives each of WARPS warps' threads
# (at least that many, in any layout: a multiple of it, as widths are powers of two), up to POLL_PACK_LIMIT; a
# thread given more polls them in loops one after the other (Llama-3.2-1B's gate-and-up output gives a thread 32
# words: two loops; session 43, an H100: one loop of 32, then NANOFORGE_DECODE_POLL_PACK=32, timed its layers and
# Qwen3-0.6B's at 1.005x and 1.008x, and the switch was taken out)
POLL_PACKS = (1, 2, 4, 8, 16)
POLL_PACK_LIMIT = POLL_PACKS[-1]
_POLL_PACK_LIMIT = tl.constexpr(POLL_PACK_LIMIT)
_POLL_PTX = [tl.constexpr(poll_tags_ptx(n)) for n in POLL_PACKS]
_POLL_CONSTRAINTS = [tl.constexpr(poll_constraints(n)) for n in POLL_PACKS]
POLL_1, POLL_2, POLL_4, POLL_8, POLL_16 = _POLL_PTX
POLL_1_OPS, POLL_2_OPS, POLL_4_OPS, POLL_8_OPS, POLL_16_OPS = _POLL_CONSTRAINTS


def poll_pack(width: int, warps: int = 8) -> int:
    """The words a thread polls in one loop in a vector of `width` (a power of two) over `warps` warps."""
    return max(n for n in POLL_PACKS if n <= max(1, width // (32 * warps)))


TAGS = 32767  # a launch's tag: 1 .. TAGS (never 0: a word of zeros is no launch's), from the launch count
_TAGS = tl.constexpr(TAGS)


@triton.jit
def _poll_one_thread(BAR, target, spin_limit):
    """Thread 0 of the program polls BAR until it reaches `target` (or `spin_limit` polls); the other threads
    return at once. PTX, as Triton runs a scalar in every thread: one poller a program (132 a GPU), where a
    scalar load polls once a warp (1,056 loads of one L2 line in flight, which the arrivals' atomics queue
    behind)."""
    return tl.inline_asm_elementwise(POLL_ONE_THREAD, "=r,l,r,r", [BAR, target, spin_limit], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _clock(TRACE_AT, row, TRACE: tl.constexpr):
    """TRACE: this program's clock at row `row` of the trace."""
    if TRACE:
        tl.store(TRACE_AT + row * tl.num_programs(0), tl.extra.cuda.globaltimer())


@triton.jit
def _arrive(BAR, step, TRACE_AT, BARRIER: tl.constexpr, TRACE: tl.constexpr):
    """This program's arrival after phase `step` of the launch. BARRIER (a persistent launch with barriers; off
    where each phase is its own launch, or tagged): every thread's stores made (the CTA barrier), then counted at
    BAR with a release. The release's fence (MEMBAR.ALL.GPU on sm_90) waits for every access the warp has in
    flight, loads included, so the next phase's first weight tile is asked for after it, between `_arrive` and
    `_depart` (session 32; before, the arrival waited for that tile to come from HBM). TRACE (a persistent launch,
    with barriers or tagged): this program's clock at row 1 + 2 step, its part of the phase stored."""
    _clock(TRACE_AT, 1 + 2 * step, TRACE)
    if BARRIER:
        tl.debug_barrier()
        tl.atomic_add(BAR, 1, sem="release")


@triton.jit
def _depart(BAR, step, TRACE_AT, TIMEOUTS, spin_limit, PERSISTENT: tl.constexpr, TRACE: tl.constexpr,
            ONE_POLLER: tl.constexpr):
    """Wait at the grid barrier after phase `step` until all programs have arrived ((step + 1) x programs counted
    at BAR): every program's stores before its arrival are visible after it. After `spin_limit` polls, give up:
    count it at TIMEOUTS and lift BAR past every target of the launch, so that no barrier of it waits again.
    ONE_POLLER (on a GPU): one thread of the program polls (`_poll_one_thread`), the others wait for it at the
    CTA barrier and read the count once; else (the interpreter, which runs no PTX) every thread polls. Session 32
    (H100) timed the other ways and took them out: every thread polling (then NANOFORGE_DECODE_POLL=all, the layers
    alone 1,056 us against 966 at Qwen3-0.6B's shape) and the whole barrier in thread 0 as cooperative groups'
    grid sync does (a release reduction, acquire loads, the give-up in PTX: 968 us, no faster). TRACE: this
    program's clock at row 2 + 2 step."""
    if PERSISTENT:
        programs = tl.num_programs(0)
        target = (step + 1) * programs
        if ONE_POLLER:
            _poll_one_thread(BAR, target, spin_limit)
            tl.debug_barrier()
            seen = tl.load(BAR, volatile=True)  # the count only grows: at least what thread 0 saw
        else:
            seen = tl.load(BAR, volatile=True)
            spins = 0
            while (seen < target) & (spins < spin_limit):
                seen = tl.load(BAR, volatile=True)
                spins += 1
        gave_up = seen < target  # (masked atomics, not a branch: no thread may skip the CTA barriers around them)
        tl.atomic_add(TIMEOUTS, 1, mask=gave_up)
        tl.atomic_max(BAR, _GAVE_UP, mask=gave_up)
        tl.atomic_add(BAR, 0, sem="acquire")
        tl.debug_barrier()
        _clock(TRACE_AT, 2 + 2 * step, TRACE)


@triton.jit
def _prefetch_rows(W, t, N, K, KP: tl.constexpr, BN: tl.constexpr, SWIGLU: tl.constexpr):
    """Ask L2 for tile t of W (rows t * BN .. + BN of N x K; with SWIGLU rows n + N too), one address a 128-byte
    line; nothing past the last row."""
    lines = tl.arange(0, KP // 64) * 64
    n = t * BN + tl.arange(0, BN)
    at = tl.where((n < N)[:, None] & (lines < K)[None, :], W + n[:, None].to(tl.int64) * K + lines[None, :], W)
    pdl.prefetch_l2(at)
    if SWIGLU:
        pdl.prefetch_l2(at + N * K)


@triton.jit
def _prefetch_tiles(W, N, K, KP: tl.constexpr, BN: tl.constexpr, TILES: tl.constexpr, SWIGLU: tl.constexpr,
                    PREFETCH: tl.constexpr):
    """Ask L2 for this program's first TILES tiles of W (as `_project` takes them)."""
    if PREFETCH:
        for j in tl.static_range(TILES):
            _prefetch_rows(W, tl.program_id(0) + j * tl.num_programs(0), N, K, KP, BN, SWIGLU)


@triton.jit
def _vector(X, K, KP: tl.constexpr):
    """A length-K vector another program of this launch wrote (.cg: from L2), in fp32, padded to KP."""
    k = tl.arange(0, KP)
    return tl.load(X + k, mask=k < K, other=0.0, cache_modifier=".cg").to(tl.float32)


@triton.jit
def _add_norm(X, A, G, S, eps, K, KP: tl.constexpr, HAS_A: tl.constexpr = True):
    """rms_norm(x + a) with weight G, as `rmsnorm.add_rms_norm` rounds it (x alone where not HAS_A); the sum
    stored to S by program 0 (every program computes the same one)."""
    k = tl.arange(0, KP)
    ty = S.dtype.element_ty
    s = _vector(X, K, KP)
    if HAS_A:
        s += _vector(A, K, KP)
    s = s.to(ty)
    if tl.program_id(0) == 0:
        tl.store(S + k, s, mask=k < K)
    return _norm(s.to(tl.float32), G, eps, K, KP, ty)


@triton.jit
def _norm(s, G, eps, K, KP: tl.constexpr, ty: tl.constexpr):
    """rms_norm(s) with weight G (s: fp32 values of ty, 0 past K), rounded as `rmsnorm.add_rms_norm` rounds it."""
    k = tl.arange(0, KP)
    rstd = tl.rsqrt(tl.sum(s * s, 0) / K + eps)
    g = tl.load(G + k, mask=k < K, other=0.0).to(tl.float32)
    return (s * rstd * g).to(ty).to(tl.float32)


@triton.jit
def _tag_words(v, tag):
    """16-bit values v (any shape) as tagged words: the value's bits low, the launch's tag high."""
    return (v.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (tag << 16)


@triton.jit
def _poll(XT, idx, inside, tag, spin_limit, poll_sleep, TIMEOUTS, ty: tl.constexpr, SPIN: tl.constexpr):
    """The values of the tagged words XT[idx] (where inside; 0 elsewhere) as fp32, once each carries `tag`:
    loaded, then on a GPU (SPIN) every thread loads its own stale words again until none is (`poll_tags_ptx`:
    `poll_pack` words a thread a loop; `poll_sleep` its back-off), so whichever threads hold a copy of a word,
    each copy is the tagged one; after spin_limit rounds, or at once after a give-up earlier in the
    launch, any still stale are counted at TIMEOUTS (wrong numbers follow). Under the interpreter the launch's one
    program wrote them."""
    at = XT + idx  # (a word outside is never loaded: it starts out carrying the tag; contiguous idx: wide loads)
    w = tl.where(inside, tl.load(at, mask=inside, other=0, volatile=True), tag << 16)
    if SPIN:
        limit = tl.where(tl.load(TIMEOUTS, volatile=True) > 0, 0, spin_limit) + idx * 0
        ops = [at, w, tag + idx * 0, limit, poll_sleep + idx * 0]
        per_thread: tl.constexpr = min(idx.shape[0] // (32 * _WARPS), _POLL_PACK_LIMIT)  # (`poll_pack`)
        if per_thread >= 16:
            w = tl.inline_asm_elementwise(POLL_16, POLL_16_OPS, ops, dtype=tl.int32, is_pure=False, pack=16)
        elif per_thread >= 8:
            w = tl.inline_asm_elementwise(POLL_8, POLL_8_OPS, ops, dtype=tl.int32, is_pure=False, pack=8)
        elif per_thread >= 4:
            w = tl.inline_asm_elementwise(POLL_4, POLL_4_OPS, ops, dtype=tl.int32, is_pure=False, pack=4)
        elif per_thread >= 2:
            w = tl.inline_asm_elementwise(POLL_2, POLL_2_OPS, ops, dtype=tl.int32, is_pure=False, pack=2)
        else:
            w = tl.inline_asm_elementwise(POLL_1, POLL_1_OPS, ops, dtype=tl.int32, is_pure=False, pack=1)
    tl.atomic_add(TIMEOUTS + idx * 0, 1, mask=((w >> 16) & 0xFFFF) != tag)
    return (w & 0xFFFF).to(tl.int16).to(ty, bitcast=True).to(tl.float32)


@triton.jit
def _poll_vector(XT, K, KP: tl.constexpr, tag, spin_limit, poll_sleep, TIMEOUTS, ty: tl.constexpr,
                 SPIN: tl.constexpr):
    """`_vector` of a tagged vector (`_poll`)."""
    k = tl.arange(0, KP)
    return _poll(XT, k, k < K, tag, spin_limit, poll_sleep, TIMEOUTS, ty, SPIN)


@triton.jit
def _tile(W, t, N, K, KP: tl.constexpr, BN: tl.constexpr, SWIGLU: tl.constexpr):
    """Tile t of W (N x K) as `_project` reduces it: rows t * BN .. + BN (w; with SWIGLU also u, the rows N
    further: W being 2N rows), evict-first, zero past N (a tile past the last) and past K; and its rows."""
    k = tl.arange(0, KP)
    n = t * BN + tl.arange(0, BN)
    mask = (n < N)[:, None] & (k < K)[None, :]
    ptrs = W + n[:, None].to(tl.int64) * K + k[None, :]
    w = tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
    u = w
    if SWIGLU:
        u = tl.load(ptrs + N * K, mask=mask, other=0.0, eviction_policy="evict_first")
    return w, u, n


@triton.jit
def _first_tile(W, N, K, KP: tl.constexpr, BN: tl.constexpr, SWIGLU: tl.constexpr, SKIP: tl.constexpr = False):
    """This program's first tile of W for `_project` (its loads issued: a persistent launch issues them while it
    waits at the barrier in front of the phase, after its arrival, as no phase writes W); SKIP: none (a phase
    whose ring takes its first tile too, `_tagged_phase`), placeholders."""
    w = 0
    u = 0
    if not SKIP:
        w, u, _ = _tile(W, tl.program_id(0), N, K, KP, BN, SWIGLU)
    return w, u


@triton.jit
def _project(h, w, u, W, B, Y, N, K, KP: tl.constexpr, BN: tl.constexpr, SWIGLU: tl.constexpr,
             HAS_BIAS: tl.constexpr, AHEAD: tl.constexpr, tag, TAGGED: tl.constexpr, RING: tl.constexpr = 0):
    """Y = h W^T (+ B) for this program's tiles of BN rows, the first (w, and u with SWIGLU) from `_first_tile`
    (SWIGLU: silu of rows n times rows n + N, W being 2N rows), rounded as `gemv` rounds it (TAGGED: stored as
    words tagged `tag`). RING 0: each tile's loads issued before the tile before it is reduced, and with AHEAD,
    the tile after that asked of L2 (registers hold two tiles; L2 a third, so that HBM has more in flight).
    RING > 1: after the first tile, the tiles stream through a RING-stage ring in shared memory (Triton's
    pipelined loop: cp.async copies, RING - 1 tiles in flight; `NANOFORGE_DECODE_RING`)."""
    ty = W.dtype.element_ty
    step = tl.num_programs(0)
    tiles = tl.cdiv(N, BN)
    t = tl.program_id(0)
    n = t * BN + tl.arange(0, BN)
    if RING > 1:
        if t < tiles:
            _reduce_store(h, w, u, B, Y, n, N, SWIGLU, HAS_BIAS, tag, TAGGED, ty)
        for r in tl.range(t + step, tiles, step, num_stages=RING):
            w, u, n = _tile(W, r, N, K, KP, BN, SWIGLU)
            _reduce_store(h, w, u, B, Y, n, N, SWIGLU, HAS_BIAS, tag, TAGGED, ty)
    else:
        while t < tiles:
            nxt = t + step
            w_next, u_next, n_next = _tile(W, nxt, N, K, KP, BN, SWIGLU)  # (a tile past the last: rows past N)
            if AHEAD:
                _prefetch_rows(W, nxt + step, N, K, KP, BN, SWIGLU)
            _reduce_store(h, w, u, B, Y, n, N, SWIGLU, HAS_BIAS, tag, TAGGED, ty)
            t = nxt
            n = n_next
            w = w_next
            u = u_next


@triton.jit
def _take_input(x, XT, RESIDUAL: tl.constexpr, G, eps, polls, K, KP: tl.constexpr, tag, spin_limit, poll_sleep,
                TIMEOUTS, ty: tl.constexpr, SPIN: tl.constexpr, trace_at, row, TRACE: tl.constexpr):
    """A tagged phase's input: the vector at XT once polled (where `polls`; then the clock at trace row `row`,
    the phase's "departure"), as is, or with RESIDUAL added to the residual stream x and normalised with weight
    G. Returns (x, the input)."""
    v = tl.zeros([KP], dtype=tl.float32)
    if polls:
        v = _poll_vector(XT, K, KP, tag, spin_limit, poll_sleep, TIMEOUTS, ty, SPIN)
        _clock(trace_at, row, TRACE)
    if RESIDUAL:
        if polls:
            x = (x + v).to(ty).to(tl.float32)
        v = _norm(x, G, eps, K, KP, ty)
    return x, v


@triton.jit
def _tagged_phase(x, w, u, XT, RESIDUAL: tl.constexpr, G, eps, polls, W, B, Y, N, K, KP: tl.constexpr,
                  BN: tl.constexpr, SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr, AHEAD: tl.constexpr, tag,
                  RING: tl.constexpr, IN_RING: tl.constexpr, spin_limit, poll_sleep, TIMEOUTS, ty: tl.constexpr,
                  SPIN: tl.constexpr, trace_at, row, TRACE: tl.constexpr):
    """A tagged launch's projection phase: `_project` of `_take_input`'s input, stored as words tagged `tag`.
    By default the phase's first tile (w, u) was loaded while the program polled. IN_RING
    (NANOFORGE_DECODE_RING_AHEAD, with a ring): every tile goes through the RING-stage ring and the input is
    taken in the pipelined loop's first pass, so that the loop's first RING - 1 tiles are copied while the
    program polls (w, u unused); a program with no tile of the phase takes the input after the loop (the
    residual stream is every program's). Returns x."""
    if IN_RING:
        t = tl.program_id(0)
        tiles = tl.cdiv(N, BN)
        h = tl.zeros([KP], dtype=tl.float32)
        for r in tl.range(t, tiles, tl.num_programs(0), num_stages=RING):
            wr, ur, n = _tile(W, r, N, K, KP, BN, SWIGLU)
            if r == t:
                x, h = _take_input(x, XT, RESIDUAL, G, eps, polls, K, KP, tag, spin_limit, poll_sleep, TIMEOUTS, ty,
                                   SPIN, trace_at, row, TRACE)
            _reduce_store(h, wr, ur, B, Y, n, N, SWIGLU, HAS_BIAS, tag, True, ty)
        if t >= tiles:
            x, h = _take_input(x, XT, RESIDUAL, G, eps, polls, K, KP, tag, spin_limit, poll_sleep, TIMEOUTS, ty,
                               SPIN, trace_at, row, TRACE)
    else:
        x, h = _take_input(x, XT, RESIDUAL, G, eps, polls, K, KP, tag, spin_limit, poll_sleep, TIMEOUTS, ty, SPIN,
                           trace_at, row, TRACE)
        _project(h, w, u, W, B, Y, N, K, KP, BN, SWIGLU, HAS_BIAS, AHEAD, tag, True, RING)
    return x


@triton.jit
def _reduce_store(h, w, u, B, Y, n, N, SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr, tag, TAGGED: tl.constexpr,
                  ty: tl.constexpr):
    """One tile of `_project`: its rows n of W (w; u the up rows with SWIGLU) against h, the epilogue, the store
    (TAGGED: as tagged words)."""
    acc = tl.sum(w.to(tl.float32) * h[None, :], 1)[None, :]
    up = acc
    if SWIGLU:
        up = tl.sum(u.to(tl.float32) * h[None, :], 1)[None, :]
    out = _epilogue(acc, up, B, n, n < N, N, SWIGLU, HAS_BIAS, ty)
    if TAGGED:
        tl.store(Y + n[None, :], _tag_words(out, tag), mask=(n < N)[None, :])
    else:
        tl.store(Y + n[None, :], out, mask=(n < N)[None, :])


@triton.jit
def _mark(MARKS, m, TRACE: tl.constexpr):
    """TRACE: the clock at phase B's point m, once every thread of the program has got there."""
    if TRACE:
        tl.debug_barrier()
        tl.store(MARKS + m * tl.num_programs(0), tl.extra.cuda.globaltimer())


@triton.jit
def _prefetch_context(KC, VC, TABLE, SEQ_LEN, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                      HKV: tl.constexpr, SPLITS: tl.constexpr, DH: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, TILES: tl.constexpr):
    """Ask L2 for the K and V rows of the first TILES key tiles of each of this program's phase-B items (as
    `_attention` shares them out): the context is in the cache before the launch, so these can be asked for
    while the program waits at the barrier in front of attention (after its arrival, whose release would wait
    for the table's loads), and its loads then find them in L2 instead of HBM."""
    seq_len = tl.load(SEQ_LEN)
    n = tl.arange(0, TILES * BLOCK_N)
    lines = tl.arange(0, triton.next_power_of_2(triton.cdiv(DH, 64))) * 64  # a 128-byte line: 64 bf16
    for item in range(tl.program_id(0), HKV * SPLITS, tl.num_programs(0)):
        hk = item // SPLITS
        lo, hi, _ = split_span(seq_len, item % SPLITS, SPLITS, BLOCK_N, True)
        key = lo + n
        ok = (key < hi)[:, None] & (lines < DH)[None, :]
        block = tl.load(TABLE + key // BLOCK_SIZE, mask=key < hi, other=0).to(tl.int64)
        slot = key % BLOCK_SIZE
        k_rows = block * stride_kb + slot * stride_ks + hk * stride_kh
        v_rows = block * stride_vb + slot * stride_vs + hk * stride_vh
        pdl.prefetch_l2(tl.where(ok, KC + k_rows[:, None] + lines[None, :], KC))
        pdl.prefetch_l2(tl.where(ok, VC + v_rows[:, None] + lines[None, :], VC))


@triton.jit
def _poll_item(QKV_T, SCRATCH, hk, with_kv, tag, spin_limit, poll_sleep, TIMEOUTS, HQ: tl.constexpr,
               HKV: tl.constexpr, GROUP: tl.constexpr, DH: tl.constexpr, SPIN: tl.constexpr, ITEM_P2: tl.constexpr):
    """Kv head hk's query rows (and where with_kv, its key and value) from the tagged Q/K/V into the same places
    of SCRATCH (QKV's layout), every thread's stores made before the program reads them. Only the split holding
    the token's own key reads its key and value (`attend_new_key`); the others wait for the query rows alone,
    which phase A's programs store first (Q's rows are the first tiles of W_qkv, each program's first tile the
    one it had loaded before the phase's input came: session 45)."""
    j = tl.arange(0, ITEM_P2)
    gd: tl.constexpr = GROUP * DH
    at = tl.where(j < gd, hk * gd + j,
                  tl.where(j < gd + DH, (HQ + hk) * DH + j - gd, (HQ + HKV + hk) * DH + j - gd - DH))
    inside = j < tl.where(with_kv, gd + 2 * DH, gd)
    ty = SCRATCH.dtype.element_ty
    v = _poll(QKV_T, at, inside, tag, spin_limit, poll_sleep, TIMEOUTS, ty, SPIN)
    tl.store(SCRATCH + at, v.to(ty), mask=inside)
    tl.debug_barrier()


@triton.jit
def _attention(QKV, ATT, O_PART, LSE_PART, COUNTS, QW, KW, KC, VC, TABLE, SEQ_LEN, SLOT, CS, eps, qk_scale,
               stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
               HQ: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, DH: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, QK_NORM: tl.constexpr, MARKS,
               TRACE: tl.constexpr, QKV_T, ATT_T, SCRATCH, tag, spin_limit, poll_sleep,
               TIMEOUTS, TAGGED: tl.constexpr, SPIN: tl.constexpr, ITEM_P2: tl.constexpr, LEFT):  # fmt: skip
    """Phase B: program p takes (kv head, context split) pairs p, p + programs, ...; a kv head's split
    SPLITS - 1 (`split_span`) writes the token's K and V; its split that finishes last combines them all, every
    split's partials loaded at once (`combine_heads`). TRACE: the clock at B_MARKS points of the item (its
    query rotated; its keys attended; its partials stored and counted; combined, where it was the last), at
    rows MARKS + m * programs (a program's last item's). (Sessions 32-44's NANOFORGE_DECODE_PRELOAD_KV loaded each
    item's first K and V tile before its query's poll: the tile's copy into shared memory for the dot, compiled
    for sm_90, then waited for the K and V loads before the poll began; 0.96-0.98x on Qwen3-0.6B's layers, taken
    out. Session 45's NANOFORGE_DECODE_EARLY_KV took the tile through a side-effecting asm after the poll, so that
    no copy of it waited before the poll: the keys part 92.2 -> 64.8 us over Qwen3-0.6B's layers on an H100, but
    the hand-overs' waits 252 -> 296 and the layers 0.97x (Llama-3.2-1B's 0.99x); taken out too.)

    TAGGED (no barriers): each item polls its query rows (the last split: and its key and value) from the tagged
    Q/K/V (QKV_T) into the program's own rows of QKV's layout (SCRATCH), which it then reads as the barrier way
    reads QKV (`_poll_item`); COUNTS are the launch's own, never reset (the last split of a head is the one
    counting a multiple of SPLITS); the combined heads are stored tagged to ATT_T straight from the registers (ATT
    is left alone); with TRACE, the item's poll's end is clocked at LEFT (the program's departure row of phase
    A's hand-over)."""
    if TAGGED:
        QKV = SCRATCH
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < DH
    io_mask = row_ok[:, None] & d_ok[None, :]
    seq_len = tl.load(SEQ_LEN)
    pos = tl.zeros([BLOCK_M], dtype=tl.int32) + (seq_len - 1)
    for item in range(tl.program_id(0), HKV * SPLITS, tl.num_programs(0)):
        hk = item // SPLITS
        split = item % SPLITS
        head = hk * GROUP + rows
        lo, hi, new_here = split_span(seq_len, split, SPLITS, BLOCK_N, True)
        K = KC + hk * stride_kh
        V = VC + hk * stride_vh
        if TAGGED:
            _poll_item(QKV_T, SCRATCH, hk, new_here, tag, spin_limit, poll_sleep, TIMEOUTS, HQ, HKV, GROUP, DH, SPIN,
                       ITEM_P2)
            _clock(LEFT, 0, TRACE)
        q = _norm_rope_rows(QKV + head[:, None] * DH, offs_d, row_ok, CS, CS + DH, QW, eps, DH, QK_NORM)
        _mark(MARKS, 0, TRACE)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
        full_hi = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
        acc, l_i, m_i = attend_span(acc, l_i, m_i, q, K, V, TABLE, lo, full_hi, hi, pos, offs_d, d_ok, qk_scale,
                                    stride_kb, stride_ks, stride_vb, stride_vs, BLOCK_N, BLOCK_SIZE, DH == BLOCK_D, 0)
        if new_here:
            acc, l_i, m_i = attend_new_key(
                acc, l_i, m_i, q, QKV + (HQ + hk) * DH, QKV + (HQ + HKV + hk) * DH, K, V, tl.load(SLOT).to(tl.int64),
                CS, CS + DH, KW, eps, offs_d, d_ok, qk_scale, stride_kb, stride_ks, stride_vb, stride_vs, DH,
                BLOCK_SIZE, QK_NORM)
        _mark(MARKS, 1, TRACE)
        l_safe = tl.where(l_i > 0, l_i, 1.0)  # an empty split (past the end of a short context) has l = 0
        part = head * SPLITS + split
        tl.store(O_PART + part[:, None] * DH + offs_d[None, :], acc / l_safe[:, None], mask=io_mask)
        tl.store(LSE_PART + part, tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")), mask=row_ok)
        tl.debug_barrier()  # every thread's partials stored before the count (the atomic releases them)
        counted = tl.atomic_add(COUNTS + hk, 1, sem="acq_rel")
        last = (counted % SPLITS if TAGGED else counted) == SPLITS - 1
        _mark(MARKS, 2, TRACE)
        if last:
            if TAGGED:  # the combined heads stored as tagged words straight from the registers
                out = combined_heads(O_PART, LSE_PART, hk * GROUP * SPLITS, SPLITS, GROUP, DH, BLOCK_D, GROUP_P2,
                                     SPLITS_P2)
                g = tl.arange(0, GROUP_P2)[:, None]
                dims = tl.arange(0, BLOCK_D)[None, :]
                tl.store(ATT_T + (hk * GROUP + g) * DH + dims, _tag_words(out.to(ATT.dtype.element_ty), tag),
                         mask=(g < GROUP) & (dims < DH))
            else:
                tl.atomic_xchg(COUNTS + hk, 0, sem="relaxed")  # (ordered before the next layer's count by the barrier)
                combine_heads(O_PART, LSE_PART, ATT + hk * GROUP * DH, hk * GROUP * SPLITS, SPLITS, GROUP, DH, DH,
                              BLOCK_D, GROUP_P2, SPLITS_P2)
        _mark(MARKS, 3, TRACE)


@triton.jit(do_not_specialize=["first_layer", "spin_limit", "poll_sleep"])
def _decode_layers_kernel(
    X_IN, XS, PEND, QKV, ATT, O, ACT, O_PART, LSE_PART, COUNTS, TIMEOUTS, TAGGED_T, SCRATCH, WS,
    G1, WQKV, BQKV, QW, KW, WO, G2, WIN, WOUT, KC, VC, TABLE, SEQ_LEN, SLOT, CS,
    stride_kl, stride_kb, stride_ks, stride_kh, stride_vl, stride_vb, stride_vs, stride_vh, eps, qk_scale, TRACE_T,
    spin_limit, poll_sleep, first_layer, n_layers,
    D: tl.constexpr, DP: tl.constexpr, NQKV: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, DH: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    F: tl.constexpr,
    FP: tl.constexpr, AP: tl.constexpr, BN_QKV: tl.constexpr, BN_O: tl.constexpr, BN_IN: tl.constexpr,
    BN_OUT: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr, PHASE: tl.constexpr,
    PERSISTENT: tl.constexpr, PREFETCH: tl.constexpr, PREFETCH_TILES: tl.constexpr, AHEAD: tl.constexpr,
    TRACE: tl.constexpr, ONE_POLLER: tl.constexpr, PREFETCH_KV: tl.constexpr,
    TAGGED: tl.constexpr, BARRIERS: tl.constexpr, RING_AHEAD: tl.constexpr, ITEM_P2: tl.constexpr,
    RING_QKV: tl.constexpr, RING_O: tl.constexpr, RING_IN: tl.constexpr, RING_OUT: tl.constexpr,
):  # fmt: skip
    """Layers first_layer .. first_layer + n_layers, every phase (PERSISTENT, barriers between them) or phase
    PHASE alone. X_IN: the embedding's output (layer 0's input); XS: the residual stream ([0] between layers,
    [1] inside one); PEND: the MLP output the next layer adds.

    TAGGED (a persistent launch of every layer; BARRIERS off): no barrier. Each phase's output vector is stored
    to its layer's place in TAGGED_T as tagged words (`_tag_words`; the tag from the launch count at WS + HKV),
    and the phases that read it poll it (`_poll`). Every program keeps the residual stream in registers (all
    compute the same sums); program 0 stores it and the last MLP output to XS and PEND at the end. With
    RING_AHEAD, each projection with a ring polls its input inside the ring's loop (`_tagged_phase`), no first
    tile in registers."""
    BAR = COUNTS + HKV
    IN_RING_QKV: tl.constexpr = TAGGED and RING_AHEAD and RING_QKV > 1  # (each projection's: `_tagged_phase`)
    IN_RING_O: tl.constexpr = TAGGED and RING_AHEAD and RING_O > 1
    IN_RING_IN: tl.constexpr = TAGGED and RING_AHEAD and RING_IN > 1
    IN_RING_OUT: tl.constexpr = TAGGED and RING_AHEAD and RING_OUT > 1
    X_MID = XS + D
    AQ = HQ * DH
    ty = XS.dtype.element_ty
    trace_at = TRACE_T + tl.program_id(0)
    if TRACE:
        tl.store(trace_at, tl.extra.cuda.globaltimer())
    if PERSISTENT:  # each phase's first tile of weights is loaded during the wait in front of it
        wq, uq = _first_tile(WQKV + first_layer.to(tl.int64) * NQKV * D, NQKV, D, DP, BN_QKV, False, IN_RING_QKV)
    tag = 0
    x = tl.zeros([DP], dtype=tl.float32)
    if TAGGED:  # (first_layer 0: every layer)
        tag = tl.load(WS + HKV, volatile=True) % _TAGS + 1
        x = _vector(X_IN, D, DP)
        SCRATCH += tl.program_id(0) * NQKV
        COUNTS = WS
    words: tl.constexpr = NQKV + AQ + D + F + D  # a layer's tagged words: Q/K/V, attention, o, SwiGLU, MLP out
    for i in range(0, n_layers):
        layer = first_layer + i
        lw = layer.to(tl.int64)
        step = i * 5
        qkv = QKV + lw * NQKV
        w_qkv = WQKV + lw * NQKV * D  # this layer's weights
        w_o = WO + lw * D * AQ
        w_in = WIN + lw * 2 * F * D
        w_out = WOUT + lw * D * F
        qkv_t = TAGGED_T + lw * words  # this layer's tagged vectors (TAGGED)
        att_t = qkv_t + NQKV
        o_t = att_t + AQ
        act_t = o_t + D
        pend_t = act_t + F
        if PERSISTENT or PHASE == 0:  # A: x += pending; Q/K/V of the normalised x
            if not PERSISTENT:
                wq, uq = _first_tile(w_qkv, NQKV, D, DP, BN_QKV, False)
            if TAGGED:  # (the layer before's MLP-down output in: the clock is its "departure"; layer 0 takes x
                # from the launch's start, nothing to poll)
                x = _tagged_phase(x, wq, uq, pend_t - words, True, G1 + lw * D, eps, layer > 0, w_qkv,
                                  BQKV + lw * NQKV, qkv_t, NQKV, D, DP, BN_QKV, False, HAS_BIAS, AHEAD, tag, RING_QKV,
                                  IN_RING_QKV, spin_limit, poll_sleep, TIMEOUTS, ty, ONE_POLLER, trace_at, 2 * step,
                                  TRACE)
            else:
                if layer == 0:  # the embedding's output, nothing pending
                    h = _add_norm(X_IN, PEND, G1, X_MID, eps, D, DP, False)
                else:
                    h = _add_norm(XS, PEND, G1 + lw * D, X_MID, eps, D, DP)
                _project(h, wq, uq, w_qkv, BQKV + lw * NQKV, qkv, NQKV, D, DP, BN_QKV, False, HAS_BIAS, AHEAD, 0,
                         False, RING_QKV)
            _arrive(BAR, step, trace_at, BARRIERS, TRACE)
            if PERSISTENT and PREFETCH_KV > 0:  # phase B's context: no phase writes it (B writes the token's slot)
                _prefetch_context(KC + lw * stride_kl, VC + lw * stride_vl, TABLE, SEQ_LEN, stride_kb, stride_ks,
                                  stride_kh, stride_vb, stride_vs, stride_vh, HKV, SPLITS, DH, BLOCK_N, BLOCK_SIZE,
                                  PREFETCH_KV)
            _depart(BAR, step, trace_at, TIMEOUTS, spin_limit, BARRIERS, TRACE, ONE_POLLER)
        if PERSISTENT or PHASE == 1:  # B: attention
            _prefetch_tiles(w_o, D, AQ, AP, BN_O, PREFETCH_TILES, False, PREFETCH)
            if TAGGED:  # (a program with an item clocks its departure again once its item's words are in)
                _clock(trace_at, 2 + 2 * step, TRACE)
            _attention(qkv, ATT, O_PART, LSE_PART, COUNTS, QW + lw * DH, KW + lw * DH, KC + lw * stride_kl,
                       VC + lw * stride_vl, TABLE, SEQ_LEN, SLOT, CS, eps, qk_scale, stride_kb, stride_ks,
                       stride_kh, stride_vb, stride_vs, stride_vh, HQ, HKV, GROUP, GROUP_P2, DH, BLOCK_D, BLOCK_M,
                       SPLITS, SPLITS_P2, BLOCK_N, BLOCK_SIZE, QK_NORM,
                       trace_at + (1 + 2 * _PHASES * n_layers + i * _B_MARKS) * tl.num_programs(0), TRACE,
                       qkv_t, att_t, SCRATCH, tag, spin_limit, poll_sleep, TIMEOUTS, TAGGED, ONE_POLLER,
                       ITEM_P2, trace_at + (2 + 2 * step) * tl.num_programs(0))
            _arrive(BAR, step + 1, trace_at, BARRIERS, TRACE)
            if PERSISTENT:
                wo, uo = _first_tile(w_o, D, AQ, AP, BN_O, False, IN_RING_O)
            _depart(BAR, step + 1, trace_at, TIMEOUTS, spin_limit, BARRIERS, TRACE, ONE_POLLER)
        if PERSISTENT or PHASE == 2:  # C: attention-out
            if not PERSISTENT:
                wo, uo = _first_tile(w_o, D, AQ, AP, BN_O, False)
            _prefetch_tiles(w_in, F, D, DP, BN_IN, PREFETCH_TILES, True, PREFETCH)
            if TAGGED:
                x = _tagged_phase(x, wo, uo, att_t, False, G2, eps, True, w_o, WO, o_t, D, AQ, AP, BN_O, False, False,
                                  AHEAD, tag, RING_O, IN_RING_O, spin_limit, poll_sleep, TIMEOUTS, ty, ONE_POLLER,
                                  trace_at, 4 + 2 * step, TRACE)
            else:
                _project(_vector(ATT, AQ, AP), wo, uo, w_o, WO, O, D, AQ, AP, BN_O, False, False, AHEAD, 0, False,
                         RING_O)
            _arrive(BAR, step + 2, trace_at, BARRIERS, TRACE)
            if PERSISTENT:
                wi, ui = _first_tile(w_in, F, D, DP, BN_IN, True, IN_RING_IN)
            _depart(BAR, step + 2, trace_at, TIMEOUTS, spin_limit, BARRIERS, TRACE, ONE_POLLER)
        if PERSISTENT or PHASE == 3:  # D: x += o; gate-and-up of the normalised x, SwiGLU
            if not PERSISTENT:
                wi, ui = _first_tile(w_in, F, D, DP, BN_IN, True)
            _prefetch_tiles(w_out, D, F, FP, BN_OUT, PREFETCH_TILES, False, PREFETCH)
            if TAGGED:
                x = _tagged_phase(x, wi, ui, o_t, True, G2 + lw * D, eps, True, w_in, WIN, act_t, F, D, DP, BN_IN,
                                  True, False, AHEAD, tag, RING_IN, IN_RING_IN, spin_limit, poll_sleep, TIMEOUTS, ty,
                                  ONE_POLLER, trace_at, 6 + 2 * step, TRACE)
            else:
                h = _add_norm(X_MID, O, G2 + lw * D, XS, eps, D, DP)
                _project(h, wi, ui, w_in, WIN, ACT, F, D, DP, BN_IN, True, False, AHEAD, 0, False, RING_IN)
            _arrive(BAR, step + 3, trace_at, BARRIERS, TRACE)
            if PERSISTENT:
                wd, ud = _first_tile(w_out, D, F, FP, BN_OUT, False, IN_RING_OUT)
            _depart(BAR, step + 3, trace_at, TIMEOUTS, spin_limit, BARRIERS, TRACE, ONE_POLLER)
        if PERSISTENT or PHASE == 4:  # E: MLP-down
            if not PERSISTENT:
                wd, ud = _first_tile(w_out, D, F, FP, BN_OUT, False)
            following = tl.minimum(lw + 1, first_layer + n_layers - 1)  # (the last layer: its own again)
            _prefetch_tiles(WQKV + following * NQKV * D, NQKV, D, DP, BN_QKV, PREFETCH_TILES, False,
                            PREFETCH)
            if TAGGED:
                x = _tagged_phase(x, wd, ud, act_t, False, G2, eps, True, w_out, WOUT, pend_t, D, F, FP, BN_OUT, False,
                                  False, AHEAD, tag, RING_OUT, IN_RING_OUT, spin_limit, poll_sleep, TIMEOUTS, ty,
                                  ONE_POLLER, trace_at, 8 + 2 * step, TRACE)
            else:
                _project(_vector(ACT, F, FP), wd, ud, w_out, WOUT, PEND, D, F, FP, BN_OUT, False, False,
                         AHEAD, 0, False, RING_OUT)
            _arrive(BAR, step + 4, trace_at, BARRIERS, TRACE)
            if PERSISTENT:
                wq, uq = _first_tile(WQKV + following * NQKV * D, NQKV, D, DP, BN_QKV, False, IN_RING_QKV)
            _depart(BAR, step + 4, trace_at, TIMEOUTS, spin_limit, BARRIERS, TRACE, ONE_POLLER)
    if TAGGED:
        if tl.program_id(0) == 0:  # the residual stream and the last MLP output, as the barrier way leaves them
            k = tl.arange(0, DP)
            tl.store(XS + k, x.to(ty), mask=k < D)
            last = TAGGED_T + (first_layer + n_layers).to(tl.int64) * words - D
            tl.store(PEND + k, _poll_vector(last, D, DP, tag, spin_limit, poll_sleep, TIMEOUTS, ty, ONE_POLLER).to(ty),
                     mask=k < D)
        _clock(trace_at, 10 * n_layers, TRACE)  # the last departure (program 0's once the last MLP output is in)
        if tl.atomic_add(WS + HKV + 1, 1, sem="acq_rel") == tl.num_programs(0) - 1:  # the last program out: the
            tl.atomic_xchg(WS + HKV + 1, 0, sem="relaxed")  # next launch's tag (every program has read this one's)
            tl.atomic_add(WS + HKV, 1, sem="relaxed")
    if BARRIERS:  # the last program out resets the barrier's count for the next launch
        if tl.atomic_add(BAR + 1, 1, sem="acq_rel") == tl.num_programs(0) - 1:
            tl.atomic_xchg(BAR, 0, sem="relaxed")
            tl.atomic_xchg(BAR + 1, 0, sem="relaxed")
