"""The weight phases of a batch-1 decode step, streamed (a Gluon probe for issue 14's next lever, session 34).

The persistent decode kernel (kernels/decode_layers.py) runs a layer as phases with a grid barrier between them,
each program reducing its tiles of the phase's weights against the vector the phase before wrote. Session 34's
traces (`docs/results/issue14/session34/`) showed those phases at ~1.7 TB/s of an H100's 3.35 whether their
weights came from HBM or had been put in L2: bound by what each program has in flight (two tiles in registers,
a third asked of L2, ~3 tiles a program a phase, filled and drained at every barrier), not by HBM.

The weights do not depend on the vectors, so nothing stops a program from copying its tiles of the next phases
while it waits at a barrier. This kernel does only the weight phases of `layers` layers (Q/K/V, attention-out,
gate-and-up, MLP-down shapes; each phase's input the previous phase's output, cut to its width; no norms,
attention or SwiGLU), three ways in one kernel:

- STAGES = 0: as decode_layers.py's `_project` does it: each tile's loads into registers issued before the tile
  before it is reduced, the phase's first tile loaded during the barrier's wait.
- STAGES >= 2: a ring of STAGES 32 KB shared-memory stages, the program's tiles copied into it in the order it
  reduces them across phases and layers, so that STAGES tiles are in flight at every point, barriers included:
  by `cp.async` (16-byte asynchronous copies from every thread, one commit group a tile; TMA = 0), or by TMA
  (one box a tile, its arrival counted at the stage's mbarrier; TMA = 1). A barrier's arrival has a release
  fence, which waits for the warp's loads in flight (session 32); whether it waits for its cp.async copies too
  is one thing the GPU runs ask; TMA's copies go through the async proxy, which it does not wait for.

Session 35 (an H100): every way bit-equal; the ring 1.05-1.07x the registers on Llama-3.2-1B's phases and
1.12-1.14x on Qwen3-0.6B's. With parts left out (WORK, SYNC; `benchmarks/weight_stream.py`'s `PARTS`), the
ring's copies alone stream at 87-91% of HBM and with their reductions at 80-86%, but the five grid barriers a
layer cost it their whole latency (~1.3 us each) though 4 stages are in flight at each, by cp.async and TMA
alike: the barriers, not the copies, bound these phases. Session 36 (an H100) ran the TMA parts and the lean
departure: TMA's copies lose the barriers' time as cp.async's do (so the arrival's fence draining cp.async
copies is not why), and the lean departure takes ~0.2 us off each barrier (ring4 1.02x on Llama, 1.05x on
Qwen3; tma4-lean Qwen3's best, 1.19x the registers). `TRACE` (`phase_trace`) times each phase, each barrier and
each phase's first tile after its barrier in one launch. Session 37 (an H100) ran it: every phase's first tile is
in ~0.3 us after its barrier, attention-out's single tile (asked for a phase and two barriers before) too, so the
ring is full when a barrier lets a program go; the barriers' waits (~1.0 us where the arrivals come together,
1.2-2.3 after a phase) are half of Qwen3's layer. Fewer barriers a layer, not more copies in flight, is the lever,
or cheaper ones: `SYNC = 4` has none, each phase's output stored as tagged words that the next phase's load
waits for (NCCL's LL protocol; `TAGS`), where a barrier is four or five dependent L2 round trips (session 37's
record). Session 37 also built `SYNC = 3`, two of a layer's five barriers local to groups of programs. Session
38 (an H100) ran both: local barriers save ~0.25 us each (1-3%), tagged vectors take Qwen3's weight phases to
14.09 us a layer against the best barriers' 17.30 (1.23x; Llama 1.06x), once the poll had a layout of its own
(`POLL_LAYOUT`).

All three reduce a tile with the same layout and order: the same bits. Gluon (Triton's explicit-layout
language, `triton.experimental.gluon`) is what allows shared memory held across phases; it has no CPU
interpreter, so on the CPU the kernel is compiled for sm_90 and inspected (`nanoforge kernels inspect
weight_stream_ring`, `_tma`, `_regs`), and runs on a GPU only (`benchmarks/weight_stream.py`,
`tests/test_kernels_weight_stream.py`).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from nanoforge.kernels.decode_layers import (
    TAGS,
    _GAVE_UP as GAVE_UP, POLL_ONE_THREAD, SPIN_LIMIT, _cooperative, grid_steps, poll_one_thread_ptx,
)

TILE = 16384  # elements of W a tile (32 KB of bf16), as decode_layers.TILE_ELEMENTS
CHUNK = 1024  # a tile is [rows, chunks, CHUNK]: rows of K = chunks x CHUNK elements (K a multiple of CHUNK)
PHASES = 4


def tile_shape(k: int) -> tuple[int, int]:
    """(rows, chunks) of a tile of a K-wide matrix: chunks = K / CHUNK rounded up to a power of two (the
    chunks past K masked), rows = TILE / (chunks x CHUNK)."""
    if k % CHUNK:
        raise ValueError(f"weight_stream: K = {k} is not a multiple of {CHUNK}")
    chunks = triton.next_power_of_2(k // CHUNK)
    if chunks * CHUNK > TILE:
        raise ValueError(f"weight_stream: K = {k} is wider than a tile ({TILE})")
    return TILE // (chunks * CHUNK), chunks


# a tile in registers, [rows, chunks, CHUNK]: 8 bf16 (16 bytes) a thread, a warp 256 columns, 4 warps a chunk,
# 2 over the rows; in shared memory unswizzled (a thread's 16 bytes after its neighbour's: no bank conflicts)
TILE_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 1, 8], [1, 1, 32], [2, 1, 4], [2, 1, 0]))
RING_LAYOUT = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))  # (a stage's: the ring's first dimension
STAGE_LAYOUT = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))  # indexes the stages)
# a TMA copy's view of a stage, [rows, K / 256, 256] (a box's dimensions are at most 256), unswizzled: the same
# bytes as STAGE_LAYOUT's [rows, chunks, CHUNK]
BOX_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=3))


# Gluon's spelling of four calls, Triton 3.9's (CI's) or 3.6's (the GPU image's), bound once here
_NEW_NAMES = hasattr(gl.shared_memory_descriptor, "reinterpret")
_reinterpret = gl.shared_memory_descriptor.reinterpret if _NEW_NAMES else gl.shared_memory_descriptor._reinterpret
_cta_barrier = gl.barrier if _NEW_NAMES else gl.thread_barrier
_copy = async_copy.async_load if _NEW_NAMES else async_copy.async_copy_global_to_shared
_tma_load = tma.async_load if _NEW_NAMES else tma.async_copy_global_to_shared


@gluon.jit
def _view(ring, D1: gl.constexpr, D2: gl.constexpr, D3: gl.constexpr, layout: gl.constexpr):
    return _reinterpret(ring, gl.bfloat16, [ring.shape[0], D1, D2, D3], layout)


@gluon.jit
def _stage(ring, s, R: gl.constexpr, C: gl.constexpr):
    """Stage s of the ring ([stages, TILE] bf16) as a [R, C, CHUNK] tile."""
    return _view(ring, R, C, 1024, STAGE_LAYOUT).index(s)


@gluon.jit
def _box(ring, s, R: gl.constexpr, C: gl.constexpr):
    """Stage s of the ring as a TMA box [R, 4 C, 256]: the same bytes."""
    return _view(ring, R, 4 * C, 256, BOX_LAYOUT).index(s)


@gluon.jit
def _tile(W, t, N, K: gl.constexpr, R: gl.constexpr, C: gl.constexpr, L: gl.constexpr):
    """Pointers and mask of tile t of W (N x K, row-major): rows t * R .. + R as [R, C, CHUNK], chunks past K
    and rows past N masked; and its rows."""
    rows = t * R + gl.arange(0, R, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
    b = gl.arange(0, C, layout=gl.SliceLayout(0, gl.SliceLayout(2, L)))
    j = gl.arange(0, 1024, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))
    ptrs = W + (rows[:, None, None].to(gl.int64) * K + b[None, :, None] * 1024 + j[None, None, :])
    mask = (rows < N)[:, None, None] & (b * 1024 < K)[None, :, None] & (j >= 0)[None, None, :]
    return ptrs, mask, rows


@gluon.jit
def _vector(X, K: gl.constexpr, C: gl.constexpr, L: gl.constexpr):
    """The phase's input (written by other programs of this launch: read from L2), fp32, as [C, CHUNK] in the
    tile's layout less its rows; zero past K."""
    b = gl.arange(0, C, layout=gl.SliceLayout(1, gl.SliceLayout(0, L)))
    j = gl.arange(0, 1024, layout=gl.SliceLayout(0, gl.SliceLayout(0, L)))
    at = b[:, None] * 1024 + j[None, :]
    return gl.load(X + at, mask=at < K, other=0.0, cache_modifier=".cg").to(gl.float32)


