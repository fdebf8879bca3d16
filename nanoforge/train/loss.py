"""The language-model head and its cross-entropy, fused and chunked over tokens.

`linear_cross_entropy(hidden, weight, targets, chunk=...)` is
`F.cross_entropy(hidden @ weight.T, targets, ignore_index=IGNORE_INDEX, reduction="sum")`
without ever holding the whole (tokens x vocabulary) logits: it walks `chunk`
tokens at a time, and for each chunk computes the logits, the loss, and at once
the gradients (softmax minus the one-hot target), which it multiplies into the
gradients of `hidden` and `weight` before moving on. Backward then only scales
those by the incoming gradient (the loss is a sum, so that is exact).

Why: at 16,384 tokens a 50,257-word vocabulary's logits are 1.6 GB in bf16 (a
128,256-word one 4.2 GB), written by the head, read by the loss, and their
gradient written and read twice more; chunk by chunk they stay small (and
mostly in L2). The matmuls are the same, only in `N / chunk` pieces.

Numerics follow the plain path: the matmuls run in the autocast dtype (bf16 on
a GPU) with fp32 accumulation, the log-softmax in fp32. The weight's gradient
is accumulated in fp32 over the chunks.
"""

from __future__ import annotations

import torch

from nanoforge.data.sft import IGNORE_INDEX


def _chunked(hidden, weight, targets, chunk: int, compute_dtype: torch.dtype, need_h: bool, need_w: bool):
    """The summed loss and, as asked, the gradients of hidden and weight (None otherwise), chunk by chunk."""
    acc = torch.promote_types(compute_dtype, torch.float32)  # the loss and the softmax: fp32 at least
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        h, w = hidden.to(compute_dtype), weight.to(compute_dtype)
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        total = torch.zeros((), dtype=acc, device=hidden.device)
        for start in range(0, h.shape[0], chunk):
            hc, tc = h[start : start + chunk], targets[start : start + chunk]
            logits = (hc @ w.t()).to(acc)  # (chunk, V)
            keep = tc != IGNORE_INDEX
            safe = torch.where(keep, tc, 0)[:, None]
            lse = torch.logsumexp(logits, dim=-1)
            total += ((lse - logits.gather(1, safe).squeeze(1)) * keep).sum()
            if need_h or need_w:
                g = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
                g.scatter_add_(1, safe, -keep[:, None].to(g.dtype))  # minus the one-hot target
                g = (g * keep[:, None]).to(compute_dtype)  # ignored tokens get no gradient
                if need_h:
                    grad_h[start : start + chunk] = g @ w
                if need_w:
                    grad_w += g.t() @ hc
    return total, grad_h, grad_w


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, compute_dtype: torch.dtype):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total, grad_h, grad_w = _chunked(hidden, weight, targets, chunk, compute_dtype, need_h, need_w)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        grad_h = None if grad_h is None else (grad_h * grad_out).to(ctx.dtypes[0])
        grad_w = None if grad_w is None else (grad_w * grad_out).to(ctx.dtypes[1])
        return grad_h, grad_w, None, None, None


@torch.compiler.disable  # a loop of whole-tensor ops: nothing for the compiler to fuse, only to unroll
def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         chunk: int) -> torch.Tensor:
    """Summed cross-entropy of `hidden @ weight.T` (hidden (N, d), weight (V, d), targets (N,) with
    IGNORE_INDEX where no loss is taken), `chunk` tokens at a time; differentiable in hidden and weight."""
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(hidden, weight, targets, chunk, dtype)
    return _chunked(hidden, weight, targets, chunk, dtype, False, False)[0]  # evaluation: the loss alone
