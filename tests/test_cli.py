"""The command line as a user meets it: real subprocesses, exit codes, one-line errors."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading

import pytest
import torch
from conftest import finish

from nanoforge.model.config import preset
from nanoforge.model.generate import generate
from nanoforge.model.hf import save_model
from nanoforge.model.transformer import Transformer
from nanoforge.tokenizer import Tokenizer

TEXT = "hello world, this is a tiny corpus for a tiny model.\n"


def plain_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "NUMBA_ENABLE_CUDASIM")}


def start(*argv, cwd=None) -> subprocess.Popen:
    """`nanoforge ARGV` in a fresh interpreter, started; `finish` waits for it."""
    return subprocess.Popen([sys.executable, "-m", "nanoforge.cli", *map(str, argv)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd, env=plain_env())


def nanoforge(*argv, cwd=None):
    return finish(start(*argv, cwd=cwd))


def side_by_side(cases: dict) -> dict:
    """`nanoforge ARGV` for every case (key: its argv), each in its own interpreter, all started at once (a run
    that fails at once is mostly Python importing: CPU cores take them in parallel)."""
    procs = {}
    try:
        for case, argv in cases.items():
            procs[case] = start(*argv)
    finally:
        done = {case: finish(proc) for case, proc in procs.items()}
    return done


def assert_one_line_error(r, *needles):
    argv = r.args[3:]  # after python -m nanoforge.cli
    assert r.returncode == 2, (argv, r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, (argv, r.stderr)
    assert "Traceback" not in r.stderr, argv
    for n in needles:
        assert n in lines[0], (argv, lines[0])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    tok = Tokenizer.char_level(TEXT)
    torch.manual_seed(0)
    m = Transformer(preset("tiny-llama", vocab_size=tok.vocab_size, max_seq_len=64)).eval()
    save_model(m, d)
    tok.save(d)
    return d


def test_generate_prints_only_the_greedy_completion(model_dir):
    proc = start("generate", "--model", str(model_dir), "--prompt", "hello", "--max-tokens", "12")
    tok = Tokenizer.load(model_dir)  # the reference, here while the CLI runs
    from nanoforge.model.hf import load_model

    ids = generate(load_model(model_dir), tok.encode("hello"), max_new_tokens=12, stop_ids=set(tok.stop_ids))
    ids = [t for t in ids if t not in tok.stop_ids]
    r = finish(proc)
    assert r.returncode == 0, r.stderr
    assert r.stdout == tok.decode(ids) + "\n"


def test_a_bad_model_folder_is_one_line_naming_what_is_wrong(tmp_path, model_dir):
    from safetensors.torch import load_file, save_file

    corrupt, mamba, misshapen = (tmp_path / n for n in ("corrupt", "mamba", "misshapen"))
    for d in (corrupt, mamba, misshapen):
        d.mkdir()
    (corrupt / "config.json").write_text((model_dir / "config.json").read_text())
    (corrupt / "model.safetensors").write_bytes(os.urandom(300))
    (mamba / "config.json").write_text(json.dumps({"model_type": "mamba", "vocab_size": 10}))
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["intermediate_size"] += 8  # the weights no longer fit the config
    (misshapen / "config.json").write_text(json.dumps(cfg))
    save_file(load_file(model_dir / "model.safetensors"), misshapen / "model.safetensors")
    cases = {  # folder: what the one line names
        tmp_path / "nope": ("nope", "not found"),
        corrupt: ("model.safetensors", "not a valid safetensors"),
        mamba: ("mamba", "not supported"),
        misshapen: ("gate_proj.weight", "expected"),
    }
    runs = side_by_side({d: ["generate", "--model", d, "--prompt", "x"] for d in cases})
    for d, needles in cases.items():
        assert_one_line_error(runs[d], *needles)


def test_generate_says_when_the_context_cuts_the_answer_short(model_dir, tmp_path):
    """A model whose final norm is zero gives all-zero logits: greedy picks id 0 (a character, not an end
    token) until the 64-token context is full. The output stops there, and stderr says why."""
    from nanoforge.model.hf import load_model

    model = load_model(model_dir)
    model.norm.weight.data.zero_()
    save_model(model, tmp_path)
    Tokenizer.load(model_dir).save(tmp_path)
    r = nanoforge("generate", "--model", str(tmp_path), "--prompt", "hello", "--max-tokens", "100")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout) == 59 + 1  # 64 - 5 prompt characters, then the newline
    assert "stopped after 59 of --max-tokens 100" in r.stderr and "context of 64" in r.stderr


def test_bad_prompts_and_flags_are_one_line_and_no_verb_lists_the_verbs(model_dir):
    """The chat template's markup (<|im_start|>, read as special tokens) is not the user's doing: a chat prompt's
    error names only the user's characters."""
    generate = ["generate", "--model", model_dir, "--prompt"]
    cases = {  # argv: what the one line says
        (*generate, "hello " * 20): "context is 64",
        ("generate", "--chat", "--model", model_dir, "--prompt", "hello 42"):
            "outside the tokenizer's vocabulary: ['2', '4']",
        (*generate, "x", "--max-tokens", "0"): "max-tokens",
        (*generate, "x", "--top-p", "2"): "top-p",
        ("frobnicate",): "invalid choice",
        (): None,  # bare `nanoforge`
    }
    runs = side_by_side({argv: list(argv) for argv in cases})
    for argv, needle in cases.items():
        if argv:
            assert_one_line_error(runs[argv], needle)
    bare = runs[()]
    assert bare.returncode == 2 and "Traceback" not in bare.stderr
    for verb in ("generate", "train", "sft", "serve", "bench", "kernels", "data"):
        assert verb in bare.stderr


