"""The OpenAI-compatible server, over real HTTP on loopback: the `openai` client for the happy paths, raw
httpx for hostile bodies, 64 concurrent streams with disconnects, backpressure, a failing engine step, and a
SIGTERM drain of a `nanoforge serve` subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from test_serve_engine import TEXT, make_model  # noqa: E402  (tests/ is on sys.path under pytest)

from nanoforge import LLM, SamplingParams  # noqa: E402
from nanoforge.model.config import preset  # noqa: E402
from nanoforge.model.hf import save_model  # noqa: E402
from nanoforge.model.transformer import Transformer  # noqa: E402
from nanoforge.serve.api import Server, build_app  # noqa: E402
from nanoforge.serve.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from nanoforge.tokenizer import Tokenizer  # noqa: E402

MODEL = "tiny"
LETTERS = "the quick brown fox jumps over lazy dog"


# --- helpers shared with test_bench_serve.py --------------------------------------------------------------

@contextlib.contextmanager
def one_torch_thread():
    """The tiny model's ops are far too small for a thread pool; on a busy 2-core box two threads
    spin-wait on each other and make every step ~100x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@contextlib.contextmanager
def serving(app, grace: float = 5.0):
    """Run `app` with uvicorn on an ephemeral loopback port in a background thread; yield its base URL."""
    server = Server(app, "127.0.0.1", 0, grace=grace, log_level="warning")
    sock = server.config.bind_socket()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive()


