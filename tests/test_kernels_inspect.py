"""Kernel inspection: occupancy arithmetic, and compiling real kernels down to SASS without a GPU.

The occupancy cases are worked by hand with the CUDA occupancy calculator's
rules for sm_90: 64 warps, 32 blocks, 64K registers (allocated per warp in
units of 256, split over 4 sub-partitions) and 228 KB of shared memory per
SM, with 1 KB reserved per block and 128 B allocation units.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nanoforge.errors import NanoforgeError
from nanoforge.kernels import inspect as ki
from nanoforge.kernels import paged_attention as pa
from conftest import raises_bug

# (threads, regs, smem) -> (blocks/SM, limiter)
OCCUPANCY_CASES = [
    # 8 warps/block: 64 // 8 = 8 blocks; 32 regs -> 1024/warp -> 16 warps per sub-partition -> 64 warps -> 8.
    ((256, 32, 0), (8, "warps, registers")),
    # 64 regs -> 2048/warp -> 8 warps per sub-partition -> 32 warps -> 4 blocks of 8 warps (50%).
    ((256, 64, 0), (4, "registers")),
    # 37 regs -> 1184 -> rounded to 1280/warp; 16384 // 1280 = 12 -> 48 warps -> 12 blocks of 4 (75%).
    ((128, 37, 0), (12, "registers")),
    # regtile_2d: 126 regs -> 4096/warp -> 4 per sub-partition -> 16 warps -> 2 blocks; smem 9 KB allows 25.
    ((256, 126, 8192), (2, "registers")),
    # 48 KB + 1 KB reserved = 50176 B; 233472 // 50176 = 4 blocks (regs would allow 16, warps 16).
    ((128, 32, 48 * 1024), (4, "shared memory")),
    # 1 warp/block, 16 regs: warps and registers would allow 64+, the 32-block cap wins (50%).
    ((32, 16, 0), (32, "blocks")),
    # 1024 threads x 64 regs = exactly the 64K per-block register limit: 1 block (50%).
    ((1024, 64, 0), (1, "registers")),
    # 65 regs -> 2304/warp x 32 warps = 73728 > 65536: cannot launch.
    ((1024, 65, 0), (0, "registers")),
    # 96 threads = 3 warps: registers allow (16384 // 1280) * 4 = 48 warps -> 16 blocks; warps allow 21.
    ((96, 40, 0), (16, "registers")),
    # the largest shared allocation, 227 KB (+1 KB reserved = all 228 KB): 1 block; one byte more: none.
    ((128, 32, 227 * 1024), (1, "shared memory")),
    ((128, 32, 227 * 1024 + 1), (0, "shared memory")),
]


@pytest.mark.parametrize("args, expected", OCCUPANCY_CASES)
def test_theoretical_occupancy_matches_hand_worked_cases(args, expected):
    threads, regs, smem = args
    occ = ki.theoretical_occupancy(threads, regs, smem)
    warps = -(-threads // 32)
    assert (occ.blocks_per_sm, occ.limiter) == expected
    assert occ.warps_per_sm == expected[0] * warps
    assert occ.occupancy == pytest.approx(expected[0] * warps / 64)


@pytest.mark.parametrize("args", [(0, 32, 0), (1025, 32, 0), (128, 256, 0), (128, 32, -1)])
def test_theoretical_occupancy_rejects_impossible_kernels(args):
    with raises_bug("must be"):
        ki.theoretical_occupancy(*args)


_SASS = """
\t\tFunction : k
        /*0000*/                   MOV R1, c[0x0][0x28] ;                  /* 0x00000a0000017a02 */
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;            /* 0x0000000404027981 */
        /*0020*/                   DEPBAR.LE SB0, 0x1 ;                    /* 0x000080400000791a */
        /*0030*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*0040*/               @P0 BRA 0x20 ;
        /*0050*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0060*/              @!P1 BRA 0x10 ;
        /*0070*/                   HMMA.16816.F32.BF16 R8, R12, R16, R8 ;
        /*0080*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0090*/                   BRA.U !UP0, 0x70 ;
        /*00a0*/                   EXIT ;
        /*00b0*/                   BRA 0xb0;
