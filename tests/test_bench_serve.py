"""`nanoforge bench serve`: workloads (Mooncake prefix sharing, Poisson arrivals), the summary numbers, and a
real run against the test server."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from test_serve_api import MODEL, one_torch_thread, serving  # noqa: E402  (tests/ is on sys.path under pytest)
from test_serve_engine import TEXT, make_model  # noqa: E402

from nanoforge.cli import main  # noqa: E402
from nanoforge.errors import NanoforgeError  # noqa: E402
from nanoforge.serve.api import build_app  # noqa: E402
from nanoforge.serve.bench_serve import (  # noqa: E402
    Result, Vocab, bench_serve, poisson_workload, read_trace, summarize, trace_workload)
from nanoforge.serve.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from nanoforge.tokenizer import Tokenizer  # noqa: E402

# hash ids as a Mooncake trace writes them: shared system prompts / conversation history first
ROWS = [
    {"timestamp": 1000, "input_length": 1500, "output_length": 7, "hash_ids": [0, 1, 2]},
    {"timestamp": 1500, "input_length": 1400, "output_length": 5, "hash_ids": [0, 1, 3]},
    {"timestamp": 3000, "input_length": 700, "output_length": 9, "hash_ids": [4, 5]},
    {"timestamp": 3100, "input_length": 1000, "output_length": 3, "hash_ids": [0, 9]},
    {"timestamp": 4000, "input_length": 1536, "output_length": 6, "hash_ids": [0, 1, 2]},
    {"timestamp": 5200, "input_length": 300, "output_length": 8, "hash_ids": [4]},
]


def common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def write_trace(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_trace_prompts_share_prefixes_block_by_block(tmp_path):
    rows = read_trace(write_trace(tmp_path / "t.jsonl", list(reversed(ROWS))))  # sorted back by timestamp
    reqs = trace_workload(rows, Vocab(5000), length_scale=1 / 16, time_scale=0.5, max_input_len=90,
                          max_output_len=6)
    block = 32  # 512 / 16 tokens per hash id
    assert [r.input_len for r in reqs] == [90, 88, 44, 62, 90, 19]  # round(len / 16), capped at 90
    assert [len(r.prompt) for r in reqs] == [r.input_len for r in reqs]
    assert [r.output_len for r in reqs] == [6, 5, 6, 3, 6, 6]
    assert [r.arrival_s for r in reqs] == pytest.approx([0, 0.25, 1.0, 1.05, 1.5, 2.1])
    for a in range(len(reqs)):
        for b in range(a + 1, len(reqs)):
            ha, hb = reqs[a].hash_ids, reqs[b].hash_ids
            shared_blocks = common_prefix(ha, hb)
            want = min(shared_blocks * block, reqs[a].input_len, reqs[b].input_len)
            assert common_prefix(reqs[a].prompt, reqs[b].prompt) == want, (a, b)
    assert reqs[0].prompt == reqs[4].prompt  # the same hash ids and capped length: the same prompt
    # the same seed gives the same prompts; another seed other ones
    again = trace_workload(rows, Vocab(5000), length_scale=1 / 16, max_input_len=90)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    other = trace_workload(rows, Vocab(5000), length_scale=1 / 16, max_input_len=90, seed=1)
    assert other[0].prompt != reqs[0].prompt


def test_trace_text_prompts_share_text_prefixes():
    tok = Tokenizer.train_bpe([TEXT * 20], vocab_size=300)
    reqs = trace_workload(ROWS, Vocab(None, tok), length_scale=1 / 16, max_input_len=90)
    first, second = reqs[0].prompt, reqs[1].prompt
    assert isinstance(first, str)
    # the text of hash ids [0, 1] alone (2 blocks of 32 tokens) starts both prompts; what follows differs
    shared = trace_workload(ROWS[:1], Vocab(None, tok), length_scale=1 / 16, max_input_len=64)[0].prompt
    assert first.startswith(shared) and second.startswith(shared) and first[len(shared):] != second[len(shared):]
    special = {tok.eos_id, tok.eot_id} | set(tok.stop_ids)
    assert not special & set(tok.encode(first, allow_special=True))
    # each request's length is the server's count of its text (re-encoded as a prompt), not the ids drawn
    assert [r.input_len for r in reqs] == [len(tok.encode_prompt(r.prompt)) for r in reqs]


def test_bad_traces_are_named(tmp_path):
    with pytest.raises(NanoforgeError, match="t.jsonl:2"):
        read_trace(write_trace(tmp_path / "t.jsonl", [ROWS[0], {"timestamp": -1, "input_length": 3,
                                                                "output_length": 1, "hash_ids": []}]))
    with pytest.raises(NanoforgeError, match="not found"):
        read_trace(tmp_path / "missing.jsonl")
    with pytest.raises(NanoforgeError, match="vocab-size"):
        Vocab(None)


def test_poisson_arrivals():
    reqs = poisson_workload(4000, 50.0, 3, 2, Vocab(100), seed=3)
    gaps = np.diff([r.arrival_s for r in reqs])
    assert reqs[0].arrival_s == 0 and (gaps > 0).all()
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.08)  # exponential gaps: std = mean
    assert all(len(r.prompt) == 3 and r.output_len == 2 for r in reqs)
    assert {r.arrival_s for r in poisson_workload(5, math.inf, 3, 2, Vocab(100))} == {0.0}


def test_summary_percentiles_and_goodput():
    rng = random.Random(0)
    results = [Result(0, 0, 10, n, ttft_ms=rng.uniform(5, 50), e2e_ms=rng.uniform(100, 300)) for n in
               [rng.randint(1, 20) for _ in range(50)]]
    for r in results:
        r.tpot_ms = (r.e2e_ms - r.ttft_ms) / (r.output_len - 1) if r.output_len > 1 else None
    results += [Result(0, 0, 10, 0, error="HTTP 429")] * 3
    s = summarize(results, 2.0, {"ttft": 30.0, "tpot": 20.0, "e2e": None})
    ok = results[:50]
    assert (s["completed"], s["failed"]) == (50, 3)
    ttft = sorted(r.ttft_ms for r in ok)
    for p in (50, 90, 99):  # the textbook definition: linear interpolation between closest ranks
        k = (len(ttft) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        assert s["ttft_ms"][f"p{p}"] == pytest.approx(ttft[lo] + (ttft[hi] - ttft[lo]) * (k - lo))
    assert s["tpot_ms"]["mean"] == pytest.approx(np.mean([r.tpot_ms for r in ok if r.tpot_ms is not None]))
    good = [r for r in ok if r.ttft_ms <= 30 and (r.tpot_ms is None or r.tpot_ms <= 20)]
    assert 0 < len(good) < 50
    assert s["goodput"] == pytest.approx(len(good) / 2.0) and s["slo_attainment"] == pytest.approx(len(good) / 53)
    assert s["output_token_throughput"] == pytest.approx(sum(r.output_len for r in ok) / 2.0)


@pytest.fixture(scope="module")
def server_url():
    tok = Tokenizer.char_level(TEXT)
    with one_torch_thread():
        app = build_app(LLMEngine(make_model(tok), tok, EngineConfig(num_gpu_blocks=400)), MODEL)
        with serving(app) as url:
            yield url, tok


def test_replay_against_the_server(server_url, tmp_path):
    url, tok = server_url
    requests = trace_workload(ROWS, Vocab(tok.vocab_size - 3), length_scale=1 / 16, time_scale=0.1,
                              max_input_len=90, max_output_len=6)
    report = bench_serve(url + "/v1", MODEL, requests, out_dir=tmp_path, ignore_eos=True,
                         slo={"ttft": None, "tpot": None, "e2e": None})
    saved = json.loads((tmp_path / "serve.json").read_text())
    assert saved["summary"] == report["summary"]
    recs = saved["requests"]
    assert all(r["error"] is None for r in recs)
    # the server counted exactly the prompt we built and generated exactly what we asked for
    assert [r["input_len"] for r in recs] == [q.input_len for q in requests]
    assert [r["output_len"] for r in recs] == [q.output_len for q in requests]
    for r in recs:
        assert r["start_s"] >= r["arrival_s"] - 1e-3  # sent no earlier than the (scaled) trace says
        assert 0 < r["ttft_ms"] <= r["e2e_ms"]
        assert r["tpot_ms"] == pytest.approx((r["e2e_ms"] - r["ttft_ms"]) / (r["output_len"] - 1))
    s = saved["summary"]
    for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
        values = [r[name] for r in recs]
        assert s[name]["mean"] == pytest.approx(np.mean(values))
        for p in (50, 90, 99):
            assert s[name][f"p{p}"] == pytest.approx(np.percentile(values, p))
    assert s["duration_s"] >= max(r["start_s"] + r["e2e_ms"] / 1000 for r in recs) - 1e-3
    assert s["output_token_throughput"] == pytest.approx(sum(q.output_len for q in requests) / s["duration_s"])
    # rows 1, 2 and 5 share two 32-token blocks: the server's prefix cache hits on them
    assert saved["server_metrics"]["nanoforge_prefix_cache_hit_rate"] > 0.1
    assert (tmp_path / "serve_cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # goodput under an SLO that half the requests meet
    slo = sorted(r["ttft_ms"] for r in recs)[2]
    results = [Result(**{k: v for k, v in r.items() if k != "hash_ids"}) for r in recs]
    s = summarize(results, 1.0, {"ttft": slo, "tpot": None, "e2e": None})
    assert s["goodput"] == sum(r["ttft_ms"] <= slo for r in recs) == 3


def test_cli_poisson_and_text_prompts(server_url, tmp_path):
    url, tok = server_url
    tok.save(tmp_path / "tok")
    for extra in (["--vocab-size", "60"], ["--tokenizer", str(tmp_path / "tok")]):
        out = tmp_path / extra[0]
        rc = main(["bench", "serve", "--base-url", url, "--model", MODEL, "--rate", "200", "--num-requests", "6",
                   "--input-len", "12", "--output-len", "4", "--ignore-eos", "--slo-ttft-ms", "60000",
                   "--out", str(out), *extra])
        assert rc == 0
        summary = json.loads((out / "serve.json").read_text())["summary"]
        assert summary["completed"] == 6 and summary["goodput"] > 0
        assert summary["output_token_throughput"] * summary["duration_s"] == pytest.approx(24)
    assert main(["bench", "serve", "--base-url", url, "--model", MODEL, "--num-requests", "3", "--vocab-size",
                 "60"]) == 2  # neither --trace nor --rate
    # a wrong model name: every request fails with the server's 404, and the run says so
    assert main(["bench", "serve", "--base-url", url, "--model", "nope", "--rate", "inf", "--num-requests", "2",
                 "--vocab-size", "60", "--out", str(tmp_path / "bad")]) == 1
    recs = json.loads((tmp_path / "bad" / "serve.json").read_text())["requests"]
    assert all(r["error"].startswith("HTTP 404") for r in recs)


def test_metric_values_reads_unlabelled_samples_and_sums_the_families_asked_for():
    from nanoforge.serve.bench_serve import metric_values

    text = """# HELP nanoforge_kv_pool_loaded_blocks_total blocks