def wait_idle(app, timeout: float = 20.0) -> dict:
    """Engine stats once no request runs or waits (aborts reach the engine thread asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = app.state.engine.stats()
        if (stats["num_running"] == stats["num_waiting"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def metric(url: str, name: str, labels: dict | None = None, default: float | None = None) -> float:
    """One sample of the server's /metrics, parsed with prometheus_client's own parser."""
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if s.name == name and (labels is None or s.labels == labels):
                return s.value
    if default is None:
        raise KeyError(name)
    return default


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.char_level(TEXT)


@pytest.fixture(scope="module")
def model(tok):
    return make_model(tok)


@pytest.fixture(scope="module")
def served(tok, model):
    """(base URL, app, reference LLM on the same weights)."""
    with one_torch_thread():
        engine = LLMEngine(model, tok, EngineConfig(num_gpu_blocks=1500, max_num_seqs=128))
        app = build_app(engine, MODEL)
        with serving(app) as url:
            yield url, app, LLM(model, tok, num_gpu_blocks=600)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http():
    """One HTTP client for many small requests (a fresh httpx.post builds a TLS context first, ~40 ms)."""
    with httpx.Client(timeout=30) as c:
        yield c


def random_text(rng: random.Random, lo: int = 4, hi: int = 30) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi)))


def greedy(llm: LLM, prompts, max_tokens: int, **kw):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)
    return [o.outputs[0] for o in llm.generate(prompts, params)]


# --- the happy paths, through the official client ------------------------------------------------------------

def test_models_health_and_metrics(served, client):
    url, app, _ = served
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    e2e = "nanoforge_e2e_request_latency_seconds"
    count, total = metric(url, e2e + "_count"), metric(url, e2e + "_sum")
    tokens = metric(url, "nanoforge_generation_tokens_total")
    steps = "nanoforge_engine_step_seconds"
    decode_steps = metric(url, steps + "_count", {"kind": "decode"})
    decode_tokens = metric(url, "nanoforge_engine_step_tokens_total", {"kind": "decode"})
    t0 = time.monotonic()
    client.completions.create(model=MODEL, prompt="the fox", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    elapsed = time.monotonic() - t0
    assert metric(url, e2e + "_count") == count + 1
    assert 0 < metric(url, e2e + "_sum") - total <= elapsed  # the server's latency fits inside the client's
    assert metric(url, "nanoforge_time_to_first_token_seconds_count") == count + 1
    assert metric(url, "nanoforge_time_per_output_token_seconds_count") == count + 1
    assert metric(url, "nanoforge_generation_tokens_total") == tokens + 5
    # 4 decode tokens after the prefill's first, in 4 decode steps, each in the +Inf bucket of the step histogram
    assert metric(url, "nanoforge_engine_step_tokens_total", {"kind": "decode"}) == decode_tokens + 4
    assert metric(url, steps + "_count", {"kind": "decode"}) == decode_steps + 4
    assert metric(url, steps + "_bucket", {"kind": "decode", "le": "+Inf"}) == decode_steps + 4
    assert metric(url, "nanoforge_kv_blocks_total") == 1500
    assert metric(url, "nanoforge_kv_blocks_used") == metric(url, "nanoforge_num_requests_running") == 0
    for name in ("nanoforge_num_requests_waiting", "nanoforge_prefix_cache_hit_rate", "nanoforge_preemptions_total",
                 "nanoforge_kv_cache_usage_ratio", "nanoforge_prefix_cache_hits_total"):
        assert metric(url, name) >= 0


def test_greedy_completions_equal_llm_generate(served, client, tok):
    _, _, llm = served
    rng = random.Random(0)
    texts = [random_text(rng) for _ in range(4)]
    ids = [[rng.randrange(60) for _ in range(rng.randint(3, 40))] for _ in range(3)]
    ref = greedy(llm, texts + ids, 16)
    for prompt, want in zip(texts + ids, ref):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
        n_prompt = len(prompt) if isinstance(prompt, list) else len(tok.encode(prompt))
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 16)
    batch = client.completions.create(model=MODEL, prompt=texts, max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [o.text for o in ref[:4]]
    assert batch.usage.prompt_tokens == sum(len(tok.encode(t)) for t in texts)


def test_chat_and_streaming_equal_llm_generate(served, client, tok):
    _, _, llm = served
    messages = [{"role": "system", "content": "the lazy dog"}, {"role": "user", "content": "quick brown fox"}]
    want = greedy(llm, [tok.encode_chat(messages)], 20)[0].text
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(tok.encode_chat(messages))
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    # text parts are joined like a plain string
    parts = [{"role": "user", "content": [{"type": "text", "text": "quick "}, {"type": "text", "text": "fox"}]}]
    r = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == greedy(llm, [tok.encode_chat([{"role": "user",
                                                                          "content": "quick fox"}])], 8)[0].text


def test_cached_tokens_count_the_prefix_cache_hits(served, client):
    """usage.prompt_tokens_details.cached_tokens: prompt tokens taken from the prefix cache (whole 16-token blocks,
    never the last prompt token), in whole responses and in a stream's usage chunk."""
    _, _, llm = served
    prefix = [(7 * i) % 60 for i in range(50)]  # 3 full blocks and 2 tokens
    first = client.completions.create(model=MODEL, prompt=prefix + [1, 2], max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=MODEL, prompt=prefix + [3, 4, 5], max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert again.usage.prompt_tokens_details.cached_tokens == 48
    assert again.choices[0].text == greedy(llm, [prefix + [3, 4, 5]], 4)[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=prefix[:33], max_tokens=3, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32
    assert metric(served[0], "nanoforge_cached_prompt_tokens_total") >= 80


def test_n_seed_and_stop_sequences(served, client):
    _, _, llm = served
    prompt = "over the lazy"
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    want = [c.text for c in llm.generate([prompt], params)[0].outputs]
    assert len(set(want)) > 1
    r = client.completions.create(model=MODEL, prompt=prompt, n=3, temperature=1.0, seed=11, max_tokens=12,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2] and [c.text for c in r.choices] == want
    streamed = {}
    for chunk in client.completions.create(model=MODEL, prompt=prompt, n=3, temperature=1.0, seed=11, max_tokens=12,
                                           stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == want

    full = greedy(llm, [prompt], 40)[0].text
    stop = full[6:9]  # three characters: the stream must hold back two until it knows they are not a stop
    cut = full[:full.find(stop)]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "@@"],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=stop,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_match_the_model(served, client, model, tok):
    prompt = "the brown dog"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    out_ids = [tok.backend.token_to_id(t) for t in lp.tokens]  # char-level: a token's text is its name
    ids = tok.encode(prompt) + out_ids
    with torch.no_grad():  # independent reference: one forward over prompt + output, float64 softmax
        ref = torch.log_softmax(model(torch.tensor([ids]))[0, len(ids) - 7:-1].double(), dim=-1)
    assert out_ids == ref.argmax(-1).tolist()  # greedy
    for i, (logprob, top) in enumerate(zip(lp.token_logprobs, lp.top_logprobs)):
        assert abs(logprob - ref[i, out_ids[i]].item()) < 1e-4
        assert [tok.backend.token_to_id(t) for t in top] == ref[i].topk(3).indices.tolist()
        assert list(top.values()) == pytest.approx(ref[i].topk(3).values.tolist(), abs=1e-4)
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(6)]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "dog"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(c.bytes == list(c.token.encode()) for c in content)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)


