"""The conductor with one prefill and one decode instance, against the single server on the same weights: the
same tokens (greedy, mixed prompt lengths, with and without pool hits, streaming and not, seeded sampling, n > 1,
stop strings, logprobs, echo, chat), the same 4xx bodies for bad input, cached_tokens, and no KV block left
behind. Everything runs in this process (uvicorn threads) over a real mooncake_master on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading

import pytest
from disagg_helpers import SEGMENT, close, close_all, need_mooncake
from test_serve_api import HOSTILE, LETTERS, MODEL, http, metric, model, one_torch_thread, serving, tok  # noqa: F401

need_mooncake()

import httpx  # noqa: E402

from nanoforge.cli import main  # noqa: E402
from nanoforge.serve.api import build_app  # noqa: E402
from nanoforge.serve.disagg.conductor import Conductor, build_conductor_app, discover  # noqa: E402
from nanoforge.serve.disagg.instance import add_role_routes  # noqa: E402
from nanoforge.serve.disagg.mooncake_store import MooncakeMaster, MooncakeStore  # noqa: E402
from nanoforge.serve.disagg.process import free_port  # noqa: E402
from nanoforge.serve.disagg.router import Instance, Router  # noqa: E402
from nanoforge.serve.llm_engine import EngineConfig, LLMEngine  # noqa: E402

CONFIG = dict(num_gpu_blocks=600, max_num_seqs=64)


def instance_app(model, tok, role, store):
    engine = LLMEngine(model, tok, EngineConfig(**CONFIG, kv_pool_save=role != "decode"), kv_pool=store)
    app = build_app(engine, MODEL)
    add_role_routes(app, role, MODEL)
    return app


@contextlib.contextmanager
def conductor_cluster(model, tok, roles: tuple[str, str]):
    """Two instances of `roles` (("prefill", "decode") or ("both", "both")), each with its share of a Mooncake
    pool, behind a conductor, and a single server on the same weights: (conductor URL, single server URL, [the
    instances' apps], conductor)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(one_torch_thread())
        master = stack.enter_context(MooncakeMaster())
        stores = [MooncakeStore(master.address, segment_bytes=SEGMENT) for _ in roles]
        lookups = MooncakeStore(master.address)  # the conductor's: holds no part of the pool
        stack.callback(close_all, [*stores, lookups])
        apps = [instance_app(model, tok, role, store) for role, store in zip(roles, stores)]
        stack.callback(lambda: [app.state.engine.engine.close() for app in apps])
        urls = [stack.enter_context(serving(app)) for app in apps]
        found = (discover([], [], timeout=10, colocated_urls=urls) if roles[0] == "both"
                 else discover(urls[:1], urls[1:], timeout=10))
        conductor = Conductor(found, store=lookups)
        url = stack.enter_context(serving(build_conductor_app(conductor)))
        single = stack.enter_context(serving(build_app(LLMEngine(model, tok, EngineConfig(**CONFIG)), MODEL)))
        yield url, single, apps, conductor


@pytest.fixture(scope="module")
def cluster(model, tok):
    """A prefill and a decode instance behind the conductor (`conductor_cluster`)."""
    with conductor_cluster(model, tok, ("prefill", "decode")) as c:
        yield c


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/" + ("chat/completions" if "messages" in body else "completions"), json=body,
                      timeout=60)


def same(a: dict, b: dict) -> None:
    """Two responses alike but for ids, times and what each one's caches held."""
    for r in (a, b):
        r.pop("id"), r.pop("created")
        r["usage"].pop("prompt_tokens_details")
    assert close(a, b), (a, b)


def streamed(url: str, body: dict) -> tuple[dict[int, str], dict[int, str], dict, list]:
    """A stream's text and finish reason per choice, its usage chunk, and its error events."""
    text, finish, usage, errors = {}, {}, None, []
    with httpx.stream("POST", url + "/v1/" + ("chat/completions" if "messages" in body else "completions"),
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errors.append(chunk["error"])
                continue
            usage = chunk.get("usage") or usage
            for c in chunk["choices"]:
                piece = c["delta"].get("content", "") if "delta" in c else c["text"]
                text[c["index"]] = text.get(c["index"], "") + (piece or "")
                if c["finish_reason"]:
                    finish[c["index"]] = c["finish_reason"]
    return text, finish, usage, errors


def random_text(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi)))


