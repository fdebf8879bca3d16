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

With `ema` > 0, an exponential moving average of the weights follows the
training weights (`WeightAverage`): evaluation, checkpoints and the final model
use the average; the trainer state keeps the training weights for the resume.

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
from nanoforge.kernels.flash_attention import document_mask
from nanoforge.model.attention import AttentionBackend, DenseAttention
from nanoforge.model.transformer import Transformer
from nanoforge.tokenizer import Tokenizer
from nanoforge.train.checkpoint import restore_rng, rng_state, save_checkpoint
from nanoforge.train.config import DTYPES, TrainConfig, sequence_length
from nanoforge.train.loss import linear_cross_entropy
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


def autocast(device: torch.device, dtype: str, cache: bool = True):
    """bf16 autocast (weights and optimizer state stay fp32), or nothing for fp32. `cache=False` under CUDA
    graph capture: autocast's cache of bf16 weight copies must not outlive the captured step."""
    if compute_dtype(device, dtype) == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=cache)


def use_cuda_graph(device: torch.device, cuda_graph: bool | None) -> bool:
    """Whether the optimizer step runs as a CUDA graph: on a GPU unless asked not to; never elsewhere."""
    if cuda_graph and device.type != "cuda":
        raise NanoforgeError(f"--cuda-graph needs a CUDA GPU; this run is on {device}", param="cuda_graph")
    return device.type == "cuda" if cuda_graph is None else cuda_graph


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


class TorchAttention(AttentionBackend):
    """A DenseAttention's masks (causal, documents apart) through PyTorch SDPA, optionally with dropout on
    the attention weights as nanoGPT trains its dropout models (the flash kernels have no dropout). With
    documents, SDPA gets the dense mask, built once per batch."""

    def __init__(self, dense: DenseAttention, p: float = 0.0):
        self.p = p
        self.mask = None if dense.doc_ids is None else document_mask(dense.doc_ids)  # (B, 1, T, T)

    def attend(self, layer, q, k, v):
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=self.mask, is_causal=self.mask is None, dropout_p=self.p,
                                           enable_gqa=q.shape[2] != k.shape[2])
        return o.transpose(1, 2)


def training_attention(attention: AttentionFor, dropout: float) -> AttentionFor:
    """The attention of training steps: `attention`, with the model's dropout on its weights if it has any,
    as nanoGPT's recipes have it (with residual dropout alone a small model overfits more)."""
    if dropout == 0:
        return attention
    return lambda batch: TorchAttention(attention(batch), dropout)


def evaluation_attention(attention: AttentionFor, dropout: float) -> AttentionFor:
    """The attention of evaluations: training's implementation without its dropout, so validation scores
    the model the way training computes it (and a run whose training attends through SDPA never builds
    the flash kernels just to evaluate)."""
    if dropout == 0:
        return attention
    return lambda batch: TorchAttention(attention(batch))


def batch_loss(model: torch.nn.Module, batch: Batch, attention: AttentionFor = document_attention,
               loss_chunk: int | None = None) -> torch.Tensor:
    """Summed cross-entropy (in fp32 at least) over the trained tokens of a batch; the caller divides by
    their count. With `loss_chunk`, the head and the loss run fused, that many tokens at a time
    (`nanoforge.train.loss`), so the whole logits never exist."""
    if loss_chunk:
        hidden = model(batch.input_ids, batch.positions, attention(batch), return_hidden=True)
        return linear_cross_entropy(hidden.flatten(0, 1), model.lm_head.weight, trained_targets(batch).flatten(),
                                    chunk=loss_chunk)
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


