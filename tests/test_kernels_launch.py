"""Launch plans (kernels/launch.py): after a key's first call through Triton, calls of the same key launch the
compiled kernel directly with the constexprs appended in parameter order; anything Triton specializes on that
changes (a pointer's dtype or 16-byte alignment, an integer's class, a constexpr) goes through Triton again."""

from __future__ import annotations

import torch

from nanoforge.kernels import launch as lp


class FakeCompiled:
    packed_metadata = object()

    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        assert len(grid) == 3, "Triton's compiled-kernel runner indexes grid[0], grid[1] and grid[2]"
        return lambda *args: self.log.append(("direct", grid, args))


class FakeKernel:
    """A JITFunction's surface: arg_names, and kernel[grid](*args, **consts) returning the compiled kernel."""

    def __init__(self, arg_names=("x", "n", "eps", "BLOCK", "FLAG")):
        self.arg_names = list(arg_names)
        self.log = []
        self.compiled = FakeCompiled(self.log)

    def __getitem__(self, grid):
        def run(*args, **consts):
            self.log.append(("triton", grid, args, consts))
            return self.compiled
        return run


def kinds(kernel):
    return [entry[0] for entry in kernel.log]


def test_same_key_launches_the_compiled_kernel_and_anything_specialized_goes_through_triton(monkeypatch):
    monkeypatch.setenv("NANOFORGE_LAUNCH_PLANS", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    k = FakeKernel()
    x, y = torch.zeros(64, dtype=torch.bfloat16), torch.zeros(64, dtype=torch.bfloat16)
    consts = dict(BLOCK=16, FLAG=True, num_warps=4)
    lp.launch(k, (4,), x, 32, 1e-6, **consts)
    lp.launch(k, (5,), y, 48, 2e-6, **consts)  # same classes: 32 and 48 are multiples of 16
    assert k.log[-1] == ("direct", (5, 1, 1), (y, 48, 2e-6, 16, True))  # constexprs appended in parameter order
    lp.launch(k, (5,), x[1:], 48, 1e-6, **consts)  # 2 bytes off: not 16-byte aligned
    lp.launch(k, (5,), x, 1, 1e-6, **consts)  # n == 1
    lp.launch(k, (5,), x, 17, 1e-6, **consts)  # neither 1 nor a multiple of 16
    lp.launch(k, (5,), x, 33, 1e-6, **consts)  # the same class as 17
    lp.launch(k, (5,), x.float(), 48, 1e-6, **consts)  # another dtype
    lp.launch(k, (5,), x, 48, 1e-6, **{**consts, "BLOCK": 32})  # another constexpr
    lp.launch(k, (5,), x, 2 ** 40, 1e-6, **consts)  # a 64-bit integer
    assert kinds(k) == ["triton", "direct", "triton", "triton", "triton", "direct", "triton", "triton", "triton"]


def test_off_by_default_under_the_interpreter_and_without_every_constexpr(monkeypatch):
    monkeypatch.delenv("NANOFORGE_LAUNCH_PLANS", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    k = FakeKernel()
    x = torch.zeros(64)
    for _ in range(2):
        lp.launch(k, (1,), x, 16, 0.5, BLOCK=16, FLAG=False)
    assert kinds(k) == ["triton", "triton"]
    monkeypatch.setenv("NANOFORGE_LAUNCH_PLANS", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    lp.launch(k, (1,), x, 16, 0.5, BLOCK=16, FLAG=False)
    lp.launch(k, (1,), x, 16, 0.5, BLOCK=16, FLAG=False)
    assert kinds(k)[2:] == ["triton", "triton"]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    k2 = FakeKernel()  # FLAG left to its default: the compiled kernel's arguments are not all known
    for _ in range(2):
        lp.launch(k2, (1,), x, 16, 0.5, BLOCK=16)
    assert kinds(k2) == ["triton", "triton"]
