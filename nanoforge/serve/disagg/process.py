"""Child processes that cannot outlive their parent: the launcher's instances and `mooncake_master`.

Each child gets PR_SET_PDEATHSIG (Linux): when the process that started it dies,
even by SIGKILL, the kernel sends the child SIGTERM. `stop` ends a child with
SIGTERM, then SIGKILL after a grace period, and always reaps it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time

from nanoforge.errors import NanoforgeError

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(cmd: list[str], *, env: dict | None = None, stdout=None, stderr=None, **kw) -> subprocess.Popen:
    """Start `cmd` as a child that gets SIGTERM when this process dies. Call from a thread that lives as long
    as the child should (the signal follows the thread that forked)."""
    try:
        return subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr, preexec_fn=_die_with_parent, **kw)
    except FileNotFoundError:
        raise NanoforgeError(f"{cmd[0]} is not on PATH", param=cmd[0]) from None


def stop(proc: subprocess.Popen, grace: float = 10.0) -> int:
    """SIGTERM, then SIGKILL after `grace` seconds; the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (for children that cannot report the one they bound)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for_port(host: str, port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Until something accepts connections on host:port; NanoforgeError after `timeout` s or if `proc` exits."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            pass
        if proc is not None and proc.poll() is not None:
            raise NanoforgeError(f"{proc.args[0]} exited with status {proc.returncode} before listening on "
                                 f"{host}:{port}")
        if time.monotonic() > deadline:
            raise NanoforgeError(f"nothing listened on {host}:{port} within {timeout:g} s")
        time.sleep(0.05)


def env_with(**values: str) -> dict:
    """This process's environment plus `values`."""
    return {**os.environ, **values}
