"""Look inside a compiled kernel: registers, shared memory, spills, occupancy, PTX and SASS.

`inspect_kernel(name, out_dir)` compiles one of the project's kernels and follows
it down the pipeline that every CUDA kernel takes:

    Python (Numba / Triton) -> PTX (virtual ISA, text) -> cubin (ptxas) -> SASS (the real ISA)

It writes NAME.ptx and NAME.sass, reads the resource usage that ptxas recorded
in the cubin (registers per thread; local memory per thread, where spills go),
takes the shared memory per block from what the kernel declares (the PTX for
Numba's static arrays, the launch metadata for Triton's dynamic buffer), and
turns those into theoretical occupancy with `theoretical_occupancy`, NVIDIA's
occupancy-calculator rules for sm_90 (H100/H200). `sass_loops` reads the SASS's
innermost loops: what a warp issues an iteration, how much of it on tensor
cores, and how long each iteration waits for its asynchronous copies.

No GPU is needed: Triton compiles for a `GPUTarget` and Numba's `compile_ptx`
emits PTX for a compute capability, and ptxas/cuobjdump are ordinary programs
(the triton wheel bundles them). On a GPU the target is the current device,
and Numba's cubin is the one its driver linker made for the launch.

Names: the SIMT ladder's kernels (`vector_add`, `sgemm_<rung>`) and the Triton
kernels in `TRITON_KERNELS`; `register_triton_kernel` adds one.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from nanoforge.errors import NanoforgeError

# --------------------------------------------------------------------------- occupancy


@dataclass(frozen=True)
class SMLimits:
    """Per-SM resource limits of one GPU architecture (NVIDIA's occupancy calculator inputs)."""

    name: str = "sm_90 (H100/H200)"
    warp_size: int = 32
    max_threads_per_block: int = 1024
    max_warps_per_sm: int = 64  # 2048 threads
    max_blocks_per_sm: int = 32
    registers_per_sm: int = 65536
    registers_per_block: int = 65536
    max_registers_per_thread: int = 255
    register_alloc_unit: int = 256  # a warp's registers come in chunks of 256 (8 per thread)
    sub_partitions: int = 4  # the register file is split between the SM's 4 schedulers
    shared_per_sm: int = 228 * 1024
    max_shared_per_block: int = 227 * 1024
    shared_alloc_unit: int = 128
    reserved_shared_per_block: int = 1024  # the CUDA runtime keeps 1 KB of every block's shared memory
    schedulers: int = 4  # warp schedulers an SM, each issuing one instruction a cycle
    tensor_flops_per_cycle: int = 4096  # dense bf16/fp16 an SM: H100 SXM's 989 TFLOP/s / 132 SMs / 1.83 GHz


SM90 = SMLimits()


@dataclass(frozen=True)
class Occupancy:
    blocks_per_sm: int
    warps_per_sm: int
    max_warps_per_sm: int
    occupancy: float  # warps_per_sm / max_warps_per_sm
    limiter: str  # which limit(s) set blocks_per_sm
    blocks_by: dict[str, int] = field(default_factory=dict)  # blocks per SM each limit alone allows


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


def theoretical_occupancy(
    threads_per_block: int,
    registers_per_thread: int,
    shared_bytes_per_block: int,
    limits: SMLimits = SM90,
) -> Occupancy:
    """Resident blocks and warps per SM for a kernel, by the CUDA occupancy calculator's rules.

    Each limit gives a number of blocks per SM; the smallest wins:
      warps      max warps per SM // warps per block;
      registers  a warp's registers are rounded up to the allocation unit, and each
                 of the 4 sub-partitions holds a whole number of warps, so
                 (regs per SM / 4 // regs per warp) * 4 // warps per block; a block
                 whose registers exceed the per-block limit cannot launch at all;
      shared     (declared + the runtime's reserved 1 KB), rounded up to 128 B,
                 into the SM's 228 KB; more than 227 KB declared cannot launch;
      blocks     at most 32 resident blocks per SM.
    """
    if not 0 < threads_per_block <= limits.max_threads_per_block:
        raise ValueError(
            f"threads_per_block must be in 1..{limits.max_threads_per_block}, got {threads_per_block}"
        )
    if not 0 <= registers_per_thread <= limits.max_registers_per_thread:
        raise ValueError(
            f"registers_per_thread must be in 0..{limits.max_registers_per_thread}, got {registers_per_thread}"
        )
    if shared_bytes_per_block < 0:
        raise ValueError(f"shared_bytes_per_block must be >= 0, got {shared_bytes_per_block}")

    warps = math.ceil(threads_per_block / limits.warp_size)
    by_warps = limits.max_warps_per_sm // warps

    regs_per_warp = _round_up(registers_per_thread * limits.warp_size, limits.register_alloc_unit)
    if regs_per_warp == 0:
        by_regs = limits.max_blocks_per_sm
    elif regs_per_warp * _round_up(warps, limits.sub_partitions) > limits.registers_per_block:
        by_regs = 0  # the hardware check assumes the block's warps fill all sub-partitions evenly
    else:
        warps_per_partition = (limits.registers_per_sm // limits.sub_partitions) // regs_per_warp
        by_regs = warps_per_partition * limits.sub_partitions // warps

    if shared_bytes_per_block > limits.max_shared_per_block:
        by_smem = 0
    else:
        smem = _round_up(shared_bytes_per_block + limits.reserved_shared_per_block, limits.shared_alloc_unit)
        by_smem = limits.shared_per_sm // smem

    blocks_by = {"warps": by_warps, "registers": by_regs, "shared memory": by_smem, "blocks": limits.max_blocks_per_sm}
    blocks = min(blocks_by.values())
    return Occupancy(
        blocks_per_sm=blocks,
        warps_per_sm=blocks * warps,
        max_warps_per_sm=limits.max_warps_per_sm,
        occupancy=blocks * warps / limits.max_warps_per_sm,
        limiter=", ".join(k for k, v in blocks_by.items() if v == blocks),
        blocks_by=blocks_by,
    )


# --------------------------------------------------------------------------- CUDA tools


def _tool_candidates(tool: str) -> list[str]:
    """Where `tool` (ptxas, cuobjdump) may live: PATH, the CUDA toolkit, the triton wheel."""
    dirs = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    paths = [shutil.which(tool)] + [os.path.join(d, "bin", tool) for d in dirs if d]
    try:
        import triton

        paths.append(str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool))
    except ImportError:
        pass
    found = []
    for p in paths:
        if p and os.path.isfile(p) and os.access(p, os.X_OK) and p not in found:
            found.append(p)
    return found


def _run_tool(tool: str, args: list[str], what: str) -> str:
    """Run the first copy of `tool` that succeeds (a newer PTX needs a newer ptxas); return stdout."""
    errors = []
    for exe in _tool_candidates(tool):
        proc = subprocess.run([exe, *args], capture_output=True, text=True)
        if proc.returncode == 0:
            return proc.stdout
        errors.append(f"{exe}: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
    if not errors:
        raise NanoforgeError(f"{what} needs {tool} (from the CUDA toolkit or the triton wheel); none found")
    raise RuntimeError(f"{what} failed: " + "; ".join(errors))


def _ptx_to_cubin(ptx: str, cc: tuple[int, int]) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp, "kernel.ptx"), Path(tmp, "kernel.cubin")
        src.write_text(ptx)
        _run_tool("ptxas", [f"-arch=sm_{cc[0]}{cc[1]}", str(src), "-o", str(dst)], "assembling PTX with ptxas")
        return dst.read_bytes()


def _cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "kernel.cubin")
        path.write_bytes(cubin)
        return _run_tool("cuobjdump", [flag, str(path)], f"cuobjdump {flag}")


