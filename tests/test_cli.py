"""The command line as a user meets it: real subprocesses, exit codes, one-line errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from nanoforge.model.config import preset
from nanoforge.model.generate import generate
from nanoforge.model.hf import save_model
from nanoforge.model.transformer import Transformer
from nanoforge.tokenizer import Tokenizer

TEXT = "hello world, this is a tiny corpus for a tiny model.\n"


def nanoforge(*argv, cwd=None):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "NUMBA_ENABLE_CUDASIM")}
    return subprocess.run([sys.executable, "-m", "nanoforge.cli", *argv], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=env)


def assert_one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


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
    r = nanoforge("generate", "--model", str(model_dir), "--prompt", "hello", "--max-tokens", "12")
    assert r.returncode == 0, r.stderr
    tok = Tokenizer.load(model_dir)
    from nanoforge.model.hf import load_model

    ids = generate(load_model(model_dir), tok.encode("hello"), max_new_tokens=12, stop_ids=set(tok.stop_ids))
    ids = [t for t in ids if t not in tok.stop_ids]
    assert r.stdout == tok.decode(ids) + "\n"


def test_missing_model_directory(tmp_path):
    assert_one_line_error(nanoforge("generate", "--model", str(tmp_path / "nope"), "--prompt", "x"), "nope", "not found")


def test_corrupt_checkpoint(tmp_path, model_dir):
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(os.urandom(300))
    assert_one_line_error(nanoforge("generate", "--model", str(tmp_path), "--prompt", "x"),
                          "model.safetensors", "not a valid safetensors")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "vocab_size": 10}))
    assert_one_line_error(nanoforge("generate", "--model", str(tmp_path), "--prompt", "x"), "mamba", "not supported")


def test_wrong_tensor_shape(tmp_path, model_dir):
    from safetensors.torch import load_file, save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["intermediate_size"] += 8  # the weights no longer fit the config
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(load_file(model_dir / "model.safetensors"), tmp_path / "model.safetensors")
    assert_one_line_error(nanoforge("generate", "--model", str(tmp_path), "--prompt", "x"),
                          "gate_proj.weight", "expected")


def test_prompt_longer_than_context(model_dir):
    assert_one_line_error(nanoforge("generate", "--model", str(model_dir), "--prompt", "hello " * 20),
                          "context is 64")


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


def test_chat_prompt_errors_name_only_the_users_characters(model_dir):
    """The chat template's markup (<|im_start|>, read as special tokens) is not the user's doing."""
    r = nanoforge("generate", "--chat", "--model", str(model_dir), "--prompt", "hello 42")
    assert_one_line_error(r, "outside the tokenizer's vocabulary: ['2', '4']")


def test_bare_nanoforge_lists_the_verbs():
    r = nanoforge()
    assert r.returncode == 2 and "Traceback" not in r.stderr
    for verb in ("generate", "train", "sft", "serve", "bench", "kernels", "data"):
        assert verb in r.stderr


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


def test_bad_flags_are_one_line(model_dir):
    assert_one_line_error(nanoforge("generate", "--model", str(model_dir), "--prompt", "x", "--max-tokens", "0"),
                          "max-tokens")
    assert_one_line_error(nanoforge("generate", "--model", str(model_dir), "--prompt", "x", "--top-p", "2"), "top-p")
    assert_one_line_error(nanoforge("frobnicate"), "invalid choice")


def test_first_run_trains_serves_and_answers_a_chat_message(tmp_path):
    """`nanoforge serve` with no model: builds the offline default chat model, serves it over HTTP and
    answers one chat message through the API (budgets shrunk here; the README's run uses the defaults)."""
    import signal

    code = ("import sys, nanoforge.cli as c; c.FIRST_RUN['cpu'].update(train=['--max-steps', '4'], "
            "sft=['--max-steps', '3', '--eval-samples', '2', '--answer-tokens', '8']); "
            "sys.exit(c.main(['serve', '--port', '0']))")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "NUMBA_ENABLE_CUDASIM")}
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("assistant:") or line.startswith("first chat message failed"):
                break
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    out = "".join(lines)
    assert "user: What does the zip function do?" in out, out[-2000:]
    assert "Warning" not in out, out  # nothing but what the run has to say (no Python warnings with source lines)
    assert any(line.startswith("assistant:") for line in lines), out[-2000:]
    # the server's first line says what its engine's start cost (CPU: no CUDA graphs)
    assert re.search(r"KV blocks; engine started in \d+\.\d s \(0\.0 s tuning the skinny matmul\), 0 CUDA graphs\)", out), out[-2000:]
    assert (tmp_path / "runs" / "default" / "sft" / "config.json").is_file()
    assert (tmp_path / "runs" / "default" / "pretrain" / "loss.png").is_file()
