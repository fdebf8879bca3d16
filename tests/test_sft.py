"""SFT: loss only on the answers, packing with document masking, a model that learns to stop at
the end of its turn, resumable runs, and clear errors for bad instruction files (CPU, tiny models)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nanoforge.cli import main
from nanoforge.data.loader import Batch
from nanoforge.data.sft import SFTPacker, render
from nanoforge.model.config import preset as model_preset
from nanoforge.model.generate import generate
from nanoforge.model.hf import load_model, save_model
from nanoforge.model.transformer import Transformer
from nanoforge.tokenizer import Tokenizer
from nanoforge.train import trainer
from nanoforge.train.sft import split_records

WORDS = "apple river stone cloud tiger lemon piano candle forest silver".split()


def make_records(n: int, seed: int = 0) -> list[dict]:
    """Records with a learnable pattern, "Say X twice." -> "X X.", in all three shapes: Alpaca,
    Alpaca with an input field, and chat messages with a system prompt."""
    rng = np.random.default_rng(seed)
    records = []
    for i in range(n):
        word = str(rng.choice(WORDS))
        if i % 3 == 0:
            records.append({"messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": f"Say {word} twice."},
                                         {"role": "assistant", "content": f"{word} {word}."}]})
        elif i % 3 == 1:
            records.append({"instruction": f"Say {word} twice.", "input": "", "output": f"{word} {word}."})
        else:
            records.append({"instruction": "Say the input twice.", "input": word, "output": f"{word} {word}."})
    return records


@pytest.fixture(scope="module")
def init_dir(tmp_path_factory):
    """A "pretrained" model folder: random tiny Llama weights and a character tokenizer."""
    text = json.dumps(make_records(50)) + "".join(WORDS) + "Say the input twice.\n"
    tok = Tokenizer.char_level(text)
    torch.manual_seed(0)
    model = Transformer(model_preset("tiny-llama", vocab_size=tok.vocab_size, max_seq_len=96))
    out = tmp_path_factory.mktemp("init")
    save_model(model, out)
    tok.save(out)
    return out


def run_cli(*argv) -> int:
    return main([str(a) for a in argv])


# --- the loss --------------------------------------------------------------------------------------

def test_loss_mask_decides_what_is_trained(init_dir):
    """Changing the labels of prompt tokens changes nothing (loss and gradients, bitwise); changing one
    answer label changes the loss. And the packed, document-masked loss equals a float64 reference
    that runs each example alone and sums -log p over its answer tokens."""
    tok = Tokenizer.load(init_dir)
    model = load_model(init_dir).double()
    examples = [render(r, tok) for r in make_records(6, seed=1)]
    batch = next(iter(SFTPacker(examples, seq_len=96, batch_size=2, seed=0)))
    assert (batch.doc_ids.max(dim=1).values >= 1).all()  # rows really hold several examples

    def loss_and_grads(b):
        model.zero_grad()
        loss = trainer.batch_loss(model, b)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    base_loss, base_grads = loss_and_grads(batch)
    relabelled = torch.where(batch.loss_mask, batch.targets, torch.randint_like(batch.targets, tok.vocab_size))
    assert (relabelled != batch.targets).any()
    loss, grads = loss_and_grads(Batch(batch.input_ids, relabelled, batch.doc_ids, batch.positions, batch.loss_mask))
    assert torch.equal(loss, base_loss) and all(torch.equal(a, b) for a, b in zip(grads, base_grads))

    one_answer_changed = batch.targets.clone()
    r, t = batch.loss_mask.nonzero()[0]
    one_answer_changed[r, t] = (one_answer_changed[r, t] + 1) % tok.vocab_size
    changed = trainer.batch_loss(model, Batch(batch.input_ids, one_answer_changed, batch.doc_ids, batch.positions,
                                              batch.loss_mask))
    assert not torch.equal(changed.detach(), base_loss)

    # Reference: every example of the batch on its own, float64, loss summed over its answer tokens.
    packed = {tuple(batch.input_ids[r, batch.doc_ids[r] == d].tolist())
              for r in range(2) for d in batch.doc_ids[r].unique()}
    expected, n_answer = 0.0, 0
    with torch.no_grad():
        for ids, mask in examples:
            if tuple(ids[:-1]) not in packed:
                continue
            logp = F.log_softmax(model(torch.tensor([ids[:-1]]))[0], dim=-1)
            for i in range(len(ids) - 1):
                if mask[i + 1]:
                    expected -= logp[i, ids[i + 1]].item()
                    n_answer += 1
    assert n_answer == int(batch.loss_mask.sum())
    assert base_loss.item() == pytest.approx(expected, rel=1e-9)


def test_split_is_seeded_and_disjoint():
    records = make_records(40)
    train, val = split_records(records, 0.1, seed=3)
    assert len(val) == 4 and len(train) == 36
    assert sorted(map(json.dumps, train + val)) == sorted(map(json.dumps, records))
    assert split_records(records, 0.1, seed=3) == (train, val)


# --- end to end ------------------------------------------------------------------------------------

def test_sft_learns_to_answer_and_stop_at_end_of_turn(init_dir, tmp_path, capsys):
    data = tmp_path / "say.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in make_records(200)) + "\n")
    out = tmp_path / "sft"
    args = ["sft", "--init", init_dir, "--data", data, "--out", out, "--max-steps", "120", "--batch-size", "8",
            "--lr", "3e-3", "--min-lr", "3e-4", "--warmup-steps", "10", "--eval-interval", "40", "--log-interval", "20",
            "--eval-samples", "20", "--answer-tokens", "24"]
    assert run_cli(*args) == 0
    log = json.loads((out / "log.json").read_text())
    val = [r["loss"] for r in log["history"]["val"]]
    assert [r["step"] for r in log["history"]["val"]] == [0, 40, 80, 120]
    assert val[-1] < val[0] / 3  # the answer-token validation loss falls
    answers = json.loads((out / "answers.json").read_text())
    assert answers["samples"] == 20 and answers["eot_rate"] >= 0.9
    assert 20 <= answers["tokens"] <= 20 * 24 and answers["seconds"] > 0  # what the check generated, and its time
    assert f"{answers['tokens']:,} tokens generated in" in capsys.readouterr().out

    # The saved chat model stops at the end-of-turn token and answers in the data's shape.
    tok, model = Tokenizer.load(out), load_model(out)
    ids = tok.encode_chat([{"role": "user", "content": "Say tiger twice."}], add_generation_prompt=True)
    out_ids = generate(model, ids, max_new_tokens=30, stop_ids=tok.stop_ids)
    assert out_ids[-1] == tok.eot_id and tok.decode(out_ids[:-1]).endswith(".")
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == sorted({tok.eot_id, tok.eos_id})
    capsys.readouterr()
    assert run_cli("generate", "--chat", "--model", out, "--prompt", "Say tiger twice.", "--max-tokens", "30") == 0
    printed = capsys.readouterr().out
    assert printed.strip().endswith(".") and "<|im_end|>" not in printed


def test_sft_resume_continues_exactly(init_dir, tmp_path):
    data = tmp_path / "say.json"
    data.write_text(json.dumps(make_records(60)))
    common = ["--init", init_dir, "--data", data, "--batch-size", "4", "--lr-decay-steps", "6", "--eval-interval", "3",
              "--log-interval", "1", "--eval-samples", "1", "--answer-tokens", "4"]
    assert run_cli("sft", "--out", tmp_path / "a", "--max-steps", "6", *common) == 0
    assert run_cli("sft", "--out", tmp_path / "b", "--max-steps", "3", *common) == 0
    assert run_cli("sft", "--out", tmp_path / "b", "--max-steps", "6", "--resume", "--eval-samples", "1",
                   "--answer-tokens", "4") == 0
    a, b = (json.loads((tmp_path / x / "log.json").read_text())["history"] for x in "ab")
    assert [r["loss"] for r in a["train"]] == [r["loss"] for r in b["train"]] and len(a["train"]) == 6
    assert [(r["step"], r["loss"]) for r in a["val"]] == [(r["step"], r["loss"]) for r in b["val"]]


def test_a_character_model_skips_records_its_vocabulary_cannot_read(init_dir, tmp_path, capsys):
    """A character-level model knows only its characters (it once crashed here with a WordLevel traceback):
    records holding others are skipped, said in one line, and SFT trains on the rest; with none left it
    refuses in one line."""
    data, out = tmp_path / "data.jsonl", tmp_path / "sft"
    records = make_records(40) + [{"instruction": f"Say {n} twice.", "output": f"{n} {n}."} for n in (42, 7, 42)]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    capsys.readouterr()
    assert run_cli("sft", "--init", init_dir, "--data", data, "--out", out, "--max-steps", "2", "--eval-samples", "2",
                   "--answer-tokens", "4") == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "skipped" in line]
    assert len(said) == 1 and "skipped 3 of 43 records" in said[0] and "'247'" in said[0], said
    data.write_text("".join(json.dumps(r) + "\n" for r in records[40:]))
    assert run_cli("sft", "--init", init_dir, "--data", data, "--out", tmp_path / "none", "--max-steps", "2") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot encode any of the 3 records" in err[0], err


# --- bad input -------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["missing-field", "not-a-model", "other-architecture", "empty"])
def test_bad_sft_input_is_one_line_and_exit_2(case, init_dir, tmp_path, capsys):
    out, init = tmp_path / "sft", init_dir
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(make_records(2)[1]) + "\n" + json.dumps({"instruction": "Say hi."}) + "\n")
    if case == "missing-field":
        message = "data.jsonl line 2: field 'output' is missing"
    elif case == "not-a-model":
        init, message = tmp_path, "config.json not found"
    elif case == "other-architecture":
        init = tmp_path / "bert"
        init.mkdir()
        (init / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
        message = "model_type 'bert' is not supported"
    else:
        data.write_text("")
        message = "data.jsonl is empty"
    capsys.readouterr()
    assert run_cli("sft", "--init", init, "--data", data, "--out", out, "--max-steps", "2") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (out / "trainer_state.pt").exists() and not (out / "model.safetensors").exists()


def test_offline_default_pipeline_needs_no_arguments(tmp_path, monkeypatch, capsys):
    """`nanoforge train`, `nanoforge sft`, `nanoforge generate --chat` with nothing but a step budget:
    the built-in corpus and instructions, runs/pretrain then runs/sft (a smoke test of the wiring)."""
    monkeypatch.chdir(tmp_path)
    assert run_cli("train", "--max-steps", "2", "--eval-iters", "1") == 0
    assert (tmp_path / "runs/pretrain/model.safetensors").is_file()
    assert run_cli("sft", "--max-steps", "2", "--eval-iters", "1", "--eval-samples", "2", "--answer-tokens", "4") == 0
    assert (tmp_path / "runs/sft/answers.json").is_file()
    records = json.loads((tmp_path / "runs/sft/log.json").read_text())["config"]
    assert records["init"] == "runs/pretrain" and records["data"] is None
    capsys.readouterr()
    assert run_cli("generate", "--chat", "--model", "runs/sft", "--prompt", "What is a list?", "--max-tokens", "4") == 0


@pytest.mark.gpu
def test_sft_on_gpu_graphed_step_matches_launched(init_dir, tmp_path):
    """On CUDA, SFT's default step is one CUDA graph; its losses follow the step launched from Python (the
    trained-token count, hence the loss divisor, changes every step here)."""
    data = tmp_path / "say.json"
    data.write_text(json.dumps(make_records(60)))
    common = ["--init", init_dir, "--data", data, "--batch-size", "4", "--max-steps", "6", "--eval-interval", "3",
              "--log-interval", "1", "--eval-samples", "2", "--answer-tokens", "8", "--device", "cuda", "--dtype",
              "fp32", "--no-compile"]
    losses = {}
    for flag in ("--cuda-graph", "--no-cuda-graph"):
        assert run_cli("sft", "--out", tmp_path / flag, *common, flag) == 0
        losses[flag] = [r["loss"] for r in json.loads((tmp_path / flag / "log.json").read_text())["history"]["train"]]
    assert len(losses["--cuda-graph"]) == 6
    assert losses["--cuda-graph"] == pytest.approx(losses["--no-cuda-graph"], rel=1e-4)