def _reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """float64 log-softmax of the model's logits over `ids` (one plain forward, no KV cache): row i scores
    token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]))[0].double(), dim=-1)


def _check_echo_logprobs(lp: dict, ids: list[int], ref: torch.Tensor, tok, k: int) -> None:
    """OpenAI's completions logprobs with echo: every token of prompt + completion, the first without any."""
    assert [tok.backend.token_to_id(t) for t in lp["tokens"]] == ids  # char-level: a token's text is its name
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4), i
        top = lp["top_logprobs"][i]
        assert [tok.backend.token_to_id(t) for t in top] == ref[i - 1].topk(k).indices.tolist()
        assert list(top.values()) == pytest.approx(ref[i - 1].topk(k).values.tolist(), abs=1e-4)
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(ids))]


def test_echo_scores_the_prompt_then_the_completion(served, client, model, tok):
    """What lm-evaluation-harness sends (echo, logprobs, max_tokens 0 or 1, token-id prompts), and the rest
    of OpenAI's echo: text prompts, batches, n, streaming."""
    url, app, llm = served
    prompt = "the brown dog"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=3, echo=True,
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.text == prompt + plain.text and c.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), 5)
    ids = tok.encode(prompt + plain.text)
    ref = _reference_logprobs(model, ids)
    _check_echo_logprobs(c.logprobs.model_dump(), ids, ref, tok, 3)
    assert ids[len(prompt):] == ref[len(prompt) - 1:-1].argmax(-1).tolist()  # and the completion is greedy

    # max_tokens=0: the prompt only, scored, over raw HTTP with token ids in a batch (lm-eval's request)
    batch = [tok.encode("quick brown fox"), tok.encode(LETTERS * 7)[:250] + [1] * 6]  # the second fills the context
    body = {"model": MODEL, "prompt": batch, "max_tokens": 0, "logprobs": 1, "echo": True, "temperature": 0}
    res = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert res.status_code == 200, res.text
    out = res.json()
    assert [ch["index"] for ch in out["choices"]] == [0, 1]
    assert out["usage"] == {"prompt_tokens": 15 + 256, "completion_tokens": 0, "total_tokens": 15 + 256,
                            "prompt_tokens_details": {"cached_tokens": 0}}  # prompt logprobs never take cached blocks
    for ids, ch in zip(batch, out["choices"]):
        assert ch["text"] == tok.decode(ids) and ch["finish_reason"] == "length"
        _check_echo_logprobs(ch["logprobs"], ids, _reference_logprobs(model, ids), tok, 1)

    # streaming: the prompt comes in each choice's first chunk; the chunks add up to the whole response
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=2,
                                      echo=True, n=2, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=2,
                                            echo=True, n=2, stream=True, extra_body={"ignore_eos": True}))
    for i in range(2):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == i]
        assert mine[0].text.startswith(prompt) and len(mine[0].logprobs.tokens) >= len(prompt)
        assert "".join(m.text for m in mine) == whole.choices[i].text
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert sum((getattr(m.logprobs, key) for m in mine), []) == getattr(whole.choices[i].logprobs, key)
    only = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, stream=True))
    assert [(ch.choices[0].text, ch.choices[0].finish_reason) for ch in only] == [(prompt, "length")]
    # echo without logprobs, and with a stop string: the stop applies to the completion only
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True,
                                  stop=[prompt[:3]], extra_body={"ignore_eos": True})
    cut = plain.text.split(prompt[:3])[0]
    assert r.choices[0].text == prompt + cut and r.choices[0].logprobs is None
    assert wait_idle(app)["kv_blocks_used"] == 0


# --- hostile bodies, over raw HTTP --------------------------------------------------------------------------

def _ok(**kw):
    return {"model": MODEL, "prompt": "the dog", "max_tokens": 4, **kw}


