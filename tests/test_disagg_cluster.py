"""`nanoforge serve --disagg` as a user runs it: mooncake_master, 2 prefill and 2 decode instance processes and
the conductor, on loopback. The pool skips prefill across instances; faults (the master killed and restarted,
a decode instance killed mid-stream, a prefill instance killed) end requests promptly, correctly or with an
error event, and the survivors take the new ones; no KV block is left behind; SIGTERM stops every process."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from disagg_helpers import listening, need_mooncake
from test_serve_api import LLM, MODEL, greedy, metric, model, tok  # noqa: F401

need_mooncake()

import httpx  # noqa: E402

from nanoforge.model.hf import save_model  # noqa: E402
from nanoforge.serve.disagg.mooncake_store import MooncakeMaster  # noqa: E402


class Cluster:
    """The launcher's process and what it printed: the conductor's URL, and the URL and pid of every child."""

    def __init__(self, model_dir: Path, shape: tuple[str, ...] = ("--prefill", "2", "--decode", "2")):
        cmd = [sys.executable, "-m", "nanoforge.cli", "serve", "--disagg", "--model", str(model_dir), *shape,
               "--port", "0", "--device", "cpu", "--pool-memory", "0.02", "--policy", "round-robin",
               "--served-model-name", MODEL, "--max-num-seqs", "64", "--shutdown-timeout", "3",
               "--log-level", "warning"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.lines: list[str] = []
        self.children: dict[str, tuple[str, int]] = {}  # "prefill 1" -> (url, pid); "master" -> (host:port, pid)
        self.url: str | None = None
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + 180
        while self.url is None or not healthy(self.url):  # the banner comes when the port is bound, not served
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.proc.kill()
                raise AssertionError("the cluster did not start:\n" + "\n".join(self.lines[-30:]))
            self.ready.wait(0.1)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if m := re.search(r"mooncake_master at (\S+) \(pid (\d+)\)", line):
                self.children["master"] = (m.group(1), int(m.group(2)))
            elif m := re.search(r"--disagg: ((?:prefill|decode|both) \d) at (\S+) \(pid (\d+)\)", line):
                self.children[m.group(1)] = (m.group(2), int(m.group(3)))
            elif m := re.search(r"^nanoforge conductor: \S+ at (http://127\.0\.0\.1:\d+)/v1", line):
                self.url = m.group(1)
                self.ready.set()
        self.ready.set()

    def pid(self, name: str) -> int:
        return self.children[name][1]

    def named(self, url: str) -> str:
        return next(name for name, (u, _) in self.children.items() if u == url)

    def live_instances(self) -> list[str]:
        return [u for name, (u, pid) in self.children.items() if name != "master" and alive(pid)]


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.fixture(scope="module")
def llm(model, tok):
    return LLM(model, tok, num_gpu_blocks=600)


@pytest.fixture(scope="module")
def cluster(model, tok, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tiny")
    save_model(model, model_dir)
    tok.save(model_dir)
    c = Cluster(model_dir)
    c.restarted_master = None
    yield c
    c.proc.send_signal(signal.SIGTERM)
    try:
        assert c.proc.wait(60) == 128 + signal.SIGTERM, "\n".join(c.lines[-20:])
    finally:
        if c.restarted_master is not None:
            c.restarted_master.stop()
        if c.proc.poll() is None:
            c.proc.kill()
    assert "stopped the conductor, 4 instances and mooncake_master" in c.lines[-1]
    left = [name for name, (_, pid) in c.children.items() if alive(pid)]
    assert not left, f"orphans: {left}"


def complete(url: str, prompt, max_tokens: int = 8, **kw) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=60, json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                              "temperature": 0, "ignore_eos": True, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def instance_metric(cluster: Cluster, name: str, metric_name: str) -> float:
    return metric(cluster.children[name][0], metric_name, default=0.0)


def test_loopback_only_and_the_pool_skips_prefill_across_instances(cluster, llm):
    # every port of ours is on loopback; the only others are Mooncake's transfer engine (2 per store client,
    # bound to every interface by Mooncake itself: see serve/disagg/mooncake_store.py)
    pids = {pid for _, pid in cluster.children.values()} | {cluster.proc.pid}
    ours = {int(u.rsplit(":", 1)[1]) for u, _ in cluster.children.values()} | {int(cluster.url.rsplit(":", 1)[1])}
    socks = listening(pids)
    assert ours <= {port for _, port, _ in socks}
    for address, port, pid in socks:
        if port in ours or pid == cluster.pid("master"):
            assert address == "127.0.0.1", (address, port, pid)
    for pid in pids - {cluster.pid("master")}:
        assert len([s for s in socks if s[2] == pid and s[0] != "127.0.0.1"]) <= 2

    prefix = [(3 * i) % 60 for i in range(224)]  # 14 full blocks
    loaded = {n: instance_metric(cluster, n, "nanoforge_kv_pool_loaded_blocks_total") for n in ("prefill 1", "prefill 2")}
    first = complete(cluster.url, prefix + [1, 2, 3])
    second = complete(cluster.url, prefix + [4, 5, 6, 7])  # round-robin: the other prefill instance
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 224  # from the pool, computed elsewhere
    now = {n: instance_metric(cluster, n, "nanoforge_kv_pool_loaded_blocks_total") for n in loaded}
    assert sorted(now[n] - loaded[n] for n in loaded) == [0, 14]
    want = greedy(llm, [prefix + [1, 2, 3], prefix + [4, 5, 6, 7]], 8)
    assert [first["choices"][0]["text"], second["choices"][0]["text"]] == [w.text for w in want]


def test_a_dead_master_means_computing_locally_and_a_restarted_one_is_used_again(cluster, llm):
    address, pid = cluster.children["master"]
    os.kill(pid, signal.SIGKILL)
    prompt = [(7 * i) % 60 for i in range(100)]
    t0 = time.monotonic()
    for extra in ([1], [2], [3]):  # correct answers, each bounded by the pool calls' time limits
        out = complete(cluster.url, prompt + extra)
        assert out["choices"][0]["text"] == greedy(llm, [prompt + extra], 8)[0].text
    assert time.monotonic() - t0 < 20
    cluster.restarted_master = MooncakeMaster(int(address.rsplit(":", 1)[1])).start()  # empty, on the same port
    deadline = time.monotonic() + 40
    k = 0
    while True:  # the instances' clients remount their pool memory; then a fresh prefix crosses instances again
        k += 1
        fresh = [(11 * i + k) % 60 for i in range(64)]
        complete(cluster.url, fresh + [1])
        if complete(cluster.url, fresh + [2])["usage"]["prompt_tokens_details"]["cached_tokens"] == 64:
            break
        assert time.monotonic() < deadline, "the pool was not used again after the master restarted"
        time.sleep(0.5)


def test_a_decode_instance_killed_mid_stream(cluster, llm):
    """Four long streams; once they are under way both decode instances are frozen (so that none can finish),
    the one with more of them is killed and the other thawed: its streams end at once with an error event,
    the others finish right, and new requests go to the survivor."""
    url = cluster.url
    prompts = [f"the quick brown {c}" for c in "abcd"]
    events: list[list[str]] = [[] for _ in prompts]
    started = [threading.Event() for _ in prompts]

    def stream(i):
        body = {"model": MODEL, "prompt": prompts[i], "max_tokens": 230, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events[i].append(line[6:])
                    if len(events[i]) == 3:
                        started[i].set()

    readers = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for t in readers:
        t.start()
    assert all(e.wait(30) for e in started)
    decodes = {name: cluster.children[name] for name in ("decode 1", "decode 2")}
    for _, pid in decodes.values():
        os.kill(pid, signal.SIGSTOP)
    time.sleep(0.3)  # what was on its way to the conductor has arrived
    running = {name: metric(url, "nanoforge_instance_requests_running", {"url": u, "role": "decode"})
               for name, (u, _) in decodes.items()}
    victim = max(running, key=running.get)
    # on a busy machine the first stream may have finished before the last one started (230 tokens is the
    # model's context): the conductor counts exactly the streams still open
    assert running[victim] >= 1 and sum(running.values()) == sum(t.is_alive() for t in readers)
    os.kill(decodes[victim][1], signal.SIGKILL)
    t0 = time.monotonic()
    for name, (_, pid) in decodes.items():
        if name != victim:
            os.kill(pid, signal.SIGCONT)
    for t in readers:
        t.join(30)
    assert not any(t.is_alive() for t in readers) and time.monotonic() - t0 < 30  # nobody hangs
    want = greedy(llm, prompts, 230)
    failed = 0
    for i, evs in enumerate(events):
        assert evs[-1] == "[DONE]"
        last = json.loads(evs[-2])
        if "error" in last:  # one of the victim's: ended at once with an error event
            failed += 1
            assert last["error"]["code"] == "service_unavailable" and "decode instance" in last["error"]["message"]
        else:
            assert "".join(json.loads(e)["choices"][0]["text"] for e in evs[:-1]) == want[i].text
    assert failed == running[victim]
    texts = asyncio.run(_many(url, [f"fox {i}" for i in range(6)]))  # the survivor takes the new ones
    assert texts == [w.text for w in greedy(llm, [f"fox {i}" for i in range(6)], 8)]
    assert metric(url, "nanoforge_instance_up", {"url": decodes[victim][0], "role": "decode"}) == 0


def test_a_prefill_instance_killed(cluster, llm):
    url = cluster.url
    victim = cluster.children["prefill 1"]
    os.kill(victim[1], signal.SIGKILL)
    prompts = [f"lazy dog {i}" for i in range(8)]
    t0 = time.monotonic()
    texts = asyncio.run(_many(url, prompts))  # those that meet the dead one first are retried on the other
    assert texts == [w.text for w in greedy(llm, prompts, 8)] and time.monotonic() - t0 < 30
    assert metric(url, "nanoforge_instance_up", {"url": victim[0], "role": "prefill"}) == 0


def test_no_kv_block_is_left_on_any_instance(cluster):
    for instance in cluster.live_instances():
        deadline = time.monotonic() + 20
        while metric(instance, "nanoforge_num_requests_running") + metric(instance, "nanoforge_num_requests_waiting"):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert metric(instance, "nanoforge_kv_blocks_used") == 0, instance
    assert metric(cluster.url, "nanoforge_num_requests_running") == 0


async def _many(url: str, prompts: list[str]) -> list[str]:
    async with httpx.AsyncClient(timeout=60) as client:
        async def one(p):
            r = await client.post(url + "/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 8,
                                                                 "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        return await asyncio.gather(*map(one, prompts))


def test_the_launcher_passes_the_engine_flags_it_was_given_to_every_instance():
    """`serve --disagg` starts its instances with the flags they act on: values, and on/off switches only where
    given (an instance left to its default decides for itself: graphed prefill on a GPU, async scheduling on a
    decode instance)."""
    from nanoforge.cli import build_parser
    from nanoforge.serve.disagg.launcher import _instance_cmd

    def cmd(*flags):
        args = build_parser().parse_args(["serve", "--disagg", "--model", "m", *flags])
        return _instance_cmd(args, "decode", "127.0.0.1:5", None)

    plain = cmd()
    assert "--kv-pool-workers" in plain and plain[plain.index("--kv-pool-workers") + 1] == "4"
    assert not any("graph-prefill" in a or "async-scheduling" in a for a in plain)
    given = cmd("--no-graph-prefill", "--async-scheduling", "--kv-pool-workers", "2", "--max-num-seqs", "7")
    assert "--no-graph-prefill" in given and "--async-scheduling" in given
    assert given[given.index("--kv-pool-workers") + 1] == "2" and given[given.index("--max-num-seqs") + 1] == "7"


def test_colocated_instances_behind_the_conductor(model, tok, tmp_path, llm):
    """`serve --disagg --colocated 2`: two --role both instances sharing the pool, each running whole requests
    behind the conductor (round-robin here: each takes every other), the single engine's greedy tokens; a prompt
    computed on one is a pool hit on the other; SIGTERM stops the three processes and the master."""
    save_model(model, tmp_path)
    tok.save(tmp_path)
    c = Cluster(tmp_path, ("--colocated", "2"))
    try:
        assert any("(2 colocated instances, policy round-robin" in line for line in c.lines)
        assert sorted(n for n in c.children if n != "master") == ["both 1", "both 2"]
        # every port of ours on loopback (the others are Mooncake's transfer engine's, as in the first test)
        ours = {int(u.rsplit(":", 1)[1]) for n, (u, _) in c.children.items() if n != "master"}
        ours.add(int(c.url.rsplit(":", 1)[1]))
        socks = listening({pid for _, pid in c.children.values()} | {c.proc.pid})
        assert ours <= {port for _, port, _ in socks}
        assert all(address == "127.0.0.1" for address, port, pid in socks if port in ours or pid == c.pid("master"))
        prefix = [(5 * i) % 60 for i in range(160)]  # 10 full blocks
        prompts = [prefix + [1], prefix + [2], [7, 8, 9], [9, 8, 7, 6]]
        outs = [complete(c.url, p) for p in prompts]
        assert [o["choices"][0]["text"] for o in outs] == [w.text for w in greedy(llm, prompts, 8)]
        assert outs[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 160  # from the pool: the other one's
        assert [instance_metric(c, n, "nanoforge_e2e_request_latency_seconds_count") for n in ("both 1", "both 2")] \
            == [2, 2]
    finally:
        c.proc.send_signal(signal.SIGTERM)
        assert c.proc.wait(60) == 128 + signal.SIGTERM, "\n".join(c.lines[-20:])
    assert "stopped the conductor, 2 instances and mooncake_master" in c.lines[-1]
    assert not [name for name, (_, pid) in c.children.items() if alive(pid)]
