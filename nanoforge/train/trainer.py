"""The training loop, shared by pretraining and SFT. Read `train` top to bottom.

Each optimizer step draws `grad_accum` micro-batches, runs forward and
backward under bf16 autocast (on GPU), clips the gradient norm and steps
AdamW at the scheduled learning rate. Every `eval_interval` steps it measures
the validation loss on `eval_iters` batches and writes a checkpoint (model,
optimizer, step, RNG, data position), the JSON log and the loss-curve PNG. At
the end it measures the loss over the whole validation split: the number a run
reports.

The host never waits for the GPU within a step: batches reach it through
pinned memory, and losses stay on the device until a log step. They are read
back at each log step and before each checkpoint, and a non-finite one stops
the run before anything is saved, keeping the last good checkpoint.

Exact resume: the batches are a function of the data position, the learning
rate a function of the step, and dropout draws from the restored RNG, so a
resumed run continues with the same numbers as one that never stopped.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from nanoforge.data.loader import Batch
from nanoforge.data.sft import IGNORE_INDEX
from nanoforge.errors import NanoforgeError
from nanoforge.model.attention import AttentionBackend, DenseAttention
from nanoforge.model.transformer import Transformer
from nanoforge.tokenizer import Tokenizer
from nanoforge.train.checkpoint import restore_rng, rng_state, save_checkpoint
from nanoforge.train.config import DTYPES, TrainConfig
from nanoforge.train.optim import lr_at, make_optimizer
from nanoforge.train.progress import Throughput, format_mfu, peak_flops, plot_losses, write_json

AttentionFor = Callable[[Batch], AttentionBackend]  # which attention a batch gets


@dataclass
class RunData:
    """Where a run's batches come from.

    `train` is an endless, resumable iterator of batches (state_dict / load_state_dict);
    `eval_batches(n)` gives n validation batches, always the same ones (None: the whole split).
    """

    train: Iterator[Batch]
    eval_batches: Callable[[int | None], Iterable[Batch]]


# --- devices and precision ----------------------------------------------------------------------

def compute_dtype(device: torch.device, dtype: str) -> str:
    """"bf16" or "fp32": what the matmuls run in ("auto": bf16 on GPU, fp32 on CPU)."""
    if dtype == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    if dtype not in DTYPES:
        raise NanoforgeError(f"dtype {dtype!r} cannot be trained in; choose one of {', '.join(DTYPES)} "
                             "(fp16 would need loss scaling)", param="dtype")
    return dtype


def autocast(device: torch.device, dtype: str):
    """bf16 autocast (weights and optimizer state stay fp32), or nothing for fp32."""
    if compute_dtype(device, dtype) == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


# --- the loss -----------------------------------------------------------------------------------

def trained_targets(batch: Batch) -> torch.Tensor:
    """Targets, with IGNORE_INDEX wherever no loss is taken.

    For SFT the loss mask decides: a target outside it is ignored whatever it holds.
    """
    if batch.loss_mask is None:
        return batch.targets
    return batch.targets.masked_fill(~batch.loss_mask, IGNORE_INDEX)


def document_attention(batch: Batch) -> AttentionBackend:
    """Packed documents never see each other (and their positions restart, as the loader gives them)."""
    return DenseAttention(batch.doc_ids)


def causal_attention(batch: Batch) -> AttentionBackend:
    """A row is one causal sequence (with --no-doc-masking the loader numbers positions 0..T-1)."""
    return DenseAttention(None)


class AttentionDropout(AttentionBackend):
    """A DenseAttention's masks (causal, documents apart) with dropout on the attention weights, as
    nanoGPT trains its dropout models, through PyTorch SDPA: the flash kernels have no dropout."""

    def __init__(self, dense: DenseAttention, p: float):
        self.doc_ids, self.p = dense.doc_ids, p
        self.mask = None  # built by the first layer, shared by the others

    def attend(self, layer, q, k, v):
        if self.doc_ids is not None and self.mask is None:
            T = q.shape[1]
            causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
            self.mask = (self.doc_ids[:, :, None] == self.doc_ids[:, None, :])[:, None] & causal  # (B, 1, T, T)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=self.mask, is_causal=self.mask is None, dropout_p=self.p,
                                           enable_gqa=q.shape[2] != k.shape[2])
        return o.transpose(1, 2)


def training_attention(attention: AttentionFor, dropout: float) -> AttentionFor:
    """The attention of training steps: `attention`, with the model's dropout on its weights if it has any,
    as nanoGPT's recipes have it (with residual dropout alone a small model overfits more)."""
    if dropout == 0:
        return attention
    return lambda batch: AttentionDropout(attention(batch), dropout)