def make_loss_fn(model: torch.nn.Module, attention: AttentionFor, compiled: bool,
                 loss_chunk: int | None = None) -> Callable[[Batch], torch.Tensor]:
    """batch -> summed loss. Compiled, the model and the cross-entropy become one graph, so the
    (tokens x vocab) logits are never upcast to fp32 in memory; with `loss_chunk` the head and loss run
    fused and chunked instead (outside the compiled graph)."""

    def loss_of(batch: Batch) -> torch.Tensor:
        return batch_loss(model, batch, attention, loss_chunk)

    return torch.compile(loss_of, dynamic=False) if compiled else loss_of


class WeightAverage:
    """An exponential moving average of a model's weights (Polyak averaging), updated after every
    optimizer step: avg += w * (weights - avg), w = 1 - min(decay, (1 + step) / (10 + step)).

    The ramp keeps the random initial weights from lingering in the average (with decay 0.998, the
    initialisation would still weigh 5% at step 1,500). The average is fp32 on the weights' device; the
    step's w is a device scalar (a CUDA graph reads it, as it reads the learning rate). Averaging
    smooths the optimizer's noise: at a high learning rate the average scores lower than the weights
    being trained, without changing the training at all.
    """

    def __init__(self, model: torch.nn.Module, decay: float):
        self.params = [p.detach() for p in model.parameters()]  # views: they see every optimizer step
        self.avg = [p.clone() for p in self.params]
        self.decay = decay
        self.weight = torch.zeros((), device=self.params[0].device)
        self._weights = [self.weight] * len(self.params)  # per-tensor weights: no host sync, capturable

    def set_step(self, step: int) -> None:
        """Before optimizer step `step` (0-based): the weight its update gives the new weights."""
        self.weight.fill_(1.0 - min(self.decay, (1 + step) / (10 + step)))

    @torch.no_grad()
    def update(self) -> None:
        torch._foreach_lerp_(self.avg, self.params, self._weights)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[list[torch.Tensor]]:
        """The model holds the average inside; yields the training weights (copies) meanwhile."""
        training = [p.clone() for p in self.params]
        torch._foreach_copy_(self.params, self.avg)
        try:
            yield training
        finally:
            torch._foreach_copy_(self.params, training)

    def keep(self) -> None:
        """The run is over: the model holds the average from now on."""
        torch._foreach_copy_(self.params, self.avg)


def train_step(loss_fn: Callable[[Batch], torch.Tensor], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               micro: list[Batch], *, lr: float, grad_clip: float, amp,
               average: WeightAverage | None = None) -> torch.Tensor:
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
    if average is not None:
        average.update()
    optimizer.zero_grad(set_to_none=True)
    return step_loss


