"""`nanoforge bench throughput`: the HF baseline runs the engine's own requests, the CLI end to end, its flags."""

from __future__ import annotations

import argparse
import json
from collections import Counter

import pytest
import torch

from nanoforge.cli import main
from nanoforge.model.config import preset
from nanoforge.model.hf import save_model
from nanoforge.model.transformer import Transformer
from nanoforge.serve import bench_throughput as bt

pytest.importorskip("transformers")

TINY = ["--device", "cpu", "--model-preset", "tiny-llama", "--num-requests", "5", "--min-input", "8",
        "--max-input", "40", "--min-output", "4", "--max-output", "16", "--hf-batch", "2"]


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen3", "tiny-gpt2"])
def test_hf_baseline_generates_the_engines_requests(family, tmp_path):
    """Greedy in fp32, HF's batched, left-padded generate gives every request the engine's tokens.

    The end-of-sequence id is set to the token the engine emits most, so a baseline that stopped at it or
    masked it out (as `min_new_tokens` alone does) would differ: ignore_eos means neither."""
    torch.manual_seed(0)
    model = Transformer(preset(family)).eval()
    prompts, outputs = bt.make_workload(7, 40, 24, vocab=model.cfg.vocab_size, seed=1, min_input=3, min_output=2)
    stats, engine_ids = bt.run_engine(model, prompts, outputs, max_num_seqs=4, temperature=0)
    assert [len(t) for t in engine_ids] == outputs
    eos, count = Counter(t for ids in engine_ids for t in ids).most_common(1)[0]
    assert count >= 2
    model.cfg.eos_token_id = eos
    save_model(model, tmp_path)
    hf, hf_ids = bt.run_hf(tmp_path, prompts, outputs, torch.device("cpu"), torch.float32, batch=3, temperature=0)
    assert hf_ids == engine_ids  # the same requests, the same prompts, the same lengths, token for token
    plan = hf["batching"]["batches"]
    assert [b["requests"] for b in plan] == [3, 3, 1]
    assert [b["prompt_len"] for b in plan] == sorted((len(p) for p in prompts), reverse=True)[::3]
    groups = bt.hf_batches(prompts, 3)
    assert [b["max_new_tokens"] for b in plan] == [max(outputs[i] for i in g) for g in groups]
    assert hf["output_tokens"] == stats["output_tokens"] == sum(outputs)
    assert hf["generated_tokens"] == sum(len(g) * max(outputs[i] for i in g) for g in groups) > sum(outputs)
    assert hf["output_tok_s"] == pytest.approx(sum(outputs) / hf["seconds"])


def test_hf_batches_are_sorted_by_prompt_length_and_cover_every_request():
    prompts = [[0] * n for n in (5, 9, 2, 9, 7, 1, 3)]
    batches = bt.hf_batches(prompts, 3)
    assert [[len(prompts[i]) for i in b] for b in batches] == [[9, 9, 7], [5, 3, 2], [1]]
    assert sorted(i for b in batches for i in b) == list(range(7))


