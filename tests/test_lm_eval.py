"""lm-evaluation-harness against `nanoforge serve`, offline: the scores of its `local-completions` model (the
usual way to evaluate a model behind an OpenAI endpoint: loglikelihoods from echo + prompt logprobs, generations
from plain completions) equal those of its own `hf` backend on the same checkpoint.

The checkpoint is a tiny random Llama with a BPE tokenizer trained here whose post-processor adds a BOS token,
as Llama's does. lm-eval's `hf` backend encodes with the tokenizer's special tokens (BOS first); its API
backends encode without them unless `add_bos_token=True`, so that is set here, as the README says. Without it
every loglikelihood differs (by what BOS changes) and every generation too, yet acc and acc_norm stayed the
same; they also stayed the same when the server's prompt logprobs were shifted by -0.5 per token, or off by
one position. So this test compares each document's loglikelihoods and generations, not only the task
metrics (each of those mistakes fails it). The two tasks are defined from local JSONL files; nothing is
downloaded (tested with lm-eval 0.4.13).
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys

# lm-eval's data and model loading must never reach for the hub (everything here is local anyway)
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")
for _module in ("aiohttp", "tenacity", "requests", "accelerate"):  # lm-eval's api and hf extras
    pytest.importorskip(_module)
lm_eval = pytest.importorskip("lm_eval")

from test_serve_api import one_torch_thread  # noqa: E402  (tests/ is on sys.path under pytest)
from test_serve_engine import make_model  # noqa: E402
from tokenizers import processors  # noqa: E402

from nanoforge.model.hf import save_model  # noqa: E402
from nanoforge.tokenizer import Tokenizer  # noqa: E402

BOS = "<|begin_of_text|>"
UNTIL = ["\n", "."]
MAX_GEN = 16
NAME = "tiny"
ANIMALS = ["cat", "dog", "horse", "fox", "owl", "bear", "wolf", "duck", "goat", "lion", "mouse", "frog"]
COLORS = ["red", "green", "blue", "yellow", "black", "white", "brown", "grey"]

MC_TASK = """task: nf_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
"""

GEN_TASK = """task: nf_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: answer
generation_kwargs:
  until: {until}
  max_gen_toks: {max_gen}
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
"""


def _tokenizer(texts: list[str]) -> Tokenizer:
    """A byte-level BPE trained on the task texts, with a Llama-style BOS added by its post-processor."""
    backend = Tokenizer.train_bpe(texts, 320).backend
    backend.add_special_tokens([BOS])
    backend.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                           special_tokens=[(BOS, backend.token_to_id(BOS))])
    return Tokenizer(backend, eos_token="<|endoftext|>", eot_token="<|im_end|>", bos_token=BOS)


def _greedy_answer(hf, hf_tok, prompt: str) -> str:
    """What greedy decoding with plain transformers gives after `prompt`, cut at the first stop string."""
    ids = hf_tok(prompt, return_tensors="pt").input_ids  # BOS first
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=MAX_GEN, do_sample=False, pad_token_id=hf_tok.pad_token_id)
    text = hf_tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    return min((text.split(s)[0] for s in UNTIL), key=len)


def _docs() -> tuple[list[dict], list[dict]]:
    """16 multiple-choice and 16 question-answer documents."""
    rng = random.Random(0)
    mc, gen = [], []
    for _ in range(16):
        sound, color = rng.choice(["moo", "woof", "hoot", "quack"]), rng.choice(COLORS)
        # choices of different lengths in tokens and bytes: acc and acc_norm rank them differently
        mc.append({"question": f"Which animal says {sound} near the {color} barn?",
                   "choices": [f"the {a}" + " indeed" * rng.randrange(3) for a in rng.sample(ANIMALS, 4)],
                   "answer": rng.randrange(4)})
        gen.append({"question": f"What color is the {rng.choice(ANIMALS)}?", "answer": rng.choice(COLORS)})
    return mc, gen


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A folder with a tiny random Llama and its tokenizer."""
    model_dir = tmp_path_factory.mktemp("lm_eval") / "model"
    mc, gen = _docs()
    tok = _tokenizer([json.dumps(d) for d in mc + gen] * 3)
    # the engine stops at the tokenizer's end tokens; transformers at config.json's eos_token_id: the same ones
    save_model(make_model(tok, "tiny-llama", eos_token_id=sorted(tok.stop_ids), bos_token_id=tok.bos_id), model_dir)
    tok.save(model_dir)
    return model_dir


