"""The SIMT kernel ladder (Numba CUDA): vector add and SGEMM from naive to 2-D register tiling.

`ladder` holds the kernels and their launchers (`sgemm`, `vector_add`);
`bench` times them against cuBLAS and torch (`run_ladder`). Neither imports
numba.cuda until a kernel is used, so tests can turn on the CPU simulator
(NUMBA_ENABLE_CUDASIM=1) whatever was imported first.
"""