"""


def test_sass_loops_are_the_innermost_backward_branches():
    """Read by hand: loops 0x20-0x40 and 0x70-0x90 (the BRA.U form, predicate on the uniform datapath); 0x10-0x60
    holds the first, and the trap's branch to itself is no loop."""
    loops = ki.sass_loops(_SASS)
    assert [(lp.start, lp.end, lp.instructions, lp.tensor_core, lp.barriers) for lp in loops] == [
        (0x20, 0x40, 3, 1, 0), (0x70, 0x90, 3, 1, 1)]
    assert loops[0].waits == ("DEPBAR.LE SB0, 0x1",) and loops[1].waits == ()
    assert loops[0].opcodes == {"DEPBAR.LE": 1, "HGMMA.64x64x16.F32.BF16": 1, "BRA": 1}
    # a warpgroup's 64 x 64 x 16 product, a quarter of it a warp's; one warp's m16n8k16
    assert (loops[0].tensor_flops, loops[1].tensor_flops) == (2 * 64 * 64 * 16 // 4, 2 * 16 * 8 * 16)


def test_unknown_kernel_name_lists_the_choices():
    with pytest.raises(NanoforgeError, match="sgemm_regtile_2d"):
        ki.inspect_kernel("no_such_kernel", "unused")


def _need_cuda_tools():
    missing = [t for t in ("ptxas", "cuobjdump") if not ki._tool_candidates(t)]
    if missing:
        pytest.skip(f"needs {' and '.join(missing)} (CUDA toolkit or the triton wheel)")


def test_triton_kernel_missing_an_argument_type_is_rejected():
    triton = pytest.importorskip("triton")

    @triton.jit
    def copy_kernel(x, out, BLOCK: triton.language.constexpr):
        pass

    ki.register_triton_kernel("test_copy", copy_kernel, {"x": "*fp32"}, {"BLOCK": 128})
    try:
        with raises_bug("argument\\(s\\) out"):
            ki.inspect_kernel("test_copy", "unused")
    finally:
        del ki.TRITON_KERNELS["test_copy"]


def test_interpreters_and_simulators_are_refused_with_a_reason():
    """In-process tests run kernels under NUMBA_ENABLE_CUDASIM / TRITON_INTERPRET; inspect needs compilers."""
    from nanoforge.kernels.simt import ladder

    checked = 0
    if ladder.simulator_active():
        with pytest.raises(NanoforgeError, match="NUMBA_ENABLE_CUDASIM"):
            ki.inspect_kernel("vector_add", "unused")
        checked += 1
    if os.environ.get("TRITON_INTERPRET") == "1":
        with pytest.raises(NanoforgeError, match="TRITON_INTERPRET"):
            ki.inspect_kernel("rmsnorm_fwd", "unused")
        checked += 1
    if not checked:
        pytest.skip("real compilers in this process")


# --------------------------------------------------------------------------- compiling for real, no GPU needed

_TINY_TRITON_KERNEL = """
import json, sys
import triton
import triton.language as tl
from nanoforge.errors import NanoforgeError
from nanoforge.kernels import inspect as ki


@triton.jit
def scale_kernel(x, out, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out + offs, tl.load(x + offs, mask=mask) * alpha, mask=mask)


ki.register_triton_kernel(
    "test_scale", scale_kernel, {"x": "*fp32", "out": "*fp32", "n": "i32", "alpha": "fp32"}, {"BLOCK": 1024},
    num_warps=8,
)
results = {}
for name in ["vector_add", "sgemm_regtile_2d", *ki.TRITON_KERNELS][int(sys.argv[2])::int(sys.argv[3])]:
    try:
        results[name] = ki.inspect_kernel(name, sys.argv[1])
    except (NanoforgeError, RuntimeError, ValueError) as e:
        results[name] = {"error": str(e)}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Inspect SIMT and Triton kernels in child processes with the real compilers (no simulator/interpreter):
    two children side by side, each compiling every other kernel (the compilers run on one CPU core each).

    Returns (name -> report or {"error": ...}, output directory).
    """
    _need_cuda_tools()
    tmp = tmp_path_factory.mktemp("inspect")
    script = tmp / "inspect_all.py"  # a file, not -c: @triton.jit reads the kernel's source
    script.write_text(_TINY_TRITON_KERNEL)
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "TRITON_INTERPRET")}
    repo = str(Path(ki.__file__).parents[2])  # so the child imports this checkout of nanoforge
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    env["NANOFORGE_DECODE_SYNC"] = "barrier"  # (the barriers' test reads them; tagged launches have their own)
    children = 2
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp), str(i), str(children)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(children)]
    results = {}
    for proc in procs:
        out, err = proc.communicate()
        assert proc.returncode == 0, err[-3000:]
        results |= json.loads(out.strip().splitlines()[-1])
    return results, tmp


