"""The pretraining loop: schedule, optimizer groups, gradient accumulation, exact resume,
non-finite losses, checkpoints, bad input, and the training benchmark (tiny models on the CPU)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from nanoforge.cli import main
from nanoforge.data.loader import Batch, doc_ids_and_positions
from nanoforge.data.sft import IGNORE_INDEX
from nanoforge.errors import NanoforgeError
from nanoforge.model.attention import DenseAttention, SDPAAttention
from nanoforge.model.config import preset as model_preset
from nanoforge.model.hf import load_model
from nanoforge.model.transformer import Transformer
from nanoforge.train import trainer
from nanoforge.train.checkpoint import canonical
from nanoforge.train.config import TrainConfig
from nanoforge.train.optim import lr_at, make_optimizer

WORDS = "the king shall speak of war and love to thee my lord what now good night sweet prince".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small deterministic text file: random lines of a few words (about 24k characters)."""
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(WORDS, size=rng.integers(3, 9))) for _ in range(800)]
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny_args(corpus, out, *extra):
    """nanoGPT's CPU baby GPT (4 layers, 128 wide) with dropout on, char-level, 4 x 32 tokens, every step logged."""
    return ["train", "--preset", "shakespeare-char-cpu", "--data", corpus, "--out", out, "--batch-size", "4",
            "--seq-len", "32", "--eval-iters", "2", "--log-interval", "1", "--dropout", "0.1", *extra]


def run_cli(*argv) -> int:
    return main([str(a) for a in argv])


def history(out) -> dict:
    return json.loads((out / "log.json").read_text())["history"]


# --- schedule, optimizer, FLOPs ------------------------------------------------------------------