@gluon.jit
def _reduce(w, x, Y, rows, N):
    """Y[rows] = the tile's rows times x (fp32 sums, stored in Y's type)."""
    acc = gl.sum(gl.sum(w.to(gl.float32) * x[None, :, :], axis=2), axis=1)
    gl.store(Y + rows, acc.to(Y.dtype.element_ty), mask=rows < N)


# SYNC = 4: no grid barrier; each phase stores its output as tagged 32-bit words (the bf16 value in the low 16
# bits, the phase's tag, 1 .. TAGS, in the high ones: one 4-byte store, single-copy atomic, so no fence orders the
# value before its tag), and the next phase's load of that vector is the wait: it loads again until every word
# carries the tag it expects (NCCL's LL protocol, in 4 bytes). A vector is written again only a layer later, after
# every program has read it (its writer needs the layer's last vector, which follows every program's reads).
# The tags' range is decode_layers.py's (`TAGS`), whose tagged launches use the same words.
_TAGS = gl.constexpr(TAGS)


@gluon.jit
def _tag(base, step):
    """The tag of the vector written at step `step` of a launch whose tags start at `base` (1 .. TAGS)."""
    return (base + step) % _TAGS + 1


# a tagged vector as it is polled, [chunks, CHUNK] words: each word in one thread only (4 a thread, 8 warps a
# chunk). The tile's layout holds the vector twice (once for each warp over the rows), and a reduction over it
# counts one copy, taking the other to be equal: words polled at two moments are not, so the poll's warps must
# each hold words of their own, and the tile's copies come from one poll's (through shared memory)
POLL_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 4], [1, 32], [1, 8], [1, 0]))