def batch_loss(model: torch.nn.Module, batch: Batch, attention: AttentionFor = document_attention) -> torch.Tensor:
    """Summed cross-entropy (in fp32 at least) over the trained tokens of a batch; the caller divides by
    their count."""
    logits = model(batch.input_ids, batch.positions, attention(batch))
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.flatten(0, 1), trained_targets(batch).flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def count_trained(batch: Batch) -> int:
    return int((trained_targets(batch) != IGNORE_INDEX).sum())


def to_device(batch: Batch, device: torch.device) -> Batch:
    """A CPU batch on the device without stalling the host: to a GPU it goes through pinned memory, so the
    copies are queued behind the previous step's kernels (from pageable memory the host may wait for them)."""
    if device.type == "cuda":
        batch = batch.pin_memory()
    return batch.to(device, non_blocking=True)


def make_loss_fn(model: torch.nn.Module, attention: AttentionFor, compiled: bool) -> Callable[[Batch], torch.Tensor]:
    """batch -> summed loss. Compiled, the model and the cross-entropy become one graph, so the
    (tokens x vocab) logits are never upcast to fp32 in memory."""

    def loss_of(batch: Batch) -> torch.Tensor:
        return batch_loss(model, batch, attention)

    return torch.compile(loss_of, dynamic=False) if compiled else loss_of


def train_step(loss_fn: Callable[[Batch], torch.Tensor], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               micro: list[Batch], *, lr: float, grad_clip: float, amp) -> torch.Tensor:
    """One optimizer step over micro-batches (CPU tensors); returns the step's mean loss, on the device.

    The loss is the mean over every trained token of the step, so gradient accumulation gives the
    gradient that one big batch would.
    """
    device = model.embed.weight.device
    for group in optimizer.param_groups:
        group["lr"] = lr
    n_trained = max(sum(count_trained(b) for b in micro), 1)  # counted on the CPU: no device sync
    step_loss = torch.zeros((), device=device)
    for batch in micro:
        with amp:
            loss = loss_fn(to_device(batch, device)) / n_trained
        loss.backward()
        step_loss += loss.detach()
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return step_loss


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[Batch], *, device, amp,
             attention: AttentionFor = document_attention) -> float:
    """Mean loss per trained token over the batches (dropout off)."""
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), device=device), 0
    for batch in batches:
        count += count_trained(batch)
        with amp:
            total += batch_loss(model, to_device(batch, device), attention)
    model.train(was_training)
    if count == 0:
        raise NanoforgeError("the validation data holds no trained tokens", param="data")
    return total.item() / count


# --- the loop -----------------------------------------------------------------------------------