_RES_USAGE = re.compile(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)")


def _resource_usage(cubin: bytes, kernel_name: str) -> dict[str, int]:
    """Registers and local-memory bytes per thread that ptxas recorded in the cubin.

    Local memory is the STACK frame (where ptxas puts spilled registers and
    local arrays it could not keep in registers) plus any other LOCAL data:
    what the driver reports as CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES.
    """
    functions = {m[1]: m for m in _RES_USAGE.finditer(_cuobjdump(cubin, "-res-usage"))}
    matches = [m for name, m in functions.items() if kernel_name in name] or list(functions.values())
    if len(matches) != 1:
        raise RuntimeError(f"cannot find kernel {kernel_name!r} in the cubin (functions: {', '.join(functions)})")
    m = matches[0]
    return {"registers_per_thread": int(m[2]), "local_bytes_per_thread": int(m[3]) + int(m[4])}


_PTX_SHARED = re.compile(r"^\s*(?:\.visible\s+)?\.shared\s+(?:\.align\s+\d+\s+)?\.[a-z](\d+)\s+\w+\[(\d+)\]", re.M)


def _ptx_static_shared_bytes(ptx: str) -> int:
    """Bytes of statically sized `.shared` arrays the PTX declares (Numba's cuda.shared.array)."""
    return sum(int(bits) // 8 * int(count) for bits, count in _PTX_SHARED.findall(ptx))


def _target_cc() -> tuple[int, int]:
    """The current GPU's compute capability, or sm_90 (H100/H200) on a machine without one."""
    import torch

    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)


# --------------------------------------------------------------------------- kernels


@dataclass(frozen=True)
class TritonKernel:
    """How to compile a @triton.jit kernel without launching it."""

    fn: Any  # the @triton.jit function, or "package.module:attribute" imported on first use
    signature: dict[str, str]  # runtime argument -> Triton type, e.g. {"x_ptr": "*fp32", "n": "i32"}
    constexprs: dict[str, Any] = field(default_factory=dict)  # tl.constexpr argument -> value (or a function
    # returning it: an environment switch, read when the kernel is compiled)
    num_warps: int = 4
    num_stages: int = 3
    # integer arguments a launch passes as multiples of 16 (model dimensions, strides): Triton's JIT specializes
    # on that (and on 16-byte aligned pointers, which every pointer here is taken to be, as PyTorch's allocator
    # gives them), and vectorized loads and cp.async pipelines follow from it: without, the compile is another,
    # slower kernel (the skinny matmul: 255 registers and spills, against 148 and none as launched)
    aligned: tuple[str, ...] = ()


