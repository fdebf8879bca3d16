"""What the disaggregated-serving tests share: a real `mooncake_master` on loopback, store clients, listening
sockets. Skips the tests that need Mooncake where it is not installed."""

from __future__ import annotations

import math
import os
import subprocess
import time

import pytest

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")  # Mooncake advertises loopback, not the external address
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

SEGMENT = 16 << 20  # the smallest pool segment Mooncake takes


def need_mooncake():
    pytest.importorskip("mooncake.store", reason="Mooncake Store is not installed (pip install 'nanoforge[disagg]')")


def listening(pids: set[int]) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket that the processes `pids` listen on (from `ss -ltnp`)."""
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        parts = line.split()
        local, users = parts[3], " ".join(parts[5:])
        address, _, port = local.rpartition(":")
        for pid in pids:
            if f"pid={pid}," in users:
                found.append((address.strip("[]"), int(port), pid))
    return found


def close_all(stores) -> None:
    """Close Mooncake store clients (each takes ~1.5-2 s to leave the pool). One after another: the binding holds
    the GIL while it closes (a Python thread ticked twice in a 2 s close), so threads would not overlap them."""
    for s in stores:
        s.close()


def close(a, b, tol: float = 1e-5) -> bool:
    """`a == b` for JSON values, floats within `tol` (logprobs computed in different chunks differ in the last
    bits)."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=tol,
                                                                                              abs_tol=tol)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k], tol) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y, tol) for x, y in zip(a, b))
    return a == b


def run_engine(engine, prompts, params, timeout: float = 60.0) -> list:
    """Step an engine until the requests of `prompts` finish; their final outputs, in order."""
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    deadline = time.monotonic() + timeout
    while engine.has_unfinished():
        assert time.monotonic() < deadline
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]
