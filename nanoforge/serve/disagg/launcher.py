"""The local launcher: `nanoforge serve --disagg --model DIR [--prefill N --decode M | --colocated K]
[--devices I,J,...]`.

One command starts a whole cluster on this machine, all on loopback:

    mooncake_master             the KV pool's metadata and allocation service (127.0.0.1, a free port)
    N x nanoforge serve --role prefill --store MASTER     each a process, on a free port
    M x nanoforge serve --role decode  --store MASTER     (or K x --role both: colocated instances)
    the conductor               in this process, at --host:--port (default 127.0.0.1:8000)

and stops them all on Ctrl-C or SIGTERM: the conductor drains first (requests
in flight get `--shutdown-timeout`), then the instances get SIGTERM, then the
master. The children run in their own sessions (a terminal's Ctrl-C reaches
only us, so nothing is cut before the conductor has drained) and die with
this process even if it is killed outright (PR_SET_PDEATHSIG).

On a GPU the instances share it: they start one after another, each allowed
its share of the memory (`--gpu-memory-utilization` 0.9 x k / (N + M) for the
k-th, which counts what those before it took), unless `--kv-cache-memory`
fixes each one's cache. With `--devices` each instance has a GPU of its own
(`CUDA_VISIBLE_DEVICES`, in the order prefill, decode) and they start together,
as they do on a CPU.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from nanoforge.errors import NanoforgeError
from nanoforge.serve.api.app import serve_app
from nanoforge.serve.disagg.conductor import Conductor, build_conductor_app, describe, discover
from nanoforge.serve.disagg.mooncake_store import MooncakeMaster, MooncakeStore
from nanoforge.serve.disagg.process import env_with, spawn, stop

START_TIMEOUT_S = 600.0  # model load, KV-cache sizing, CUDA-graph capture
_print_lock = threading.Lock()


def _say(line: str) -> None:
    with _print_lock:  # the children's lines and ours, whole
        print(line, flush=True)

# `nanoforge serve` flags the instances get as they were given to the launcher
_PASSED = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "kv_cache_memory", "max_waiting",
           "max_request_bytes", "shutdown_timeout", "log_level", "device", "dtype", "pool_memory", "kv_pool_workers")
_SWITCHES = ("graph_prefill", "async_scheduling")  # on/off flags, passed where they were given


class _Child:
    """An instance process whose output we echo, prefixed, until it tells us its address."""

    def __init__(self, name: str, cmd: list[str], device: str | None = None):
        self.name = name
        gpu = {} if device is None else {"CUDA_VISIBLE_DEVICES": device}
        self.proc = spawn(cmd, env=env_with(MC_TCP_BIND_ADDRESS="127.0.0.1", PYTHONUNBUFFERED="1", **gpu),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.url: str | None = None
        self.ready = threading.Event()
        self.tail: list[str] = []
        threading.Thread(target=self._echo, daemon=True).start()

    def _echo(self) -> None:
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.tail = (self.tail + [line])[-20:]
            if self.url is None:
                match = re.search(r" at (http://[0-9.]+:\d+)/v1", line)
                if match:
                    self.url = match.group(1)
                    self.ready.set()
            _say(f"[{self.name}] {line}")
        self.ready.set()  # it exited

    def wait_ready(self, deadline: float) -> str:
        self.ready.wait(max(0.0, deadline - time.monotonic()))
        if self.url is None:
            status = self.proc.poll()
            why = f"exited with status {status}" if status is not None else "did not start in time"
            raise NanoforgeError(f"the {self.name} instance {why}; its last lines:\n  " + "\n  ".join(self.tail[-5:]))
        return self.url


def _instance_cmd(args, role: str, master: str, gpu_share: float | None) -> list[str]:
    cmd = [sys.executable, "-m", "nanoforge.cli", "serve", "--model", args.model, "--role", role, "--store", master,
           "--host", "127.0.0.1", "--port", "0", "--served-model-name", args.served_model_name or
           Path(args.model).resolve().name]
    for name in _PASSED:
        value = getattr(args, name)
        if value is not None:
            cmd += [f"--{name.replace('_', '-')}", str(value)]
    for name in _SWITCHES:
        value = getattr(args, name, None)
        if value is not None:
            cmd.append(f"--{'' if value else 'no-'}{name.replace('_', '-')}")
    if args.no_prefix_caching:
        cmd.append("--no-prefix-caching")
    if gpu_share is not None:
        cmd += ["--gpu-memory-utilization", f"{gpu_share:.4f}"]
    return cmd


def instance_devices(spec: str | None, instances: int) -> list[str] | None:
    """`--devices I,J,...`: one GPU index for each instance, none twice (None: not given); NanoforgeError if not."""
    if spec is None:
        return None
    devices = [d.strip() for d in spec.split(",")]
    if not all(d.isdigit() for d in devices):
        raise NanoforgeError(f"--devices takes GPU indices separated by commas (e.g. 0,1), got {spec!r}",
                             param="devices")
    if len(devices) != instances or len(set(devices)) != instances:
        raise NanoforgeError(f"--devices gives each of the {instances} instances a GPU of its own: {instances} "
                             f"different indices, got {spec!r} (leave it out to share one GPU)", param="devices")
    return devices


def _on_gpu(args) -> bool:
    if args.device not in ("auto",) and not args.device.startswith("cuda"):
        return False
    import torch

    return torch.cuda.is_available()


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through run_local_cluster's clean-up (uvicorn re-raises the signal)


def run_local_cluster(args) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if not (Path(args.model) / "config.json").is_file():
        raise NanoforgeError(f"--model {args.model}: no config.json there (a model directory is needed)",
                             param="model")
    if args.colocated:
        roles = [("both", i + 1) for i in range(args.colocated)]
    else:
        roles = [("prefill", i + 1) for i in range(args.prefill)] + [("decode", i + 1) for i in range(args.decode)]
    devices = instance_devices(args.devices, len(roles))
    sequential = _on_gpu(args) and not args.kv_cache_memory and devices is None
    children: list[_Child] = []
    master = MooncakeMaster()
    store = None
    try:
        master.start()
        _say(f"nanoforge serve --disagg: mooncake_master at {master.address} (pid {master.proc.pid})")
        deadline = time.monotonic() + START_TIMEOUT_S
        for k, (role, n) in enumerate(roles):
            share = 0.9 * (k + 1) / len(roles) if sequential else None
            child = _Child(f"{role} {n}", _instance_cmd(args, role, master.address, share),
                           None if devices is None else devices[k])
            children.append(child)
            if sequential:
                child.wait_ready(deadline)
        for child in children:
            url = child.wait_ready(deadline)
            _say(f"nanoforge serve --disagg: {child.name} at {url} (pid {child.proc.pid})")
        urls = {role: [c.url for c in children if c.name.startswith(role)] for role in ("prefill", "decode", "both")}
        instances = discover(urls["prefill"], urls["decode"], timeout=30.0, colocated_urls=urls["both"])
        store = MooncakeStore(master.address)
        conductor = Conductor(instances, policy=args.policy, store=store, ttft_slo=args.ttft_slo,
                              tpot_slo=args.tpot_slo)
        app = build_conductor_app(conductor, max_waiting=args.max_waiting, max_request_bytes=args.max_request_bytes)
        slos = "".join(f", {name} SLO {v:g} s" for name, v in (("TTFT", args.ttft_slo), ("TPOT", args.tpot_slo)) if v)
        return serve_app(app, args, f"nanoforge conductor: {conductor.model_name} at {{url}} ({describe(conductor)}, "
                                    f"policy {args.policy}{slos}; Ctrl-C stops all)")
    finally:
        for child in children:  # all at once: each drains its own requests
            if child.proc.poll() is None:
                child.proc.terminate()
        for child in children:
            stop(child.proc, grace=args.shutdown_timeout + 10)
        if store is not None:
            store.close()
        master.stop()
        _say(f"nanoforge serve --disagg: stopped the conductor, {len(children)} instances and mooncake_master")