def test_greedy_and_sampled_outputs_equal_the_single_server(cluster):
    url, single, apps, conductor = cluster
    rng = random.Random(0)
    shared = random_text(rng, 60, 60)
    prompts = [random_text(rng, 1, 15), random_text(rng, 16, 16), random_text(rng, 40, 120), shared + "ab",
               shared + "the fox", [rng.randrange(60) for _ in range(90)], shared + "dog"]
    bodies = []
    for p in prompts:
        bodies.append({"model": MODEL, "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                       "logprobs": 2})
    bodies += [
        {"model": MODEL, "prompt": shared + "x", "max_tokens": 10, "n": 3, "temperature": 1.0, "seed": 5},
        {"model": MODEL, "prompt": shared, "max_tokens": 30, "temperature": 0.8, "top_k": 20, "seed": 9,
         "ignore_eos": True},
        {"model": MODEL, "prompt": prompts[:3], "max_tokens": 6, "temperature": 0, "ignore_eos": True},
        {"model": MODEL, "prompt": shared, "max_tokens": 1, "temperature": 0},  # done after the prefill
        {"model": MODEL, "prompt": shared, "max_tokens": 5, "echo": True, "logprobs": 1, "temperature": 0},
        {"model": MODEL, "prompt": shared, "max_tokens": 0, "echo": True, "logprobs": 1},  # prefill only
        {"model": MODEL, "messages": [{"role": "user", "content": shared}], "max_tokens": 8, "temperature": 0,
         "logprobs": True, "top_logprobs": 2},
    ]
    single_text = post(single, bodies[0]).json()["choices"][0]["text"]
    bodies.append({"model": MODEL, "prompt": prompts[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                   "stop": [single_text[4:6]]})  # a stop string mid-way
    for body in bodies:
        a, b = post(url, body), post(single, body)
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        same(a.json(), b.json())
    for body in bodies[:2] + bodies[7:9] + bodies[-3:]:  # streams: the same texts and finish reasons
        ta, fa, ua, ea = streamed(url, body)
        tb, fb, ub, eb = streamed(single, body)
        assert (ta, fa, ea) == (tb, fb, eb) and ua["completion_tokens"] == ub["completion_tokens"]


def test_the_hand_over_goes_through_the_pool_and_hits_are_cached_tokens(cluster):
    """The decode instance takes the prompt's blocks from the pool and computes only the rest; a second prompt
    with the same prefix is computed from the prefill instance's cache: cached_tokens counts it."""
    url, single, apps, conductor = cluster
    decode = apps[1].state.engine
    prompt = [(5 * i) % 60 for i in range(100)]  # 6 full blocks and 4 tokens
    before = decode.stats()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    first = post(url, body).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    after = decode.stats()
    assert after["kv_pool"]["loaded_blocks"] - before["kv_pool"]["loaded_blocks"] == 6
    # the decode instance computed the last 4 prompt tokens and the first output token, then 3 decodes
    assert after["computed_tokens"] - before["computed_tokens"] == 4 + 1 + 3
    again = post(url, {**body, "prompt": prompt + [7]}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    assert again["choices"] == post(single, {**body, "prompt": prompt + [7]}).json()["choices"]
    assert first["choices"] == post(single, body).json()["choices"]
    assert metric(url, "nanoforge_prefix_cache_hit_rate") > 0
    assert metric(url, "nanoforge_kv_pool_lookup_hit_blocks_total") >= 6  # the conductor saw them in the pool


@pytest.mark.parametrize("endpoint,body,status,param", HOSTILE,
                         ids=[f"{i}-{e}-{s}-{p}" for i, (e, _, s, p) in enumerate(HOSTILE)])
def test_bad_input_gets_the_single_servers_bodies(cluster, http, endpoint, body, status, param):
    url, single = cluster[:2]
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    a = http.post(f"{url}/v1/{endpoint}", **kw)
    b = http.post(f"{single}/v1/{endpoint}", **kw)
    assert (a.status_code, a.json()) == (b.status_code, b.json()) and a.status_code == status


def test_metrics_disconnects_and_no_blocks_left(cluster):
    url, single, apps, conductor = cluster
    before = metric(url, "nanoforge_e2e_request_latency_seconds_count")
    post(url, {"model": MODEL, "prompt": "the dog", "max_tokens": 4})
    assert metric(url, "nanoforge_e2e_request_latency_seconds_count") == before + 1
    assert metric(url, "nanoforge_instance_up", {"url": conductor.instances[0].url, "role": "prefill"}) == 1
    assert httpx.get(url + "/health").json() == {"status": "ok"}

    async def leave_mid_stream(client, i):  # clients that go away after their first chunk
        body = {"model": MODEL, "prompt": f"dog {i}", "max_tokens": 200, "ignore_eos": True, "stream": True}
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    return

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            await asyncio.gather(*(leave_mid_stream(client, i) for i in range(8)))
        with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
            await httpx.AsyncClient(timeout=0.3).post(url + "/v1/completions", json={
                "model": MODEL, "prompt": "lazy", "max_tokens": 240, "n": 8, "ignore_eos": True})

    asyncio.run(main())
    for app in apps:  # the conductor's aborts reached both instances: every block is back
        engine = app.state.engine
        deadline = 20
        while (s := engine.stats())["num_running"] + s["num_waiting"] and deadline > 0:
            deadline -= 0.1
            threading.Event().wait(0.1)
        assert s["num_running"] == s["num_waiting"] == s["kv_blocks_used"] == 0
    assert not conductor.streams


def test_instances_that_cannot_be_reached_are_routed_around(cluster, model, tok):
    """A second conductor over the same instances plus a dead prefill and a dead decode instance (nothing
    listens at their addresses), taking turns: every request is retried on the live ones and answers right."""
    url, single, apps, conductor = cluster
    live_p, live_d = conductor.router.prefill[0], conductor.router.decode[0]
    dead = [Instance(f"http://127.0.0.1:{free_port()}", role, live.info) for role, live in
            (("prefill", live_p), ("decode", live_d))]
    other = Conductor([Instance(live_p.url, "prefill", live_p.info), dead[0], dead[1],
                       Instance(live_d.url, "decode", live_d.info)], policy="round-robin", health_interval=3600)
    with serving(build_conductor_app(other)) as url2:
        for i in range(4):
            body = {"model": MODEL, "prompt": f"the dog {i}", "max_tokens": 6, "temperature": 0}
            a, b = post(url2, body).json(), post(single, body).json()
            assert a["choices"] == b["choices"]
        assert other.counters["retries"] >= 2 and not any(d.healthy for d in dead)
        assert metric(url2, "nanoforge_handover_retries_total") >= 2


def test_early_rejection_answers_429_at_once(cluster):
    """Once the cost model has seen a few requests, a request predicted to miss its TTFT objective gets 429 with
    Retry-After and OpenAI's rate-limit body, before anything runs."""
    url, single, apps, conductor = cluster
    strict = Conductor([Instance(i.url, i.role, i.info) for i in conductor.instances], ttft_slo=1e-9)
    with serving(build_conductor_app(strict)) as url2:
        body = {"model": MODEL, "prompt": "the lazy dog", "max_tokens": 3}
        for _ in range(3):  # nothing to predict with yet: served
            assert post(url2, body).status_code == 200
        routed = sum(i.routed for i in strict.instances)
        r = post(url2, body)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error" and "--ttft-slo" in r.json()["error"]["message"]
        assert sum(i.routed for i in strict.instances) == routed  # it never reached an instance
        assert metric(url2, "nanoforge_early_rejections_total", {"slo": "ttft"}) == 1


BAD_HANDOVERS = [
    # (endpoint, body, status, param): the instances' own endpoints check what they are sent like any request
    ("prefill", {"request_id": "r", "prompt": [1, 2]}, 400, "body"),
    ("prefill", {"request_id": "", "prompt": [1, 2], "params": {}}, 400, "request_id"),
    ("prefill", {"request_id": "r", "prompt": "text", "params": {}}, 400, "prompt"),
    ("prefill", {"request_id": "r", "prompt": [1, 10**6], "params": {}}, 400, "prompt"),
    ("prefill", {"request_id": "r", "prompt": [1, 2], "params": {"temperature": -1}}, 400, "temperature"),
    ("prefill", {"request_id": "r", "prompt": [1, 2], "params": {"wizard": 1}}, 400, "params"),
    ("decode", {"request_id": "r", "prompt": [1, 2], "params": {}}, 400, "body"),
    ("decode", {"request_id": "r", "prompt": [1, 2], "params": {}, "outputs": [{"index": 0}]}, 400, "outputs"),
    ("decode", {"request_id": "r", "prompt": [1, 2], "params": {}, "outputs": []}, 400, "outputs"),
    ("decode", {"request_id": "r", "prompt": [1, 2], "params": {"max_tokens": 2},
                "outputs": [{"index": 0, "token_ids": [3, 4], "logprobs": None}]}, 400, "outputs"),
    ("decode", {"request_id": "r", "prompt": [1, 2], "params": {"n": 2},
                "outputs": [{"index": 2, "token_ids": [3], "logprobs": None}]}, 400, "outputs"),
    ("decode", {"request_id": "r", "prompt": [1, 2], "params": {"logprobs": 1},
                "outputs": [{"index": 0, "token_ids": [3], "logprobs": None}]}, 400, "outputs"),
]


@pytest.mark.parametrize("endpoint,body,status,param", BAD_HANDOVERS)
def test_bad_hand_overs_are_4xx(cluster, http, endpoint, body, status, param):
    conductor = cluster[3]
    inst = conductor.router.prefill[0] if endpoint == "prefill" else conductor.router.decode[0]
    r = http.post(f"{inst.url}/disagg/{endpoint}", json=body)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    wrong = conductor.router.decode[0] if endpoint == "prefill" else conductor.router.prefill[0]
    assert http.post(f"{wrong.url}/disagg/{endpoint}", json=body).status_code == 404  # not this instance's role


def test_bad_command_lines_are_one_line_and_exit_2(cluster, capsys, tmp_path):
    url, single, apps, conductor = cluster
    prefill, decode = conductor.router.prefill[0].url, conductor.router.decode[0].url
    nobody = f"http://127.0.0.1:{free_port()}"
    cases = [
        (["serve", "--model", str(tmp_path), "--prefill", "2"], "--disagg"),
        (["serve", "--disagg"], "--model"),
        (["serve", "--disagg", "--model", str(tmp_path)], "config.json"),
        (["serve", "--disagg", "--model", str(tmp_path), "--store", "127.0.0.1:1"], "--store"),
        (["serve", "--model", str(tmp_path), "--role", "decode", "--store", "nohost"], "HOST:PORT"),
        (["conductor", "--prefill", nobody, "--decode", decode, "--wait-timeout", "0.3"], "no answer from"),
        (["conductor", "--prefill", decode, "--decode", decode], "is a decode instance"),
        (["conductor", "--prefill", single, "--decode", decode], "not a nanoforge instance"),
        (["conductor", "--prefill", prefill, "--decode", decode, "--ttft-slo", "-1"], "--ttft-slo"),
        (["conductor", "--prefill", prefill, "--decode", decode, "--policy", "fastest"], "--policy"),
    ]
    for argv, words in cases:
        with pytest.raises(SystemExit) if "-1" in argv or "fastest" in argv else contextlib.nullcontext():
            assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err and "Traceback" not in err, (argv, err)


def test_cache_aware_routing_prefers_the_instance_that_holds_the_prefix():
    """The router alone: the prefill instance whose cache holds the prompt wins while it is not busier than the
    transfer from the pool is worth; early rejection once the cost model predicts over the objective."""
    a, b = (Instance(f"http://{n}", "prefill", {"block_size": 16, "kv_block_bytes": 10**8}) for n in "ab")
    d = Instance("http://d", "decode", {})
    router = Router([a, b], [d], "cache-aware", ttft_slo=1.0)
    hashes = list(range(10))
    a.remember(hashes[:8])
    assert router.plan(170, hashes, pool_blocks=0).prefill is a  # 8 blocks cached there, none elsewhere
    assert router.plan(170, hashes, pool_blocks=8).prefill is a  # b would load 8 x 100 MB from the pool
    a.queued_tokens = 10**7  # ... unless a is swamped
    assert router.plan(170, hashes, pool_blocks=8).prefill is b
    for n in (100, 1000, 10000):  # 1 ms per 1,000 tokens, measured
        router.prefill_fit.observe(n, n / 1e6)
    assert router.predict_ttft(b, hashes, 0, 170) == pytest.approx(170 / 1e6, rel=1e-6)
    b.queued_tokens = 2 * 10**6  # two seconds of work queued everywhere: over the 1 s objective
    a.queued_tokens = 2 * 10**6
    with pytest.raises(Exception) as e:
        router.plan(170, hashes, 0)
    assert e.value.status == 429 and e.value.retry_after >= 1 and router.rejected["ttft"] == 1
