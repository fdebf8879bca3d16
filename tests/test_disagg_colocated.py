"""The conductor over colocated instances (`nanoforge conductor --colocated`, `serve --disagg --colocated K`): two
`--role both` instances sharing a pool, each running whole requests, against the single server on the same
weights (the same tokens, streams and errors), with cache-aware routing sending a prompt whose prefix one
instance holds to that instance. In this process, over a real mooncake_master on loopback."""

from __future__ import annotations

import random

import pytest
from disagg_helpers import need_mooncake
from test_disagg_serving import CONFIG, conductor_cluster, post, random_text, same, streamed
from test_serve_api import MODEL, metric, model, serving, tok  # noqa: F401

need_mooncake()

import httpx  # noqa: E402

from nanoforge.cli import main  # noqa: E402
from nanoforge.errors import NanoforgeError  # noqa: E402
from nanoforge.serve.api import build_app  # noqa: E402
from nanoforge.serve.disagg.conductor import Conductor, build_conductor_app, discover  # noqa: E402
from nanoforge.serve.disagg.launcher import instance_devices  # noqa: E402
from nanoforge.serve.disagg.process import free_port  # noqa: E402
from nanoforge.serve.disagg.router import Instance  # noqa: E402
from nanoforge.serve.llm_engine import EngineConfig, LLMEngine  # noqa: E402

@pytest.fixture(scope="module")
def colocated(model, tok):
    """Two `both` instances behind the conductor (`conductor_cluster`)."""
    with conductor_cluster(model, tok, ("both", "both")) as c:
        yield c


def test_outputs_equal_the_single_server_and_each_request_runs_on_one_instance(colocated):
    url, single, apps, conductor = colocated
    assert conductor.router.colocated and [i.role for i in conductor.instances] == ["both", "both"]
    rng = random.Random(1)
    shared = random_text(rng, 60, 60)
    bodies = [{"model": MODEL, "prompt": p, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "logprobs": 2}
              for p in (random_text(rng, 1, 15), random_text(rng, 40, 120), shared + "ab", shared + "the fox")]
    bodies += [{"model": MODEL, "prompt": shared + "x", "max_tokens": 8, "n": 3, "temperature": 1.0, "seed": 5},
               {"model": MODEL, "messages": [{"role": "user", "content": "the dog"}], "max_tokens": 6,
                "temperature": 0},
               {"model": MODEL, "prompt": "the dog", "max_tokens": 12, "temperature": 0, "stop": [" "]}]
    computed = [app.state.engine.stats()["computed_tokens"] for app in apps]
    for body in bodies:
        same(post(url, body).json(), post(single, body).json())
    for body in bodies[:2] + bodies[-3:]:
        text, finish, usage, errors = streamed(url, body)
        text1, finish1, usage1, errors1 = streamed(single, body)
        assert (text, finish, errors) == (text1, finish1, errors1)
        assert usage["completion_tokens"] == usage1["completion_tokens"]
    # one instance a request, counted once (one after another, the cache-aware policy finds the first as good)
    assert sum(i.routed for i in conductor.instances) == len(bodies) + 5
    assert sum(app.state.engine.stats()["computed_tokens"] - c for app, c in zip(apps, computed)) > 0
    assert not conductor.streams and all(i.running == 0 for i in conductor.instances)
    assert conductor.router.prefill_fit.n and conductor.router.step_fit.n  # it learns from the streams
    # round-robin over the same instances: every other request on each, the same answers
    other = Conductor([Instance(i.url, i.role, i.info) for i in conductor.instances], policy="round-robin")
    with serving(build_conductor_app(other)) as url2:
        for body in bodies[:4]:
            same(post(url2, body).json(), post(single, body).json())
    assert [i.routed for i in other.instances] == [2, 2]