@gluon.jit
def _vector_tagged(X, K: gl.constexpr, C: gl.constexpr, L: gl.constexpr, tag, spin_limit, TIMEOUTS):
    """`_vector` of tagged words (SYNC = 4): loaded again (from L2) until each carries `tag` (`POLL_LAYOUT`),
    then their values in the tile's layout; a wait past spin_limit loads gives up and counts it at TIMEOUTS, and
    every later wait of the launch then gives up at once (so that a bug ends the launch, with wrong numbers)."""
    b = gl.arange(0, C, layout=gl.SliceLayout(1, POLL_LAYOUT))
    j = gl.arange(0, 1024, layout=gl.SliceLayout(0, POLL_LAYOUT))
    at = b[:, None] * 1024 + j[None, :]
    inside = at < K
    w = at * 0  # (the words, loaded at least once below)
    missing = spin_limit * 0 + 1
    spins = gl.where(gl.load(TIMEOUTS, volatile=True) > 0, spin_limit, 0)  # (after a give-up: one load)
    while (missing > 0) & (spins <= spin_limit):
        w = gl.load(X + at, mask=inside, other=0, volatile=True)
        missing = gl.sum(gl.sum((((w >> 16) != tag) & inside).to(gl.int32), axis=1), axis=0)
        spins += 1
    gl.atomic_add(TIMEOUTS, 1, mask=missing > 0)
    x = (w & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)
    return gl.convert_layout(x, gl.SliceLayout(0, L)).to(gl.float32)


@gluon.jit
def _reduce_tagged(w, x, Y, rows, N, tag):
    """`_reduce`, each output stored as a tagged word (SYNC = 4)."""
    acc = gl.sum(gl.sum(w.to(gl.float32) * x[None, :, :], axis=2), axis=1)
    bits = acc.to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    gl.store(Y + rows, bits | (tag << 16), mask=rows < N)


@gluon.jit
def _arrive(BAR):
    """decode_layers.py's grid barrier, its arrival (`_arrive`): every thread's stores made, then counted at BAR
    with a release (whose fence waits for the warp's loads in flight: the next phase's first register tile is
    loaded after it, as there)."""
    _cta_barrier()
    gl.atomic_add(BAR, 1, sem="release")


@gluon.jit
def _depart(BAR, target, spin_limit, TIMEOUTS):
    """decode_layers.py's grid barrier, its departure (`_depart`): one thread polls (`POLL_ONE_THREAD`) until
    `target` arrivals, then an acquire; a wait past spin_limit polls gives up, counts it at TIMEOUTS and lifts BAR
    past every target of the launch."""
    gl.inline_asm_elementwise(POLL_ONE_THREAD, "=r,l,r,r", [BAR, target, spin_limit], dtype=gl.int32,
                              is_pure=False, pack=1)
    _cta_barrier()
    seen = gl.load(BAR, volatile=True)
    gave_up = seen < target
    gl.atomic_add(TIMEOUTS, 1, mask=gave_up)
    gl.atomic_max(BAR, GAVE_UP, mask=gave_up)
    gl.atomic_add(BAR, 0, sem="acquire")
    _cta_barrier()


# The lean departure's poll (SYNC = 2): thread 0 polls with acquire loads; a give-up counts itself at $4 and lifts
# the count at $1 past every target, as `_depart` does with atomics, in PTX. No re-read, no atomic after.
LEAN_POLL = gl.constexpr(poll_one_thread_ptx("ld.acquire.gpu.global", f"""
    red.relaxed.gpu.global.add.s32 [$4], 1;
    red.relaxed.gpu.global.max.s32 [$1], {GAVE_UP.value};"""))


@gluon.jit
def _depart_lean(BAR, target, spin_limit, TIMEOUTS):
    """The departure in one thread, as cooperative groups' grid sync waits (`LEAN_POLL`): its acquire loads
    order the other programs' arrivals before it, the CTA barrier after it orders them before every thread's
    next reads. What `_depart` adds after its poll (a CTA barrier, a strong re-read of the count, the give-up's
    atomics, an acquire: L2 round trips in series) is left out, to see what they cost with copies in flight."""
    gl.inline_asm_elementwise(LEAN_POLL, "=r,l,r,r,l", [BAR, target, spin_limit, TIMEOUTS], dtype=gl.int32,
                              is_pure=False, pack=1)
    _cta_barrier()


@gluon.jit
def _barrier(BAR, target, spin_limit, TIMEOUTS, SYNC: gl.constexpr):
    """The grid barrier, arrival then departure: SYNC = 1 decode_layers.py's, 2 its lean departure
    (`_depart_lean`), 0 none (a measurement of what the barriers cost: the phases then read vectors not yet
    written)."""
    if SYNC == 1:
        _arrive(BAR)
        _depart(BAR, target, spin_limit, TIMEOUTS)
    elif SYNC == 2:
        _arrive(BAR)
        _depart_lean(BAR, target, spin_limit, TIMEOUTS)


@gluon.jit
def _attention_stand_in(gap_ns):
    """The attention phase's place in a layer (between Q/K/V and attention-out, a barrier on each side): gap_ns
    nanoseconds of the GPU's clock in which this kernel reads nothing of its own (decode_layers' attention phase
    takes ~10 us a layer of Qwen3-0.6B's at context 384 on an H100, reading ~50 KB), so that what a ring copies
    meanwhile shows; 0: no wait, the two barriers alone."""
    if gap_ns > 0:
        start = _clock()
        while _clock() - start < gap_ns:
            pass


@gluon.jit
def _clock():
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