def train(model: Transformer, tokenizer: Tokenizer, cfg: TrainConfig, data: RunData, out_dir: str | Path, *,
          resume: dict | None = None, title: str = "train") -> dict:
    """Train `model` (already on its device) to cfg.max_steps; checkpoints and logs go to out_dir.

    `resume` is a checkpoint's trainer state: the optimizer, data position, RNG, step and history
    continue from it. Returns the run's summary (also in out_dir/log.json).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if resume is None and cfg.lr_decay_steps is None:
        cfg = cfg.replace(lr_decay_steps=cfg.max_steps)  # fixed now, so a resume with more steps keeps it
    device = model.embed.weight.device
    amp = autocast(device, cfg.dtype)
    seq_len = cfg.seq_len or model.cfg.max_seq_len
    optimizer = make_optimizer(model, cfg)
    step, history = 0, {"train": [], "val": []}
    if resume is not None:
        optimizer.load_state_dict(resume["optimizer"])
        data.train.load_state_dict(resume["data"])
        restore_rng(resume["rng"])
        step, history = resume["step"], resume["history"]
    start_step, last_saved = step, (step if resume is not None else None)
    attention = document_attention if cfg.doc_masking else causal_attention
    compiled = cfg.compile if cfg.compile is not None else device.type == "cuda"
    # Evaluation runs eagerly (no recompiles for eval mode) and without dropout.
    loss_fn = make_loss_fn(model, training_attention(attention, model.cfg.dropout), compiled)
    model.train()

    meter = Throughput(cfg.batch_size * seq_len * cfg.grad_accum, model.cfg.flops_per_token(seq_len),
                       peak_flops(device))
    pending: list[tuple[int, torch.Tensor, float]] = []  # (step, loss on the device, lr) not yet read back
    wall_start = time.perf_counter()

    def summary() -> dict:
        ms_per_step, tok_s = meter.steady()
        vals = [r["loss"] for r in history["val"]]
        return {"title": title, "step": step, "max_steps": cfg.max_steps, "last_checkpoint_step": last_saved,
                "initial_val_loss": vals[0] if vals else None, "val_loss": vals[-1] if vals else None,
                "best_val_loss": min(vals) if vals else None, "wall_time_s": time.perf_counter() - wall_start,
                "ms_per_step": ms_per_step, "tokens_per_s": tok_s, "mfu": meter.mfu(tok_s), "device": str(device),
                "compiled": compiled, "model": model.cfg.to_dict(), "config": cfg.to_dict()}

    def write_log(extra: dict | None = None) -> dict:
        log = summary() | (extra or {})
        write_json(out_dir / "log.json", log | {"history": history})
        plot_losses(out_dir / "loss.png", history, f"{title}: {model.cfg.arch}, {model.num_params() / 1e6:.1f}M params")
        return log

    def read_back_losses() -> float | None:
        """Move pending losses into the history; stop the run at the first non-finite one."""
        values = torch.stack([loss for _, loss, _ in pending]).tolist() if pending else []  # one device sync
        for (s, _, lr), value in zip(pending, values):
            history["train"].append({"step": s, "loss": value, "lr": lr})
            if not math.isfinite(value):
                bar.close()
                write_log({"stopped": f"non-finite loss at step {s}"})
                kept = (f"the last good checkpoint (step {last_saved}) is kept in {out_dir}" if last_saved is not None
                        else "no checkpoint had been written")
                raise NanoforgeError(f"step {s}: training loss is {value}; stopped, and {kept}; "
                                     f"try a lower --lr or more --warmup-steps", param="lr")
        pending.clear()
        return history["train"][-1]["loss"] if history["train"] else None

    bar = tqdm(total=cfg.max_steps, initial=step, desc=title, unit="step", dynamic_ncols=True, mininterval=1.0)
    meter.resume()
    while True:
        done = step >= cfg.max_steps
        # --- validate and checkpoint (not again at the step a resumed run starts from) ---
        if (step % cfg.eval_interval == 0 or done) and not (resume is not None and step == start_step):
            meter.pause()  # evaluation and saving are not training time
            read_back_losses()
            val = evaluate(model, data.eval_batches(cfg.eval_iters), device=device, amp=amp, attention=attention)
            history["val"].append({"step": step, "loss": val})
            if not math.isfinite(val):
                bar.close()
                write_log({"stopped": f"non-finite validation loss at step {step}"})
                raise NanoforgeError(f"step {step}: validation loss is {val}; stopped, and the last good checkpoint "
                                     f"(step {last_saved}) is kept in {out_dir}", param="lr")
            saved = step > start_step
            if saved:
                save_checkpoint(out_dir, model, tokenizer, {
                    "step": step, "config": cfg.to_dict(), "optimizer": optimizer.state_dict(),
                    "data": data.train.state_dict(), "rng": rng_state(), "history": history})
                last_saved = step
            write_log()
            bar.write(f"step {step}: val loss {val:.4f}" + (f", saved to {out_dir}" if saved else ""))
            meter.resume()
        if done:
            break

        # --- one optimizer step over grad_accum micro-batches ---
        lr = lr_at(step, cfg)
        micro = [next(data.train) for _ in range(cfg.grad_accum)]
        step_loss = train_step(loss_fn, model, optimizer, micro, lr=lr, grad_clip=cfg.grad_clip, amp=amp)
        step += 1
        meter.steps += 1
        pending.append((step, step_loss, lr))

        # --- progress: read losses back (this waits for the device), throughput since the last log ---
        if step % cfg.log_interval == 0 or step == cfg.max_steps:
            loss_now = read_back_losses()
            bar.update(meter.steps)
            tok_s = meter.end_interval()
            history["train"][-1] |= {"tokens_per_s": tok_s}
            bar.set_postfix_str(f"loss {loss_now:.4f}, lr {lr:.2e}, {tok_s:,.0f} tok/s, "
                                f"MFU {format_mfu(meter.mfu(tok_s))}")
    bar.close()

    final = evaluate(model, data.eval_batches(None), device=device, amp=amp, attention=attention)
    return write_log({"final_val_loss_full_split": final})