def _i32(*names: str) -> dict[str, str]:
    return dict.fromkeys(names, "i32")


_PAGED_SIGNATURE = {  # paged attention's kernel: decode and prefill differ in constexprs only
    "Q": "*bf16", "K": "*bf16", "V": "*bf16", "BLOCK_TABLES": "*i32", "SEQ_LENS": "*i32", "CU_Q": "*i32",
    "TILE_STARTS": "*i32", "O": "*bf16", "O_PART": "*fp32", "LSE_PART": "*fp32", "C": "*i32",
    **{p: "*bf16" for p in ("KN", "VN", "COS", "SIN", "QW", "KW")}, "SLOTS": "*i32",
    **_i32("stride_qt", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs"),
    **_i32("stride_vh", "stride_bt", "stride_ot", "stride_oh"), "qk_scale": "fp32", "num_seqs": "i32",
    "num_splits": "i32", **_i32("stride_knt", "stride_knh", "stride_vnt", "stride_vnh", "stride_ct"), "eps": "fp32"}
# every stride a launch passes is a multiple of 16 (head dims of 64 and 128), but the block tables' row stride,
# which the kernel does not specialize on (it changes from step to step)
_PAGED_ALIGNED = tuple(a for a in _PAGED_SIGNATURE if a.startswith("stride_") and a != "stride_bt")


def _paged(*, num_warps: int = 4, **constexprs) -> TritonKernel:
    """Paged attention's kernel with these constants (BLOCK_D = HEAD_D, 16-token cache blocks, 64-key tiles and
    the optional parts off unless given)."""
    return TritonKernel(
        "nanoforge.kernels.paged_attention:_paged_attn_kernel", _PAGED_SIGNATURE,
        {"BLOCK_D": constexprs["HEAD_D"], "BLOCK_SIZE": 16, "BLOCK_N": 64, "FUSE": False, "SPLITS_P2": 32,
         "PDL": False, "ROPE": False, "HAS_NORM": False, **constexprs},
        num_warps=num_warps, aligned=_PAGED_ALIGNED,
    )  # fmt: skip


_DECODE_LAYERS_SIGNATURE = {
    **{p: "*bf16" for p in ("X_IN", "XS", "PEND", "QKV", "ATT", "O", "ACT")}, "O_PART": "*fp32", "LSE_PART": "*fp32",
    "COUNTS": "*i32", "TIMEOUTS": "*i32", "TAGGED_T": "*i32", "SCRATCH": "*bf16", "WS": "*i32",
    **{p: "*bf16" for p in ("G1", "WQKV", "BQKV", "QW", "KW", "WO", "G2", "WIN", "WOUT", "KC", "VC")},
    "TABLE": "*i32", "SEQ_LEN": "*i32", "SLOT": "*i64", "CS": "*bf16",
    **{f"stride_{c}{d}": "i64" if d == "l" else "i32" for c in "kv" for d in "lbsh"}, "eps": "fp32",
    "qk_scale": "fp32", "TRACE_T": "*i64", **_i32("spin_limit", "poll_sleep", "first_layer", "n_layers")}


def _decode_layers(**shape) -> TritonKernel:
    """The persistent decode kernel (kernels/decode_layers.py) for one model's shape, as a GPU launch takes it:
    one launch, barriers between the phases (or tagged vectors, as NANOFORGE_DECODE_SYNC says), the L2 prefetch
    on (the weights through a ring as NANOFORGE_DECODE_RING and _RING_ON say), no trace; phase B's context
    prefetch as NANOFORGE_DECODE_PREFETCH_KV says, the ring's first tiles copied before each poll as
    NANOFORGE_DECODE_RING_AHEAD says (each read when compiled)."""
    from nanoforge.kernels import decode_layers as dl

    constexprs = dict(
        **dl.shape_constants(shape["D"], shape["NQKV"], shape["HQ"], shape["HKV"], shape["DH"], shape["F"],
                             dl.CONTEXT_SPLITS),
        BLOCK_N=dl.ATTN_BLOCK_N, BLOCK_SIZE=16, HAS_BIAS=shape["HAS_BIAS"], QK_NORM=shape["QK_NORM"], PHASE=-1,
        PERSISTENT=True, PREFETCH=True, PREFETCH_TILES=2, AHEAD=True, TRACE=False,
        ONE_POLLER=True, PREFETCH_KV=dl.prefetch_kv_tiles,
        TAGGED=lambda: dl.sync_mode() == "tagged", BARRIERS=lambda: dl.sync_mode() != "tagged",
        RING_AHEAD=lambda: dl.sync_mode() == "tagged" and dl.ring_ahead(),
        **{key: (lambda key=key: dl.ring_constants()[key]) for key in dl.ring_constants()})
    aligned = tuple(a for a in _DECODE_LAYERS_SIGNATURE if a.startswith("stride_"))
    return TritonKernel(dl._decode_layers_kernel, _DECODE_LAYERS_SIGNATURE, constexprs, num_warps=8, aligned=aligned)


def _weight_stream(stages: int, tma: bool = False) -> TritonKernel:
    """kernels/weight_stream.py's Gluon probe at Qwen3-0.6B's widths (Q/K/V, attention-out, gate-and-up,
    MLP-down), its tiles through a ring of `stages` shared-memory stages filled by cp.async or (`tma`) TMA
    (0 stages: through registers)."""
    from nanoforge.kernels import weight_stream as ws

    widths = ws.layer_widths(d=1024, q=2048, kv=1024, f=3072)
    layout = repr(ws.BOX_LAYOUT.value)
    signature = {**{a: "*bf16" for a in ("V0", "V1", "V2", "V3", "W0", "W1", "W2", "W3")},
                 **{f"D{p}": f"tensordesc<bf16{ws.box_shape(k)},{layout}>" for p, (_, k) in enumerate(widths)},
                 "BAR": "*i32", "TIMEOUTS": "*i32", "T": "*i64", **_i32("n_layers", "spin_limit", "gap_ns", "epoch")}
    return TritonKernel(ws.weight_stream_kernel, signature, ws.shape_constants(widths, stages, tma), num_warps=8)


# The project's Triton kernels, each compiled at one representative configuration (bf16, H100-sized tiles).

_GEMV_SIGNATURE = {**{p: "*bf16" for p in ("X", "R", "G", "S", "W", "B", "Y")},
                   **_i32("M", "N", "K", "stride_xm", "stride_rm", "stride_sm", "stride_wn", "stride_ym"), "eps": "fp32",
                   "PREFETCH_K": "i32"}
_GEMV_ALIGNED = ("N", "K", "stride_xm", "stride_rm", "stride_sm", "stride_wn", "stride_ym", "PREFETCH_K")

TRITON_KERNELS: dict[str, TritonKernel] = {
    "matmul": TritonKernel(
        "nanoforge.kernels.matmul:_matmul_tiled_kernel",
        {"a": "*bf16", "b": "*bf16", "c": "*bf16", "bias": "*bf16",
         **_i32("M", "N", "K", "M_BUCKET"),
         **_i32("stride_am", "stride_ak", "stride_bk", "stride_bn", "stride_cm", "stride_cn")},
        {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "HAS_BIAS": False, "ACTIVATION": "none",
         "USE_TMA": False, "B_NK": False},
        num_warps=8,
    ),
    "matmul_swiglu": TritonKernel(  # gate-and-up with SwiGLU in the epilogue, as a Hopper launch runs it: TMA
        "nanoforge.kernels.matmul:_matmul_tiled_kernel",  # descriptors, b the (2F, K) weight seen as (2, F, K),
        {"a": "tensordesc<bf16[128, 64]>", "b": "tensordesc<bf16[2, 128, 64]>",  # c's block half a tile
         "c": "tensordesc<bf16[128, 128]>",
         "bias": "*bf16", **_i32("M", "N", "K", "M_BUCKET"),
         **_i32("stride_am", "stride_ak", "stride_bk", "stride_bn", "stride_cm", "stride_cn")},
        {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "HAS_BIAS": False, "ACTIVATION": "swiglu",
         "USE_TMA": True, "B_NK": True},
        num_warps=8,
    ),
    "matmul_swiglu_persistent": TritonKernel(  # the same tile, one program an SM looping over tiles (the next
        "nanoforge.kernels.matmul:_matmul_persistent_kernel",  # tile's loads in flight during the epilogue)
        {"a": "tensordesc<bf16[128, 64]>", "b": "tensordesc<bf16[2, 128, 64]>", "c": "tensordesc<bf16[128, 128]>",
         "bias": "*bf16", "partials": "*fp32", "flags": "*i32", **_i32("M", "N", "K", "M_BUCKET", "NUM_SMS"),
         **_i32("stride_am", "stride_ak", "stride_bk", "stride_bn", "stride_cm", "stride_cn")},
        {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "SK_ITERS": 16, "MODE": "persistent",
         "FIXUP": "owner", "WS_TILE": 0, "HAS_BIAS": False, "ACTIVATION": "swiglu", "USE_TMA": True, "B_NK": True},
        num_warps=8,
    ),
    "weight_stream_ring": _weight_stream(6),  # Qwen3-0.6B's four weight phases a layer, a ring of 6 stages
    "weight_stream_tma": _weight_stream(6, tma=True),  # the same ring filled by TMA
    "weight_stream_regs": _weight_stream(0),  # the same, its tiles through registers as decode_layers' are
    "flash_attention_fwd": TritonKernel(
        "nanoforge.kernels.flash_attention:_attn_fwd",
        {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "LSE": "*fp32", "STARTS": "*i32", "ENDS": "*i32",
         **_i32(*(f"stride_{t}{d}" for t in "qkvo" for d in "bth"), "T", "H"), "qk_scale": "fp32",
         **_i32("Q_OFF", "TQ")},
        {"GROUP": 1, "HEAD_D": 128, "BLOCK_D": 128, "CAUSAL": True, "HAS_DOCS": True, "BLOCK_M": 128, "BLOCK_N": 64},
        num_warps=8,
    ),
    "flash_attention_bwd_dkdv": TritonKernel(
        "nanoforge.kernels.flash_attention:_attn_bwd_dkdv",
        {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "DO": "*bf16", "LSE": "*fp32", "DELTA": "*fp32", "DK": "*bf16",
         "DV": "*bf16", "STARTS": "*i32", "ENDS": "*i32",
         **_i32(*(f"stride_{t}{d}" for t in ("q", "k", "v", "do", "dk", "dv") for d in "bth"), "T", "HKV"),
         "scale": "fp32", "qk_scale": "fp32", **_i32("Q_OFF", "TQ")},
        {"GROUP": 1, "HEAD_D": 64, "BLOCK_D": 64, "CAUSAL": True, "HAS_DOCS": True, "BLOCK_M": 32, "BLOCK_N": 128},
        num_warps=4,
    ),
    "flash_attention_bwd_dq": TritonKernel(
        "nanoforge.kernels.flash_attention:_attn_bwd_dq",
        {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "DO": "*bf16", "LSE": "*fp32", "DELTA": "*fp32", "DQ": "*bf16",
         "STARTS": "*i32", "ENDS": "*i32",
         **_i32(*(f"stride_{t}{d}" for t in ("q", "k", "v", "do", "dq") for d in "bth"), "T", "H"),
         "scale": "fp32", "qk_scale": "fp32", **_i32("Q_OFF", "TQ")},
        {"GROUP": 1, "HEAD_D": 64, "BLOCK_D": 64, "CAUSAL": True, "HAS_DOCS": True, "BLOCK_M": 128, "BLOCK_N": 32},
        num_warps=4,
    ),
    "doc_bounds": TritonKernel(
        "nanoforge.kernels.flash_attention:_doc_bounds_kernel",
        {"IDS": "*i64", "STARTS": "*i32", "ENDS": "*i32", "T": "i32"}, {"BLOCK": 1024}, num_warps=4,
    ),
    "paged_attention_decode": _paged(GROUP=4, HEAD_D=128, BLOCK_M=16, BLOCK_Q=1, SPLIT=True, VARLEN=False),
    "paged_attention_decode_fused": _paged(  # NANOFORGE_ATTN_COMBINE=fused, NANOFORGE_ATTN_ROPE=fused:
        GROUP=2, HEAD_D=128, BLOCK_M=16, BLOCK_Q=1, SPLIT=True, VARLEN=False, FUSE=True, PDL=True, ROPE=True,
        HAS_NORM=True),  # Qwen3-0.6B's heads, its q/k norms
    "paged_attention_combine": TritonKernel(  # the split partials' combine where it is a launch of its own
        "nanoforge.kernels.paged_attention:_combine_splits",
        {"O_PART": "*fp32", "LSE_PART": "*fp32", "O": "*bf16", **_i32("stride_ot", "stride_oh", "H", "num_splits")},
        {"HEAD_D": 128, "BLOCK_D": 128, "SPLITS_P2": 32, "PDL": True}, num_warps=4,
    ),
    "paged_attention_prefill": _paged(GROUP=2, HEAD_D=128, BLOCK_M=64, BLOCK_Q=32, SPLIT=False, VARLEN=True,
                                      num_warps=4),  # the default tile at Qwen3-0.6B's heads
    "paged_attention_prefill_wide": _paged(  # the default tile at head dim 64, 128x64w8s3: Llama-3.2-1B's heads
        GROUP=4, HEAD_D=64, BLOCK_M=128, BLOCK_Q=32, SPLIT=False, VARLEN=True, num_warps=8),
    "rope_qkv_write_kv": TritonKernel(  # Qwen3's q/k norms, RoPE and the paged KV write of one token per program
        "nanoforge.kernels.rope:_qkv_rope_write_kv_kernel",
        {**{p: "*bf16" for p in ("Q", "K", "V", "COS", "SIN", "QW", "KW", "QO", "KC", "VC")}, "SLOTS": "*i64",
         **_i32("HQ", "HKV", "sqt", "sqh", "skt", "skh", "svt", "svh", "sct"), "eps": "fp32"},
        {"HALF": 64, "BLOCK_HQ": 16, "BLOCK_HKV": 8, "BLOCK_D": 64, "HAS_Q": True, "HAS_NORM": True, "PDL": False},
    ),
    "gemv_decode": TritonKernel(  # Llama's gate-and-up at one row: the norm prologue, SwiGLU, PDL and W's prefetch
        "nanoforge.kernels.gemv:_gemv_kernel", _GEMV_SIGNATURE,
        {"NORM": True, "HAS_RES": True, "SWIGLU": True, "HAS_BIAS": False, "PDL": 1, "LINE": 64, "BLOCK_M": 16,
         "BLOCK_N": 32, "BLOCK_K": 256, "STATS_ROWS": 2, "STATS_K": 2048},
        num_warps=4, num_stages=4, aligned=_GEMV_ALIGNED,
    ),
    "decode_layers_llama": _decode_layers(  # every layer of Llama-3.2-1B's batch-1 decode step in one launch
        D=2048, NQKV=3072, HQ=32, HKV=8, DH=64, F=8192, HAS_BIAS=False, QK_NORM=False),
    "decode_layers_qwen3": _decode_layers(D=1024, NQKV=4096, HQ=16, HKV=8, DH=128, F=3072, HAS_BIAS=False,
                                          QK_NORM=True),  # Qwen3-0.6B's
    "gather_step": TritonKernel(  # a serving step's input gathers (kernels/gather.py) at Qwen3-0.6B's widths
        "nanoforge.kernels.gather:_gather_step_kernel",
        {**{p: "*i64" for p in ("SRC", "SAMPLED", "IDS", "POSITIONS")}, "EMBED": "*bf16", "stride_e": "i64",
         "POS_EMBED": "*bf16", "stride_p": "i64", "ROPE": "*bf16", "ROW_SLOT": "*i64", "TABLE": "*i32",
         "stride_t": "i64", "TOKENS": "*i64", "X": "*bf16", "CS": "*bf16", "TABLES": "*i32",
         **_i32("n", "D", "R", "width")},
        {"BLOCK_D": 1024, "BLOCK_R": 256, "BLOCK_W": 1024, "HAS_POS": False, "HAS_ROPE": True, "PDL": 1},
        aligned=("stride_e", "D", "R"),
    ),
    "rmsnorm_fwd": TritonKernel(
        "nanoforge.kernels.rmsnorm:_rms_norm_fwd_kernel",
        {"x": "*bf16", "res": "*bf16", "w": "*bf16", "y": "*bf16", "h": "*bf16", "rstd": "*fp32",
         **_i32("N", "stride_x", "stride_r", "stride_y", "stride_h"), "eps": "fp32"},
        {"BLOCK_N": 4096, "HAS_RESIDUAL": True, "PDL": False},
        num_warps=8,
    ),
}


def register_triton_kernel(
    name: str,
    fn: Any,
    signature: dict[str, str],
    constexprs: dict[str, Any] | None = None,
    *,
    num_warps: int = 4,
    num_stages: int = 3,
    aligned: tuple[str, ...] = (),
) -> None:
    """Make `inspect_kernel(name)` compile `fn` with these argument types and constants (`aligned`: the integer
    arguments a launch passes as multiples of 16)."""
    TRITON_KERNELS[name] = TritonKernel(fn, signature, constexprs or {}, num_warps, num_stages, aligned)


def simt_kernels() -> dict[str, tuple[Any, str, int]]:
    """SIMT ladder kernels: name -> (Python kernel, Numba signature, threads per block)."""
    from nanoforge.kernels.simt import ladder

    kernels = {"vector_add": (ladder.vector_add_kernel, ladder.VECTOR_ADD_SIGNATURE, ladder.VECTOR_ADD_THREADS)}
    for rung in ladder.RUNGS.values():
        kernels[rung.kernel.__name__] = (rung.kernel, ladder.SGEMM_SIGNATURE, rung.threads_per_block)
    return kernels


def kernel_names() -> list[str]:
    return [*simt_kernels(), *TRITON_KERNELS]


# --------------------------------------------------------------------------- compiling


@dataclass
class Compiled:
    """What inspection needs from a compiled kernel, whoever compiled it."""

    name: str
    source: str  # "numba" or "triton"
    arch: str
    ptx: str
    cubin: bytes
    entry: str  # (part of) the kernel's symbol name in the cubin
    threads_per_block: int
    shared_bytes_per_block: int


def _compile_numba(name: str, fn, signature: str, threads: int) -> Compiled:
    from nanoforge.kernels.simt.ladder import numba_cuda, simulator_active

    cuda = numba_cuda()
    if simulator_active():
        raise NanoforgeError(
            f"inspecting {name} needs Numba's real CUDA compiler, but NUMBA_ENABLE_CUDASIM=1 selected the simulator"
        )
    cc = _target_cc()
    try:
        if cuda.is_available():  # the PTX and cubin that a launch on this GPU uses
            (kernel,) = cuda.jit(signature)(fn).overloads.values()
            ptx, cubin = kernel.inspect_asm(cc), kernel.library.get_cubin(cc)
        else:
            ptx, _ = cuda.compile_ptx(fn, signature, cc=cc)
            cubin = _ptx_to_cubin(ptx, cc)
    except NanoforgeError:
        raise
    except Exception as e:  # NVVM missing, driver errors: say which step failed, in one line
        raise RuntimeError(f"compiling {name} with Numba failed: {type(e).__name__}: {e}".splitlines()[0]) from e
    arch = f"sm_{cc[0]}{cc[1]}"
    return Compiled(name, "numba", arch, ptx, cubin, fn.__name__, threads, _ptx_static_shared_bytes(ptx))


def _compile_triton(name: str, spec: TritonKernel) -> Compiled:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget

    fn = spec.fn
    if isinstance(fn, str):
        module, _, attr = fn.partition(":")
        fn = getattr(importlib.import_module(module), attr)
    while isinstance(fn, (triton.runtime.Autotuner, triton.runtime.Heuristics)):  # @autotune / @heuristics
        fn = fn.fn
    missing = [a for a in fn.arg_names if a not in spec.signature and a not in spec.constexprs]
    if missing:
        raise ValueError(f"Triton kernel {name}: no type or constexpr value for argument(s) {', '.join(missing)}")
    if not isinstance(fn, triton.runtime.JITFunction):
        raise NanoforgeError(
            f"inspecting {name} needs Triton's compiler, but TRITON_INTERPRET=1 selected the CPU interpreter"
        )
    signature = {a: "constexpr" if a in spec.constexprs else spec.signature[a] for a in fn.arg_names}
    divisible = [i for i, a in enumerate(fn.arg_names) if signature[a].startswith("*") or a in spec.aligned]
    cc = _target_cc()
    constexprs = {a: v() if callable(v) else v for a, v in spec.constexprs.items()}  # (a switch: read now)
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

    # a @gluon.jit kernel (explicit layouts: kernels/weight_stream.py) compiles from its own source type
    source = GluonASTSource if isinstance(fn, GluonJITFunction) else triton.compiler.ASTSource
    compiled = triton.compile(
        source(fn, signature, constexprs, attrs={(i,): [["tt.divisibility", 16]] for i in divisible}),
        target=GPUTarget("cuda", cc[0] * 10 + cc[1], 32),
        options={"num_warps": spec.num_warps, "num_stages": spec.num_stages},
    )
    return compiled_triton(name, compiled)


def compiled_triton(name: str, compiled) -> Compiled:
    """Wrap a Triton CompiledKernel: from `triton.compile`, or the object a launch returns on a GPU."""
    md = compiled.metadata
    return Compiled(
        name,
        "triton",
        f"sm_{md.target.arch}",
        compiled.asm["ptx"],
        compiled.asm["cubin"],
        md.name,
        md.num_warps * 32,  # NVIDIA warps are 32 threads
        md.shared,  # Triton's one dynamic shared-memory buffer, sized at compile time
    )


# --------------------------------------------------------------------------- loops in SASS

_SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_PREDICATE = re.compile(r"^@!?U?P[0-9T]\s+")
_BRANCH = re.compile(r"^BRA(?:\.\S+)?\s+(?:!?U?P[0-9T],\s*)?0x([0-9a-f]+)$")  # BRA 0x.., BRA.U !UP0, 0x..


@dataclass(frozen=True)
class SassLoop:
    """An innermost loop of a kernel's SASS: the instructions from a backward branch's target to the branch, as
    one warp issues them an iteration. `waits`: its DEPBAR instructions (`DEPBAR.LE SB0, 0x2`: the iteration goes
    on once at most two groups of asynchronous copies are still in flight, loads for later iterations that overlap
    this one's work. A Triton loop of num_stages=3 keeps two tiles' loads in flight, so there `0x0`, a wait for
    every copy, means nothing overlaps; at num_stages=2 the loop waits for its one tile in flight, `0x0`, and
    issues the next tile's loads before its products)."""

    start: int  # byte address of the loop's first instruction
    end: int  # of its backward branch
    instructions: int
    tensor_core: int  # HGMMA (wgmma) and HMMA (mma.sync) instructions
    barriers: int  # BAR.SYNC: the whole block waits
    waits: tuple[str, ...]
    opcodes: dict[str, int] = field(default_factory=dict)
    tensor_flops: int = 0  # a warp's share of its 16-bit products' FLOPs an iteration (a wgmma: a quarter)


def _tensor_flops(op: str) -> int:
    """FLOPs of one 16-bit (bf16/fp16 operands) tensor-core instruction as one warp issues it: HGMMA.64x64x16 is
    a warpgroup's (four warps') 64 x 64 x 16 product, HMMA.16816 one warp's m16n8k16; 0 for other types."""
    if not re.search(r"\.(BF16|F16)\b", op):
        return 0
    if m := re.match(r"HGMMA\.(\d+)x(\d+)x(\d+)", op):
        return 2 * int(m[1]) * int(m[2]) * int(m[3]) // 4
    if m := re.match(r"HMMA\.(\d\d)(\d)(\d+)", op):
        return 2 * int(m[1]) * int(m[2]) * int(m[3])
    return 0


def sass_loops(sass: str) -> list[SassLoop]:
    """The innermost loops of each function in `sass` (cuobjdump -sass text), in address order: a loop is the
    span from a backward branch's target to the branch (a branch to itself, the trap after EXIT, is none);
    innermost: no other loop inside it."""
    loops = []
    for function in re.split(r"\n\s*Function : ", sass):
        code = [(int(m[1], 16), _PREDICATE.sub("", m[2])) for m in map(_SASS_LINE.match, function.splitlines()) if m]
        spans = sorted({(int(target, 16), addr) for addr, text in code
                        for target in _BRANCH.findall(text) if int(target, 16) < addr})
        for lo, hi in spans:
            if any((a, b) != (lo, hi) and lo <= a and b <= hi for a, b in spans):
                continue  # holds an inner loop
            body = [text for addr, text in code if lo <= addr <= hi]
            ops = dict(Counter(text.split()[0] for text in body))
            loops.append(SassLoop(
                lo, hi, len(body), sum(n for op, n in ops.items() if op.startswith(("HGMMA", "HMMA"))),
                sum(n for op, n in ops.items() if op.startswith("BAR.SYNC")),
                tuple(text for text in body if text.startswith("DEPBAR")), ops,
                sum(n * _tensor_flops(op) for op, n in ops.items()),
            ))  # fmt: skip
    return loops


# --------------------------------------------------------------------------- reporting


def report(compiled: Compiled, out_dir: str | os.PathLike, *, quiet: bool = False) -> dict:
    """Resource usage + occupancy of a compiled kernel; writes NAME.ptx and NAME.sass; prints a table (unless
    quiet)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    usage = _resource_usage(compiled.cubin, compiled.entry)
    occupancy = theoretical_occupancy(
        compiled.threads_per_block, usage["registers_per_thread"], compiled.shared_bytes_per_block
    )
    ptx_path, sass_path = out / f"{compiled.name}.ptx", out / f"{compiled.name}.sass"
    ptx_path.write_text(compiled.ptx)
    sass = _cuobjdump(compiled.cubin, "-sass")
    sass_path.write_text(sass)
    result = {
        "name": compiled.name,
        "source": compiled.source,
        "arch": compiled.arch,
        "threads_per_block": compiled.threads_per_block,
        **usage,
        "shared_bytes_per_block": compiled.shared_bytes_per_block,
        "occupancy": asdict(occupancy),
        "ptx": str(ptx_path),
        "sass": str(sass_path),
        "loops": [asdict(loop) for loop in sass_loops(sass)],
    }
    if not quiet:
        _print_report(result)
    return result


def _print_report(r: dict) -> None:
    occ = r["occupancy"]
    rows = [
        ("kernel", f"{r['name']} ({r['source']}, {r['arch']})"),
        ("threads / block", r["threads_per_block"]),
        ("registers / thread", r["registers_per_thread"]),
        ("shared memory / block", f"{r['shared_bytes_per_block']} B (+{SM90.reserved_shared_per_block} B runtime)"),
        ("local memory / thread", f"{r['local_bytes_per_thread']} B (spills, stack; 0 = all in registers)"),
        (
            "theoretical occupancy",
            f"{occ['blocks_per_sm']} blocks/SM = {occ['warps_per_sm']}/{occ['max_warps_per_sm']} warps "
            f"= {occ['occupancy']:.0%} (limited by {occ['limiter']})",
        ),
        ("PTX", r["ptx"]),
        ("SASS", r["sass"]),
        *((f"loop {loop['start']:#x}-{loop['end']:#x}", _loop_line(loop, r["threads_per_block"] // SM90.warp_size))
          for loop in r["loops"]),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def _loop_line(loop: dict, warps: int) -> str:
    """What a loop issues an iteration; with 16-bit products, the cycles an SM needs to issue a block's warps'
    instructions (one a cycle from each of its schedulers) against its tensor cores' cycles for the products: the
    larger bounds the loop (whatever share of the SM the block gets, both scale alike)."""
    waits = ", ".join(loop["waits"]) or "none"
    line = (f"{loop['instructions']} instructions a warp an iteration, {loop['tensor_core']} on tensor cores, "
            f"{loop['barriers']} block barriers; waits: {waits}")
    if loop["tensor_flops"]:
        issue, tensor = loop_cycles(loop, warps)
        line += f"; a block's iteration: {issue} issue cycles, {tensor} tensor-core cycles"
    return line


def loop_cycles(loop: dict, warps: int) -> tuple[int, int]:
    """A block of `warps` warps' iteration of `loop` (a report's "loops" entry) in SM cycles: to issue its
    instructions (one a cycle from each scheduler), and on the tensor cores for its 16-bit products."""
    return (loop["instructions"] * warps // SM90.schedulers,
            loop["tensor_flops"] * warps // SM90.tensor_flops_per_cycle)


def inspect_variant(name: str, variant: str, out_dir: str | os.PathLike, *, num_warps: int, num_stages: int,
                    **constexprs) -> dict:
    """`TRITON_KERNELS[name]` compiled with other warps, stages and constexpr values (a launch configuration a
    sweep tries), reported quietly as `<name>_<variant>`."""
    spec = replace(TRITON_KERNELS[name], constexprs={**TRITON_KERNELS[name].constexprs, **constexprs},
                   num_warps=num_warps, num_stages=num_stages)
    return report(_compile_triton(f"{name}_{variant}", spec), out_dir, quiet=True)


def inspect_kernel(name: str, out_dir: str | os.PathLike = "out") -> dict:
    """Compile kernel `name` and report its registers, shared memory, spills and occupancy."""
    simt = simt_kernels()
    if name in simt:
        compiled = _compile_numba(name, *simt[name])
    elif name in TRITON_KERNELS:
        compiled = _compile_triton(name, TRITON_KERNELS[name])
    else:
        raise NanoforgeError(f"unknown kernel {name!r}; choose one of {', '.join(kernel_names())}", param="name")
    return report(compiled, out_dir)