# TRACE: a launch's events, a row each of (rows, programs) int64 nanoseconds of the GPU's clock (0: the event did
# not happen in that program): per layer, each of the five barriers' arrival and departure (rows 2 b, 2 b + 1;
# barrier b = 0 after Q/K/V, 1 after the attention phase's stand-in, 2-4 after the phases after it), then each of
# the four phases' first and last tiles ready in the ring (rows 10 + 2 p, + 1: their waits done). `phase_trace`
# reads it.
EVENTS = 18
_EVENTS = gl.constexpr(EVENTS)
BEFORE = (4, 1, 2, 3)  # the barrier in front of phase p (4: the layer before's last)
AFTER = (0, 2, 3, 4)  # the barrier after phase p
_AFTER = gl.constexpr(AFTER)


@gluon.jit
def _stamp(T, row, TRACE: gl.constexpr):
    """TRACE: this program's clock at row `row` of the trace T."""
    if TRACE:
        gl.store(T + row * gl.num_programs(0) + gl.program_id(0), _clock())


# SYNC = 3: the two barriers around the attention phase's stand-in (0 and 1) each local to a group of
# GROUP_PROGRAMS consecutive programs (as a kv head's attention and its columns of attention-out could be), counted
# at BAR + LINE * (1 + group), a 128-byte line a group; the other three grid-wide at BAR, three a layer
GROUP_PROGRAMS = 16
LINE = 32  # int32s
_GROUP_PROGRAMS, _LINE = gl.constexpr(GROUP_PROGRAMS), gl.constexpr(LINE)


def count_words(programs: int) -> int:
    """The int32 counts a launch of `programs` needs zeroed: the grid barrier's line, a line a group (SYNC 3)."""
    return LINE * (1 + triton.cdiv(programs, GROUP_PROGRAMS))


@gluon.jit
def _barrier_at(BAR, layer, b, spin_limit, TIMEOUTS, SYNC: gl.constexpr, T, TRACE: gl.constexpr):
    """Layer `layer`'s barrier b of five (`_barrier`; SYNC 3: b = 0, 1 local to the program's group, the others
    grid-wide), its arrival and departure stamped at trace rows 2 b, 2 b + 1 of the layer's."""
    row = layer * _EVENTS + 2 * b
    _stamp(T, row, TRACE)
    if SYNC == 3:
        if b < 2:
            group = gl.program_id(0) // _GROUP_PROGRAMS
            size = gl.minimum(gl.num_programs(0) - group * _GROUP_PROGRAMS, _GROUP_PROGRAMS)
            _barrier(BAR + _LINE * (1 + group), (layer * 2 + b + 1) * size, spin_limit, TIMEOUTS, 1)
        else:
            _barrier(BAR, (layer * 3 + b - 1) * gl.num_programs(0), spin_limit, TIMEOUTS, 1)
    else:
        _barrier(BAR, (layer * 5 + b + 1) * gl.num_programs(0), spin_limit, TIMEOUTS, SYNC)
    _stamp(T, row + 1, TRACE)


@gluon.jit
def _issue_tile(ring, bar, s, W, D, layer, t, N: gl.constexpr, K: gl.constexpr, R: gl.constexpr, C: gl.constexpr,
                L: gl.constexpr, TMA: gl.constexpr):
    """Copy tile t of one phase's weights of `layer` (W: the phase's (layers, N, K); D: its TMA descriptor) into
    ring stage s: one TMA box counted at the stage's mbarrier bar, or cp.async from every thread."""
    if TMA:
        mbarrier.expect(bar, 32768)  # (a box is a whole stage, TILE bf16, its zero fill past K counted)
        _tma_load(D, [layer * N + t * R, 0, 0], bar, _box(ring, s, R, C))
    else:
        ptrs, mask, _rows = _tile(W + layer.to(gl.int64) * N * K, t, N, K, R, C, L)
        _copy(_stage(ring, s, R, C), ptrs, mask)


@gluon.jit
def _issue(ring, bars, s, layer, phase, k, W0, W1, W2, W3, D0, D1, D2, D3, N0: gl.constexpr, K0: gl.constexpr,
           R0: gl.constexpr, C0: gl.constexpr, N1: gl.constexpr, K1: gl.constexpr, R1: gl.constexpr,
           C1: gl.constexpr, N2: gl.constexpr, K2: gl.constexpr, R2: gl.constexpr, C2: gl.constexpr,
           N3: gl.constexpr, K3: gl.constexpr, R3: gl.constexpr, C3: gl.constexpr, n_layers, L: gl.constexpr,
           TMA: gl.constexpr):
    """Copy this program's k-th tile of `phase` of `layer` into ring stage s (`_issue_tile`); with cp.async one
    commit group, empty past the last layer (with TMA nothing there)."""
    t = gl.program_id(0) + k * gl.num_programs(0)
    bar = bars.index(s)
    if layer < n_layers:
        if phase == 0:
            _issue_tile(ring, bar, s, W0, D0, layer, t, N0, K0, R0, C0, L, TMA)
        elif phase == 1:
            _issue_tile(ring, bar, s, W1, D1, layer, t, N1, K1, R1, C1, L, TMA)
        elif phase == 2:
            _issue_tile(ring, bar, s, W2, D2, layer, t, N2, K2, R2, C2, L, TMA)
        else:
            _issue_tile(ring, bar, s, W3, D3, layer, t, N3, K3, R3, C3, L, TMA)
    if not TMA:
        async_copy.commit_group()


@gluon.jit
def _count(N, R):
    """This program's tiles of an N-row phase of R-row tiles (program p takes tiles p, p + programs, ...)."""
    return gl.maximum(gl.cdiv(gl.cdiv(N, R) - gl.program_id(0), gl.num_programs(0)), 0)


