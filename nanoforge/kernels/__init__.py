"""GPU kernels as plain functions: a PyTorch reference and a Triton (or SIMT) fast path each.

    matmul, linear          kernels/matmul.py           tiled / persistent / Stream-K / hybrid GEMM
    rms_norm                kernels/rmsnorm.py
    attention               kernels/flash_attention.py  flash attention fwd+bwd, causal, GQA, document masks
    paged_attention         kernels/paged_attention.py  decode and chunked prefill over block tables
    simt.ladder             kernels/simt/               Numba CUDA SGEMM ladder (naive -> register tiled)
    inspect_kernel          kernels/inspect.py          registers, shared memory, spills, occupancy, PTX, SASS

`dispatch.use_fast` is the single switch between the two paths (Triton on CUDA
tensors, the reference elsewhere; NANOFORGE_KERNELS=torch|triton overrides).
Kernels know nothing about models.
"""