def _report(results: dict, name: str) -> dict:
    r = results[name]
    if "error" in r:
        if "nvvm" in r["error"].lower():
            pytest.skip(f"Numba cannot find NVVM here: {r['error']}")
        pytest.fail(r["error"])
    return r


def test_simt_kernels_compile_to_sass_and_register_tiles_stay_in_registers(compiled):
    """The 2-D register-tiled SGEMM keeps 8x8 accumulators + 8 + 8 operands in `cuda.local.array`s;
    they must live in registers (> 80 of them) with no local memory, and its shared memory is exactly
    its two tiles."""
    from nanoforge.kernels.simt import ladder

    results, out = compiled
    vec, sgemm = _report(results, "vector_add"), _report(results, "sgemm_regtile_2d")
    assert vec["source"] == "numba" and vec["arch"] == "sm_90"
    assert vec["shared_bytes_per_block"] == 0 and vec["threads_per_block"] == ladder.VECTOR_ADD_THREADS
    assert sgemm["shared_bytes_per_block"] == 4 * (ladder.BM2 * ladder.BK2 + ladder.BK2 * ladder.BN2)
    assert sgemm["local_bytes_per_thread"] == 0, "register tiles spilled to local memory"
    assert 80 < sgemm["registers_per_thread"] <= 255
    assert sgemm["threads_per_block"] == ladder.THREADS2
    expected = ki.theoretical_occupancy(ladder.THREADS2, sgemm["registers_per_thread"], sgemm["shared_bytes_per_block"])
    assert sgemm["occupancy"]["blocks_per_sm"] == expected.blocks_per_sm
    sass = (out / "sgemm_regtile_2d.sass").read_text()
    assert sass.count("FFMA") >= ladder.TM2 * ladder.TN2  # the unrolled outer product
    assert "STL" not in sass and "LDL" not in sass  # no local-memory traffic
    assert "ld.shared" in (out / "sgemm_regtile_2d.ptx").read_text()


def test_triton_kernel_compiles_to_sass_without_a_gpu(compiled):
    results, out = compiled
    r = _report(results, "test_scale")
    assert r["source"] == "triton" and r["threads_per_block"] == 256
    assert 0 < r["registers_per_thread"] <= 255 and r["local_bytes_per_thread"] == 0
    expected = ki.theoretical_occupancy(256, r["registers_per_thread"], r["shared_bytes_per_block"])
    assert r["occupancy"]["blocks_per_sm"] == expected.blocks_per_sm
    assert ".entry scale_kernel" in (out / "test_scale.ptx").read_text()
    sass = (out / "test_scale.sass").read_text()
    assert "LDG" in sass and "STG" in sass and "FMUL" in sass  # load, scale, store in the real ISA