HOSTILE = [
    # (endpoint, body (dict or raw bytes), status, param)
    ("completions", _ok(max_tokens=-1), 400, "max_tokens"),
    ("completions", _ok(max_tokens=0), 400, "max_tokens"),
    ("completions", _ok(max_tokens=10**12), 400, "max_tokens"),
    ("completions", _ok(max_tokens="16"), 400, "max_tokens"),
    ("completions", _ok(max_tokens=True), 400, "max_tokens"),
    ("completions", _ok(max_tokens=2.5), 400, "max_tokens"),
    ("completions", _ok(temperature="hot"), 400, "temperature"),
    ("completions", _ok(temperature=-1), 400, "temperature"),
    ("completions", _ok(top_p=0), 400, "top_p"),
    ("completions", _ok(top_p=[1]), 400, "top_p"),
    ("completions", _ok(n=0), 400, "n"),
    ("completions", _ok(n=10**6), 400, "n"),
    ("completions", _ok(stop=5), 400, "stop"),
    ("completions", _ok(stop=[""]), 400, "stop"),
    ("completions", _ok(stop=["x"] * 100), 400, "stop"),
    ("completions", _ok(seed=-3), 400, "seed"),
    ("completions", _ok(logprobs=100), 400, "logprobs"),
    ("completions", _ok(stream="yes"), 400, "stream"),
    ("completions", _ok(stream_options={"include_usage": "y"}), 400, "stream_options"),
    ("completions", _ok(user=7), 400, "user"),
    ("completions", _ok(prompt=5), 400, "prompt"),
    ("completions", _ok(prompt=None), 400, "prompt"),
    ("completions", _ok(prompt=[1, "a"]), 400, "prompt"),
    ("completions", _ok(prompt=[]), 400, "prompt"),
    ("completions", _ok(prompt=[1, 10**6]), 400, "prompt"),
    ("completions", _ok(prompt=[1, -1]), 400, "prompt"),
    ("completions", _ok(prompt=[True, 2]), 400, "prompt"),
    ("completions", _ok(prompt="a" * 300), 400, "prompt"),  # longer than the 256-token context
    ("completions", _ok(prompt="a" * 250, max_tokens=10), 400, "max_tokens"),
    ("completions", _ok(prompt="\u00e9\u20ac"), 400, None),  # characters the tokenizer cannot encode
    ("completions", _ok(foo=1), 400, "foo"),
    ("completions", _ok(frequency_penalty=0.5), 400, "frequency_penalty"),
    ("completions", _ok(echo="yes"), 400, "echo"),
    ("completions", _ok(echo=True, max_tokens=-1), 400, "max_tokens"),
    ("completions", _ok(echo=True, max_tokens=0, n=2), 400, "n"),
    ("completions", _ok(echo=True, max_tokens=0, prompt="a" * 257), 400, "prompt"),  # the context is 256
    ("completions", _ok(echo=True, max_tokens=0, logprobs=21), 400, "logprobs"),
    ("completions", _ok(model="gpt-4"), 404, "model"),
    ("completions", {"prompt": "the"}, 400, "model"),
    ("completions", _ok(model=5), 400, "model"),
    ("completions", b'{"model": "tiny", "prompt": ', 422, None),
    ("completions", b'{"model": "tiny", "prompt": "\xff\xfe"}', 422, None),
    ("completions", b"[1, 2, 3]", 422, None),
    ("completions", b'{"model": "tiny", "prompt": "a", "temperature": NaN}', 422, None),
    ("completions", b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 422, None),
    ("completions", b'{"model": "tiny", "max_tokens": 1' + b"0" * 5000 + b"}", 422, None),
    ("completions", b"", 422, None),
    ("completions", b'{"model": "tiny", "prompt": "a\\ud800b"}', 400, None),  # valid JSON, but no Unicode text
    ("chat/completions", {"model": MODEL}, 400, "messages"),
    ("chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, 400, "messages"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": 3, "content": "dog"}]}, 400, "messages"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "dog"}]}, 400, "messages"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "dog"}], "top_logprobs": 2},
     400, "top_logprobs"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "dog"}],
                          "max_completion_tokens": -5}, 400, "max_completion_tokens"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "dog"}], "tools": [{}]},
     400, "tools"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "dog"}], "echo": True},
     400, "echo"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "dog"}], "max_tokens": 0},
     400, "max_tokens"),
]


def _check_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("endpoint,body,status,param", HOSTILE,
                         ids=[f"{i}-{e}-{s}-{p}" for i, (e, _, s, p) in enumerate(HOSTILE)])
def test_hostile_bodies_get_openai_errors(served, http, endpoint, body, status, param):
    url = served[0]
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    err = _check_error(http.post(f"{url}/v1/{endpoint}", **kw), status, param)
    if status == 404:
        assert err["code"] == "model_not_found"


