"""The fused, chunked LM head + cross-entropy against the plain float64 computation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanoforge.data.sft import IGNORE_INDEX
from nanoforge.train.loss import linear_cross_entropy


def _inputs(n: int, d: int, vocab: int, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=dtype)
    weight = torch.randn(vocab, d, generator=g, dtype=dtype) * 0.3
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[torch.rand(n, generator=g) < 0.3] = IGNORE_INDEX  # SFT-style: no loss on some tokens
    return hidden, weight, targets


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])  # 7 does not divide 37; 64 is one chunk
def test_loss_and_gradients_match_the_plain_computation(chunk):
    hidden, weight, targets = _inputs(37, 12, 29)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = F.cross_entropy(h1 @ w1.t(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
    (ref * 0.7).backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    got = linear_cross_entropy(h2, w2, targets, chunk=chunk)
    (got * 0.7).backward()  # backward scales by the incoming gradient
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(h2.grad, h1.grad)
    torch.testing.assert_close(w2.grad, w1.grad)
    assert h2.grad[targets == IGNORE_INDEX].abs().sum() == 0  # ignored tokens get no gradient


def test_tied_weights_collect_both_gradients():
    """GPT-2 ties the head to the embedding: the weight's gradient is the embedding's plus the head's."""
    hidden_ids = torch.randint(0, 29, (20,))
    _, weight, targets = _inputs(20, 12, 29, seed=1)
    grads = []
    for fused in (False, True):
        w = weight.clone().requires_grad_()
        h = w[hidden_ids] * 1.5  # the "model": an embedding lookup
        if fused:
            loss = linear_cross_entropy(h, w, targets, chunk=6)
        else:
            loss = F.cross_entropy(h @ w.t(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
        loss.backward()
        grads.append(w.grad)
    torch.testing.assert_close(grads[1], grads[0])


def test_without_gradients_only_the_loss_is_computed():
    hidden, weight, targets = _inputs(30, 8, 17, dtype=torch.float32)
    with torch.no_grad():
        got = linear_cross_entropy(hidden.requires_grad_(), weight, targets, chunk=8)
    ref = F.cross_entropy(hidden.detach() @ weight.t(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
    assert not got.requires_grad
    torch.testing.assert_close(got, ref)


def test_bf16_autocast_follows_the_plain_path():
    """Under bf16 autocast the matmuls run in bf16 like the plain head's, the log-softmax in fp32."""
    hidden, weight, targets = _inputs(64, 32, 50, dtype=torch.float32, seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy((hidden @ weight.t()).float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
        got = linear_cross_entropy(hidden, weight, targets, chunk=16)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)


def test_chunked_loss_trains_like_the_plain_loss():
    """Two training runs of the CPU preset, plain and with --loss-chunk, give the same losses (fp32)."""
    from nanoforge.model.config import preset
    from nanoforge.model.transformer import Transformer
    from nanoforge.train import trainer
    from nanoforge.train.bench import packed_batches
    from nanoforge.train.config import TrainConfig
    from nanoforge.train.optim import make_optimizer

    cfg = preset("tiny-gpt2")
    batches = packed_batches(3, 4, 32, cfg.vocab_size, eos=0, mean_doc_len=10, seed=3)
    runs = []
    for chunk in (None, 24):
        torch.manual_seed(0)
        model = Transformer(cfg)
        opt = make_optimizer(model, TrainConfig())
        loss_fn = trainer.make_loss_fn(model, trainer.document_attention, False, chunk)
        step = trainer.make_stepper(loss_fn, model, opt, grad_clip=1.0, amp=trainer.autocast(torch.device("cpu"), "fp32"),
                                    graphed=False, device="cpu")
        runs.append([step([b], 1e-3).item() for b in batches * 2])
    assert runs[1] == pytest.approx(runs[0], rel=1e-5)
