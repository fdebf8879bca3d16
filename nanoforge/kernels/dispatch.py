"""The one place that decides between a Triton kernel and its PyTorch reference.

Every op in `nanoforge.kernels` is a plain function with two implementations:
a PyTorch reference (runs anywhere, float64-capable, the definition of
correct) and a fast one (Triton on a CUDA GPU). `use_fast(*tensors)` picks.

Override with the environment variable NANOFORGE_KERNELS:
  - "auto" (default): Triton on CUDA tensors when Triton imports, else torch;
  - "torch": always the reference;
  - "triton": always Triton (on the CPU this needs TRITON_INTERPRET=1; tests use it).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import time

import torch


_TRITON = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    return _TRITON


def interpreting() -> bool:
    """Whether Triton runs its CPU interpreter (TRITON_INTERPRET=1): kernels pick small fixed configurations."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The environment switch `name` (lower-cased; unset: the first of `choices`), or one line naming the problem."""
    value = os.environ.get(name, choices[0]).lower()
    if value not in choices:
        from nanoforge.errors import NanoforgeError

        allowed = f"{', '.join(choices[:-1])} or {choices[-1]}"
        raise NanoforgeError(f"{name} must be {allowed}, not {value!r}", param=name)
    return value


def env_count(name: str, default: int, lo: int, hi: int) -> int:
    """The environment setting `name` as a whole number from lo to hi (unset: `default`), or one line naming
    the problem."""
    value = os.environ.get(name, str(default))
    if not value.isdigit() or not lo <= int(value) <= hi:
        from nanoforge.errors import NanoforgeError

        raise NanoforgeError(f"{name} must be a whole number from {lo} to {hi}, not {value!r}", param=name)
    return int(value)


def env_mib(name: str, default: str) -> float:
    """The environment setting `name` as a number of MiB (unset: `default`), or one line naming the problem."""
    value = os.environ.get(name, default)
    try:
        return float(value)
    except ValueError:
        from nanoforge.errors import NanoforgeError

        raise NanoforgeError(f"{name} must be a number of MiB, not {value!r}", param=name) from None


def kernel_mode() -> str:
    return env_choice("NANOFORGE_KERNELS", ("auto", "torch", "triton"))


def use_fast(*tensors: torch.Tensor) -> bool:
    """True when the fast (Triton) implementation should run on these tensors.

    Sharded tensors (DTensor, a subclass) always take the reference: its PyTorch ops know how to run on
    shards, a Triton launch does not."""
    mode = kernel_mode()
    if mode == "torch" or not triton_available() or any(hasattr(t, "device_mesh") for t in tensors):
        return False
    if mode == "triton":
        return True
    return all(t.is_cuda for t in tensors)


@functools.cache
def sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors (1 for a CPU: the interpreter runs one program at a time)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


_COUNTERS: dict[tuple, torch.Tensor] = {}
_KEPT: list[torch.Tensor] = []  # every counter buffer made: graphs captured with one still use it


def capturing(device: torch.device) -> bool:
    """Whether work on this device is being captured into a CUDA graph right now."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def replays_us(runs: dict, rounds: int = 8, cuda: bool = True) -> dict:
    """Microseconds of each run() (a CUDA graph's replay, or any call), the best of `rounds`, the runs taking
    turns: a GPU whose clocks are still ramping up (a fresh server's start) favours none of them, where timed one
    after the other the first would read slow. `cuda`: each run timed by CUDA events around it (on the current
    stream), else by the wall clock."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for name, run in runs.items():
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                us = 1000 * start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                run()
                us = 1e6 * (time.perf_counter() - t0)
            best[name] = min(best[name], us)
    return best


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least `n` int32 arrival counts for kernels whose last program to arrive finishes a piece of work (the
    skinny matmul's split-K tiles, paged attention's split contexts, the persistent decode kernel's barriers),
    zero between launches (each piece's last program resets its own), per device and stream: two launches on one
    stream never count at once, as a kernel counts only after its wait for the one before it (PDL's; stream order
    without it), so every kernel on the stream shares one buffer. Grown, never shrunk (a captured graph keeps
    the one it was captured with alive here).

    A launch inside a CUDA graph capture takes the device's buffer for graphs, which eager launches make (the
    autotuner and the engine's warm-up run a shape before any capture); one is never made inside a capture: it
    would come from the graph's memory pool, which goes back to the allocator with its engine, while a later
    engine's graphs (captured on PyTorch's one capture stream, so under the same key) would still count in it,
    inside whatever the allocator had put there since (session 26: a second model's engine in one process, with
    the persistent decode kernel, decoded wrong tokens)."""
    for_graphs = (str(device), "graphs")
    if capturing(device):
        have = _COUNTERS.get(for_graphs)
        if have is None or have.numel() < n:
            raise RuntimeError(f"arrival_counters: {n} counts first asked for inside a CUDA graph capture on "
                               f"{device}; launch the kernel once eagerly before capturing it")
        return have
    key = (str(device), torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    for k in (for_graphs, key):
        have = _COUNTERS.get(k)
        if have is None or have.numel() < n:
            _COUNTERS[k] = have = torch.zeros(max(n, 4096), device=device, dtype=torch.int32)
            _KEPT.append(have)
    return have


def compile_threads() -> int:
    """NANOFORGE_COMPILE_THREADS: threads that compile an autotuner's candidates at once, 1 to 256 (default: this
    process's CPUs, up to 16; 1 compiles them one after another, as the autotuner does by itself)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return env_count("NANOFORGE_COMPILE_THREADS", min(16, cpus), 1, 256)


_COMPILE_FAILED: list[str] = []  # why a parallel compile fell back, once (a warning says it the first time)


def compile_in_parallel(fn, configs: list, args: tuple, meta: dict) -> bool:
    """Compile the @triton.jit `fn` at each of an autotuner's `configs` for these arguments, in threads, before the
    autotuner times them one after another: it then finds each compiled in `fn`'s cache. Triton's compiler
    releases the GIL for most of its work (`benchmarks/compile_threads.py`: the skinny matmul's five candidates
    for sm_90, 4.19 s in one thread and 2.48 s in two on a 2-core CPU), so a cold start's autotuning waits for
    about its slowest compile rather than for their sum. Compiles go through Triton's own AsyncCompileMode with
    `fn.warmup`, the path a launch compiles by. Where this Triton has no AsyncCompileMode, with one thread, or on
    an error (warned once), the autotuner compiles as it always did; a candidate that fails to compile is left to
    the autotuner, which meets the error again in its own pass and handles it as it always has (errors ignored
    here: Triton 3.6's AsyncCompileMode would otherwise stay active after raising one). Whether the compiles ran."""
    import triton

    async_mode = getattr(triton, "AsyncCompileMode", None)
    threads = min(len(configs), compile_threads())
    if async_mode is None or threads < 2:
        return False
    from concurrent.futures import ThreadPoolExecutor

    try:
        with (ThreadPoolExecutor(threads, thread_name_prefix="nanoforge-compile") as pool,
              async_mode(pool, ignore_errors=True)):
            for config in configs:
                fn.warmup(*args, grid=(1,), **meta, **config.all_kwargs())
    except Exception as e:  # a compile the autotuner will meet again, and report, in its own serial pass
        if not _COMPILE_FAILED:
            import warnings

            warnings.warn(f"compiling {getattr(fn, '__name__', fn)}'s candidates in parallel failed "
                          f"({type(e).__name__}: {e}); the autotuner compiles them one by one", stacklevel=2)
        _COMPILE_FAILED.append(f"{type(e).__name__}: {e}")
        return False
    return True
