"""The SIMT ladder: vector add and five SGEMM kernels, each one idea faster.

Written in Numba CUDA: plain Python functions that run once per GPU thread,
with explicit thread/block indices, shared memory and per-thread local arrays.
Each rung changes one thing over the one before it:

  naive        one thread per C[row, col]; a warp's 32 threads walk down a
               column of C, so their loads of A and stores to C are K and N
               floats apart (uncoalesced: 32 memory transactions per load).
  coalesced    the same kernel with the thread-to-(row, col) mapping swapped,
               so a warp walks along a row of C: its reads of B and writes of C
               are consecutive (one transaction), and A[row, k] is a broadcast.
  smem_tiled   a block computes a 32x32 tile of C; each K-step it stages a 32x32
               tile of A and of B in shared memory, so every float fetched from
               global memory is reused 32 times.
  regtile_1d   each thread computes TM=8 outputs of one column, keeping them in
               registers and reusing each B value from shared memory 8 times
               (64x64 block tile, BK=8: siboehm's "1-D blocktiling").
  regtile_2d   each thread computes an 8x8 outer-product tile: per K-step it
               loads 8 A and 8 B values into registers and does 64 FMAs, so
               shared-memory traffic per FMA drops 4x again (128x128 block
               tile, BK=8: siboehm's "2-D blocktiling").

`sgemm(a, b, rung)` and `vector_add(a, b)` launch them on numpy arrays (copied
to and from the device) or on device arrays (Numba device arrays, or anything
with `__cuda_array_interface__` such as a CUDA torch tensor). The output is
filled with NaN before the launch, so an element a kernel forgets to write
shows up in any comparison.

numba.cuda is imported lazily, by `numba_cuda()`: numba decides at that import
whether it is the real CUDA target or the CPU simulator (NUMBA_ENABLE_CUDASIM=1,
used by the tests), so importing this module must not settle that question.
The kernels below refer to the module-global `cuda`, which `numba_cuda()`
binds; Numba resolves globals when it compiles a kernel (first launch), and the
simulator swaps that same global for its per-thread fake.

Local arrays (`cuda.local.array`) whose size is a compile-time constant, indexed
only inside fully unrolled constant-trip-count loops, are promoted to registers;
`nanoforge kernels inspect sgemm_regtile_2d` shows the register count and that
nothing spills to local memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np


cuda: Any = None  # numba.cuda, bound by numba_cuda() on first use (see the module docstring)


def numba_cuda():
    """Import and return numba.cuda, honouring NUMBA_ENABLE_CUDASIM set at any time before."""
    global cuda
    if cuda is None:
        from numba.core import config

        # numba reads NUMBA_ENABLE_CUDASIM when `numba` itself is imported; re-read
        # it in case numba was imported (by anyone) before the variable was set.
        config.reload_config()
        import numpy as np

        if not hasattr(np, "row_stack"):  # numba-cuda releases before NumPy 2.5 still register np.row_stack
            np.row_stack = np.vstack
        from numba import cuda as numba_cuda_module

        cuda = numba_cuda_module
    return cuda


def simulator_active() -> bool:
    """True when numba.cuda is the CPU simulator rather than a real GPU target."""
    # Ask the module we got, not the environment: whoever imported numba.cuda first decided.
    return numba_cuda().jit.__module__.startswith("numba.cuda.simulator")


# --------------------------------------------------------------------------- tile sizes
# Module-level ints are frozen into the kernels as compile-time constants, which
# is what lets shared/local arrays have static sizes and loops fully unroll.

VECTOR_ADD_THREADS = 256

SIMPLE_BLOCK = 32  # naive and coalesced: 32x32 threads, one output each
TILE = 32  # smem_tiled: 32x32 threads, 32x32 tiles of A and B in shared memory

BM1, BN1, BK1, TM1 = 64, 64, 8, 8  # regtile_1d: block tile BM1 x BN1, TM1 outputs per thread
THREADS1 = BM1 * BN1 // TM1  # 512

BM2, BN2, BK2, TM2, TN2 = 128, 128, 8, 8, 8  # regtile_2d: TM2 x TN2 outputs per thread
THREADS2 = BM2 * BN2 // (TM2 * TN2)  # 256
A_ROWS_PER_PASS2 = THREADS2 // BK2  # rows of the A tile that the block loads in one pass (32)
B_ROWS_PER_PASS2 = THREADS2 // BN2  # rows of the B tile that the block loads in one pass (2)

# The cooperative tile loads below assume the block's threads cover a tile row exactly.
assert THREADS1 == BM1 * BK1 == BK1 * BN1
assert THREADS2 % BK2 == 0 and THREADS2 % BN2 == 0


# --------------------------------------------------------------------------- kernels


def vector_add_kernel(a, b, c):
    """c = a + b, one element per thread: the bandwidth-bound hello world."""
    i = cuda.grid(1)
    if i < c.shape[0]:
        c[i] = a[i] + b[i]


def sgemm_naive(a, b, c):
    """C = A @ B, one thread per output; threadIdx.x walks *rows* (uncoalesced)."""
    row, col = cuda.grid(2)  # x (fastest across a warp) -> row: neighbours are K/N floats apart
    if row < c.shape[0] and col < c.shape[1]:
        acc = np.float32(0.0)
        for k in range(a.shape[1]):
            acc += a[row, k] * b[k, col]
        c[row, col] = acc


def sgemm_coalesced(a, b, c):
    """As sgemm_naive, but threadIdx.x walks *columns*: B reads and C writes coalesce."""
    col, row = cuda.grid(2)  # the only change from sgemm_naive
    if row < c.shape[0] and col < c.shape[1]:
        acc = np.float32(0.0)
        for k in range(a.shape[1]):
            acc += a[row, k] * b[k, col]
        c[row, col] = acc


def sgemm_smem_tiled(a, b, c):
    """C = A @ B with 32x32 tiles of A and B staged in shared memory."""
    a_tile = cuda.shared.array((TILE, TILE), np.float32)
    b_tile = cuda.shared.array((TILE, TILE), np.float32)
    m, k_total = a.shape
    n = b.shape[1]
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    row = cuda.blockIdx.y * TILE + ty
    col = cuda.blockIdx.x * TILE + tx
    acc = np.float32(0.0)
    for k0 in range(0, k_total, TILE):
        # Each thread stages one element of each tile; zeros pad the ragged edges.
        a_tile[ty, tx] = a[row, k0 + tx] if row < m and k0 + tx < k_total else np.float32(0.0)
        b_tile[ty, tx] = b[k0 + ty, col] if k0 + ty < k_total and col < n else np.float32(0.0)
        cuda.syncthreads()
        for k in range(TILE):
            acc += a_tile[ty, k] * b_tile[k, tx]
        cuda.syncthreads()  # everyone is done with the tiles before they are overwritten
    if row < m and col < n:
        c[row, col] = acc


def sgemm_regtile_1d(a, b, c):
    """C = A @ B; each of the 512 threads computes TM1=8 outputs of one column of a 64x64 tile."""
    a_tile = cuda.shared.array((BM1, BK1), np.float32)
    b_tile = cuda.shared.array((BK1, BN1), np.float32)
    acc = cuda.local.array(TM1, np.float32)
    m, k_total = a.shape
    n = b.shape[1]
    t = cuda.threadIdx.x
    row0 = cuda.blockIdx.y * BM1
    col0 = cuda.blockIdx.x * BN1
    out_col = t % BN1  # this thread's column in the tile ...
    out_row = (t // BN1) * TM1  # ... and the first of its TM1 rows
    a_row, a_col = t // BK1, t % BK1  # the A-tile element this thread loads
    b_row, b_col = t // BN1, t % BN1  # the B-tile element this thread loads
    for i in range(TM1):
        acc[i] = 0.0
    for k0 in range(0, k_total, BK1):
        r, kk = row0 + a_row, k0 + a_col
        a_tile[a_row, a_col] = a[r, kk] if r < m and kk < k_total else np.float32(0.0)
        kk, cc = k0 + b_row, col0 + b_col
        b_tile[b_row, b_col] = b[kk, cc] if kk < k_total and cc < n else np.float32(0.0)
        cuda.syncthreads()
        for k in range(BK1):
            b_val = b_tile[k, out_col]  # one shared load, reused TM1 times from a register
            for i in range(TM1):
                acc[i] += a_tile[out_row + i, k] * b_val
        cuda.syncthreads()
    for i in range(TM1):
        r, cc = row0 + out_row + i, col0 + out_col
        if r < m and cc < n:
            c[r, cc] = acc[i]


def sgemm_regtile_2d(a, b, c):
    """C = A @ B; each of the 256 threads computes an 8x8 tile of a 128x128 block tile."""
    a_tile = cuda.shared.array((BM2, BK2), np.float32)
    b_tile = cuda.shared.array((BK2, BN2), np.float32)
    acc = cuda.local.array((TM2, TN2), np.float32)
    a_reg = cuda.local.array(TM2, np.float32)
    b_reg = cuda.local.array(TN2, np.float32)
    m, k_total = a.shape
    n = b.shape[1]
    t = cuda.threadIdx.x
    row0 = cuda.blockIdx.y * BM2
    col0 = cuda.blockIdx.x * BN2
    out_row = (t // (BN2 // TN2)) * TM2  # top-left corner of this thread's TM2 x TN2 tile
    out_col = (t % (BN2 // TN2)) * TN2
    a_row, a_col = t // BK2, t % BK2  # first A-tile element this thread loads (then every 32 rows)
    b_row, b_col = t // BN2, t % BN2  # first B-tile element this thread loads (then every 2 rows)
    for i in range(TM2):
        for j in range(TN2):
            acc[i, j] = 0.0
    for k0 in range(0, k_total, BK2):
        kk = k0 + a_col
        for p in range(0, BM2, A_ROWS_PER_PASS2):
            r = row0 + a_row + p
            a_tile[a_row + p, a_col] = a[r, kk] if r < m and kk < k_total else np.float32(0.0)
        cc = col0 + b_col
        for p in range(0, BK2, B_ROWS_PER_PASS2):
            kk = k0 + b_row + p
            b_tile[b_row + p, b_col] = b[kk, cc] if kk < k_total and cc < n else np.float32(0.0)
        cuda.syncthreads()
        for k in range(BK2):
            for i in range(TM2):
                a_reg[i] = a_tile[out_row + i, k]
            for j in range(TN2):
                b_reg[j] = b_tile[k, out_col + j]
            for i in range(TM2):  # outer product: 64 FMAs from 16 shared-memory loads
                for j in range(TN2):
                    acc[i, j] += a_reg[i] * b_reg[j]
        cuda.syncthreads()
    for i in range(TM2):
        r = row0 + out_row + i
        for j in range(TN2):
            cc = col0 + out_col + j
            if r < m and cc < n:
                c[r, cc] = acc[i, j]


# --------------------------------------------------------------------------- rungs and launchers

SGEMM_SIGNATURE = "void(float32[:, ::1], float32[:, ::1], float32[:, ::1])"
VECTOR_ADD_SIGNATURE = "void(float32[::1], float32[::1], float32[::1])"


@dataclass(frozen=True)
class Rung:
    """One SGEMM kernel and how to launch it."""

    name: str
    kernel: Callable  # the plain Python kernel (numba_cuda().jit compiles it)
    block: tuple[int, int]  # threads per block (x, y)
    tile: tuple[int, int]  # (rows, cols) of C computed by one block
    rows_on_x: bool = False  # grid x walks rows of C (only the naive rung)

    @property
    def threads_per_block(self) -> int:
        return self.block[0] * self.block[1]

    def grid(self, m: int, n: int) -> tuple[int, int]:
        blocks_m, blocks_n = math.ceil(m / self.tile[0]), math.ceil(n / self.tile[1])
        return (blocks_m, blocks_n) if self.rows_on_x else (blocks_n, blocks_m)


RUNGS: dict[str, Rung] = {
    r.name: r
    for r in (
        Rung("naive", sgemm_naive, (SIMPLE_BLOCK, SIMPLE_BLOCK), (SIMPLE_BLOCK, SIMPLE_BLOCK), rows_on_x=True),
        Rung("coalesced", sgemm_coalesced, (SIMPLE_BLOCK, SIMPLE_BLOCK), (SIMPLE_BLOCK, SIMPLE_BLOCK)),
        Rung("smem_tiled", sgemm_smem_tiled, (TILE, TILE), (TILE, TILE)),
        Rung("regtile_1d", sgemm_regtile_1d, (THREADS1, 1), (BM1, BN1)),
        Rung("regtile_2d", sgemm_regtile_2d, (THREADS2, 1), (BM2, BN2)),
    )
}

_jitted: dict[Callable, Any] = {}


def _jit(kernel: Callable):
    """The Numba dispatcher for a kernel (compiled per argument types on first launch)."""
    if kernel not in _jitted:
        _jitted[kernel] = numba_cuda().jit(kernel)
    return _jitted[kernel]


def _as_device(x, name: str, ndim: int):
    """(device array, came_from_host) for a numpy array or any CUDA-array-interface object."""
    cuda = numba_cuda()
    if isinstance(x, np.ndarray):
        dev, from_host = cuda.to_device(np.ascontiguousarray(x)), True
    elif getattr(x, "__cuda_ndarray__", False):  # a Numba device array (real or simulated)
        dev, from_host = x, False
    elif hasattr(x, "__cuda_array_interface__"):  # e.g. a CUDA torch tensor
        dev, from_host = cuda.as_cuda_array(x), False
    else:
        raise ValueError(f"{name} must be a numpy array or a CUDA device array, not {type(x).__name__}")
    if dev.ndim != ndim or dev.dtype != np.float32:
        raise ValueError(
            f"{name} must be a {ndim}-D float32 array, got {dev.ndim}-D {dev.dtype} with shape {tuple(dev.shape)}"
        )
    return dev, from_host


def _output(out, shape: tuple[int, ...]):
    """The output device array: `out` (checked) or a fresh one; poisoned with NaN either way."""
    cuda = numba_cuda()
    if out is None:
        return cuda.to_device(np.full(shape, np.nan, np.float32))
    if isinstance(out, np.ndarray):
        raise ValueError("out must be a device array (numpy inputs get a new numpy result)")
    dev, _ = _as_device(out, "out", len(shape))
    if tuple(dev.shape) != shape:
        raise ValueError(f"out has shape {tuple(dev.shape)}, expected {shape}")
    dev.copy_to_device(np.full(shape, np.nan, np.float32))
    return dev


def launch_sgemm(rung: Rung, a, b, c) -> None:
    """Launch one rung on device arrays, no checks or copies: what the benchmark times."""
    m, n = c.shape
    _jit(rung.kernel)[rung.grid(m, n), rung.block](a, b, c)


def launch_vector_add(a, b, c) -> None:
    """Launch vector add on device arrays, no checks or copies: what the benchmark times."""
    _jit(vector_add_kernel)[math.ceil(c.shape[0] / VECTOR_ADD_THREADS), VECTOR_ADD_THREADS](a, b, c)


def get_rung(name: str) -> Rung:
    if name not in RUNGS:
        raise ValueError(f"unknown SGEMM rung {name!r}; choose one of {', '.join(RUNGS)}")
    return RUNGS[name]


def sgemm(a, b, rung: str, out=None):
    """C = A @ B in float32 with the given rung of the ladder.

    Numpy inputs give a numpy result; device inputs give a device array
    (`out`, a device array, if given). The output is NaN-filled before the
    kernel runs.
    """
    spec = get_rung(rung)
    a_dev, from_host = _as_device(a, "a", 2)
    b_dev, _ = _as_device(b, "b", 2)
    if a_dev.shape[1] != b_dev.shape[0]:
        raise ValueError(f"sgemm: a is {tuple(a_dev.shape)} but b is {tuple(b_dev.shape)}; inner sizes differ")
    c_dev = _output(out, (a_dev.shape[0], b_dev.shape[1]))
    launch_sgemm(spec, a_dev, b_dev, c_dev)
    return c_dev.copy_to_host() if from_host else c_dev


def vector_add(a, b, out=None):
    """a + b for 1-D float32 arrays; numpy in, numpy out; device in, device out."""
    a_dev, from_host = _as_device(a, "a", 1)
    b_dev, _ = _as_device(b, "b", 1)
    if a_dev.shape != b_dev.shape:
        raise ValueError(f"vector_add: a has {a_dev.shape[0]} elements but b has {b_dev.shape[0]}")
    c_dev = _output(out, tuple(a_dev.shape))
    launch_vector_add(a_dev, b_dev, c_dev)
    return c_dev.copy_to_host() if from_host else c_dev