def test_lr_schedule_is_warmup_then_cosine_then_floor():
    cfg = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, lr_decay_steps=110, max_steps=200)
    assert lr_at(0, cfg) == pytest.approx(1e-3 / 11)
    assert lr_at(9, cfg) == pytest.approx(1e-3 * 10 / 11)
    assert lr_at(10, cfg) == pytest.approx(1e-3)  # cosine starts at the peak
    assert lr_at(60, cfg) == pytest.approx(1e-4 + 0.5 * 9e-4)  # halfway: the midpoint
    assert lr_at(110, cfg) == lr_at(199, cfg) == 1e-4
    lrs = [lr_at(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_optimizer_decays_matrices_and_embeddings_only():
    model = Transformer(model_preset("tiny-gpt2"))
    opt = make_optimizer(model, TrainConfig(weight_decay=0.1))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in no_decay["params"]} == {n for n, p in model.named_parameters() if p.dim() == 1}
    assert any(names[id(p)] == "embed.weight" for p in decay["params"])
    # The tied output head is the embedding: every parameter is in exactly one group, once.
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == model.num_params()


def test_training_flops_match_nanogpt_estimate():
    """nanoGPT: 6 N + 12 L H Q T with N = all parameters except position embeddings (the tied
    embedding counted once, as the output projection). Biases and norms are the small difference."""
    cfg = model_preset("gpt2-124m")
    n = cfg.num_params() + cfg.vocab_size * cfg.d_model  # matrices + tied head
    n_nanogpt = 124_439_808 - 1024 * 768  # GPT-2 124M, minus wpe (nanoGPT's get_num_params: 123.65M)
    assert abs(n - n_nanogpt) / n_nanogpt < 2e-3
    assert cfg.flops_per_token(1024) == pytest.approx(6 * n + 12 * 12 * 768 * 1024)


# --- gradient accumulation -------------------------------------------------------------------------

def _batch(ids: torch.Tensor, loss_mask: torch.Tensor | None = None) -> Batch:
    inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    doc_ids, positions = doc_ids_and_positions(inputs, eot_id=0)
    return Batch(inputs, targets, doc_ids, positions, loss_mask)


def test_gradient_accumulation_equals_one_big_batch():
    """Micro-batches with different numbers of trained tokens give the gradient of the whole batch:
    the loss is the mean over every trained token of the step, not a mean of means."""
    torch.manual_seed(0)
    cfg = model_preset("tiny-llama")
    ids = torch.randint(0, cfg.vocab_size, (4, 17))
    mask = torch.rand(4, 16) < 0.5
    mask[:2] = mask[:2] & (torch.rand(2, 16) < 0.3)  # the first micro-batch trains on fewer tokens
    grads = []
    for micro in ([_batch(ids, mask)], [_batch(ids[:2], mask[:2]), _batch(ids[2:], mask[2:])]):
        torch.manual_seed(1)
        model = Transformer(cfg).double()
        sgd = torch.optim.SGD(model.parameters(), lr=1.0)  # new params = old - grad: exposes the gradient
        before = [p.detach().clone() for p in model.parameters()]
        loss_fn = trainer.make_loss_fn(model, trainer.document_attention, compiled=False)
        trainer.TrainStep(loss_fn, model, sgd, grad_clip=0.0, amp=torch.autocast("cpu", enabled=False),
                          device="cpu")(micro, 1.0)
        grads.append([b - p.detach() for b, p in zip(before, model.parameters())])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert any(g.abs().sum() > 0 for g in grads[0])


def test_weight_average_follows_a_float64_running_average():
    """The average after each step is avg + w (weights - avg), w = 1 - min(decay, (1 + t) / (10 + t)),
    recomputed here in float64 from the weights each step left; training itself is not changed by it."""
    torch.manual_seed(0)
    cfg = model_preset("tiny-llama")
    batches = [_batch(torch.randint(0, cfg.vocab_size, (2, 17))) for _ in range(3)]
    amp = torch.autocast("cpu", enabled=False)
    runs = {}
    for decay in (0.0, 0.95):
        torch.manual_seed(1)
        model = Transformer(cfg)
        opt = make_optimizer(model, TrainConfig(weight_decay=0.1))
        average = trainer.WeightAverage(model, decay, "cpu") if decay else None
        step = trainer.make_stepper(trainer.make_loss_fn(model, trainer.document_attention, False), model, opt,
                                    grad_clip=1.0, amp=amp, graphed=False, average=average, device="cpu")
        naive = [p.detach().double().clone() for p in model.parameters()]
        losses = []
        for t in range(12):
            if average is not None:
                average.set_step(t)
            losses.append(step([batches[t % 3]], 3e-3).item())
            w = 1 - min(decay, (1 + t) / (10 + t))
            naive = [a + w * (p.detach().double() - a) for a, p in zip(naive, model.parameters())]
        runs[decay] = losses, [p.detach().clone() for p in model.parameters()], average, naive
    (plain_losses, plain_weights, _, _), (losses, weights, average, naive) = runs[0.0], runs[0.95]
    assert losses == plain_losses and all(torch.equal(a, b) for a, b in zip(weights, plain_weights))
    for got, want, w in zip(average.avg, naive, weights):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert max((a - w).abs().max().item() for a, w in zip(average.avg, weights)) > 1e-3  # a real average
    with average.swapped_in() as training:
        assert all(torch.equal(p, a) for p, a in zip(average.params, average.avg))
        assert all(torch.equal(t, w) for t, w in zip(training, weights))
    assert all(torch.equal(p, w) for p, w in zip(average.params, weights))  # put back


# --- dropout and evaluation ------------------------------------------------------------------------------

def naive_attention(q, k, v, doc_ids):
    """Float64 definition: explicit scores, causal and same-document mask, softmax; (B, T, H, D), GQA."""
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(q.shape[-1])
    T = q.shape[1]
    allowed = torch.ones(T, T, dtype=torch.bool).tril() & (doc_ids[:, :, None] == doc_ids[:, None, :])[:, None]
    return torch.einsum("bhij,bjhd->bihd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


def test_attention_dropout_keeps_the_masks_and_is_unbiased():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 12, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 12, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    doc_ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    dense = DenseAttention(doc_ids)
    want = naive_attention(q, k, v, doc_ids)
    torch.testing.assert_close(SDPAAttention(doc_ids, 0.0).attend(0, q, k, v), want)
    torch.testing.assert_close(dense.attend(0, q, k, v), want)
    # Dropout on the weights, rescaled by 1 / (1 - p): each draw differs, the average is the attention.
    torch.manual_seed(0)
    draws = torch.stack([SDPAAttention(doc_ids, 0.5).attend(0, q, k, v) for _ in range(4000)])

    def rel_error(x):
        return ((x - want).norm() / want.norm()).item()

    assert not torch.equal(draws[0], draws[1]) and rel_error(draws[0]) > 0.3
    assert rel_error(draws.mean(0)) < 0.05


def test_training_steps_drop_attention_weights_and_evaluation_does_not(corpus, tmp_path, monkeypatch):
    """With model dropout on, training steps drop attention weights as nanoGPT does (here the only
    dropout left on, so the only randomness); evaluation is deterministic and drops nothing."""
    seen = []  # the attention that the loop's training steps get
    real_make_loss_fn = trainer.make_loss_fn

    def spy(model, attention, compiled, loss_chunk=None):
        seen.append(attention)
        return real_make_loss_fn(model, attention, compiled, loss_chunk)

    monkeypatch.setattr(trainer, "make_loss_fn", spy)
    assert run_cli(*tiny_args(corpus, tmp_path / "run", "--max-steps", "1")) == 0  # --dropout 0.1
    backend = seen[0](_batch(torch.randint(0, 60, (2, 9))))
    assert isinstance(backend, SDPAAttention) and backend.p == 0.1
    monkeypatch.undo()

    torch.manual_seed(0)
    model = Transformer(model_preset("tiny-gpt2", dropout=0.3)).train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0  # residual and embedding dropout off
    batch = _batch(torch.randint(0, 256, (2, 33)))
    assert trainer.training_attention(trainer.document_attention, 0.0) is trainer.document_attention
    loss_fn = trainer.make_loss_fn(model, trainer.training_attention(trainer.document_attention, 0.3), compiled=False)
    assert loss_fn(batch).item() != loss_fn(batch).item()
    amp = torch.autocast("cpu", enabled=False)
    evals = [trainer.evaluate(model, [batch], device=torch.device("cpu"), amp=amp) for _ in range(2)]
    assert model.training  # evaluate puts the model back in training mode
    model.eval()
    with torch.no_grad():
        exact = trainer.batch_loss(model, batch).item() / trainer.count_trained(batch)
    assert evals[0] == evals[1] == pytest.approx(exact, rel=1e-6)
    # The loop evaluates with training's attention implementation, dropout off: the same, deterministic loss.
    eval_attention = trainer.evaluation_attention(trainer.document_attention, 0.3)
    assert eval_attention(batch).p == 0.0
    via_training_path = [trainer.evaluate(model, [batch], device=torch.device("cpu"), amp=amp,
                                          attention=eval_attention) for _ in range(2)]
    assert via_training_path[0] == via_training_path[1] == pytest.approx(exact, rel=1e-5)


@pytest.mark.parametrize("mode,blocks", [("full", [0, 1, 2, 3]), ("2", [0, 2])])
def test_activation_checkpointing_keeps_only_block_inputs_and_changes_no_gradient(mode, blocks):
    """--ac (train/parallel/ac.py): the checkpointed blocks save nothing for the backward (autograd sees only what
    the rest of the model saves), recompute in the backward with the same dropout masks, and the loss and every
    gradient are the plain model's, bit for bit (fp32); parameter names stay as they were."""
    import copy

    from nanoforge.train.parallel.ac import apply_ac, checkpointed

    torch.manual_seed(0)
    plain = Transformer(model_preset("tiny-llama", n_layers=4, dropout=0.1)).train()
    model = copy.deepcopy(plain)
    assert apply_ac(model, mode) == len(blocks) and checkpointed(model) == blocks and checkpointed(plain) == []
    batch = _batch(torch.randint(0, 256, (2, 33)))

    def run(m):
        saved = []
        loss_fn = trainer.make_loss_fn(m, trainer.training_attention(trainer.document_attention, 0.1), compiled=False)
        torch.manual_seed(1)  # the same dropout masks in both models' forwards
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            loss = loss_fn(batch)
        loss.backward()
        return sum(saved), loss.item(), {n: p.grad for n, p in m.named_parameters()}

    bytes_plain, loss_plain, grads_plain = run(plain)
    bytes_ac, loss_ac, grads_ac = run(model)
    assert loss_ac == loss_plain and grads_ac.keys() == grads_plain.keys()
    assert all(torch.equal(grads_ac[n], grads_plain[n]) for n in grads_plain)
    per_block = (bytes_plain - bytes_ac) / len(blocks)  # what each checkpointed block no longer keeps
    outside = bytes_plain - 4 * per_block  # embedding, final norm, head and loss
    assert per_block > 0 and bytes_ac == pytest.approx(outside + (4 - len(blocks)) * per_block, rel=1e-6)
    assert outside < 4 * per_block
    model.eval()
    with torch.no_grad():  # evaluation runs the blocks plainly
        assert torch.equal(model(batch.input_ids), plain.eval()(batch.input_ids))


def test_checkpointed_blocks_compile_into_one_graph():
    """torch.compile traces the checkpointed blocks whole (the GPU default: the compiled step, captured in a CUDA
    graph, where an eager checkpoint's RNG bookkeeping could not run): no graph break, which a block changing
    anything outside it (the attention backend caching the documents' bounds in its first layer, once) caused."""
    import torch._dynamo

    from nanoforge.train.parallel.ac import apply_ac

    torch.manual_seed(0)
    model = Transformer(model_preset("tiny-llama", n_layers=2)).train()
    apply_ac(model, "full")
    ids = torch.randint(0, 256, (2, 17))
    batch = Batch(ids[:, :-1], ids[:, 1:], *doc_ids_and_positions(ids[:, :-1], eot_id=0))
    explained = torch._dynamo.explain(lambda b: trainer.batch_loss(model, b, trainer.document_attention))(batch)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons


def test_the_ac_flag_trains_the_same_run_and_refuses_unknown_modes(corpus, tmp_path, capsys, monkeypatch):
    assert run_cli(*tiny_args(corpus, tmp_path / "plain", "--max-steps", "2")) == 0
    assert run_cli(*tiny_args(corpus, tmp_path / "ac", "--max-steps", "2", "--ac", "full")) == 0
    losses = {run: [r["loss"] for part in ("train", "val") for r in history(tmp_path / run)[part]]
              for run in ("plain", "ac")}
    assert losses["ac"] == losses["plain"]  # dropout 0.1 included
    assert json.loads((tmp_path / "ac" / "log.json").read_text())["checkpointed_blocks"] == [0, 1, 2, 3]
    capsys.readouterr()
    assert run_cli(*tiny_args(corpus, tmp_path / "bad", "--ac", "some")) == 2
    err = capsys.readouterr().err.strip()
    assert "ac must be none, full or a number N (every N-th block), not 'some'" in err and "\n" not in err
    # a CUDA graph asked for (a GPU's; here the device stands in) with checkpointing it cannot hold: one line
    real = trainer.use_cuda_graph
    monkeypatch.setattr(trainer, "use_cuda_graph", lambda dev, graph, layout=None, blocker=None: real(
        torch.device("cuda"), True, layout, blocker))
    assert run_cli(*tiny_args(corpus, tmp_path / "graphed", "--ac", "full", "--no-compile")) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the tokenizer's progress
    assert last.startswith("nanoforge train: error: --cuda-graph: eager activation checkpointing saves the CUDA RNG state"), last
    # left to its default there, the step runs ungraphed and says why
    monkeypatch.setattr(trainer, "use_cuda_graph", lambda dev, graph, layout=None, blocker=None: real(
        torch.device("cuda"), graph, layout, blocker))
    assert run_cli(*tiny_args(corpus, tmp_path / "default", "--max-steps", "2", "--ac", "full", "--no-compile")) == 0
    assert "train: the step runs without a CUDA graph: eager activation checkpointing" in capsys.readouterr().out


def test_a_step_with_checkpointing_is_graphed_only_where_a_capture_can_hold_it():
    """graph_blocker: eager checkpointing, or compiled with dropout (torch.compile's recomputed dropout draws from
    generator states a captured step does not register: the H200 failed so), keeps the step out of a CUDA
    graph; compiled without dropout, or no checkpointing, does not. use_cuda_graph then leaves the graph out by
    default, and refuses it in one line when asked for."""
    blocker, use = trainer.graph_blocker, trainer.use_cuda_graph
    assert blocker(True, "none", 0.1) is None and blocker(False, "none", 0.0) is None
    assert blocker(True, "full", 0.0) is None and blocker(True, "2", 0.0) is None
    assert "eager" in blocker(False, "full", 0.0) and "dropout" in blocker(True, "2", 0.1)
    gpu = torch.device("cuda")  # only its type is read
    assert use(gpu, None) and not use(gpu, None, None, blocker(True, "full", 0.1))
    assert not use(gpu, False, None, blocker(False, "full", 0.0)) and use(gpu, True, None, None)
    with pytest.raises(NanoforgeError, match="^--cuda-graph: torch.compile recomputes .* drop --cuda-graph"):
        use(gpu, True, None, blocker(True, "full", 0.1))


def test_the_final_val_loss_covers_the_whole_split(corpus, tmp_path):
    """Along the way eval_iters batches; at the end the whole split, to its last token (recomputed here
    from the saved model and val.bin, window by window)."""
    out = tmp_path / "run"
    assert run_cli(*tiny_args(corpus, out, "--max-steps", "4", "--eval-interval", "2", "--eval-iters", "1")) == 0
    log = json.loads((out / "log.json").read_text())
    assert [r["step"] for r in log["history"]["val"]] == [0, 2, 4]
    model = load_model(out)
    dtype = json.loads((out / "data" / "meta.json").read_text())["dtype"]
    tokens = torch.from_numpy(np.fromfile(out / "data" / "val.bin", dtype=dtype).astype(np.int64))
    windows = tokens[: (len(tokens) - 1) // 32 * 32 + 1].unfold(0, 33, 32)  # non-overlapping, 32 + 1 tokens
    assert len(windows) > 1  # more than one eval batch of 4 rows would hold: eval_iters 1 was not used
    with torch.no_grad():
        logits = model(windows[:, :-1])
    whole = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()
    assert log["final_val_loss_full_split"] == pytest.approx(whole, rel=1e-5)


# --- exact resume, non-finite loss, checkpoints ------------------------------------------------------

@pytest.mark.parametrize("ema", ["0", "0.9"])
def test_resume_reproduces_the_uninterrupted_run_bitwise(corpus, tmp_path, ema, capsys):
    """8 steps straight vs 4 steps, stop, resume for 4: the same losses and weights, bit for bit
    (dropout is on, so the RNG state must come back too; the data position and schedule as well).
    With a weight average, the checkpoint's model is the average and its state the training weights."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    common = ["--lr-decay-steps", "8", "--warmup-steps", "2", "--eval-interval", "4", "--ema", ema]
    assert run_cli(*tiny_args(corpus, straight, "--max-steps", "8", *common)) == 0
    assert run_cli(*tiny_args(corpus, split, "--max-steps", "4", *common)) == 0
    assert torch.load(split / "trainer_state.pt", weights_only=True)["step"] == 4
    torch.manual_seed(12345)  # as in a new process: the RNG must come from the checkpoint
    capsys.readouterr()
    assert run_cli(*tiny_args(corpus, split, "--max-steps", "8", "--resume")) == 0
    assert ": 4 steps (from step 4 to 8) in " in capsys.readouterr().out  # the steps it ran, not the step it reached

    a, b = history(straight), history(split)
    assert [r["step"] for r in b["train"]] == list(range(1, 9))
    assert [r["loss"] for r in a["train"]] == [r["loss"] for r in b["train"]]
    assert [(r["step"], r["loss"]) for r in a["val"]] == [(r["step"], r["loss"]) for r in b["val"]]
    wa, wb = load_file(straight / "model.safetensors"), load_file(split / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # The run really learnt something and was really resumed (not restarted).
    assert a["val"][-1]["loss"] < a["val"][0]["loss"]
    state = torch.load(split / "trainer_state.pt", weights_only=True)
    assert state["step"] == 8
    if ema != "0":
        # The folder holds the average: a model of those weights scores the last val loss; the training
        # weights differ from it, and training itself is the run without an average.
        model = load_model(split)
        folder = canonical(model.named_parameters(), model.cfg)
        assert state["training_weights"].keys() == folder.keys()
        assert not all(torch.equal(t, folder[n].float()) for n, t in state["training_weights"].items())
        plain = tmp_path / "plain"
        assert run_cli(*tiny_args(corpus, plain, "--max-steps", "8", *common[:-1], "0")) == 0
        assert [r["loss"] for r in history(plain)["train"]] == [r["loss"] for r in a["train"]]
        assert history(plain)["val"][-1]["loss"] != a["val"][-1]["loss"]


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(corpus, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    real_loss, calls = trainer.batch_loss, {"train": 0}

    def loss_turning_nan(model, batch, attention=trainer.document_attention, loss_chunk=None):
        loss = real_loss(model, batch, attention, loss_chunk)
        if model.training:
            calls["train"] += 1
            if calls["train"] == 6:  # the 6th training step
                return loss * float("nan")
        return loss

    monkeypatch.setattr(trainer, "batch_loss", loss_turning_nan)
    code = run_cli(*tiny_args(corpus, out, "--max-steps", "8", "--eval-interval", "4"))
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2
    assert "step 6: training loss is nan" in err and "last good checkpoint (step 4)" in err
    state = torch.load(out / "trainer_state.pt", weights_only=True)
    assert state["step"] == 4
    model = load_model(out)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not any(p.name.startswith(".checkpoint") for p in out.iterdir())
    log = json.loads((out / "log.json").read_text())
    assert log["stopped"] == "non-finite loss at step 6" and (out / "loss.png").is_file()


def test_checkpoint_is_a_huggingface_model_with_its_tokenizer(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(*tiny_args(corpus, out, "--max-steps", "3", "--eval-interval", "3")) == 0
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    ours = load_model(out)
    ids = torch.randint(0, ours.cfg.vocab_size, (1, 12))
    torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=1e-4, atol=1e-4)
    capsys.readouterr()
    assert run_cli("generate", "--model", out, "--prompt", "the king", "--max-tokens", "5") == 0
    assert capsys.readouterr().out.strip()
    # A half-written checkpoint (crash before the commit rename) is dropped, not used.
    (out / ".checkpoint.tmp").mkdir()
    (out / ".checkpoint.tmp" / "model.safetensors").write_bytes(b"partial")
    assert run_cli(*tiny_args(corpus, out, "--max-steps", "4", "--resume")) == 0
    assert not (out / ".checkpoint.tmp").exists()


# --- every family, any preset, bf16 ------------------------------------------------------------------

FAMILIES = ["tiny-gpt2", "tiny-llama", "tiny-qwen2", "tiny-qwen3"]


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_attends_in_one_dtype_under_bf16_autocast(name):
    """Under bf16 autocast q, k and v come out of the projection in bf16 while RoPE's cos/sin follow the fp32
    residual stream: the rotation must hand attention q and k in v's dtype (it once gave fp32 q, k and bf16 v,
    and attention refused). The logits track the fp32 model's to bf16 precision, gradients included."""
    torch.manual_seed(0)
    model = Transformer(model_preset(name))
    ids = torch.randint(0, 256, (2, 24))
    doc_ids = torch.tensor([[0] * 10 + [1] * 14, [0] * 24])
    positions = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, 24)
    seen = []
    attend = DenseAttention.attend

    def spy(self, layer, q, k, v):
        seen.append((q.dtype, k.dtype, v.dtype))
        return attend(self, layer, q, k, v)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DenseAttention, "attend", spy)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids, positions, DenseAttention(doc_ids))
        logits.float().logsumexp(-1).sum().backward()
    assert seen and all(s == (torch.bfloat16,) * 3 for s in seen), seen
    want = model(ids, positions, DenseAttention(doc_ids)).detach()
    assert ((logits.float() - want).norm() / want.norm()).item() < 3e-2
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def pretrain_then_finetune(name, corpus, tmp_path, *device_flags) -> dict:
    """`train --preset NAME` (the generic recipe for a model preset, with document masking) for 30 steps on the
    corpus, then `sft` from it for 12; returns the log of each."""
    pre, sft = tmp_path / "pre", tmp_path / "sft"
    records = [{"instruction": f"say {w}", "output": f"{w} {w}"} for w in WORDS * 4]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    common = ["--batch-size", "4", "--seq-len", "64", "--lr", "3e-3", "--warmup-steps", "2", "--eval-iters", "2",
              "--log-interval", "5", *device_flags]
    assert run_cli("train", "--preset", name, "--data", corpus, "--tokenizer", "bpe:300", "--out", pre,
                   "--max-steps", "30", "--eval-interval", "30", *common) == 0
    assert run_cli("sft", "--init", pre, "--data", tmp_path / "sft.jsonl", "--out", sft, "--max-steps", "12",
                   "--eval-interval", "12", "--eval-samples", "2", "--answer-tokens", "4", *common) == 0
    return {"pretrain": json.loads((pre / "log.json").read_text()), "sft": json.loads((sft / "log.json").read_text())}