@pytest.fixture(scope="module")
def server(checkpoint):
    """`nanoforge serve` on the checkpoint, on an ephemeral loopback port: the process, started now, and a
    function that waits until it serves and returns its base URL (the tasks are written meanwhile)."""
    proc = subprocess.Popen([sys.executable, "-m", "nanoforge.cli", "serve", "--model", str(checkpoint), "--port",
                             "0", "--device", "cpu", "--dtype", "fp32", "--served-model-name", NAME,
                             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})

    def url() -> str:
        line = proc.stdout.readline()  # printed once the socket is bound; requests wait for startup after that
        match = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        assert match, line + proc.stderr.read()
        return f"http://127.0.0.1:{match.group(1)}"

    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def tasks(checkpoint):
    """A folder with the two task YAMLs, over JSONL files beside it. Half the generation targets are what
    transformers generates greedily, so exact_match is 0.5 when the generations are right."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(checkpoint)
    assert hf_tok("the cat").input_ids[0] == hf_tok.bos_token_id  # the tokenizer adds BOS, as Llama's does
    mc, gen = _docs()
    with one_torch_thread():
        for doc in gen[::2]:
            doc["answer"] = _greedy_answer(hf, hf_tok, f"Q: {doc['question']}\nA:")
    root = checkpoint.parent
    folder = root / "tasks"
    folder.mkdir()
    for name, docs, template in (("nf_mc", mc, MC_TASK), ("nf_gen", gen, GEN_TASK)):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (folder / f"{name}.yaml").write_text(template.format(data=data, cache=root / "datasets_cache",
                                                             until=json.dumps(UNTIL), max_gen=MAX_GEN))
    return folder


def _evaluate(model: str, model_args: str, tasks) -> dict:
    from lm_eval.tasks import TaskManager

    # include_defaults=False: only our two tasks (indexing lm-eval's thousands of built-in ones takes ~10 s)
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["nf_mc", "nf_gen"], batch_size=1,
                                   task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
                                   log_samples=True)


def test_local_completions_scores_equal_the_hf_backend(checkpoint, server, tasks):
    with one_torch_thread():
        served = _evaluate("local-completions", f"model={NAME},base_url={server()}/v1/completions,"
                           f"tokenizer={checkpoint},tokenizer_backend=huggingface,num_concurrent=1,max_length=256,"
                           "add_bos_token=True", tasks)
        local = _evaluate("hf", f"pretrained={checkpoint},dtype=float32,device=cpu", tasks)
    print({name: {m: (served["results"][name][m], local["results"][name][m])
                  for m in ("acc,none", "acc_norm,none", "exact_match,none") if m in local["results"][name]}
           for name in ("nf_mc", "nf_gen")})

    for metric in ("acc,none", "acc_norm,none"):
        assert served["results"]["nf_mc"][metric] == local["results"]["nf_mc"][metric]
    assert served["results"]["nf_gen"]["exact_match,none"] == local["results"]["nf_gen"]["exact_match,none"] == 0.5

    # document by document: each choice's loglikelihood (sum of the continuation's prompt logprobs) and
    # whether it is the greedy continuation; each generation, character for character
    mc_served, mc_local = served["samples"]["nf_mc"], local["samples"]["nf_mc"]
    assert len(mc_served) == len(mc_local) == 16
    for a, b in zip(mc_served, mc_local):
        assert a["doc_id"] == b["doc_id"]
        (ll_a, greedy_a), (ll_b, greedy_b) = zip(*(r[0] for r in a["resps"])), zip(*(r[0] for r in b["resps"]))
        assert ll_a == pytest.approx(ll_b, abs=1e-4) and greedy_a == greedy_b
    gen_served, gen_local = served["samples"]["nf_gen"], local["samples"]["nf_gen"]
    assert [s["resps"] for s in gen_served] == [s["resps"] for s in gen_local]
    assert len(gen_served) == 16
