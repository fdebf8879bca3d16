"""kernels/weight_stream.py, the Gluon probe of decode's weight phases streamed through shared memory: its host
side on the CPU (Gluon has no interpreter; its compiled form is checked in test_kernels_inspect.py), and on a
GPU both ways against a float64 reference and each other, bit for bit."""

from __future__ import annotations

import pytest
import torch

from nanoforge.kernels import weight_stream as ws

QWEN3 = ws.layer_widths(1024, 2048, 1024, 3072)
LLAMA = ws.layer_widths(2048, 2048, 512, 8192)


def test_a_tile_is_32_kb_of_whole_rows_its_chunks_a_power_of_two():
    assert QWEN3 == [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]
    assert [ws.tile_shape(k) for _, k in QWEN3] == [(16, 1), (8, 2), (16, 1), (4, 4)]  # 3,072: 4 chunks, 1 masked
    assert [ws.tile_shape(k) for _, k in LLAMA] == [(8, 2), (8, 2), (8, 2), (2, 8)]
    assert all(r * c * ws.CHUNK == ws.TILE for r, c in map(ws.tile_shape, (1024, 2048, 3072, 4096, 8192, 16384)))
    assert [ws.box_shape(k) for _, k in QWEN3] == [[16, 4, 256], [8, 8, 256], [16, 4, 256], [4, 16, 256]]
    consts = ws.shape_constants(QWEN3, 4)
    assert consts["STAGES"] == 4 and not consts["TMA"] and not consts["TRACE"]
    assert (consts["N3"], consts["K3"], consts["R3"], consts["C3"]) == (1024, 3072, 4, 4)
    with pytest.raises(ValueError, match="K = 1000 is not a multiple of 1024"):
        ws.tile_shape(1000)
    with pytest.raises(ValueError, match="wider than a tile"):
        ws.tile_shape(32768)
    with pytest.raises(ValueError, match="4 phases, not 3"):
        ws.shape_constants(QWEN3[:3], 0)


_PARTS_CHILD = """
import dataclasses, json, sys
from nanoforge.kernels import inspect as ki
out = {}
for work, sync, tma, trace in json.loads(sys.argv[1]):
    spec = ki._weight_stream(4, tma=tma)
    if sync == 4:  # tagged words
        spec = dataclasses.replace(spec, signature={**spec.signature, **{v: "*i32" for v in ("V0", "V1", "V2", "V3")}})
    spec = dataclasses.replace(spec, constexprs={**spec.constexprs, "WORK": work, "SYNC": int(sync), "TRACE": trace})
    ptx = ki._compile_triton("weight_stream_part", spec).ptx
    out[f"{work} {sync} {tma} {trace}"] = {p: ptx.count(p) for p in (
        "cp.async.bulk.tensor", "cp.async.cg.shared.global", "ld.shared.v4", "red.global.gpu.release.add",
        "ld.global.gpu.acquire", "ld.acquire.gpu.global", "%globaltimer", "st.global.b64", "ld.volatile.global.v4")}
print(json.dumps(out))
"""