def assert_both_learnt(logs: dict) -> None:
    assert logs["pretrain"]["config"]["beta2"] == 0.95  # the generic recipe
    for run, drop in (("pretrain", 1.0), ("sft", 0.0)):
        val = [r["loss"] for r in logs[run]["history"]["val"]]
        assert val[-1] < val[0] - drop, (run, val)


@pytest.mark.parametrize("name", FAMILIES)
def test_any_model_preset_pretrains_and_finetunes_in_bf16(name, corpus, tmp_path):
    """`train --preset` takes any model preset (the generic recipe, flags on top), in bf16 autocast on the CPU
    with document masking; `sft` continues from it. The loss falls in both."""
    assert_both_learnt(pretrain_then_finetune(name, corpus, tmp_path, "--dtype", "bf16"))


@pytest.mark.gpu
@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_pretrains_and_finetunes_on_the_gpu(name, corpus, tmp_path):
    """The GPU's defaults (bf16 autocast, our flash kernels with document masking, the whole step as one CUDA
    graph) for every family; not compiled, to keep the test short (compiled runs are tested above)."""
    logs = pretrain_then_finetune(name, corpus, tmp_path, "--device", "cuda", "--no-compile")
    assert_both_learnt(logs)
    for run in logs.values():
        assert run["cuda_graph"] and run["config"]["doc_masking"] and run["device"].startswith("cuda")