def test_cli_writes_both_sides_and_says_how_long_it_will_take(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bt, "LONG_ON_CPU_S", 0)  # every workload is "long": the shrink advice must come first
    out = tmp_path / "t.json"
    assert main(["bench", "throughput", *TINY, "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert stdout.index("estimated time on this CPU") < stdout.index("to shrink it") < stdout.index("system")
    r = json.loads(out.read_text())
    assert r["device"] == "cpu" and r["dtype"] == "torch.float32" and r["model"] == "tiny-llama"
    assert r["temperature"] == 0.6 and "greedy_identical" not in r
    w = r["workload"]
    assert (w["requests"], w["min_input"], w["max_input"], w["min_output"], w["max_output"]) == (5, 8, 40, 4, 16)
    e, hf = r["nanoforge"], r["hf"]
    assert e["output_tokens"] == hf["output_tokens"] == w["output_tokens"]  # the same work on both sides
    assert hf["generated_tokens"] >= hf["output_tokens"]
    assert r["speedup"] == pytest.approx(e["output_tok_s"] / hf["output_tok_s"])
    assert hf["batching"]["batch"] == 2 and [b["requests"] for b in hf["batching"]["batches"]] == [2, 2, 1]
    assert set(r["estimate_s"]) == {"engine", "hf"}
    assert "HF generate (batch 2)" in stdout and "nanoforge engine" in stdout


def test_cli_greedy_run_counts_identical_requests(tmp_path, capsys):
    assert main(["bench", "throughput", *TINY, "--temperature", "0", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "throughput.json").read_text())  # a directory gets throughput.json
    assert r["greedy_identical"] == 5
    assert "greedy outputs identical on both sides: 5/5 requests" in capsys.readouterr().out


def test_profile_counts_each_step_kind_and_its_work():
    """Three prompts prefilled in one step, then three decode steps: the profile's counts, bytes and FLOPs
    are those of that schedule, computed here from the shapes."""
    torch.manual_seed(0)
    model = Transformer(preset("tiny-llama")).eval()
    cfg = model.cfg
    prompts, outputs = [[1] * 5, [2] * 7, [3] * 9], [4, 4, 4]
    stats, ids = bt.run_engine(model, prompts, outputs, max_num_seqs=8, temperature=0, profile=True)
    assert [len(t) for t in ids] == outputs
    p = stats["profile"]
    assert set(p) == {"prefill", "decode"}
    assert (p["prefill"]["steps"], p["prefill"]["tokens"]) == (1, 21)
    assert (p["decode"]["steps"], p["decode"]["tokens"]) == (3, 9)
    body = cfg.num_params()  # without the embedding and the vocabulary projection
    vocab = cfg.vocab_size * cfg.d_model
    pairs = sum(n * (n + 1) // 2 for n in (5, 7, 9))
    flops = 2 * body * 21 + 2 * vocab * 3 + 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * pairs
    dev_s = p["prefill"]["device_ms"] / 1e3
    assert p["prefill"]["achieved_TFLOP_s"] == pytest.approx(flops / dev_s / 1e12)
    kv_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4  # fp32 K and V of one token
    read = sum(n + k for n in (5, 7, 9) for k in (1, 2, 3))  # context of each decode query
    norms = sum(w.numel() for w in model.parameters() if w.dim() == 1)
    nbytes = 3 * (body + norms + vocab) * 4 + read * kv_token
    dev_s = 3 * p["decode"]["device_ms"] / 1e3
    assert p["decode"]["achieved_GB_s"] == pytest.approx(nbytes / dev_s / 1e9)
    for r in p.values():
        assert r["wall_ms"] >= r["host_ms"] > 0 and r["wait_ms"] >= 0 and 0 < r["device_ms"] <= r["wall_ms"]
        # on a CPU the device's part runs on the host: the three add up to the step
        assert r["host_ms"] + r["device_ms"] + r["wait_ms"] == pytest.approx(r["wall_ms"])
        assert r["hbm_fraction"] is None and r["flops_fraction"] is None  # no known peaks on a CPU


def test_cli_profile_prints_the_breakdown(tmp_path, capsys):
    assert main(["bench", "throughput", *TINY, "--no-baseline", "--profile", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "throughput.json").read_text())
    assert {"prefill", "decode"} <= set(r["nanoforge"]["profile"])
    out = capsys.readouterr().out
    assert "step kind" in out and "host ms" in out and "\ndecode " in out


@pytest.mark.parametrize("argv, needle", [
    (["--num-requests", "0"], "--num-requests"),
    (["--max-output", "0"], "--max-output"),
    (["--min-input", "50", "--max-input", "20"], "--min-input"),
    (["--hf-batch", "0"], "--hf-batch"),
    (["--max-num-seqs", "-1"], "--max-num-seqs"),
    (["--temperature", "-1"], "--temperature"),
    (["--temperature", "nan"], "--temperature"),
    (["--model-preset", "nope"], "--model-preset"),
    (["--model-preset", "shakespeare-char", "--max-input", "200", "--max-output", "100"], "--max-input"),
    (["--dtype", "fp8"], "--dtype"),
    (["--num-requests", "many"], "--num-requests"),
    (["--hf-prompt", "512"], "--hf-prompt"),  # the old unlike-for-like baseline's flags are gone
    (["--out", "/dev/null/x/t.json"], "--out"),
])
def test_bad_flags_are_one_line_and_exit_2(argv, needle, tmp_path, capsys):
    out = tmp_path / "t.json"
    try:  # the last --out wins
        rc = main(["bench", "throughput", "--device", "cpu", "--out", str(out), *argv])
    except SystemExit as e:  # argparse's own errors (types, unknown flags)
        rc = e.code
    captured = capsys.readouterr()
    assert rc == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in captured.err
    assert captured.out == "" and not out.exists()  # nothing ran


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_asking_for_a_gpu_without_one_is_one_line(capsys):
    assert main(["bench", "throughput", "--device", "cuda"]) == 2
    assert "--device" in capsys.readouterr().err


def _args(*argv) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bt.add_cli_arguments(p)
    return p.parse_args(argv)


def test_cpu_default_is_small_and_says_how_to_run_the_full_workload():
    w, line = bt.resolve_workload(_args(), torch.device("cpu"))
    assert w == bt.CPU_WORKLOAD and "finishes in seconds" in line
    full_flags = line.split("nanoforge bench throughput ")[1].split()
    assert bt.resolve_workload(_args(*full_flags), torch.device("cpu"))[0] == bt.GPU_WORKLOAD
    # the GPU default is nano-vllm's workload
    w, line = bt.resolve_workload(_args(), torch.device("cuda"))
    assert (w.preset, w.requests, w.min_input, w.max_input, w.min_output, w.max_output) == \
        ("qwen3-0.6b", 256, 100, 1024, 100, 1024)
    # a flag changes only its own field of the device's default
    w, line = bt.resolve_workload(_args("--num-requests", "3"), torch.device("cpu"))
    assert w.requests == 3 and w.max_output == bt.CPU_WORKLOAD.max_output and line.startswith("workload:")


def test_every_flag_has_help_with_its_default():
    p = argparse.ArgumentParser()
    bt.add_cli_arguments(p)
    options = [a for a in p._actions if a.option_strings and a.dest != "help"]
    assert len(options) == 18
    for a in options:
        assert a.help and "default" in a.help, a.option_strings
