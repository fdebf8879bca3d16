"""One prompt encoding for every front door, and it is Hugging Face's: `tokenizer(prompt)` applies the
post-processor of tokenizer.json (Llama 3's adds <|begin_of_text|>; GPT-2's adds nothing although its
tokenizer_config.json names a BOS token). `nanoforge generate`, `LLM.generate` and the server must all
encode a prompt that way, so that greedy output equals `transformers`' on the same checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from tokenizers import processors  # noqa: E402

from nanoforge import LLM, SamplingParams  # noqa: E402
from nanoforge.model.config import preset  # noqa: E402
from nanoforge.model.hf import load_model, save_model  # noqa: E402
from nanoforge.model.transformer import Transformer  # noqa: E402
from nanoforge.serve.api import build_app  # noqa: E402
from nanoforge.serve.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from nanoforge.tokenizer import ENDOFTEXT, IM_END, Tokenizer  # noqa: E402

BOS = "<|begin_of_text|>"
CORPUS = ["the quick brown fox jumps over the lazy dog. " * 3, "def zip(*iterables): return tuples", "a b c d e"] * 20
PROMPTS = ["the lazy fox", "def zip(", f"one{IM_END}two", " leading space"]
NEW_TOKENS = 8


def make_tokenizer(style: str) -> Tokenizer:
    """A byte-level BPE like Llama 3's (a template post-processor that adds BOS) or GPT-2's (a ByteLevel
    post-processor that adds nothing, with a BOS token named in the config all the same)."""
    backend = Tokenizer.train_bpe(CORPUS, vocab_size=300).backend
    if style == "llama3":
        backend.add_special_tokens([BOS])
        bos_id = backend.token_to_id(BOS)
        backend.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                               special_tokens=[(BOS, bos_id)])
        return Tokenizer(backend, eos_token=ENDOFTEXT, eot_token=IM_END, bos_token=BOS)
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return Tokenizer(backend, eos_token=ENDOFTEXT, eot_token=IM_END, bos_token=ENDOFTEXT)


@pytest.fixture(scope="module", params=["llama3", "gpt2"])
def model_dir(request, tmp_path_factory):
    tok = make_tokenizer(request.param)
    torch.manual_seed(0)
    name = "tiny-llama" if request.param == "llama3" else "tiny-gpt2"
    model = Transformer(preset(name, vocab_size=tok.vocab_size)).eval()
    d = tmp_path_factory.mktemp(request.param)
    save_model(model, d)
    tok.save(d)
    return request.param, d


@pytest.fixture(scope="module")
def hf(model_dir):
    """transformers' tokenizer and model on the same folder, and its greedy continuation of each prompt."""
    _, d = model_dir
    hf_tok = transformers.AutoTokenizer.from_pretrained(d)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    hf_model.generation_config.eos_token_id = None  # generate exactly NEW_TOKENS, as ignore_eos does
    outputs = {}
    for p in PROMPTS:
        ids = hf_tok(p, return_tensors="pt")
        with torch.no_grad():
            out = hf_model.generate(**ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                    pad_token_id=0)
        outputs[p] = (ids.input_ids[0].tolist(), out[0, ids.input_ids.shape[1]:].tolist())
    return hf_tok, outputs


def test_prompt_ids_are_autotokenizers(model_dir, hf):
    style, d = model_dir
    ours, (hf_tok, _) = Tokenizer.load(d), hf
    for p in PROMPTS:
        ids = ours.encode_prompt(p)
        assert ids == hf_tok(p)["input_ids"], p
        assert (ids[0] == ours.bos_id) == (style == "llama3"), ids  # the post-processor decides, not the config
    assert ours.encode_prompt_batch(PROMPTS) == [hf_tok(p)["input_ids"] for p in PROMPTS]
    assert ours.eot_id in ours.encode_prompt(PROMPTS[2])  # special-token strings are special, as in HF


def test_llm_generates_what_transformers_does(model_dir, hf):
    _, d = model_dir
    llm = LLM(str(d), device="cpu")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for p, out in zip(PROMPTS, outs):
        prompt_ids, new_ids = hf[1][p]
        assert out.prompt_token_ids == prompt_ids, p
        assert out.outputs[0].token_ids == new_ids, p


def test_server_encodes_and_generates_what_transformers_does(model_dir, hf):
    from test_serve_api import one_torch_thread, serving

    _, d = model_dir
    hf_tok, outputs = hf
    tok = Tokenizer.load(d)
    with one_torch_thread():
        engine = LLMEngine(load_model(d), tok, EngineConfig(num_gpu_blocks=64))
        with serving(build_app(engine, "m")) as url:
            for p in PROMPTS:
                r = httpx.post(url + "/v1/completions", timeout=60, json={
                    "model": "m", "prompt": p, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True})
                body = r.json()
                prompt_ids, new_ids = outputs[p]
                assert body["usage"]["prompt_tokens"] == len(prompt_ids), (p, body)
                assert body["choices"][0]["text"] == hf_tok.decode(new_ids, skip_special_tokens=True), p


@pytest.fixture(scope="module", autouse=True)
def cli_generations(request, model_dir):
    """`nanoforge generate` on the first two prompts, started as soon as the model folder is written: child
    processes that run beside this module's other tests; test_cli_generate_prints_what_transformers_generates
    reads what they printed."""
    reader = "test_cli_generate_prints_what_transformers_generates"
    if not any(item.module is request.module and item.originalname == reader for item in request.session.items):
        yield None
        return
    _, d = model_dir
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "NUMBA_ENABLE_CUDASIM")}
    procs = {p: subprocess.Popen([sys.executable, "-m", "nanoforge.cli", "generate", "--model", str(d), "--prompt", p,
                                  "--max-tokens", str(NEW_TOKENS)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=env) for p in PROMPTS[:2]}
    yield procs
    for proc in procs.values():
        proc.kill()
        proc.communicate()


def test_cli_generate_prints_what_transformers_generates(model_dir, hf, cli_generations):
    """`nanoforge generate` prints the greedy continuation up to the first end token (it once prepended the
    config's BOS to GPT-2 prompts, which `transformers` does not)."""
    _, d = model_dir
    hf_tok, outputs = hf
    tok = Tokenizer.load(d)
    for p, proc in cli_generations.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        new_ids = outputs[p][1]
        stops = [i for i, t in enumerate(new_ids) if t in tok.stop_ids]
        want = hf_tok.decode(new_ids[:stops[0]] if stops else new_ids, skip_special_tokens=True)
        assert stdout == want + "\n", (p, stdout, want)