def test_train_init_continues_a_model_folder(corpus, tmp_path):
    """`train --init DIR` starts from that folder's weights and tokenizer (no preset initialisation): the
    first evaluation scores the saved model."""
    first, second = tmp_path / "first", tmp_path / "second"
    assert run_cli(*tiny_args(corpus, first, "--max-steps", "20", "--eval-interval", "20", "--dropout", "0")) == 0
    assert run_cli("train", "--init", first, "--data", corpus, "--out", second, "--max-steps", "2",
                   "--batch-size", "4", "--seq-len", "32", "--eval-iters", "2", "--eval-interval", "2") == 0
    assert history(second)["val"][0]["loss"] == pytest.approx(history(first)["val"][-1]["loss"], rel=1e-4)
    assert json.loads((second / "config.json").read_text())["n_embd"] == 128  # the folder's model, not a preset's


# --- bad input ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["empty", "binary", "preset", "exists", "architecture", "other-model",
                                  "resume-nothing", "cuda-graph", "ema"])
def test_bad_input_is_one_line_exit_2_and_nothing_that_looks_good(case, corpus, tmp_path, capsys):
    out = tmp_path / "run"
    if case == "empty":
        (tmp_path / "empty.txt").write_text("")
        argv, message = tiny_args(tmp_path / "empty.txt", out), "empty.txt is empty"
    elif case == "binary":
        (tmp_path / "blob.txt").write_bytes(bytes(range(256)) * 8)
        argv, message = tiny_args(tmp_path / "blob.txt", out), "binary"
    elif case == "preset":
        argv, message = ["train", "--preset", "gpt5", "--out", out], "no training preset named 'gpt5'"
    elif case == "exists":
        assert run_cli(*tiny_args(corpus, out, "--max-steps", "2")) == 0
        argv, message = tiny_args(corpus, out, "--max-steps", "4"), "already holds a checkpoint (step 2)"
    elif case == "architecture":
        assert run_cli(*tiny_args(corpus, out, "--max-steps", "2")) == 0
        argv = ["train", "--resume", "--preset", "shakespeare-char", "--out", out, "--max-steps", "4"]
        message = "holds a checkpoint of another model: d_model is 128 there, 384"
    elif case == "other-model":  # its 128-token sequences are longer than the other preset's context of 64
        assert run_cli("train", "--preset", "tiny-gpt2", "--data", corpus, "--tokenizer", "char", "--out", out,
                       "--seq-len", "128", "--batch-size", "2", "--max-steps", "2", "--eval-iters", "2") == 0
        argv = ["train", "--resume", "--preset", "shakespeare-char-cpu", "--out", out, "--max-steps", "4"]
        message = "holds a checkpoint of another model: vocab_size is 64 there, 25 in this run's model; d_model is 64"
    elif case == "cuda-graph":
        argv, message = tiny_args(corpus, out, "--cuda-graph", "--device", "cpu"), "--cuda-graph needs a CUDA GPU"
    elif case == "ema":
        argv, message = tiny_args(corpus, out, "--ema", "1"), "ema must be in [0, 1), got 1.0"
    else:
        argv, message = ["train", "--resume", "--out", out], "holds no training checkpoint to resume"
    before = sorted(p.name for p in out.iterdir()) if out.exists() else []
    capsys.readouterr()
    assert run_cli(*argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    if case in ("empty", "binary", "preset", "resume-nothing", "cuda-graph", "ema"):
        assert not (out / "trainer_state.pt").exists() and not (out / "model.safetensors").exists()
    else:  # the earlier good checkpoint is untouched
        assert sorted(p.name for p in out.iterdir()) == before
        assert torch.load(out / "trainer_state.pt", weights_only=True)["step"] == 2


def test_overwrite_starts_again(corpus, tmp_path):
    out = tmp_path / "run"
    assert run_cli(*tiny_args(corpus, out, "--max-steps", "3")) == 0
    assert run_cli(*tiny_args(corpus, out, "--max-steps", "2", "--overwrite")) == 0
    assert torch.load(out / "trainer_state.pt", weights_only=True)["step"] == 2
    assert [r["step"] for r in history(out)["train"]] == [1, 2]


# --- benchmark ---------------------------------------------------------------------------------------

def test_bench_train_runs_all_variants_and_writes_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert run_cli("bench", "train", "--preset", "tiny-gpt2", "--batch-size", "2", "--seq-len", "32", "--steps", "1",
                   "--warmup", "1", "--doc-len", "8", "--json", path) == 0
    table = capsys.readouterr().out
    report = json.loads(path.read_text())
    assert [r["variant"] for r in report["results"]] == ["nanoforge", "chunked-loss", "no-doc-mask", "torch-doc-mask",
                                                         "baseline"]
    for r in report["results"]:
        assert r["tokens_per_s"] > 0 and math.isfinite(r["loss"]) and r["mfu"] is None  # CPU: MFU n/a
        assert r["variant"] in table
    assert report["results"][-1]["vs_baseline"] == 1.0
    # The dense-mask variant trains the same masked model as ours (same seed, same batches), unlike causal-only.
    loss = {r["variant"]: r["loss"] for r in report["results"]}
    assert loss["torch-doc-mask"] == pytest.approx(loss["nanoforge"], rel=1e-5)
    assert loss["chunked-loss"] == pytest.approx(loss["nanoforge"], rel=1e-5)
    assert loss["no-doc-mask"] != pytest.approx(loss["nanoforge"], rel=1e-5)


# --- GPU -------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_batches_reach_the_gpu_through_pinned_memory():
    batch = _batch(torch.randint(0, 256, (2, 17)), torch.rand(2, 16) < 0.5)
    assert all(t.is_pinned() for t in vars(batch.pin_memory()).values())
    moved = trainer.to_device(batch, torch.device("cuda"))
    for name, t in vars(moved).items():
        assert t.is_cuda and torch.equal(t.cpu(), getattr(batch, name))


@pytest.mark.gpu
def test_compiled_bf16_training_on_gpu_tracks_eager(corpus, tmp_path):
    """On CUDA (bf16 autocast, Triton flash attention, fused AdamW) the compiled loop trains and
    follows the eager one; its checkpoint resumes."""
    runs = {}
    for mode in ("--compile", "--no-compile"):
        out = tmp_path / mode
        assert run_cli(*tiny_args(corpus, out, "--max-steps", "12", "--eval-interval", "6", "--dropout", "0",
                                  "--device", "cuda", mode)) == 0
        runs[mode] = [r["loss"] for r in history(out)["train"]]
    compiled, eager = runs["--compile"], runs["--no-compile"]
    assert all(math.isfinite(x) for x in compiled) and compiled[-1] < compiled[0] - 0.3
    assert compiled == pytest.approx(eager, abs=0.05)
    assert run_cli(*tiny_args(corpus, tmp_path / "--compile", "--max-steps", "14", "--resume")) == 0


@pytest.mark.gpu
def test_cuda_graphed_step_computes_what_the_launched_step_does():
    """Same seed, same batches, dropout on: the graphed steps give the launched steps' losses and weights,
    so the warm-up steps before capture were undone (weights, AdamW state, weight average, RNG), and the graph reads the
    learning rate and loss divisor of each step (both change here)."""
    from nanoforge.train.bench import packed_batches

    cfg = model_preset("tiny-gpt2").replace(dropout=0.1)
    batches = packed_batches(3, 4, 64, cfg.vocab_size, eos=0, mean_doc_len=20, seed=1)
    batches[1].targets[:, :7] = IGNORE_INDEX  # another trained-token count
    dev = torch.device("cuda")
    runs = {}
    for graphed in (False, True):
        torch.manual_seed(0)
        model = Transformer(cfg).to(dev).train()
        opt = make_optimizer(model, TrainConfig(weight_decay=0.1), capturable=graphed, device=dev)
        loss_fn = trainer.make_loss_fn(model, trainer.training_attention(trainer.document_attention, 0.1), False)
        average = trainer.WeightAverage(model, 0.9, dev)  # its update is in the graph too
        step = trainer.make_stepper(loss_fn, model, opt, grad_clip=0.5, amp=trainer.autocast(dev, "fp32"), device=dev,
                                    graphed=graphed, average=average)
        losses = []
        for i in range(6):
            average.set_step(i)
            losses.append(step([batches[i % 3], batches[(i + 1) % 3]], 1e-3 * (i + 1)).item())
        runs[graphed] = losses, [p.detach().clone() for p in model.parameters()], average.avg
    (eager, eager_p, eager_avg), (graph, graph_p, graph_avg) = runs[False], runs[True]
    assert graph == pytest.approx(eager, rel=1e-4)
    assert len(set(eager)) == len(eager)
    for a, b in zip(eager_p + eager_avg, graph_p + graph_avg):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-5)
    with pytest.raises(NanoforgeError, match="batches of one shape"):
        step([batches[0]], 1e-3)