def test_oversized_and_unroutable_requests(served, client):
    url, app, _ = served
    err = _check_error(httpx.post(url + "/v1/completions", json=_ok(prompt="a" * 10_000_000), timeout=60), 413)
    assert err["code"] == "request_too_large"
    _check_error(httpx.get(url + "/v1/nothing-here"), 404)
    _check_error(httpx.get(url + "/v1/completions"), 405)
    _check_error(httpx.get(url + "/v1/models/gpt-4"), 404, "model")
    # neutral values of unsupported fields are fine, and the server still serves after all that
    r = httpx.post(url + "/v1/completions", json=_ok(frequency_penalty=0, echo=False, logit_bias={}), timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert wait_idle(app)["kv_blocks_used"] == 0


# --- concurrency, disconnects, backpressure, failures -----------------------------------------------------------

def test_64_streams_with_disconnects(served):
    url, app, llm = served
    rng = random.Random(7)
    prompts = [random_text(rng, 5, 40) for _ in range(64)]
    leaving = set(range(0, 64, 4))  # a quarter disconnect after their first chunk
    want = [o.text for o in greedy(llm, prompts, 12)]
    finished_before = metric(url, "nanoforge_request_success_total", {"finish_reason": "length"}, default=0)

    async def stream(i: int, client: httpx.AsyncClient):
        body = {"model": MODEL, "prompt": prompts[i], "temperature": 0, "stream": True, "ignore_eos": True,
                "max_tokens": 200 if i in leaving else 12}
        text, events = "", []
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if line[6:] == "[DONE]":
                    break
                text += json.loads(line[6:])["choices"][0]["text"]
                if i in leaving:
                    return None  # leaving the block closes the connection mid-stream
        assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        return text

    async def hostile(client: httpx.AsyncClient, k: int):
        bodies = [_ok(max_tokens=-1), _ok(prompt=[10**9]), b"{", _ok(model="nope")]
        body = bodies[k % len(bodies)]
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        return (await client.post(url + "/v1/completions", **kw)).status_code

    async def main():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            return await asyncio.gather(*[stream(i, client) for i in range(64)],
                                        *[hostile(client, k) for k in range(8)])

    results = asyncio.run(main())
    texts, statuses = results[:64], results[64:]
    for i in range(64):
        assert texts[i] == (None if i in leaving else want[i]), i
    assert sorted(statuses) == [400, 400, 400, 400, 404, 404, 422, 422]
    stats = wait_idle(app)
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["kv_blocks_used"] == 0  # the aborted requests' blocks came back too
    # exactly the 48 that stayed finished; the 16 that left were aborted, not run to their 200 tokens
    assert metric(url, "nanoforge_request_success_total", {"finish_reason": "length"}) == finished_before + 48


def test_non_streaming_client_that_leaves_is_aborted(served):
    url, app, _ = served
    finished_before = metric(url, "nanoforge_request_success_total", {"finish_reason": "length"}, default=0)
    with pytest.raises(httpx.ReadTimeout):  # 32 x 240 tokens take a while; the client gives up long before
        httpx.post(url + "/v1/completions", json=_ok(n=32, max_tokens=240, ignore_eos=True), timeout=0.15)
    stats = wait_idle(app)
    assert stats["num_running"] == 0 and stats["kv_blocks_used"] == 0
    assert metric(url, "nanoforge_request_success_total", {"finish_reason": "length"}, default=0) == finished_before


def test_full_waiting_queue_gets_429_then_503_when_draining(model, tok):
    with one_torch_thread():
        engine = LLMEngine(model, tok, EngineConfig(num_gpu_blocks=200, max_num_seqs=1))
        app = build_app(engine, MODEL, max_waiting=2)
        with serving(app) as url:

            async def burst():
                async with httpx.AsyncClient(timeout=60) as client:
                    return await asyncio.gather(*[client.post(url + "/v1/completions", json=_ok(
                        prompt=f"dog {i}", max_tokens=100, temperature=0, ignore_eos=True)) for i in range(10)])

            responses = asyncio.run(burst())
            codes = [r.status_code for r in responses]
            assert set(codes) <= {200, 429} and 429 in codes and codes.count(200) >= 2, codes  # 2 fit the queue
            for r in responses:
                if r.status_code == 429:
                    assert r.headers["retry-after"] == "1"
                    assert _check_error(r, 429)["type"] == "rate_limit_error"
                else:
                    assert r.json()["usage"]["completion_tokens"] == 100
            assert wait_idle(app)["kv_blocks_used"] == 0
            app.state.engine.stop_accepting()  # what a SIGTERM does first
            r = httpx.post(url + "/v1/completions", json=_ok())
            _check_error(r, 503)
            assert r.headers["retry-after"] == "1"


def test_failing_engine_step_fails_only_the_requests_in_flight(served, caplog):
    url, app, llm = served
    engine = app.state.engine.engine
    real_step = engine.step
    failed = False

    def flaky_step():  # fails once, as soon as both requests below are in the engine
        nonlocal failed
        stats = engine.stats()
        if not failed and stats["num_running"] + stats["num_waiting"] == 2:
            failed = True
            raise RuntimeError("injected device fault")
        return real_step()

    engine.step = flaky_step
    try:
        async def streamed(client):
            async with client.stream("POST", url + "/v1/completions",
                                     json=_ok(max_tokens=100, ignore_eos=True, stream=True)) as r:
                return [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]

        async def both():
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(
                    client.post(url + "/v1/completions", json=_ok(max_tokens=100, ignore_eos=True)), streamed(client))

        whole, events = asyncio.run(both())
    finally:
        del engine.step  # back to the class's method
    assert failed
    assert _check_error(whole, 500)["type"] == "server_error"
    logged = [r for r in caplog.records if r.exc_info and "injected device fault" in str(r.exc_info[1])]
    assert logged, "the failure must be logged with its traceback, server-side"
    assert events[-1] == "[DONE]" and "injected device fault" in json.loads(events[-2])["error"]["message"]
    assert wait_idle(app)["kv_blocks_used"] == 0
    r = httpx.post(url + "/v1/completions", json=_ok(max_tokens=8, temperature=0, ignore_eos=True), timeout=30)
    assert r.json()["choices"][0]["text"] == greedy(llm, ["the dog"], 8)[0].text


@pytest.mark.gpu
def test_concurrent_greedy_streams_on_the_gpu(tok):
    """The engine thread drives CUDA (graphs captured on the main thread, replayed on the engine's)."""
    model = make_model(tok).cuda()
    app = build_app(LLMEngine(model, tok, EngineConfig(num_gpu_blocks=800, max_num_seqs=64)), MODEL)
    rng = random.Random(9)
    prompts = [random_text(rng, 5, 60) for _ in range(32)]
    want = [o.text for o in greedy(LLM(model, tok, num_gpu_blocks=800, max_num_seqs=64), prompts, 24)]
    with serving(app) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)

        async def one(prompt):
            text = ""
            async for chunk in await client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                                               temperature=0, stream=True,
                                                               extra_body={"ignore_eos": True}):
                text += chunk.choices[0].text
            return text

        async def run():
            return await asyncio.gather(*map(one, prompts))

        assert asyncio.run(run()) == want
        assert wait_idle(app)["kv_blocks_used"] == 0