def test_a_kernel_compiles_as_its_launch_specializes_it(compiled):
    """Pointers 16-byte aligned and the dimensions and strides a launch passes as multiples of 16, as Triton's
    JIT specializes them: the skinny matmul's fused gate-and-up then streams W through shared memory with
    cp.async and keeps everything in registers (compiled without those facts: 255 registers and spills)."""
    results, out = compiled
    r = _report(results, "gemv_decode")
    assert r["local_bytes_per_thread"] == 0 and r["registers_per_thread"] < 255
    ptx = (out / "gemv_decode.ptx").read_text()
    assert "cp.async" in ptx and "prefetch.global.L2::evict_last" in ptx and "griddepcontrol.wait" in ptx


@pytest.mark.parametrize("name", list(ki.TRITON_KERNELS))
def test_project_triton_kernels_compile_at_their_inspect_configuration(compiled, name):
    """Keeps TRITON_KERNELS in step with the kernels' argument lists."""
    results, out = compiled
    r = _report(results, name)
    assert 0 < r["registers_per_thread"] <= 255 and r["threads_per_block"] % 32 == 0
    assert (out / f"{name}.sass").stat().st_size > 0


@pytest.mark.parametrize("name", ["decode_layers_llama", "decode_layers_qwen3"])
def test_the_persistent_decode_kernel_fits_one_program_an_sm_and_its_barriers_release_and_acquire(compiled, name):
    """kernels/decode_layers.py as a GPU launch compiles it for sm_90: what its grid-wide barriers rely on. One
    program of 8 warps fits an SM without spilling (its grid is one program an SM, all resident at once), and
    each of its five barriers a layer counts arrivals with a release and leaves after an acquire; the next
    phase's first weight tile is asked for between the arrival and the poll."""
    results, out = compiled
    r = _report(results, name)
    assert r["threads_per_block"] == 256 and r["local_bytes_per_thread"] == 0
    occ = ki.theoretical_occupancy(r["threads_per_block"], r["registers_per_thread"], r["shared_bytes_per_block"])
    assert occ.blocks_per_sm >= 1
    ptx = (out / f"{name}.ptx").read_text()
    assert ptx.count("red.global.gpu.release.add") == 5 and ptx.count("ld.global.gpu.acquire") >= 5
    assert "prefetch.global.L2" in ptx
    # the next phase's first weight tile (evict-first loads) is asked for after the arrival, before the poll:
    # an arrival's release fence waits for the loads its warp has in flight (session 32); phase A's has none
    sass = [line for line in (out / f"{name}.sass").read_text().splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", line)]
    arrivals = [i for i, line in enumerate(sass) if "REDG.E.ADD.STRONG.GPU" in line]
    tiles = []
    for i in arrivals:
        poll = next(j for j in range(i + 1, len(sass)) if "LDG.E.STRONG.GPU" in sass[j])
        tiles.append(sum("LDG.E.EF" in line for line in sass[i + 1:poll]))
    assert len(arrivals) == 5 and tiles[0] == 0 and all(n > 0 for n in tiles[1:]), tiles


@pytest.mark.parametrize("name", ["decode_layers_qwen3", "paged_attention_decode_fused"])
def test_an_arrival_count_is_zeroed_for_the_next_use_without_a_fence_or_a_wait(compiled, name):
    """The last program to arrive at a count (a decode head's splits, the persistent
    kernel's barrier) zeroes it for the next launch or layer with a relaxed exchange: what orders it before the
    next use is the kernel's end or the grid barrier, and the sums it reads next were acquired by its arrival. An
    acq_rel exchange (Triton's default) compiled to MEMBAR.ALL.GPU, the atomic, then CCTL.IVALL and a CTA barrier:
    a round trip to L2 in front of the combine's loads (session 32: every EXCH in the SASS now stands alone)."""
    results, out = compiled
    _report(results, name)
    ptx = (out / f"{name}.ptx").read_text()
    assert re.search(r"atom\.global\.gpu\.relaxed\.exch", ptx) and "acq_rel.exch" not in ptx
    sass = [line for line in (out / f"{name}.sass").read_text().splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", line)]
    exch = [i for i, line in enumerate(sass) if "ATOMG.E.EXCH" in line]
    assert exch and not any("MEMBAR" in line or "CCTL.IVALL" in line for i in exch for line in sass[i - 3:i + 2])


@pytest.mark.parametrize("name", ["paged_attention_prefill", "paged_attention_prefill_wide"])
def test_prefill_attention_compiles_to_hopper_tensor_core_instructions_without_spills(compiled, name):
    """Paged attention's prefill tiles (the default at Qwen3-0.6B's heads; 128 rows over two warpgroups at
    Llama-3.2-1B's, `128x64w8s3`, the default at head dim 64) as a launch specializes them: both products on
    wgmma (SASS HGMMA), the K/V gather pipelined through shared memory with cp.async, nothing in local memory."""
    results, out = compiled
    r = _report(results, name)
    assert r["local_bytes_per_thread"] == 0 and r["registers_per_thread"] < 255
    ptx = (out / f"{name}.ptx").read_text()
    assert "wgmma.mma_async" in ptx and "cp.async" in ptx
    assert "HGMMA" in (out / f"{name}.sass").read_text()


@pytest.mark.parametrize("name,masked_wait", [("paged_attention_prefill", "0x2"),
                                               ("paged_attention_prefill_wide", "0x2"),
                                               ("paged_attention_decode", "0x0")])
def test_paged_attention_loops_keep_later_tiles_loads_in_flight(compiled, name, masked_wait):
    """The loop over whole key tiles is software-pipelined: an iteration waits until two groups of K/V copies
    are left in flight, not until none are. A block-table load inside it made every iteration wait for all of
    them (`DEPBAR.LE SB0, 0x0`: no load overlapped a product) until session 28. In prefill the masked loop after
    it (the diagonal) has its table entries loaded before it too (session 29); in decode that loop, one ragged
    tile, still loads its entries itself and waits for everything."""
    results, _ = compiled
    loops = [loop for loop in _report(results, name)["loops"] if loop["tensor_core"]]
    assert len(loops) == 2, loops
    assert loops[0]["waits"] == ["DEPBAR.LE SB0, 0x2"], loops
    assert loops[1]["waits"] == [f"DEPBAR.LE SB0, {masked_wait}"], loops
    # Q K^T and P V over a tile: 2 x BLOCK_M x BLOCK_N x HEAD_D FLOPs each, the tensor cores' share of a loop
    spec = ki.TRITON_KERNELS[name].constexprs
    warps = ki.TRITON_KERNELS[name].num_warps
    assert loops[0]["tensor_flops"] * warps == 2 * 2 * spec["BLOCK_M"] * spec["BLOCK_N"] * spec["HEAD_D"]


@pytest.mark.parametrize("name", ["matmul_swiglu", "matmul_swiglu_persistent"])
def test_the_swiglu_gemm_compiles_to_tma_loads_and_wgmma_without_spills(compiled, name):
    """kernels/matmul.py's GEMM with activation="swiglu" as a Hopper launch specializes it (TMA descriptors, a
    128 x 256 tile: 128 gate and 128 up columns), a program a tile and programs looping over tiles: both products
    on wgmma, the tiles through TMA, no local memory; the epilogue's exponentials flush subnormals
    (`swiglu.swiglu_round`: no rescaling around each MUFU.EX2), none left to `tl.exp`'s `ex2.approx.f32`."""
    results, out = compiled
    r = _report(results, name)
    assert r["local_bytes_per_thread"] == 0 and r["registers_per_thread"] < 255
    sass = (out / f"{name}.sass").read_text()
    assert "HGMMA" in sass and "UTMALDG" in sass
    ptx = (out / f"{name}.ptx").read_text()
    assert ptx.count("ex2.approx.ftz.f32") >= 64 and "ex2.approx.f32" not in ptx


_TAGGED_DECODE = """
import json, sys
from nanoforge.kernels import inspect as ki
ki.TRITON_KERNELS["decode_layers_qwen3"].constexprs["TRACE"] = sys.argv[2] == "traced"
print(json.dumps(ki.inspect_kernel("decode_layers_qwen3", sys.argv[1])))
"""


def test_the_tagged_decode_kernel_polls_words_instead_of_barriers(tmp_path):
    """NANOFORGE_DECODE_SYNC=tagged, compiled for sm_90 as a GPU launch takes it: one program of 8 warps an SM,
    no spill, no barrier arrival (no release-add), and a poll loop where each phase reads another's vector: Q/K/V
    (its item's words, two a thread), attention, o, SwiGLU's output, the MLP's (at each layer's start and once at
    the end), each reloading only its stale words, a thread's words in one loop. Traced, the same with the clock
    read at the start, at each poll's end and each phase's last store (phase B's poll twice: for a program with
    no item and for one with), at phase B's four marks and once at the end: 17 reads."""
    _need_cuda_tools()
    script = tmp_path / "tagged.py"
    script.write_text(_TAGGED_DECODE)
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "TRITON_INTERPRET")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(ki.__file__).parents[2]), env.get("PYTHONPATH")]))
    env["NANOFORGE_DECODE_SYNC"] = "tagged"
    for how in ("plain", "traced"):
        out = tmp_path / how
        out.mkdir()
        run = subprocess.run([sys.executable, str(script), str(out), how], env=env, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-3000:]
        r = json.loads(run.stdout.strip().splitlines()[-1])
        assert r["threads_per_block"] == 256 and r["local_bytes_per_thread"] == 0
        assert r["occupancy"]["blocks_per_sm"] == 1
        ptx = (out / "decode_layers_qwen3.ptx").read_text()
        assert "red.global.gpu.release.add" not in ptx and ptx.count("NF_TAGS_AGAIN:") == 6
        assert "@nfS0 ld.relaxed.gpu.global.u32" in ptx and "bra.uni NF_TAGS" not in ptx
        assert ptx.count("%globaltimer") == (17 if how == "traced" else 0)