def test_the_cli_needs_no_serve_extras_to_start(tmp_path):
    """A GPU image without FastAPI / uvicorn / pydantic (the H200 machine's) still runs `nanoforge kernels`,
    `train` and `generate`: only the serving verbs import the HTTP stack, when they run."""
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text("import builtins\n_real = builtins.__import__\n"
                       "def _imp(name, *a, **k):\n"
                       "    if name.split('.')[0] in ('fastapi', 'uvicorn', 'pydantic', 'starlette'):\n"
                       "        raise ModuleNotFoundError(f'No module named {name!r} (blocked)')\n"
                       "    return _real(name, *a, **k)\n"
                       "builtins.__import__ = _imp\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "nanoforge.cli", "kernels", "bench", "--help"], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 0 and "--kinds" in r.stdout, r.stderr


def test_an_internal_failure_keeps_its_traceback_and_exits_1(model_dir):
    """A bug is not bad input: a kernel refusing what our own model code handed it (as attention once refused
    bf16 v with fp32 q, k) must print its traceback and exit 1, not pose as a one-line user error."""
    code = ("import sys, nanoforge.model.attention as a\n"
            "def broken(self, layer, q, k, v):\n"
            "    raise ValueError('attention: q, k, v must share a dtype')\n"
            "a.KVCache.attend = broken\n"
            "from nanoforge.cli import main\n"
            f"sys.exit(main(['generate', '--model', {str(model_dir)!r}, '--prompt', 'hello']))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "NUMBA_ENABLE_CUDASIM")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "Traceback" in r.stderr and "must share a dtype" in r.stderr
    assert "nanoforge generate: error" not in r.stderr


@pytest.fixture(scope="module", autouse=True)
def first_run(request, tmp_path_factory):
    """`nanoforge serve` with no model in a fresh folder, started with this module's first test: the longest run
    here (it trains), it goes on beside the other tests' runs, and its own test reads what it printed. The
    server is stopped (SIGTERM) as soon as it has printed the first chat exchange, or its failure."""
    reader = "test_first_run_trains_serves_and_answers_a_chat_message"
    if not any(item.module is request.module and item.name == reader for item in request.session.items):
        yield None
        return
    cwd = tmp_path_factory.mktemp("first_run")
    code = ("import sys, nanoforge.cli as c; c.FIRST_RUN['cpu'].update(train=['--max-steps', '4'], "
            "sft=['--max-steps', '3', '--eval-samples', '2', '--answer-tokens', '8']); "
            "sys.exit(c.main(['serve', '--port', '0']))")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=plain_env())
    lines = []

    def read():
        try:
            for line in proc.stdout:
                lines.append(line)
                if line.startswith("assistant:") or line.startswith("first chat message failed"):
                    break
        finally:
            proc.send_signal(signal.SIGTERM)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    yield cwd, proc, reader, lines
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            proc.kill()


def test_first_run_trains_serves_and_answers_a_chat_message(first_run):
    """`nanoforge serve` with no model: builds the offline default chat model, serves it over HTTP and
    answers one chat message through the API (budgets shrunk here; the README's run uses the defaults)."""
    cwd, proc, reader, lines = first_run
    reader.join(timeout=280)
    assert not reader.is_alive(), "".join(lines)[-2000:]
    proc.wait(timeout=60)
    out = "".join(lines)
    assert "user: What does the zip function do?" in out, out[-2000:]
    assert "Warning" not in out, out  # nothing but what the run has to say (no Python warnings with source lines)
    assert any(line.startswith("assistant:") for line in lines), out[-2000:]
    # the server's first line says what its engine's start cost (CPU: no CUDA graphs)
    assert re.search(r"KV blocks; engine started in \d+\.\d s \(0\.0 s tuning the skinny matmul, \d+\.\d s capturing 0 "
                     r"CUDA graphs\)\)", out), out[-2000:]
    assert (cwd / "runs" / "default" / "sft" / "config.json").is_file()
    assert (cwd / "runs" / "default" / "pretrain" / "loss.png").is_file()