@pytest.mark.gpu
def test_cuda_graphed_training_resumes_exactly(corpus, tmp_path):
    """The default GPU loop (compiled, graphed, bf16) stopped and resumed gives the uninterrupted run's losses."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    common = ["--lr-decay-steps", "8", "--warmup-steps", "2", "--eval-interval", "4", "--device", "cuda"]
    assert run_cli(*tiny_args(corpus, straight, "--max-steps", "8", *common)) == 0
    assert run_cli(*tiny_args(corpus, split, "--max-steps", "4", *common)) == 0
    assert run_cli(*tiny_args(corpus, split, "--max-steps", "8", "--resume")) == 0
    a, b = history(straight), history(split)
    assert a["train"][-1]["step"] == b["train"][-1]["step"] == 8
    assert [r["loss"] for r in a["train"]] == pytest.approx([r["loss"] for r in b["train"]], rel=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("name", FAMILIES)
def test_gpu_activation_checkpointing_trains_the_same_run_in_less_memory(name, corpus, tmp_path, capsys):
    """--ac full on the H200, each family: a forward and backward of 8 blocks over 32 x 128 tokens under bf16
    autocast peaks lower than without, with the same gradients to bf16 rounding; the GPU's default loop (compiled;
    with dropout and checkpointing its step runs outside a CUDA graph, and says so), the same without dropout
    (graphed, checkpointed) and an eager one train the family's run without checkpointing; a CUDA graph asked
    for where checkpointing stops the capture is refused in one line."""
    from nanoforge.train.parallel.ac import apply_ac

    dev = torch.device("cuda")
    ids = torch.randint(0, 256, (32, 129), generator=torch.Generator().manual_seed(0))
    batch = Batch(ids[:, :-1], ids[:, 1:], torch.zeros_like(ids[:, :-1]), torch.arange(128).expand(32, 128)).to(dev)
    peaks, grads = {}, {}
    for mode in ("none", "full"):
        torch.manual_seed(0)
        model = Transformer(model_preset(name, n_layers=8)).to(dev).train()
        apply_ac(model, mode)
        loss_fn = trainer.make_loss_fn(model, trainer.document_attention, compiled=False)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", torch.bfloat16):
            loss = loss_fn(batch)
        loss.backward()
        torch.cuda.synchronize()
        peaks[mode] = torch.cuda.max_memory_allocated() - base
        grads[mode] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert peaks["full"] < 0.6 * peaks["none"], peaks
    assert ((grads["full"] - grads["none"]).norm() / grads["none"].norm()).item() < 1e-2
    # the default loop (compiled; its step a CUDA graph, but with dropout and checkpointing, not), the same without
    # dropout (checkpointed and graphed), and an eager one
    for flags in (["--compile"], ["--compile", "--dropout", "0"], ["--no-compile", "--no-cuda-graph"]):
        runs = {}
        for ac in ("none", "full"):
            out = tmp_path / f"{flags[-1]}-{len(flags)}-{ac}"
            args = tiny_args(corpus, out, "--max-steps", "6", "--device", "cuda", *flags, "--ac", ac)
            capsys.readouterr()
            assert run_cli(*[name if a == "shakespeare-char-cpu" else a for a in args]) == 0
            ungraphed = "the step runs without a CUDA graph" in capsys.readouterr().out
            assert ungraphed == (flags == ["--compile"] and ac == "full"), (flags, ac)
            runs[ac] = [r["loss"] for r in history(out)["train"]]
        assert runs["full"] == pytest.approx(runs["none"], rel=2e-2), flags
    # a CUDA graph asked for where the capture cannot hold checkpointing: one line says so
    for flags in (["--no-compile"], ["--compile"]):
        assert run_cli(*tiny_args(corpus, tmp_path / f"graph{len(flags)}", "--device", "cuda", *flags, "--cuda-graph",
                                  "--ac", "full")) == 2


def test_loss_chunk_flag_trains_the_same_run(corpus, tmp_path, capsys):
    """`--loss-chunk` (the fused, chunked head + loss) gives the plain run's losses; 0 is refused."""
    runs = {}
    for extra in ([], ["--loss-chunk", "20"]):
        out = tmp_path / f"run{len(extra)}"
        assert run_cli(*tiny_args(corpus, out, "--max-steps", "4", "--eval-interval", "4", *extra)) == 0
        runs[len(extra)] = history(out)
    assert [r["loss"] for r in runs[2]["train"]] == pytest.approx([r["loss"] for r in runs[0]["train"]], rel=1e-5)
    assert [r["loss"] for r in runs[2]["val"]] == pytest.approx([r["loss"] for r in runs[0]["val"]], rel=1e-5)
    capsys.readouterr()
    assert run_cli(*tiny_args(corpus, tmp_path / "bad", "--loss-chunk", "0")) == 2
    assert "loss_chunk must be positive" in capsys.readouterr().err