class GraphedStep:
    """`train_step`, captured once into a CUDA graph and replayed: one launch per optimizer step.

    A small model's step is hundreds of short kernels; launched one by one from Python, the GPU waits for
    the host between them (nanoGPT's baby GPT spends more time launching than computing). The graph holds
    the forward and backward of every micro-batch, the clipping, the fused AdamW update and the weight
    average's update (if any); a step copies
    its batches into the graph's static input buffers, sets the learning rate and the loss divisor (device
    scalars the graph reads) and replays.

    Capture needs a few warm-up steps first (compilation, autotuning, lazy allocations). They run on the
    first real batches; afterwards the weights, the optimizer state, the average and the CUDA RNG are put back as they
    were, so a graphed run computes the same steps as an eager one, and a resumed run the same as one
    that never stopped. The copies kept meanwhile cost three times the weights' memory on the device
    during capture: a model near the GPU's memory limit wants --no-cuda-graph. Every step must have the
    batches' shapes of the first (the packed loaders give fixed (batch, seq_len) batches); another shape
    is an error, not a silent recapture.
    """

    WARMUP = 3

    def __init__(self, loss_fn: Callable[[Batch], torch.Tensor], model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, *, grad_clip: float, amp,
                 average: WeightAverage | None = None):
        if not all(group.get("capturable") for group in optimizer.param_groups):
            raise ValueError("GraphedStep needs an optimizer made with capturable=True")
        self.loss_fn, self.model, self.optimizer, self.grad_clip, self.amp = loss_fn, model, optimizer, grad_clip, amp
        self.average = average
        self.device = model.embed.weight.device
        self.graph: torch.cuda.CUDAGraph | None = None

    def _signature(self, micro: list[Batch]) -> list:
        return [[None if t is None else (tuple(t.shape), t.dtype) for t in vars(b).values()] for b in micro]

    def _body(self) -> torch.Tensor:
        """The step as the graph records it: static batches in, summed-then-scaled loss out."""
        step_loss = torch.zeros((), device=self.device)
        for batch in self.static:
            with self.amp:
                loss = self.loss_fn(batch) * self.inv_count
            loss.backward()
            step_loss += loss.detach()
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        if self.average is not None:
            self.average.update()
        return step_loss

    def _load(self, micro: list[Batch], lr: float) -> None:
        for static, batch in zip(self.static, micro):
            for name, value in vars(batch.pin_memory()).items():  # pinned: the copies queue, the host goes on
                if value is not None:
                    getattr(static, name).copy_(value, non_blocking=True)
        self.lr.fill_(lr)
        self.inv_count.fill_(1.0 / max(sum(count_trained(b) for b in micro), 1))

    def _capture(self, micro: list[Batch], lr: float) -> None:
        self.signature = self._signature(micro)
        self.static = [to_device(b, self.device) for b in micro]  # the graph's input buffers
        self.lr = torch.tensor(lr, device=self.device)
        self.inv_count = torch.zeros((), device=self.device)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr  # a device tensor: the graph reads the step's learning rate from it
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        saved_params = [p.detach().clone() for p in params]
        saved_state = {id(p): {k: v.clone() for k, v in self.optimizer.state[p].items()} for p in params
                       if p in self.optimizer.state}
        saved_avg = [t.clone() for t in self.average.avg] if self.average is not None else []
        saved_rng = torch.cuda.get_rng_state(self.device)
        self._load(micro, lr)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.WARMUP):
                self.optimizer.zero_grad(set_to_none=True)
                self._body()
        torch.cuda.current_stream(self.device).wait_stream(side)
        with torch.no_grad():  # back to where the run was: the warm-up steps never happened
            for p, saved in zip(params, saved_params):
                p.copy_(saved)
            for p in params:
                for k, v in self.optimizer.state[p].items():
                    before = saved_state.get(id(p), {}).get(k)
                    v.copy_(before) if before is not None else v.zero_()
            if self.average is not None:
                torch._foreach_copy_(self.average.avg, saved_avg)
        torch.cuda.set_rng_state(saved_rng, self.device)
        self.optimizer.zero_grad(set_to_none=True)  # the graph's backward allocates the gradients it writes
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.loss = self._body()

    def __call__(self, micro: list[Batch], lr: float) -> torch.Tensor:
        if self.graph is None:
            self._capture(micro, lr)
        elif self._signature(micro) != self.signature:
            raise NanoforgeError(f"a CUDA-graphed training step needs batches of one shape; got "
                                 f"{self._signature(micro)} after {self.signature} (use --no-cuda-graph)",
                                 param="cuda_graph")
        self._load(micro, lr)
        self.graph.replay()
        return self.loss.clone()


