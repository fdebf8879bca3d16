"""Launch plans for the serving kernels: a Triton kernel launched without Triton's per-call argument handling.

`kernel[grid](*args, **consts)` binds every argument and works out what the compiled kernel is specialized on
(each pointer's dtype and 16-byte alignment, each integer's value class, the constexprs) on every call, in
Python. An eager engine step makes ~200 such launches (a 28-layer model), and the one profile of an eager step
on the H200 put ~170-210 us of host time on each RMSNorm call against ~12 us for the CUDA launch itself.
`launch(kernel, grid, *args, **consts)` does that work once per key and afterwards launches the compiled kernel
directly, as `matmul.py`'s launch plans do for the GEMM. The key holds everything Triton specializes on, and
more (an integer's class is (== 1, multiple of 16, fits in 32 bits) even where `do_not_specialize` says not to
look): a key seen for the first time always goes through Triton, so a finer key costs one slow call, never a
wrong kernel.

Opt-in (`NANOFORGE_LAUNCH_PLANS=1`) until the H200 has measured it (issue 14); under the Triton interpreter,
and for a compiled kernel whose constexprs are not all given by keyword, launches take Triton's path.
"""

from __future__ import annotations

import os

import torch

_PLANS: dict[tuple, tuple] = {}  # (kernel, key) -> (compiled kernel, its constexpr values in parameter order)
_MAX_PLANS = 4096


def enabled() -> bool:
    return os.environ.get("NANOFORGE_LAUNCH_PLANS", "0") == "1" and os.environ.get("TRITON_INTERPRET", "0") != "1"


def _arg_key(a):
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, bool) or a is None:
        return a
    if isinstance(a, int):
        return a == 1, a % 16 == 0, -(2 ** 31) <= a < 2 ** 31
    if isinstance(a, float):
        return float
    return type(a), a  # anything else: by value (it must be hashable)


def launch(kernel, grid: tuple, *args, **consts) -> None:
    """`kernel[grid](*args, **consts)`, with the runtime arguments positional and the constexprs and launch
    options (num_warps, ...) by keyword."""
    if not enabled():
        kernel[grid](*args, **consts)
        return
    key = (kernel, tuple(_arg_key(a) for a in args), tuple(sorted(consts.items())))
    plan = _PLANS.get(key)
    if plan is not None:
        compiled, tail = plan
        compiled[(*grid, 1, 1)[:3]](*args, *tail)  # a compiled kernel's launcher reads all three grid dims
        return
    compiled = kernel[grid](*args, **consts)
    names = kernel.arg_names[len(args):]  # the constexpr parameters, after the runtime ones
    if hasattr(compiled, "packed_metadata") and all(n in consts for n in names):
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = (compiled, tuple(consts[n] for n in names))