# TYPE nanoforge_kv_pool_loaded_blocks_total counter
nanoforge_kv_pool_loaded_blocks_total 11064.0
nanoforge_early_rejections_total{slo="ttft"} 3.0
nanoforge_early_rejections_total{slo="tpot"} 4.0
nanoforge_time_to_first_token_seconds_bucket{le="0.1"} 7.0
process_cpu_seconds_total 1.5
nanoforge_broken NaN-ish
"""
    assert metric_values(text) == {"nanoforge_kv_pool_loaded_blocks_total": 11064.0}
    assert metric_values(text, totals=("nanoforge_early_rejections_total",)) == {
        "nanoforge_kv_pool_loaded_blocks_total": 11064.0, "nanoforge_early_rejections_total": 7.0}
    assert metric_values(text, prefix="process_") == {"process_cpu_seconds_total": 1.5}
    assert metric_values(text, labelled=True)['nanoforge_early_rejections_total{slo="tpot"}'] == 4.0


def test_the_gpu_serve_script_replays_the_trace_on_the_cpu_with_and_without_the_prefix_cache(tmp_path):
    """benchmarks/gpu_serve.sh's dry run (a tiny Qwen3, the CPU): both servers replay a trace to the end, the lengths
    capped to the tiny model's 128-token context (before session 49 its warm-up asked for 1,024-token prompts, the
    server refused them and the script stopped, leaving the server running), and the prefix-cached run hits the
    trace's shared first block where the other does not. The hits are the trace's alone: the warm-ups' prompts share
    no prefix (until session 50 each length's began with the shorter one's tokens, and those hits were all this test
    saw: it replayed the real trace's first 4 rows, which share no hash id)."""
    import os
    import subprocess

    def replay(rows: list[list[int]], out) -> dict:
        trace = out / "trace.jsonl"
        trace.write_text("".join(json.dumps({"timestamp": 2000 * i, "input_length": 600, "output_length": 4,
                                             "hash_ids": h}) + "\n" for i, h in enumerate(rows)))
        env = dict(os.environ, PRESET="tiny-qwen3", DEVICE="cpu", NUM_REQUESTS="4", WARMUP_LENS="32 1024",
                   OUT=str(out), TRACE=str(trace), OMP_NUM_THREADS="1")
        run = subprocess.run(["bash", "benchmarks/gpu_serve.sh"], env=env, capture_output=True, text=True,
                             timeout=600)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        return {name: json.loads((out / name / "serve.json").read_text())
                for name in ("prefix_cache_on", "prefix_cache_off")}

    # 600 tokens x 0.1 = 60 (51-token hash blocks): rows 1 and 3 begin with row 0's first block, 48 tokens of it in
    # full 16-token KV blocks; arrivals 0.5 s apart (x0.25), so row 0's blocks are cached before row 1 comes
    runs = replay([[1, 2], [1, 3], [4, 5], [1, 6]], tmp_path)
    for r in runs.values():
        assert r["summary"]["completed"] == r["summary"]["requests"] == 4 and not r["summary"]["failed"]
    assert runs["prefix_cache_on"]["server_metrics"]["nanoforge_prefix_cache_hits_total"] == 2 * 48
    assert runs["prefix_cache_off"]["server_metrics"].get("nanoforge_prefix_cache_hits_total", 0) == 0
    assert set(json.loads((tmp_path / "serve_compare.json").read_text())) >= {"output tokens/s", "TTFT p50 (ms)"}