@gluon.jit
def _advance(layer, phase, k, n0, n1, n2, n3, n_layers):
    """The cursor (layer, phase, k) of this program's next tile, past phases where it has none."""
    k += 1
    n = gl.where(phase == 0, n0, gl.where(phase == 1, n1, gl.where(phase == 2, n2, n3)))
    while (k >= n) & (layer < n_layers):
        k = 0
        phase += 1
        if phase == 4:
            phase = 0
            layer += 1
        n = gl.where(phase == 0, n0, gl.where(phase == 1, n1, gl.where(phase == 2, n2, n3)))
    return layer, phase, k


@gluon.jit
def _phase_ring(ring, bars, c, X, Y, N: gl.constexpr, K: gl.constexpr, R: gl.constexpr, C: gl.constexpr, n,
                cur_layer, cur_phase, cur_k, W0, W1, W2, W3, D0, D1, D2, D3, N0: gl.constexpr, K0: gl.constexpr,
                R0: gl.constexpr, C0: gl.constexpr, N1: gl.constexpr, K1: gl.constexpr, R1: gl.constexpr,
                C1: gl.constexpr, N2: gl.constexpr, K2: gl.constexpr, R2: gl.constexpr, C2: gl.constexpr,
                N3: gl.constexpr, K3: gl.constexpr, R3: gl.constexpr, C3: gl.constexpr, n0, n1, n2, n3, n_layers,
                STAGES: gl.constexpr, L: gl.constexpr, TMA: gl.constexpr, WORK: gl.constexpr, T, row,
                TRACE: gl.constexpr, SYNC: gl.constexpr, tag_in, tag_out, spin_limit, TIMEOUTS):
    """One phase from the ring: each of its n tiles waited for, reduced, and its stage refilled with the tile
    STAGES ahead of it in the program's order (the cursor). WORK = 2: the tiles waited for and refilled, not
    read or reduced (what the copies alone cost). TRACE: the clock once the first and the last tile are in,
    at trace rows `row` and `row` + 1. SYNC = 4: X and Y tagged words, X waited for until it carries tag_in,
    Y stored with tag_out."""
    if SYNC == 4:
        x = _vector_tagged(X, K, C, L, tag_in, spin_limit, TIMEOUTS)
    else:
        x = _vector(X, K, C, L)
    for i in range(n):
        if TMA:  # the stage's n-th box, n = c // STAGES: the mbarrier's phase of that parity completed
            mbarrier.wait(bars.index(c % STAGES), (c // STAGES) & 1)
        else:
            async_copy.wait_group(STAGES - 1)  # (the oldest group: this tile's)
            _cta_barrier()  # every thread's copies of it landed
        if i == 0:
            _stamp(T, row, TRACE)
        if i == n - 1:
            _stamp(T, row + 1, TRACE)
        if WORK == 1:
            w = _stage(ring, c % STAGES, R, C).load(L)
        t = gl.program_id(0) + i * gl.num_programs(0)
        rows = t * R + gl.arange(0, R, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
        _cta_barrier()  # every thread's reads of the stage done before it is refilled
        if TMA:
            fence_async_shared()  # (those reads, by the generic proxy, ordered before the async proxy's writes)
        _issue(ring, bars, c % STAGES, cur_layer, cur_phase, cur_k, W0, W1, W2, W3, D0, D1, D2, D3, N0, K0, R0, C0,
               N1, K1, R1, C1, N2, K2, R2, C2, N3, K3, R3, C3, n_layers, L, TMA)
        cur_layer, cur_phase, cur_k = _advance(cur_layer, cur_phase, cur_k, n0, n1, n2, n3, n_layers)
        if WORK == 1:
            if SYNC == 4:
                _reduce_tagged(w, x, Y, rows, N, tag_out)
            else:
                _reduce(w, x, Y, rows, N)
        c += 1
    return c, cur_layer, cur_phase, cur_k


@gluon.jit
def _phase_regs(W, X, Y, N: gl.constexpr, K: gl.constexpr, R: gl.constexpr, C: gl.constexpr, n, w, L: gl.constexpr):
    """One phase as `_project` runs it: w (the first tile, loaded during the barrier's wait) reduced while the
    next tile's loads are in flight."""
    x = _vector(X, K, C, L)
    for i in range(n):
        t = gl.program_id(0) + i * gl.num_programs(0)
        p, m, _ = _tile(W, t + gl.num_programs(0), N, K, R, C, L)
        w_next = gl.load(p, mask=m, other=0.0, eviction_policy="evict_first")
        rows = t * R + gl.arange(0, R, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
        _reduce(w, x, Y, rows, N)
        w = w_next


@gluon.jit
def _first(W, N: gl.constexpr, K: gl.constexpr, R: gl.constexpr, C: gl.constexpr, L: gl.constexpr):
    p, m, _ = _tile(W, gl.program_id(0), N, K, R, C, L)
    return gl.load(p, mask=m, other=0.0, eviction_policy="evict_first")


@gluon.jit
def weight_stream_kernel(V0, V1, V2, V3, W0, W1, W2, W3, D0, D1, D2, D3, BAR, TIMEOUTS, T, n_layers, spin_limit,
                         gap_ns, epoch,
                         N0: gl.constexpr, K0: gl.constexpr, R0: gl.constexpr, C0: gl.constexpr,
                         N1: gl.constexpr, K1: gl.constexpr, R1: gl.constexpr, C1: gl.constexpr,
                         N2: gl.constexpr, K2: gl.constexpr, R2: gl.constexpr, C2: gl.constexpr,
                         N3: gl.constexpr, K3: gl.constexpr, R3: gl.constexpr, C3: gl.constexpr,
                         STAGES: gl.constexpr, TMA: gl.constexpr, WORK: gl.constexpr = 1,
                         SYNC: gl.constexpr = 1, TRACE: gl.constexpr = False):
    """n_layers layers of four phases, V0 -> V1 -> V2 -> V3 -> V0 (phase p: V[p+1] = W_p[layer] V[p], the
    input cut to K_p), a grid barrier after each phase and the attention phase's stand-in (gap_ns, a barrier after
    it too: five a layer, as decode_layers'); W_p: (layers, N_p, K_p) bf16. STAGES: 0 for tiles through
    registers, else the shared-memory ring's stages, TMA how they are filled (see the module's docstring). What the
    time goes to, with a ring: WORK = 0 no tiles (the barriers, the vectors' loads and the stand-in alone), 2 the
    tiles copied but not read or reduced, 1 everything; SYNC = 0 no grid barriers (wrong numbers, the copies and
    reductions alone), 2 the barriers' lean departure (`_depart_lean`), 3 the two around the stand-in local to
    groups of GROUP_PROGRAMS (attention-out then reads vectors not yet written: wrong numbers), 4 none, the
    vectors tagged words (`_vector_tagged`; their tags from `epoch`, the launch's number). TRACE (a ring): each
    program's clock at its barriers and tiles into T (`EVENTS` rows a layer)."""
    L: gl.constexpr = TILE_LAYOUT
    programs = gl.num_programs(0)
    n0 = _count(N0, R0)
    n1 = _count(N1, R1)
    n2 = _count(N2, R2)
    n3 = _count(N3, R3)
    if WORK == 0:
        n0, n1, n2, n3 = n0 * 0, n1 * 0, n2 * 0, n3 * 0
    if STAGES > 0:
        ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 16384], RING_LAYOUT)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        if TMA:
            for s in gl.static_range(STAGES):
                mbarrier.init(bars.index(s), count=1)
            fence_async_shared()  # (the initialised barriers visible to the async proxy)
        cur_layer = n_layers * 0
        cur_phase = n_layers * 0
        cur_k = n_layers * 0 - 1
        cur_layer, cur_phase, cur_k = _advance(cur_layer, cur_phase, cur_k, n0, n1, n2, n3, n_layers)
        for s in gl.static_range(STAGES):  # the first STAGES tiles in flight
            _issue(ring, bars, s, cur_layer, cur_phase, cur_k, W0, W1, W2, W3, D0, D1, D2, D3, N0, K0, R0, C0, N1,
                   K1, R1, C1, N2, K2, R2, C2, N3, K3, R3, C3, n_layers, L, TMA)
            cur_layer, cur_phase, cur_k = _advance(cur_layer, cur_phase, cur_k, n0, n1, n2, n3, n_layers)
        c = n_layers * 0
        base = epoch * 4 * n_layers  # (SYNC = 4: the tags of this launch; the host's input carries _tag(base, 0))
        for layer in range(n_layers):
            for p in gl.static_range(4):  # phase p: V_p -> V_{p+1} (V3 -> V0); after Q/K/V the stand-in
                c, cur_layer, cur_phase, cur_k = _phase_ring(
                    ring, bars, c, (V0, V1, V2, V3)[p], (V1, V2, V3, V0)[p], (N0, N1, N2, N3)[p],
                    (K0, K1, K2, K3)[p], (R0, R1, R2, R3)[p], (C0, C1, C2, C3)[p], (n0, n1, n2, n3)[p], cur_layer,
                    cur_phase, cur_k, W0, W1, W2, W3, D0, D1, D2, D3, N0, K0, R0, C0, N1, K1, R1, C1, N2, K2, R2,
                    C2, N3, K3, R3, C3, n0, n1, n2, n3, n_layers, STAGES, L, TMA, WORK, T,
                    layer * _EVENTS + 10 + 2 * p, TRACE, SYNC, _tag(base, layer * 4 + p),
                    _tag(base, layer * 4 + p + 1), spin_limit, TIMEOUTS)
                if SYNC != 4:
                    _barrier_at(BAR, layer, _AFTER[p], spin_limit, TIMEOUTS, SYNC, T, TRACE)
                if p == 0:
                    _attention_stand_in(gap_ns)
                    if SYNC != 4:
                        _barrier_at(BAR, layer, 1, spin_limit, TIMEOUTS, SYNC, T, TRACE)
        if TMA:
            for s in gl.static_range(STAGES):
                mbarrier.invalidate(bars.index(s))
        else:
            async_copy.wait_group(0)
    else:
        first = _first(W0, N0, K0, R0, C0, L)
        for layer in range(n_layers):
            lw = layer.to(gl.int64)
            step = layer * 5
            w0 = W0 + lw * N0 * K0
            w1 = W1 + lw * N1 * K1
            w2 = W2 + lw * N2 * K2
            w3 = W3 + lw * N3 * K3
            _phase_regs(w0, V0, V1, N0, K0, R0, C0, n0, first, L)
            _arrive(BAR)
            _depart(BAR, (step + 1) * programs, spin_limit, TIMEOUTS)
            _attention_stand_in(gap_ns)
            _arrive(BAR)
            first1 = _first(w1, N1, K1, R1, C1, L)
            _depart(BAR, (step + 2) * programs, spin_limit, TIMEOUTS)
            _phase_regs(w1, V1, V2, N1, K1, R1, C1, n1, first1, L)
            _arrive(BAR)
            first2 = _first(w2, N2, K2, R2, C2, L)
            _depart(BAR, (step + 3) * programs, spin_limit, TIMEOUTS)
            _phase_regs(w2, V2, V3, N2, K2, R2, C2, n2, first2, L)
            _arrive(BAR)
            first3 = _first(w3, N3, K3, R3, C3, L)
            _depart(BAR, (step + 4) * programs, spin_limit, TIMEOUTS)
            _phase_regs(w3, V3, V0, N3, K3, R3, C3, n3, first3, L)
            _arrive(BAR)
            following = gl.minimum(lw + 1, n_layers - 1)
            first = _first(W0 + following * N0 * K0, N0, K0, R0, C0, L)
            _depart(BAR, (step + 5) * programs, spin_limit, TIMEOUTS)


def shape_constants(widths: list[tuple[int, int]], stages: int, tma: bool = False, work: int = 1,
                    sync: int = 1, trace: bool = False) -> dict:
    """The kernel's constexprs for four phases' (N, K), `stages` (0: registers), `tma` (the ring's copies), and
    what to leave out to see what the rest costs (with a ring): `work` 0 (no tiles), 2 (tiles copied, not
    reduced) or 1 (all), `sync` 0 (no grid barriers) or 3 (the two around the stand-in local to groups of
    programs); `sync` 2: the barriers' lean departure, 4: no barriers, tagged vectors (`TAGS`; with a ring);
    `trace`: the clock at every barrier and phase (with a ring)."""
    if len(widths) != PHASES:
        raise ValueError(f"weight_stream: {PHASES} phases, not {len(widths)}")
    if work not in (0, 1, 2):
        raise ValueError(f"weight_stream: work is 0, 1 or 2, not {work!r}")
    if sync not in (0, 1, 2, 3, 4):
        raise ValueError(f"weight_stream: sync is 0, 1, 2, 3 or 4, not {sync!r}")
    if sync == 4 and (work != 1 or trace):
        raise ValueError("weight_stream: sync 4 (tagged vectors) runs with every tile's work and untraced")
    if (work != 1 or sync != 1 or trace) and not stages:
        raise ValueError("weight_stream: work 0 or 2, sync 0, 2 or 3 and a trace run on the ring's path: "
                         "stages >= 2")
    out = {"STAGES": stages, "TMA": tma, "WORK": int(work), "SYNC": int(sync), "TRACE": bool(trace)}
    for p, (n, k) in enumerate(widths):
        r, c = tile_shape(k)
        out |= {f"N{p}": n, f"K{p}": k, f"R{p}": r, f"C{p}": c}
    return out


def layer_widths(d: int, q: int, kv: int, f: int) -> list[tuple[int, int]]:
    """A Llama/Qwen layer's four weight phases, (N, K) each: Q/K/V, attention-out, gate-and-up, MLP-down (d the
    model's width, q and kv the query's and a K's or V's width over all heads, f the MLP's)."""
    return [(q + 2 * kv, d), (d, q), (2 * f, d), (d, f)]


def box_shape(k: int) -> list[int]:
    """A TMA box of a tile of a K-wide matrix seen as (rows, K / 256, 256): [rows, 4 chunks, 256], its part
    past K filled with zeros by the copy (K = 3,072: 12 of 16)."""
    rows, chunks = tile_shape(k)
    return [rows, 4 * chunks, 256]


def descriptors(ws: list[torch.Tensor]) -> list:
    """Each phase's weights as a TMA descriptor of (layers x N, K / 256, 256), one box a tile."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    out = []
    for w in ws:
        layers, n, k = w.shape
        if n % tile_shape(k)[0]:  # (a box past a layer's last row would copy the next layer's rows)
            raise ValueError(f"weight_stream: N = {n} is not a multiple of a tile's {tile_shape(k)[0]} rows")
        view = w.view(layers * n, k // 256, 256)
        out.append(TensorDescriptor(view, list(view.shape), list(view.stride()), box_shape(k), BOX_LAYOUT.value))
    return out


def stream_layers(ws: list[torch.Tensor], v: list[torch.Tensor], stages: int, counts: torch.Tensor, *,
                  tma: bool = False, gap_ns: int = 0, programs: int | None = None, descs: list | None = None,
                  spin_limit: int = SPIN_LIMIT, work: int = 1, sync: int = 1,
                  trace: torch.Tensor | None = None, epoch: int = 0) -> None:
    """Launch the kernel over weights ws (four (layers, N_p, K_p) bf16 tensors) and vectors v (four bf16
    vectors, v[p] N_{p-1} long, at least K_p; v[0] the input, the layers' output left in it). counts:
    `count_words(programs)` zeroed int32, [0] the grid barrier's arrivals, [1] the waits that gave up (0 unless
    the programs were not all resident), then a line a group's (sync 3). stages: 0 for registers, else the
    ring's, filled by cp.async or (`tma`) TMA. gap_ns: the attention phase's stand-in, a wait between Q/K/V and
    attention-out. programs: the grid (default one an SM). descs: `descriptors(ws)`, made once by a caller that
    launches again (else here). work, sync: the parts left out (`shape_constants`; the numbers then wrong: sync 0
    or 3), or sync 2 the lean barrier (the same numbers), or sync 4 tagged vectors: v int32 words, v[0]
    `tag_words(x, epoch, layers)`, the others zeroed once and never holding this launch's tags (`epoch`: a
    launch's number, other than the last launch's on these buffers; `untag` reads them). trace: zeroed int64
    (`EVENTS` x layers, programs), a ring's launch: each program's clock at its barriers and tiles (`phase_trace`
    reads it)."""
    programs = programs or torch.cuda.get_device_properties(ws[0].device).multi_processor_count
    if counts.dtype != torch.int32 or counts.numel() < count_words(programs):
        raise ValueError(f"weight_stream: counts are {count_words(programs)} zeroed int32 for {programs} programs")
    consts = shape_constants([tuple(w.shape[1:]) for w in ws], stages, tma, work, sync, trace is not None)
    if any(t.dtype != (torch.int32 if sync == 4 else torch.bfloat16) for t in v):
        raise ValueError("weight_stream: the vectors are bf16, or int32 tagged words with sync 4")
    if trace is not None and (trace.dtype != torch.int64 or tuple(trace.shape) != (EVENTS * ws[0].shape[0], programs)):
        raise ValueError(f"weight_stream: a trace is int64 ({EVENTS} x layers, programs)")
    weight_stream_kernel[(programs,)](*v, *ws, *(descs or descriptors(ws)), counts, counts[1:],
                                      trace if trace is not None else counts, ws[0].shape[0], spin_limit, gap_ns,
                                      epoch % TAGS,
                                      **consts, num_warps=8, **_cooperative())


def tag_words(x: torch.Tensor, epoch: int, n_layers: int) -> torch.Tensor:
    """A bf16 vector as the tagged words a sync-4 launch numbered `epoch` reads as its first layer's input."""
    tag = (epoch % TAGS) * 4 * n_layers % TAGS + 1  # (the kernel's _tag(base, 0))
    return (x.view(torch.int16).to(torch.int32) & 0xFFFF) | (tag << 16)


def untag(words: torch.Tensor) -> torch.Tensor:
    """The bf16 values of tagged words."""
    return (words & 0xFFFF).to(torch.int16).view(torch.bfloat16)


def phase_trace(trace: torch.Tensor, group: int | None = None) -> dict:
    """Microseconds a layer, averaged over the layers after the first, from a traced launch (`stream_layers`),
    cut as decode_layers' `grid_steps` cuts its launch: per phase p, "work" from the last program to leave the
    barrier in front of it to the last to arrive at the one after it, and "stall" the mean over the programs with
    a tile in it of the time from leaving that barrier to having the phase's first tile (0: the copies went on
    through the barrier, the tile was in), "last_tile_us" the same to its last tile (the phase's tiles coming in
    at once or one by one); per barrier b, "wait" from its last arrival to its last departure. `group` (a launch
    with sync 3: barriers 0 and 1 local to groups of that many programs): those two barriers' waits are each
    group's own (its last arrival to its last departure), averaged over the groups."""
    t = trace.double().cpu().reshape(-1, EVENTS, trace.shape[1]) / 1e3  # (layers, events, programs), us
    layers = t.shape[0]
    arrive, leave = t[:, 0:10:2].reshape(5 * layers, -1), t[:, 1:10:2].reshape(5 * layers, -1)  # steps in order
    before, work, wait = (x.reshape(layers, 5) for x in grid_steps(arrive[0], arrive, leave))
    ready = torch.where(t[:, 10:] > 0, t[:, 10:], float("nan"))  # (0: the program had no tile of the phase)
    first, last = ready[:, 0::2], ready[:, 1::2]
    lv = leave.reshape(layers, 5, -1)  # each program's departure before phase p of layers 1 ..
    own_before = torch.stack([lv[:-1, BEFORE[p]] if p == 0 else lv[1:, BEFORE[p]] for p in range(PHASES)], 1)
    out = {}
    for p in range(PHASES):  # (the work of step AFTER[p]: from the barrier in front of phase p to the one after)
        out[f"phase {p}"] = {"work_us": float(work[1:, AFTER[p]].mean()),
                             "stall_us": float((first[1:, p] - own_before[:, p]).nanmean()),
                             "last_tile_us": float((last[1:, p] - own_before[:, p]).nanmean())}
    for b in range(5):
        out[f"barrier {b}"] = {"wait_us": float(wait[1:, b].mean())}
    if group:
        a, d = arrive.reshape(layers, 5, -1)[1:, :2], lv[1:, :2]  # (layers after the first, barriers 0-1, programs)
        waits = [d[..., g:g + group].amax(2) - a[..., g:g + group].amax(2) for g in range(0, a.shape[2], group)]
        for b, w in enumerate(torch.stack(waits).mean(0).mean(0).tolist()):
            out[f"barrier {b}"] = {"wait_us": w}
    out["layer_us"] = float((work[1:] + wait[1:]).sum(1).mean())  # (a layer's last departure to the next's)
    return out


def reference(ws: list[torch.Tensor], x: torch.Tensor) -> list[torch.Tensor]:
    """The four vectors after the layers, in float64 with each phase's output rounded to bf16 as the kernel's."""
    v = [x.double()]
    for layer in range(ws[0].shape[0]):
        for w in ws:
            v.append((w[layer].double() @ v[-1][: w.shape[2]]).to(torch.bfloat16).double())
    return [v[-1], v[-4], v[-3], v[-2]]