def test_the_tagged_decode_kernels_ring_copies_its_first_tiles_before_the_poll_and_waits_after(tmp_path):
    """NANOFORGE_DECODE_RING_AHEAD (the default) with a 3-stage ring on every projection, compiled for sm_90: the
    pipelined loop's first two tiles of Q/K/V are copied into shared memory (cp.async, a commit group each) as
    each layer starts, before the loop over the tiles whose first pass polls phase A's input, with no wait and
    no tile loaded into registers there, and the kernel does not spill (it spilled 24 bytes a thread with the
    first tile in registers under the poll, session 46)."""
    _need_cuda_tools()
    script = tmp_path / "ring.py"
    script.write_text(_TAGGED_DECODE)
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "TRITON_INTERPRET")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(ki.__file__).parents[2]), env.get("PYTHONPATH")]))
    env.update(NANOFORGE_DECODE_SYNC="tagged", NANOFORGE_DECODE_RING="3", NANOFORGE_DECODE_RING_ON="all")
    env.pop("NANOFORGE_DECODE_RING_AHEAD", None)
    run = subprocess.run([sys.executable, str(script), str(tmp_path), "plain"], env=env, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    assert r["threads_per_block"] == 256 and r["local_bytes_per_thread"] == 0
    ptx = (tmp_path / "decode_layers_qwen3.ptx").read_text()
    # the layers' loop header (a block: from its label to the next), where phase A's ring starts, before the loop
    # over its tiles whose first pass polls (the blocks' order in the text is not the order they run in)
    head = ptx[ptx.index("=>This Loop Header: Depth=1"):]
    head = head[:head.index("\n$L__BB")]
    assert head.count("cp.async.commit_group") == 2 and "cp.async.wait_group" not in head
    assert "NF_TAGS_AGAIN" not in head and "ld.global.L1::evict_first" not in head


_PREFILL_MODEL = """
import json, sys
sys.path.insert(0, sys.argv[2])
import gpu_kernels_attention as bench
from pathlib import Path
print(json.dumps(bench.model_paged_prefill(Path(sys.argv[1]), tiles=[(64, 64, 4, 3), (128, 64, 8, 3)])))
"""


def test_the_prefill_sweep_compiled_reads_each_tiles_loop(tmp_path):
    """`gpu_kernels_attention.py --prefill-sweep --compiled` without a GPU, two tiles: each tile's loop does the
    tensor-core work its shape says (Q K^T and P V: 2 x 2 x BLOCK_M x BLOCK_N x head dim FLOPs a tile, at sm_90's
    4,096 an SM a cycle), its issue cycles are a warp's instructions times the block's warps over 4 schedulers,
    and the engine's default tile is marked once a shape."""
    _need_cuda_tools()
    script = tmp_path / "model.py"
    script.write_text(_PREFILL_MODEL)
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "TRITON_INTERPRET")}
    repo = Path(ki.__file__).parents[2]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, str(script), str(tmp_path), str(repo / "benchmarks")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    assert [(r["shape"], r["tile"]) for r in rows] == [(s, t) for s in ("llama3-1b", "qwen3-0.6b")
                                                       for t in ("64x64w4s3", "128x64w8s3")]
    for r in rows:
        block_m, block_n, warps, _ = pa._parse_tile(r["tile"])
        d = 64 if r["shape"] == "llama3-1b" else 128
        assert r["tensor_cycles"] == 2 * 2 * block_m * block_n * d // 4096
        assert r["issue_cycles"] == r["instructions"] * warps // 4
        assert r["issue_per_tensor"] == round(r["issue_cycles"] / r["tensor_cycles"], 2)
        assert r["wait"] == "DEPBAR.LE SB0, 0x2" and r["spill"] == 0
    assert [r["default"] for r in rows] == [False, True, True, False]  # the wide tile at D 64 (session 30)