def test_a_prompt_goes_where_its_prefix_is_cached(colocated):
    url, single, apps, conductor = colocated
    prefix = [(7 * i) % 60 for i in range(96)]  # 6 full blocks
    body = {"model": MODEL, "prompt": prefix + [1], "max_tokens": 3, "temperature": 0}
    before = [i.routed for i in conductor.instances]
    first = post(url, body).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    home = next(k for k, i in enumerate(conductor.instances) if i.routed > before[k])
    for j in (2, 3):  # the instance that computed the prefix holds it: cache-aware routing sends these there
        again = post(url, {**body, "prompt": prefix + [j]}).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
        assert again["choices"] == post(single, {**body, "prompt": prefix + [j]}).json()["choices"]
    assert [i.routed - b for i, b in zip(conductor.instances, before)] == [3 if k == home else 0 for k in range(2)]
    assert metric(url, "nanoforge_instance_up", {"url": conductor.instances[1].url, "role": "both"}) == 1
    assert metric(url, "nanoforge_time_to_first_token_seconds_count") >= 3


def test_bad_input_and_generate_on_the_wrong_role(colocated, model, tok):
    url, single, apps, conductor = colocated
    body = {"model": MODEL, "prompt": "x" * 5000, "max_tokens": 3}
    a, b = post(url, body), post(single, body)
    assert (a.status_code, a.json()) == (b.status_code, b.json()) and a.status_code == 400
    inst = conductor.instances[0].url
    r = httpx.post(inst + "/disagg/generate", json={"request_id": "r", "prompt": "text", "params": {}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    prefill_only = build_app(LLMEngine(model, tok, EngineConfig(**CONFIG)), MODEL)
    from nanoforge.serve.disagg.instance import add_role_routes

    add_role_routes(prefill_only, "prefill", MODEL)
    try:
        with serving(prefill_only) as p:
            assert httpx.post(p + "/disagg/generate", json={}).status_code == 404  # colocated instances only
            with pytest.raises(NanoforgeError, match="not both kinds"):
                discover([p], [], timeout=5, colocated_urls=[inst])
            with pytest.raises(NanoforgeError, match="listed as a both one"):
                discover([], [], timeout=5, colocated_urls=[p])
    finally:
        prefill_only.state.engine.engine.close()


def test_bad_command_lines_are_one_line_and_exit_2(colocated, capsys, tmp_path):
    inst = colocated[3].instances[0].url
    (tmp_path / "config.json").write_text("{}")
    cases = [
        (["serve", "--model", str(tmp_path), "--colocated", "2"], "--disagg"),
        (["serve", "--model", str(tmp_path), "--devices", "0,1"], "--disagg"),
        (["serve", "--disagg", "--model", str(tmp_path), "--colocated", "2", "--prefill", "2"], "not both"),
        (["serve", "--disagg", "--model", str(tmp_path), "--devices", "0,0"], "a GPU of its own"),
        (["serve", "--disagg", "--model", str(tmp_path), "--devices", "0"], "a GPU of its own"),
        (["serve", "--disagg", "--model", str(tmp_path), "--devices", "a,b"], "GPU indices"),
        (["conductor"], "--colocated"),
        (["conductor", "--prefill", inst], "--colocated"),
        (["conductor", "--colocated", inst, "--decode", inst], "not both kinds"),
    ]
    for argv, words in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err and "Traceback" not in err, (argv, err)
    assert instance_devices(None, 3) is None and instance_devices("1, 0", 2) == ["1", "0"]


def test_a_colocated_instance_that_cannot_be_reached_is_routed_around(colocated):
    """A second conductor over a dead colocated instance (nothing listens at its address) and a live one, taking
    turns: every request that went to the dead one is retried on the live one and answers as the single server."""
    url, single, apps, conductor = colocated
    live = conductor.instances[0]
    dead = Instance(f"http://127.0.0.1:{free_port()}", "both", live.info)
    other = Conductor([dead, Instance(live.url, "both", live.info)], policy="round-robin", health_interval=3600)
    with serving(build_conductor_app(other)) as url2:
        for i in range(4):
            body = {"model": MODEL, "prompt": f"the cat {i}", "max_tokens": 6, "temperature": 0}
            assert post(url2, body).json()["choices"] == post(single, body).json()["choices"]
        assert other.counters["retries"] >= 1 and not dead.healthy
        assert metric(url2, "nanoforge_handover_retries_total") >= 1