def test_the_parts_left_out_are_gone_from_the_compiled_kernel():
    """The benchmark's parts (`PARTS`), compiled for sm_90 at Qwen3-0.6B's widths (a ring of 4, in a child
    process: the real compiler, not the interpreter): no tiles (work 0) copies nothing and reads no stage; copies
    only (2) copies but reads no stage; no sync has no barrier's release arrival or acquire, and the lean
    departure (sync 2) acquires in its poll instead of after it, with two of the five local to groups of
    programs (sync 3) the barriers are decode_layers' still, and tagged vectors (sync 4) have none, their loads
    volatile; what is kept is there (five barriers a layer,
    the stages read 16 bytes at a time). A traced launch (the last case) stores the clock 18 times a layer
    (`EVENTS`: each barrier's arrival and departure, each phase's first and last tile), an untraced one never
    (its only clock reads the attention stand-in's)."""
    import json
    import os
    import subprocess
    import sys

    from test_kernels_inspect import _need_cuda_tools

    _need_cuda_tools()
    cases = [(0, 1, False, False), (2, 1, False, False), (1, 0, False, False), (2, 0, True, False),
             (1, 2, True, True), (1, 3, False, False), (1, 4, False, False), (1, 4, True, False)]
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "TRITON_INTERPRET")}
    r = subprocess.run([sys.executable, "-c", _PARTS_CHILD, json.dumps(cases)], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for work, sync, tma, trace in cases:
        n = got[f"{work} {sync} {tma} {trace}"]
        assert (n["st.global.b64"], n["%globaltimer"]) == ((ws.EVENTS, ws.EVENTS + 2) if trace else (0, 2)), n
        copies = n["cp.async.bulk.tensor"] if tma else n["cp.async.cg.shared.global"]
        assert (copies > 0) == (work != 0), (work, sync, tma, n)
        assert (n["ld.shared.v4"] > 0) == (work == 1), (work, sync, tma, n)
        assert n["red.global.gpu.release.add"] == (5 if sync in (1, 2, 3) else 0), n  # the arrivals
        assert n["ld.global.gpu.acquire"] == (5 if sync in (1, 3) else 0), n  # (the lean departure's polls acquire)
        assert n["ld.acquire.gpu.global"] == (5 if sync == 2 else 0), n
        assert (n["ld.volatile.global.v4"] > 0) == (sync == 4), n  # (tagged vectors: loaded again until tagged)
    with pytest.raises(ValueError, match="work is 0, 1 or 2, not 3"):
        ws.shape_constants(QWEN3, 4, work=3)
    with pytest.raises(ValueError, match="run on the ring's path"):
        ws.shape_constants(QWEN3, 0, sync=2)
    with pytest.raises(ValueError, match="run on the ring's path"):
        ws.shape_constants(QWEN3, 0, trace=True)
    with pytest.raises(ValueError, match="sync is 0, 1, 2, 3 or 4, not 5"):
        ws.shape_constants(QWEN3, 4, sync=5)
    with pytest.raises(ValueError, match="sync 4 .* every tile's work and untraced"):
        ws.shape_constants(QWEN3, 4, work=2, sync=4)
    with pytest.raises(ValueError, match="sync 4 .* every tile's work and untraced"):
        ws.shape_constants(QWEN3, 4, sync=4, trace=True)


def test_the_trace_reads_each_phases_work_its_first_tiles_wait_and_each_barriers_wait():
    """`phase_trace` on a trace written by hand (three layers, two programs, in microseconds): barrier b of layer l
    arrived at 100 l + 20 b + 1 and + 3, left at + 5 and + 6; each phase's first tile in 2 and 4 us after the
    program left the barrier in front of it (program 1 has no tile of attention-out: left out), its last in 9.
    So every barrier waits 3 us (last arrival to last departure), every phase works 17 (last departure before to
    last arrival after; Q/K/V's from the layer before's last barrier), the first tiles wait 3 us on average (2
    for attention-out), the last 9, and a layer takes 100; the first layer is left out (nothing before it)."""
    layers, programs = 3, 2
    t = torch.zeros(layers, ws.EVENTS, programs, dtype=torch.float64)
    for layer in range(layers):
        for b in range(5):
            base = 100 * layer + 20 * b
            t[layer, 2 * b] = torch.tensor([base + 1, base + 3])
            t[layer, 2 * b + 1] = torch.tensor([base + 5, base + 6])
        for p in range(ws.PHASES):
            before = t[layer - 1, 2 * 4 + 1] if p == 0 else t[layer, 2 * ws.BEFORE[p] + 1]
            t[layer, 10 + 2 * p] = before + torch.tensor([2.0, 4.0])
            t[layer, 11 + 2 * p] = before + 9
        t[layer, 10 + 2 * 1, 1] = 0  # program 1: no tile of attention-out
    got = ws.phase_trace((t * 1000).reshape(layers * ws.EVENTS, programs).long())
    assert got["layer_us"] == pytest.approx(100)
    for b in range(5):
        assert got[f"barrier {b}"]["wait_us"] == pytest.approx(3)
    for p in range(ws.PHASES):
        assert got[f"phase {p}"]["work_us"] == pytest.approx(17)
        assert got[f"phase {p}"]["stall_us"] == pytest.approx(2 if p == 1 else 3)
        assert got[f"phase {p}"]["last_tile_us"] == pytest.approx(9)


def test_the_trace_reads_barriers_local_to_groups_group_by_group():
    """A sync-3 launch's trace (`group`): barriers 0 and 1 each group's own, so their wait is each group's last
    arrival to its last departure, averaged over the groups (here 3 and 1 us: 2), not the grid's (1 us: group 1
    arrived last and left soon after, while group 0 had waited 3); the grid-wide ones as before (3 us)."""
    layers, programs = 3, 4
    t = torch.zeros(layers, ws.EVENTS, programs, dtype=torch.float64)
    for layer in range(layers):
        for b in range(5):
            base = 100 * layer + 20 * b
            local = b < 2
            t[layer, 2 * b] = base + torch.tensor([1.0, 2, 10, 11] if local else [1.0, 3, 1, 3])
            t[layer, 2 * b + 1] = base + torch.tensor([5.0, 5, 12, 12] if local else [5.0, 6, 5, 6])
    trace = (t * 1000).reshape(layers * ws.EVENTS, programs).long()
    got, grid = ws.phase_trace(trace, group=2), ws.phase_trace(trace)
    assert [got[f"barrier {b}"]["wait_us"] for b in range(5)] == pytest.approx([2, 2, 3, 3, 3])
    assert [grid[f"barrier {b}"]["wait_us"] for b in range(5)] == pytest.approx([1, 1, 3, 3, 3])


def test_tagged_words_hold_the_bf16_bits_and_the_tag_the_kernel_expects_first():
    """`tag_words` / `untag` (sync 4): the value's 16 bits round-trip bit for bit (negative values and NaN
    included), the tag is the kernel's first, `_tag(epoch x 4 x layers, 0)`, 1 .. TAGS, and consecutive
    launches' tags differ (a graph-free launch's stale words never pass for this launch's)."""
    x = torch.tensor([1.5, -2.25, 0.0, -0.0, float("nan"), 3e38, -1e-30], dtype=torch.bfloat16)
    for epoch in (0, 1, 291, ws.TAGS - 1, ws.TAGS, 10**6):
        words = ws.tag_words(x, epoch, 28)
        assert words.dtype == torch.int32
        assert torch.equal(ws.untag(words).view(torch.int16), x.view(torch.int16))
        tags = set((words >> 16).tolist())
        assert tags == {(epoch % ws.TAGS) * 4 * 28 % ws.TAGS + 1} and 1 <= min(tags) <= ws.TAGS
        assert tags != set((ws.tag_words(x, epoch + 1, 28) >> 16).tolist())


def test_a_tma_descriptor_covers_a_phases_layers_one_box_a_tile():
    w = [torch.zeros(2, n, k, dtype=torch.bfloat16) for n, k in QWEN3]
    d = ws.descriptors(w)
    assert [list(x.shape) for x in d] == [[8192, 4, 256], [2048, 8, 256], [12288, 4, 256], [2048, 12, 256]]
    assert [list(x.block_shape) for x in d] == [ws.box_shape(k) for _, k in QWEN3]
    assert all(list(x.strides) == [k, 256, 1] for x, (_, k) in zip(d, QWEN3))
    with pytest.raises(ValueError, match="N = 1022 is not a multiple of a tile's 4 rows"):
        ws.descriptors([torch.zeros(1, 1022, 3072, dtype=torch.bfloat16)])


def test_the_reference_chains_the_phases_with_bf16_between_them():
    """`reference` against the same chain written out for one layer of small widths."""
    gen = torch.Generator().manual_seed(1)
    widths = ws.layer_widths(1024, 1024, 512, 1024)
    w = [(torch.randn(1, n, k, generator=gen) / k**0.5).bfloat16() for n, k in widths]
    x = torch.randn(1024, generator=gen).bfloat16()
    v1 = (w[0][0].double() @ x.double()).bfloat16()
    v2 = (w[1][0].double() @ v1[:1024].double()).bfloat16()
    v3 = (w[2][0].double() @ v2.double()).bfloat16()
    v0 = (w[3][0].double() @ v3[:1024].double()).bfloat16()
    got = ws.reference(w, x)
    assert all(torch.equal(g, e.double()) for g, e in zip(got, [v0, v1, v2, v3]))


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [None, 7])  # one an SM (some with no tile of a phase); few, many tiles each
@pytest.mark.parametrize("widths", [QWEN3, LLAMA], ids=["qwen3-0.6b", "llama3-1b"])
def test_gpu_the_ring_computes_what_registers_do_bit_for_bit(widths, programs):
    """Three layers through registers and through rings of 2 and 6 stages filled by cp.async and by TMA, and of
    4 with the barriers' lean departure (`_depart_lean`, each copy kind), and traced (`trace`): the same bits (the
    same tiles reduced in the same layout and order), within bf16's rounding of the float64 chain, no barrier
    given up (five a layer), with the attention phase's stand-in waiting or not; traced, every program's clock at
    every barrier, no departure before the barrier's last arrival."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (runs on the H200 machine)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = [(torch.randn(3, n, k, generator=gen, device="cuda") / k**0.5).bfloat16() for n, k in widths]
    x = torch.randn(widths[0][1], generator=gen, device="cuda").bfloat16()
    want = ws.reference(w, x)
    outs = []
    grid = programs or torch.cuda.get_device_properties(0).multi_processor_count
    for stages, tma, sync, traced in ((0, False, 1, False), (2, False, 1, False), (6, False, 1, False),
                                      (2, True, 1, False), (6, True, 1, False), (4, False, 2, False),
                                      (4, True, 2, False), (4, False, 1, True), (4, True, 2, True)):
        v = [torch.full((widths[p - 1][0],), float("nan"), device="cuda", dtype=torch.bfloat16) for p in range(4)]
        v[0].copy_(x)
        counts = torch.zeros(ws.count_words(grid), dtype=torch.int32, device="cuda")
        trace = torch.zeros(ws.EVENTS * 3, grid, dtype=torch.int64, device="cuda") if traced else None
        ws.stream_layers(w, v, stages, counts, tma=tma, gap_ns=2000 if stages == 6 else 0, programs=programs,
                         sync=sync, trace=trace)
        torch.cuda.synchronize()
        assert int(counts[1]) == 0 and int(counts[0]) == 3 * 5 * grid
        for got, ref in zip(v, want):
            assert float((got.double() - ref).norm() / ref.norm()) < 1e-2
        outs.append(v)
        if traced:  # every program stamped every barrier, and none left one before the last arrived at it
            t = trace.reshape(3, ws.EVENTS, grid)
            arrive, depart = t[:, 0:10:2], t[:, 1:10:2]
            assert bool((arrive > 0).all()) and bool((depart >= arrive).all())
            assert bool((depart.amin(2) >= arrive.amax(2)).all())
    assert all(torch.equal(a, b) for o in outs[1:] for a, b in zip(outs[0], o))


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True], ids=["cp.async", "tma"])
@pytest.mark.parametrize("programs", [None, 7])
def test_gpu_tagged_vectors_compute_what_the_barriers_do_launch_after_launch(programs, tma):
    """sync 4 (the benchmark's `-tagged` ways): no grid barrier, each phase's output tagged and the next phase's
    load waiting for the tags: the same bits as the registers' way with its barriers, at Qwen3-0.6B's widths,
    in three launches in a row on the same buffers (each launch's tags new, so none reads the last one's words),
    the attention stand-in waiting or not; no wait gives up, and no barrier is counted."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (runs on the H200 machine)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = [(torch.randn(3, n, k, generator=gen, device="cuda") / k**0.5).bfloat16() for n, k in QWEN3]
    x = torch.randn(QWEN3[0][1], generator=gen, device="cuda").bfloat16()
    grid = programs or torch.cuda.get_device_properties(0).multi_processor_count
    v = [torch.full((QWEN3[p - 1][0],), float("nan"), device="cuda", dtype=torch.bfloat16) for p in range(4)]
    v[0].copy_(x)
    counts = torch.zeros(ws.count_words(grid), dtype=torch.int32, device="cuda")
    ws.stream_layers(w, v, 0, counts, programs=programs)  # the registers' way, with its barriers
    words = [torch.zeros(t.numel(), device="cuda", dtype=torch.int32) for t in v]
    for epoch, gap_ns in enumerate((0, 2000, 0)):
        counts.zero_()
        words[0].copy_(ws.tag_words(x, epoch, 3))
        ws.stream_layers(w, words, 4, counts, tma=tma, gap_ns=gap_ns, programs=programs, sync=4, epoch=epoch)
        torch.cuda.synchronize()
        assert int(counts[1]) == 0 and int(counts[0]) == 0
        assert all(torch.equal(ws.untag(got), want) for got, want in zip(words, v)), epoch


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [None, 20])  # one an SM (8 groups of 16 and one of 4); a group of 4 last
def test_gpu_barriers_local_to_groups_hold_within_each_group(programs):
    """sync 3 (the benchmark's `group-*` parts): the two barriers around the stand-in local to groups of
    GROUP_PROGRAMS programs, the other three grid-wide. Traced: every program stamps every barrier, none leaves a
    local one before the last of its group has arrived, or a grid one before the last of all; each group's count
    and the grid's are what three layers add to them; no wait gives up."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (runs on the H200 machine)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = [(torch.randn(3, n, k, generator=gen, device="cuda") / k**0.5).bfloat16() for n, k in QWEN3]
    grid = programs or torch.cuda.get_device_properties(0).multi_processor_count
    v = [torch.zeros((QWEN3[p - 1][0],), device="cuda", dtype=torch.bfloat16) for p in range(4)]
    counts = torch.zeros(ws.count_words(grid), dtype=torch.int32, device="cuda")
    trace = torch.zeros(ws.EVENTS * 3, grid, dtype=torch.int64, device="cuda")
    ws.stream_layers(w, v, 4, counts, gap_ns=1000, programs=programs, sync=3, trace=trace)
    torch.cuda.synchronize()
    groups = -(-grid // ws.GROUP_PROGRAMS)
    sizes = [min(ws.GROUP_PROGRAMS, grid - g * ws.GROUP_PROGRAMS) for g in range(groups)]
    assert int(counts[1]) == 0 and int(counts[0]) == 3 * 3 * grid
    assert [int(counts[ws.LINE * (1 + g)]) for g in range(groups)] == [3 * 2 * n for n in sizes]
    t = trace.reshape(3, ws.EVENTS, grid)
    arrive, depart = t[:, 0:10:2], t[:, 1:10:2]  # (layers, barriers, programs)
    assert bool((arrive > 0).all()) and bool((depart >= arrive).all())
    assert bool((depart[:, 2:].amin(2) >= arrive[:, 2:].amax(2)).all())
    for g in range(groups):
        own = slice(g * ws.GROUP_PROGRAMS, g * ws.GROUP_PROGRAMS + sizes[g])
        assert bool((depart[:, :2, own].amin(2) >= arrive[:, :2, own].amax(2)).all())


def test_the_benchmark_refuses_bad_input_in_one_line():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "weight_stream.py"
    for args, line in ((["--stages", "2,9"], "--stages: whole numbers from 2 to 6, not '2,9'"),
                       (["--presets", "nope"], "--presets: no model preset named 'nope'"),
                       (["--gap-us", "-1"], "--gap-us: numbers from 0 to 1,000, not '-1'")):
        r = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith(line)
    if not torch.cuda.is_available():
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
        assert r.returncode == 2 and r.stderr.startswith("needs a CUDA GPU with cp.async")