# --- the real command: SIGTERM drains --------------------------------------------------------------------------

def test_sigterm_finishes_short_requests_and_aborts_long_ones(tmp_path, tok):
    torch.manual_seed(0)  # big enough that 4000 tokens take well over the 3 s grace period on any CPU
    save_model(Transformer(preset("tiny-llama", vocab_size=tok.vocab_size, max_seq_len=4096, d_model=256,
                                  n_layers=4)), tmp_path)
    tok.save(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "nanoforge.cli", "serve", "--model", str(tmp_path), "--port", "0",
                             "--device", "cpu", "--served-model-name", MODEL, "--shutdown-timeout", "3",
                             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        line = proc.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        assert match, line + proc.stderr.read()
        url = f"http://127.0.0.1:{match.group(1)}"

        async def run():
            started = asyncio.Event()
            first_chunks = 0

            async def stream(client, max_tokens):
                nonlocal first_chunks
                body = _ok(max_tokens=max_tokens, stream=True, ignore_eos=True, stream_options={"include_usage": True})
                events = []
                async with client.stream("POST", url + "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            if len(events) == 1:
                                first_chunks += 1
                                if first_chunks == 4:
                                    started.set()
                return events

            async def terminate():
                await started.wait()
                proc.send_signal(signal.SIGTERM)

            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(stream(client, 60), stream(client, 60), stream(client, 4000),
                                            stream(client, 4000), terminate())

        *streams, _ = asyncio.run(run())
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once drained
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for events in streams[:2]:  # in flight at SIGTERM, and done within the grace period
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 60
    for events in streams[2:]:  # could not finish in 3 s: ended with an error event, not a cut connection
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == "service_unavailable" and "shut down" in err["message"]
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health")