@pytest.mark.parametrize("name", ["weight_stream_ring", "weight_stream_tma", "weight_stream_regs"])
def test_the_weight_stream_probe_moves_its_tiles_through_shared_memory_or_registers(compiled, name):
    """kernels/weight_stream.py's Gluon kernel compiled for sm_90 at Qwen3-0.6B's widths, one program an SM: the
    ring's tiles copied global -> shared by 16-byte cp.async or by 3-D TMA boxes waited for at mbarriers (none
    through registers) into 6 stages of 32 KB and read back 16 bytes at a time; the baseline's loaded into
    registers 16 bytes at a time, evict-first, as decode_layers.py's are. Every way five grid barriers a layer
    (the attention phase's stand-in between two), each a release arrival and an acquire."""
    results, out = compiled
    r = _report(results, name)
    sass, ptx = (out / f"{name}.sass").read_text(), (out / f"{name}.ptx").read_text()
    occ = ki.theoretical_occupancy(r["threads_per_block"], r["registers_per_thread"], r["shared_bytes_per_block"])
    assert r["threads_per_block"] == 256 and occ.blocks_per_sm >= 1
    assert ptx.count("red.global.gpu.release.add") == 5 and ptx.count("ld.global.gpu.acquire") == 5
    assert "%globaltimer" in ptx  # (the stand-in's clock)
    if name.endswith(("ring", "tma")):
        tma = name.endswith("tma")
        assert ("UTMALDG.3D" in sass and "SYNCS.PHASECHK" in sass) == tma and ("LDGSTS.E.BYPASS.128" in sass) != tma
        assert "LDG.E.EF" not in sass and "LDS.128" in sass
        assert r["shared_bytes_per_block"] >= 6 * 32768 and r["local_bytes_per_thread"] <= 8
    else:
        assert "LDGSTS" not in sass and "LDG.E.EF.128" in sass