def make_stepper(loss_fn: Callable[[Batch], torch.Tensor], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 *, grad_clip: float, amp, graphed: bool,
                 average: WeightAverage | None = None) -> Callable[[list[Batch], float], torch.Tensor]:
    """(micro-batches, lr) -> the step's mean loss on the device: `train_step`, or its CUDA graph."""
    if graphed:
        return GraphedStep(loss_fn, model, optimizer, grad_clip=grad_clip, amp=amp, average=average)
    return lambda micro, lr: train_step(loss_fn, model, optimizer, micro, lr=lr, grad_clip=grad_clip, amp=amp,
                                        average=average)


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[Batch], *, device, amp,
             attention: AttentionFor = document_attention, loss_chunk: int | None = None) -> float:
    """Mean loss per trained token over the batches (dropout off)."""
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), device=device), 0
    for batch in batches:
        count += count_trained(batch)
        with amp:
            total += batch_loss(model, to_device(batch, device), attention, loss_chunk)
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
    graphed = use_cuda_graph(device, cfg.cuda_graph)
    amp = autocast(device, cfg.dtype)
    seq_len = sequence_length(cfg, model.cfg)
    optimizer = make_optimizer(model, cfg, capturable=graphed)
    step, history = 0, {"train": [], "val": []}
    if resume is not None:
        optimizer.load_state_dict(resume["optimizer"])
        for group in optimizer.param_groups:  # the checkpoint may come from a run with(out) a CUDA graph
            group["capturable"], group["lr"] = graphed, float(group["lr"])
        data.train.load_state_dict(resume["data"])
        restore_rng(resume["rng"])
        step, history = resume["step"], resume["history"]
    start_step, last_saved = step, (step if resume is not None else None)
    attention = document_attention if cfg.doc_masking else causal_attention
    compiled = cfg.compile if cfg.compile is not None else device.type == "cuda"
    # Evaluation runs eagerly (no recompiles for eval mode) and without dropout.
    eval_attention = evaluation_attention(attention, model.cfg.dropout)
    loss_fn = make_loss_fn(model, training_attention(attention, model.cfg.dropout), compiled, cfg.loss_chunk)
    # The model folder of a run with a weight average holds the average; the training weights are in its state.
    average = WeightAverage(model, cfg.ema) if cfg.ema > 0 else None
    if resume is not None and "training_weights" in resume:
        with torch.no_grad():
            torch._foreach_copy_(list(model.parameters()), [t.to(device) for t in resume["training_weights"]])
    step_fn = make_stepper(loss_fn, model, optimizer, grad_clip=cfg.grad_clip, amp=autocast(device, cfg.dtype, not graphed),
                           graphed=graphed, average=average)
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
                "compiled": compiled, "cuda_graph": graphed, "model": model.cfg.to_dict(), "config": cfg.to_dict()}

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
            with average.swapped_in() if average is not None else contextlib.nullcontext() as training_weights:
                val = evaluate(model, data.eval_batches(cfg.eval_iters), device=device, amp=amp,
                               attention=eval_attention, loss_chunk=cfg.loss_chunk)
                history["val"].append({"step": step, "loss": val, "wall_s": time.perf_counter() - wall_start})
                if not math.isfinite(val):
                    bar.close()
                    write_log({"stopped": f"non-finite validation loss at step {step}"})
                    raise NanoforgeError(f"step {step}: validation loss is {val}; stopped, and the last good "
                                         f"checkpoint (step {last_saved}) is kept in {out_dir}", param="lr")
                saved = step > start_step
                if saved:
                    state = {"step": step, "config": cfg.to_dict(), "optimizer": optimizer.state_dict(),
                             "data": data.train.state_dict(), "rng": rng_state(), "history": history}
                    if training_weights is not None:
                        state["training_weights"] = [t.cpu() for t in training_weights]
                    save_checkpoint(out_dir, model, tokenizer, state)
                    last_saved = step
            write_log()
            bar.write(f"step {step}: val loss {val:.4f}" + (f", saved to {out_dir}" if saved else ""))
            meter.resume()
        if done:
            break

        # --- one optimizer step over grad_accum micro-batches ---
        lr = lr_at(step, cfg)
        if average is not None:
            average.set_step(step)
        micro = [next(data.train) for _ in range(cfg.grad_accum)]
        step_loss = step_fn(micro, lr)
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

    if average is not None:
        average.keep()
    final = evaluate(model, data.eval_batches(None), device=device, amp=amp, attention=eval_attention,
                     loss_chunk=cfg.loss_chunk)
    return write_log({"final_val_loss_full_split": final})
