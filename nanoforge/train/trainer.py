"""The training loop, shared by pretraining and SFT: a `Trainer` holds a run and `fit()` runs it.

Each optimizer step draws `grad_accum` micro-batches, runs forward and
backward under bf16 autocast (on GPU), clips the gradient norm and steps
AdamW at the scheduled learning rate (`TrainStep`, or its CUDA graph,
`GraphedStep`, which records that same step). Every `eval_interval` steps it
measures the validation loss on `eval_iters` batches and writes a checkpoint
(model, optimizer, step, RNG, data position: `Trainer.state_dict()`), the JSON
log and the loss-curve PNG. At the end it measures the loss over the whole
validation split: the number a run reports.

Where the tensors live is the run's *layout*: `SingleDevice` here (one device,
nothing to combine), or `nanoforge.train.parallel.Parallel`, the same
interface over a DeviceMesh (FSDP2, tensor, context and pipeline parallelism
applied to the unchanged model). The trainer asks the layout for the device,
the rows and tokens of a batch that this rank computes, the divisor of the
loss, the sums of numbers across ranks and the gradient norm, and hands it
checkpoints to write; it never looks at a weight to find out where it runs.

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
from nanoforge.model.attention import AttentionBackend, DenseAttention, SDPAAttention
from nanoforge.model.transformer import Transformer
from nanoforge.tokenizer import Tokenizer
from nanoforge.train.checkpoint import canonical, load_shards, restore_rng, rng_state, save_checkpoint
from nanoforge.train.config import DTYPES, TrainConfig, sequence_length
from nanoforge.train.loss import linear_cross_entropy
from nanoforge.train.optim import init_optimizer_state, lr_at, make_optimizer
from nanoforge.train.parallel.ac import ac_every, apply_ac, checkpointed
from nanoforge.train.progress import Throughput, format_mfu, peak_flops, plot_losses, write_json

AttentionFor = Callable[[Batch], AttentionBackend]  # which attention a batch gets
LossFn = Callable[[Batch], torch.Tensor]  # batch (on the device) -> summed loss over its trained tokens
TENSOR_PARTS = ("model", "optimizer", "average")  # the parts of Trainer.state_dict() that hold tensors


@dataclass
class RunData:
    """Where a run's batches come from.

    `train` is an endless, resumable iterator of batches (state_dict / load_state_dict);
    `eval_batches(n)` gives n validation batches, always the same ones (None: the whole split).
    In a data-parallel run both give this rank's rows of each batch.
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


def use_cuda_graph(device: torch.device, cuda_graph: bool | None, layout: str | None = None,
                   blocker: str | None = None) -> bool:
    """Whether the optimizer step runs as a CUDA graph: on a GPU unless asked not to; never elsewhere, never in
    a parallel `layout` (named, when there is one: its collectives run outside a graph), and never where
    `graph_blocker` names a reason (`blocker`): asked for then (`cuda_graph` True), one line says why not."""
    if cuda_graph and device.type != "cuda":
        raise NanoforgeError(f"--cuda-graph needs a CUDA GPU; this run is on {device}", param="cuda_graph")
    if cuda_graph and layout:
        raise NanoforgeError(f"--cuda-graph runs on one GPU; this run is parallel ({layout}): drop --cuda-graph",
                             param="cuda_graph")
    if cuda_graph and blocker:
        raise NanoforgeError(f"--cuda-graph: {blocker}; drop --cuda-graph (or --ac)", param="cuda_graph")
    return device.type == "cuda" and not layout and not blocker if cuda_graph is None else cuda_graph


def graph_blocker(compiled: bool, ac: str, dropout: float) -> str | None:
    """Why a step with activation checkpointing (`ac`) cannot be captured in one CUDA graph, or None where it can.
    Eager, torch.utils.checkpoint saves the CUDA RNG state at every block, which a capture forbids. Compiled with
    dropout on, torch.compile replays a checkpointed block's dropout masks from generator states that only its
    own CUDA graphs register (cudagraph trees); captured here, the first draw fails (seen on the H200, torch
    2.11). Compiled without dropout, no RNG is recomputed, and the step is captured."""
    if not ac_every(ac):
        return None
    if not compiled:
        return "eager activation checkpointing saves the CUDA RNG state at each block, which a graph capture forbids"
    if dropout > 0:
        return ("torch.compile recomputes a checkpointed block's dropout from generator states that only its own "
                "CUDA graphs can register, not a captured training step")
    return None


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


def training_attention(attention: AttentionFor, dropout: float) -> AttentionFor:
    """The attention of training steps: `attention`, with the model's dropout on its weights if it has any,
    as nanoGPT's recipes have it (with residual dropout alone a small model overfits more). Dropout takes
    PyTorch SDPA with the same masks (`SDPAAttention`): the flash kernels have none."""
    if dropout == 0:
        return attention
    return lambda batch: SDPAAttention(attention(batch).doc_ids, dropout)


def evaluation_attention(attention: AttentionFor, dropout: float) -> AttentionFor:
    """The attention of evaluations: training's implementation without its dropout, so validation scores
    the model the way training computes it (and a run whose training attends through SDPA never builds
    the flash kernels just to evaluate)."""
    if dropout == 0:
        return attention
    return lambda batch: SDPAAttention(attention(batch).doc_ids)


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
    return logits_loss(logits, trained_targets(batch))


def logits_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of (B, T, V) logits against (B, T) targets (IGNORE_INDEX: no loss), in fp32 at least."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def count_trained(batch: Batch) -> int:
    return int((trained_targets(batch) != IGNORE_INDEX).sum())


def to_device(batch: Batch, device: torch.device) -> Batch:
    """A CPU batch on the device without stalling the host: to a GPU it goes through pinned memory, so the
    copies are queued behind the previous step's kernels (from pageable memory the host may wait for them)."""
    if device.type == "cuda":
        batch = batch.pin_memory()
    return batch.to(device, non_blocking=True)


def make_loss_fn(model: torch.nn.Module, attention: AttentionFor, compiled: bool,
                 loss_chunk: int | None = None) -> LossFn:
    """batch -> summed loss. Compiled, the model and the cross-entropy become one graph, so the
    (tokens x vocab) logits are never upcast to fp32 in memory; with `loss_chunk` the head and loss run
    fused and chunked instead (outside the compiled graph)."""

    def loss_of(batch: Batch) -> torch.Tensor:
        return batch_loss(model, batch, attention, loss_chunk)

    return torch.compile(loss_of, dynamic=False) if compiled else loss_of


# --- the layout of a run on one device ------------------------------------------------------------

def device_peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


class SingleDevice:
    """A run on one device: every batch is this process's, and every number is already the total.

    `nanoforge.train.parallel.Parallel` implements the same methods over a DeviceMesh; the trainer calls
    only these, so one loop runs both.
    """

    distributed = False
    is_main = True  # the process that prints, logs and writes files
    name = None  # a parallel layout's description ("dp_shard 2 x tp 2")
    world_size = 1

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    data_shard = (0, 1)  # (this rank's index, ranks) among the ranks that read different rows of each batch

    def on_main(self, fn: Callable[[], object]) -> object:
        """Run `fn` (files, printing) on the main process; every rank gets its result."""
        return fn()

    def peak_memory_gib(self) -> float | None:
        """The most memory torch allocated at once on this run's device (on a GPU; None elsewhere)."""
        return device_peak_gib(self.device)

    def close(self) -> None:
        """The run is over (a parallel layout leaves its process group)."""

    def parallelize(self, model: torch.nn.Module, cfg: TrainConfig) -> torch.nn.Module:
        """The model as this rank trains it (here: as it is, its blocks checkpointed if cfg.ac says so)."""
        apply_ac(model, cfg.ac)
        return model

    def local(self, batch: Batch) -> Batch:
        """The part of a batch (already this rank's rows) whose tokens this rank computes."""
        return batch

    def attention(self, attention: AttentionFor) -> AttentionFor:
        """How this rank's part of a batch attends (context parallelism gathers keys from other ranks)."""
        return attention

    def loss_fn(self, model: torch.nn.Module, attention: AttentionFor, compiled: bool,
                loss_chunk: int | None) -> LossFn:
        return make_loss_fn(model, attention, compiled, loss_chunk)

    def divisor(self, n_trained: int) -> int | torch.Tensor:
        """What this rank divides its summed loss by: the step's trained tokens, so that the gradient is the
        mean over all of them (in a parallel run, over every rank's, scaled for the gradients' averaging)."""
        return max(n_trained, 1)

    def total(self, loss: torch.Tensor) -> torch.Tensor:
        """A loss that this rank holds a share of (its rows, its tokens, its pipeline stage's), summed over the
        ranks that share it (and unscaled from `divisor`'s factor)."""
        return loss

    def step_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """A step's mean loss from this rank's share of it (the sum of its micro-batches' losses / divisor)."""
        return loss

    def count(self, n: int) -> int:
        """Trained tokens counted in this rank's rows, summed over the ranks that read other rows."""
        return n

    @staticmethod
    def copy_(dst: torch.Tensor, src: torch.Tensor) -> None:
        """Load `src` (a checkpoint's tensor) into `dst` (this run's weight or optimizer state)."""
        if dst is not src:
            dst.copy_(src)

    def clip_grad_norm_(self, params: list[torch.Tensor], max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(params, max_norm)

    def forward_backward(self, loss_fn: LossFn, batches: list[Batch], divisor: int | torch.Tensor, amp) -> torch.Tensor:
        """Forward and backward of a step's micro-batches (a pipeline's schedule, in a pipelined run)."""
        return forward_backward(loss_fn, batches, divisor, amp)

    def eval_loss(self, loss_fn: LossFn, batch: Batch) -> torch.Tensor:
        return loss_fn(batch)


# --- weights and steps --------------------------------------------------------------------------

class WeightAverage:
    """An exponential moving average of a model's weights (Polyak averaging), updated after every
    optimizer step: avg += w * (weights - avg), w = 1 - min(decay, (1 + step) / (10 + step)).

    The ramp keeps the random initial weights from lingering in the average (with decay 0.998, the
    initialisation would still weigh 5% at step 1,500). The average is fp32 beside the weights (sharded
    as they are); the step's w is a scalar on `device` (a CUDA graph reads it, as it reads the learning
    rate). Averaging smooths the optimizer's noise: at a high learning rate the average scores lower than
    the weights being trained, without changing the training at all.
    """

    def __init__(self, model: torch.nn.Module, decay: float, device: torch.device | str):
        self.names, weights = zip(*((n, p.detach()) for n, p in model.named_parameters()))
        # This rank's shards of sharded weights (views: they see every optimizer step); the average is
        # shard by shard, like the optimizer.
        self.params = [_local(p) for p in weights]
        self.avg = [p.clone() for p in self.params]
        self._like = weights  # what `named` wraps the average's shards like
        self.decay = decay
        self.weight = torch.zeros((), device=device)
        self._weights = [self.weight] * len(self.params)  # per-tensor weights: no host sync, capturable

    def set_step(self, step: int) -> None:
        """Before optimizer step `step` (0-based): the weight its update gives the new weights."""
        self.weight.fill_(1.0 - min(self.decay, (1 + step) / (10 + step)))

    @torch.no_grad()
    def update(self) -> None:
        torch._foreach_lerp_(self.avg, self.params, self._weights)

    def named(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, average) per weight; for a sharded weight, a DTensor of the average's shards laid out as it."""
        return zip(self.names, (_shard_like(a, p) for a, p in zip(self.avg, self._like)))

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


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view), or the tensor."""
    return t.to_local() if hasattr(t, "device_mesh") else t


def _shard_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`local` as a shard of a DTensor laid out like `like` (or itself, for a plain tensor)."""
    if not hasattr(like, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def forward_backward(loss_fn: LossFn, batches: list[Batch], divisor: int | torch.Tensor, amp) -> torch.Tensor:
    """Forward and backward of each micro-batch (on the device), each loss divided by `divisor`; returns the
    sum of those losses (the step's mean loss when divisor is the step's trained-token count)."""
    step_loss = None
    for batch in batches:
        with amp:
            loss = loss_fn(batch) / divisor
        loss.backward()
        step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()
    return step_loss


class TrainStep:
    """One optimizer step over micro-batches: forward and backward of each (the layout's pipeline schedule
    instead, in a pipeline-parallel run), gradient clipping, the optimizer, the weight average.

    `run` is the step itself (batches on the device in, the step's loss out, gradients left for the caller
    to drop); `GraphedStep` records exactly that into a CUDA graph. Called, it is the launched step: it
    sets the learning rate, counts the trained tokens, moves the batches and runs it.
    """

    def __init__(self, loss_fn: LossFn, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 grad_clip: float, amp, average: WeightAverage | None = None, layout: SingleDevice | None = None,
                 device: torch.device | str | None = None):
        """`layout`: where the run's tensors live (or, for one device, just its `device`)."""
        if (layout is None) == (device is None):
            raise ValueError("TrainStep takes a layout or a device")
        self.layout = layout or SingleDevice(device)
        self.loss_fn, self.model, self.optimizer, self.grad_clip, self.amp = loss_fn, model, optimizer, grad_clip, amp
        self.average, self.device = average, self.layout.device
        self.params = [p for group in optimizer.param_groups for p in group["params"]]

    def run(self, batches: list[Batch], divisor: int | torch.Tensor) -> torch.Tensor:
        loss = self.layout.forward_backward(self.loss_fn, batches, divisor, self.amp)
        if self.grad_clip > 0:
            self.layout.clip_grad_norm_(self.params, self.grad_clip)
        self.optimizer.step()
        if self.average is not None:
            self.average.update()
        return loss

    def __call__(self, micro: list[Batch], lr: float) -> torch.Tensor:
        """One step over micro-batches (this rank's rows, on the CPU); returns the step's mean loss over
        every trained token of the step (all ranks'), on the device, so that gradient accumulation (and data
        parallelism) give the gradient of one big batch."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        divisor = self.layout.divisor(sum(count_trained(b) for b in micro))  # counted on the CPU: no device sync
        loss = self.run([to_device(self.layout.local(b), self.device) for b in micro], divisor)
        self.optimizer.zero_grad(set_to_none=True)
        return self.layout.step_loss(loss)


class GraphedStep:
    """A `TrainStep`'s `run`, captured once into a CUDA graph and replayed: one launch per optimizer step.

    A small model's step is hundreds of short kernels; launched one by one from Python, the GPU waits for
    the host between them (nanoGPT's baby GPT spends more time launching than computing). The graph holds
    the forward and backward of every micro-batch, the clipping, the fused AdamW update and the weight
    average's update (if any); a step copies its batches into the graph's static input buffers, sets the
    learning rate and the loss divisor (device scalars the graph reads) and replays.

    Capture needs a few warm-up steps first (compilation, autotuning, lazy allocations). They run on the
    first real batches; afterwards the weights, the optimizer state, the average and the CUDA RNG are put back as they
    were, so a graphed run computes the same steps as an eager one, and a resumed run the same as one
    that never stopped. The copies kept meanwhile cost three times the weights' memory on the device
    during capture: a model near the GPU's memory limit wants --no-cuda-graph. Every step must have the
    batches' shapes of the first (the packed loaders give fixed (batch, seq_len) batches); another shape
    is an error, not a silent recapture.
    """

    WARMUP = 3

    def __init__(self, step: TrainStep):
        if not all(group.get("capturable") for group in step.optimizer.param_groups):
            raise ValueError("GraphedStep needs an optimizer made with capturable=True")
        if step.layout.distributed:
            raise ValueError("GraphedStep runs on one device")
        self.step, self.optimizer, self.average, self.device = step, step.optimizer, step.average, step.device
        self.graph: torch.cuda.CUDAGraph | None = None

    def _signature(self, micro: list[Batch]) -> list:
        return [[None if t is None else (tuple(t.shape), t.dtype) for t in vars(b).values()] for b in micro]

    def _load(self, micro: list[Batch], lr: float) -> None:
        for static, batch in zip(self.static, micro):
            for name, value in vars(batch.pin_memory()).items():  # pinned: the copies queue, the host goes on
                if value is not None:
                    getattr(static, name).copy_(value, non_blocking=True)
        self.lr.fill_(lr)
        self.count.fill_(max(sum(count_trained(b) for b in micro), 1))

    def _capture(self, micro: list[Batch], lr: float) -> None:
        self.signature = self._signature(micro)
        self.static = [to_device(b, self.device) for b in micro]  # the graph's input buffers
        self.lr = torch.tensor(lr, device=self.device)
        self.count = torch.ones((), device=self.device)  # the step's trained tokens: the loss divisor
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr  # a device tensor: the graph reads the step's learning rate from it
        params = self.step.params
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
                self.step.run(self.static, self.count)
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
            self.loss = self.step.run(self.static, self.count)

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


def make_stepper(loss_fn: LossFn, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, grad_clip: float,
                 amp, graphed: bool, average: WeightAverage | None = None, layout: SingleDevice | None = None,
                 device: torch.device | str | None = None) -> Callable[[list[Batch], float], torch.Tensor]:
    """(micro-batches, lr) -> the step's mean loss on the device: a `TrainStep`, or its CUDA graph."""
    step = TrainStep(loss_fn, model, optimizer, grad_clip=grad_clip, amp=amp, average=average, layout=layout,
                     device=device)
    return GraphedStep(step) if graphed else step


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[Batch], *, device, amp,
             attention: AttentionFor = document_attention, loss_chunk: int | None = None,
             layout: SingleDevice | None = None) -> float:
    """Mean loss per trained token over the batches (dropout off); in a parallel run, over every rank's."""
    layout = layout or SingleDevice(device)
    loss_fn = layout.loss_fn(model, layout.attention(attention), False, loss_chunk)
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), device=layout.device), 0
    for batch in batches:
        count += count_trained(batch)
        with amp:
            total += layout.eval_loss(loss_fn, to_device(layout.local(batch), layout.device))
    model.train(was_training)
    count = layout.count(count)
    if count == 0:
        raise NanoforgeError("the validation data holds no trained tokens", param="data")
    return layout.total(total).item() / count


# --- the run ------------------------------------------------------------------------------------

class Trainer:
    """A training run: the model as this rank trains it, its optimizer, weight average, data, step and loss
    history, with one `state_dict()` / `load_state_dict()` for checkpoints and resume, and `fit()`, the loop.

    The model is given whole (on `layout.device`); the layout parallelizes it. `resume` is a checkpoint's
    state (`load_state`), which continues the optimizer, data position, RNG, step and history.
    """

    def __init__(self, model: Transformer, tokenizer: Tokenizer, cfg: TrainConfig, data: RunData,
                 out_dir: str | Path, *, layout: SingleDevice, resume: dict | None = None, title: str = "train"):
        if resume is None and cfg.lr_decay_steps is None:
            cfg = cfg.replace(lr_decay_steps=cfg.max_steps)  # fixed now, so a resume with more steps keeps it
        self.cfg, self.data, self.tokenizer, self.title, self.layout = cfg, data, tokenizer, title, layout
        self.out_dir = Path(out_dir)
        self.model_cfg = model.cfg
        self.device = device = layout.device
        self.compiled = cfg.compile if cfg.compile is not None else device.type == "cuda"
        blocker = graph_blocker(self.compiled, cfg.ac, model.cfg.dropout)
        self.graphed = use_cuda_graph(device, cfg.cuda_graph, layout.name, blocker)
        if blocker and use_cuda_graph(device, cfg.cuda_graph, layout.name):  # graphed, but for the blocker
            print(f"{title}: the step runs without a CUDA graph: {blocker}")
        self.amp = autocast(device, cfg.dtype)
        self.seq_len = sequence_length(cfg, model.cfg)
        self.model = layout.parallelize(model, cfg)
        self.optimizer = make_optimizer(self.model, cfg, capturable=self.graphed, device=device)
        # The model folder of a run with a weight average holds the average; the training weights are in its state.
        self.average = WeightAverage(self.model, cfg.ema, device) if cfg.ema > 0 else None
        attention = document_attention if cfg.doc_masking else causal_attention
        # Evaluation runs eagerly (no recompiles for eval mode) and without dropout.
        self.eval_attention = evaluation_attention(attention, model.cfg.dropout)
        loss_fn = layout.loss_fn(self.model, layout.attention(training_attention(attention, model.cfg.dropout)),
                                 self.compiled and not layout.distributed, cfg.loss_chunk)
        self.step_fn = make_stepper(loss_fn, self.model, self.optimizer, grad_clip=cfg.grad_clip,
                                    amp=autocast(device, cfg.dtype, not self.graphed), graphed=self.graphed,
                                    average=self.average, layout=layout)
        self.step, self.history, self.last_saved = 0, {"train": [], "val": []}, None
        self.resumed_at = None
        if resume is not None:
            self.load_state_dict(resume)

    # --- state ---

    def _canonical(self, named) -> dict[str, torch.Tensor]:
        return canonical(named, self.model_cfg)

    def state_dict(self) -> dict:
        """Everything a resume needs, tensors by layout-independent names (`checkpoint.canonical`): the
        training weights ("model"), AdamW's moments and step count per weight ("optimizer"), the weight
        average ("average", with --ema), and the step, TrainConfig, data position, RNG and loss history.
        The tensors are this rank's live weights and state (views, DTensors in a parallel run), not copies."""
        init_optimizer_state(self.optimizer)
        optimizer = {}
        for name, p in self.model.named_parameters():
            s = self.optimizer.state[p]
            avg, avg_sq = self._canonical([(name, s["exp_avg"])]), self._canonical([(name, s["exp_avg_sq"])])
            for piece in avg:  # the parts of a fused weight share its step count
                optimizer[piece] = {"exp_avg": avg[piece], "exp_avg_sq": avg_sq[piece], "step": s["step"]}
        state = {"model": self._canonical((n, p.detach()) for n, p in self.model.named_parameters()),
                 "optimizer": optimizer, "step": self.step, "config": self.cfg.to_dict(),
                 "data": self.data.train.state_dict(), "rng": rng_state(), "history": self.history}
        if self.average is not None:
            state["average"] = self._canonical(self.average.named())
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Continue from `state_dict()`'s content (from this layout or another). Tensors that a checkpoint
        reader already loaded in place are left alone; missing "model" or "average" keep what the model
        holds (a model folder's weights, loaded before)."""
        live = self.state_dict()
        if state.get("sharded"):  # a parallel run's checkpoint: DCP reads this layout's pieces in place
            loaded = load_shards(state["sharded"], {k: v for k, v in live.items() if k in TENSOR_PARTS},
                                 self.layout.distributed)
            state = state | {k: live[k] for k in loaded}
        if "param_groups" in state["optimizer"]:  # a checkpoint of nanoforge before parallel layouts
            self._load_unnamed(state)
            state = {k: v for k, v in state.items() if k != "optimizer"} | {"optimizer": {}}
        for part in ("model", "average"):
            for name, src in (state.get(part) or {}).items():
                if name in live.get(part, {}):
                    self.layout.copy_(live[part][name], src)
        for name, src in state["optimizer"].items():
            if name in live["optimizer"]:
                for key, t in src.items():
                    self.layout.copy_(live["optimizer"][name][key], t)
        for group in self.optimizer.param_groups:  # the checkpoint may come from a run with(out) a CUDA graph
            group["capturable"], group["lr"] = self.graphed, float(group["lr"])
        self.data.train.load_state_dict(state["data"])
        restore_rng(state["rng"])
        self.step, self.history = state["step"], state["history"]
        self.last_saved = self.resumed_at = self.step

    def _load_unnamed(self, state: dict) -> None:
        """A single-device checkpoint from before tensors were stored by name: torch's optimizer state (weights
        by position, which this model and `make_optimizer` reproduce) and the training weights as a list."""
        if self.layout.distributed:
            raise NanoforgeError("this checkpoint predates parallel training; resume it on one device, save, "
                                 "then resume at a parallel layout", param="resume")
        self.optimizer.load_state_dict(state["optimizer"])
        if isinstance(state.get("model"), list):
            torch._foreach_copy_([p.detach() for p in self.model.parameters()],
                                 [t.to(self.device) for t in state.pop("model")])

    def save(self) -> None:
        """A checkpoint of the run as it is now (see `checkpoint.py`; a parallel layout writes DCP shards)."""
        state = self.state_dict()
        if self.layout.distributed:
            self.layout.save_checkpoint(self.out_dir, state, self.model_cfg, self.tokenizer)
        else:
            files = {k: v for k, v in state.items() if k not in ("model", "average")}  # the optimizer stays
            with self.average.swapped_in() if self.average is not None else contextlib.nullcontext() as training:
                if training is not None:  # the folder holds the average; the state, the training weights
                    files["training_weights"] = self._canonical(zip(self.average.names, (t.cpu() for t in training)))
                save_checkpoint(self.out_dir, self.model, self.tokenizer, files)
        self.last_saved = self.step

    # --- the loop ---

    def evaluate(self, batches: Iterable[Batch]) -> float:
        return evaluate(self.model, batches, device=self.device, amp=self.amp, attention=self.eval_attention,
                        loss_chunk=self.cfg.loss_chunk, layout=self.layout)

    def fit(self) -> dict:
        """Train to cfg.max_steps; checkpoints and logs go to out_dir (from the main process). Returns the
        run's summary (also in out_dir/log.json)."""
        cfg, model, main = self.cfg, self.model, self.layout.is_main
        out_dir, history = self.out_dir, self.history
        if main:
            out_dir.mkdir(parents=True, exist_ok=True)
        start_step = self.step
        model.train()
        peak = peak_flops(self.device)  # of every device of the run: MFU is the run's
        meter = Throughput(cfg.batch_size * self.seq_len * cfg.grad_accum, self.model_cfg.flops_per_token(self.seq_len),
                           peak * self.layout.world_size if peak else None)
        pending: list[tuple[int, torch.Tensor, float]] = []  # (step, loss on the device, lr) not yet read back
        wall_start = time.perf_counter()

        def summary() -> dict:
            ms_per_step, tok_s = meter.steady()
            vals = [r["loss"] for r in history["val"]]
            return {"title": self.title, "step": self.step, "start_step": start_step, "max_steps": cfg.max_steps,
                    "last_checkpoint_step": self.last_saved,
                    "initial_val_loss": vals[0] if vals else None, "val_loss": vals[-1] if vals else None,
                    "best_val_loss": min(vals) if vals else None, "wall_time_s": time.perf_counter() - wall_start,
                    "ms_per_step": ms_per_step, "tokens_per_s": tok_s, "mfu": meter.mfu(tok_s),
                    "device": str(self.device), "compiled": self.compiled, "cuda_graph": self.graphed,
                    "parallel": self.layout.name, "checkpointed_blocks": checkpointed(self.model),
                    "model": self.model_cfg.to_dict(), "config": cfg.to_dict()}

        def write_log(extra: dict | None = None) -> dict:
            log = summary() | (extra or {})
            if main:
                write_json(out_dir / "log.json", log | {"history": history})
                plot_losses(out_dir / "loss.png", history,
                            f"{self.title}: {self.model_cfg.arch}, {self.model_cfg.num_params(False) / 1e6:.1f}M params")
            return log

        def read_back_losses() -> float | None:
            """Move pending losses into the history; stop the run at the first non-finite one."""
            values = torch.stack([loss for _, loss, _ in pending]).tolist() if pending else []  # one device sync
            for (s, _, lr), value in zip(pending, values):
                history["train"].append({"step": s, "loss": value, "lr": lr})
                if not math.isfinite(value):
                    bar.close()
                    write_log({"stopped": f"non-finite loss at step {s}"})
                    kept = (f"the last good checkpoint (step {self.last_saved}) is kept in {out_dir}"
                            if self.last_saved is not None else "no checkpoint had been written")
                    raise NanoforgeError(f"step {s}: training loss is {value}; stopped, and {kept}; "
                                         f"try a lower --lr or more --warmup-steps", param="lr")
            pending.clear()
            return history["train"][-1]["loss"] if history["train"] else None

        bar = tqdm(total=cfg.max_steps, initial=self.step, desc=self.title, unit="step", dynamic_ncols=True,
                   mininterval=1.0, disable=not main)
        meter.resume()
        while True:
            done = self.step >= cfg.max_steps
            # --- validate and checkpoint (not again at the step a resumed run starts from) ---
            if (self.step % cfg.eval_interval == 0 or done) and self.step != self.resumed_at:
                meter.pause()  # evaluation and saving are not training time
                read_back_losses()
                with self.average.swapped_in() if self.average is not None else contextlib.nullcontext():
                    val = self.evaluate(self.data.eval_batches(cfg.eval_iters))
                history["val"].append({"step": self.step, "loss": val, "wall_s": time.perf_counter() - wall_start})
                if not math.isfinite(val):
                    bar.close()
                    write_log({"stopped": f"non-finite validation loss at step {self.step}"})
                    raise NanoforgeError(f"step {self.step}: validation loss is {val}; stopped, and the last good "
                                         f"checkpoint (step {self.last_saved}) is kept in {out_dir}", param="lr")
                saved = self.step > start_step
                if saved:
                    self.save()
                write_log()
                if main:
                    bar.write(f"step {self.step}: val loss {val:.4f}" + (f", saved to {out_dir}" if saved else ""))
                meter.resume()
            if done:
                break

            # --- one optimizer step over grad_accum micro-batches ---
            lr = lr_at(self.step, cfg)
            if self.average is not None:
                self.average.set_step(self.step)
            micro = [next(self.data.train) for _ in range(cfg.grad_accum)]
            step_loss = self.step_fn(micro, lr)
            self.step += 1
            meter.steps += 1
            pending.append((self.step, step_loss, lr))

            # --- progress: read losses back (this waits for the device), throughput since the last log ---
            if self.step % cfg.log_interval == 0 or self.step == cfg.max_steps:
                loss_now = read_back_losses()
                bar.update(meter.steps)
                tok_s = meter.end_interval()
                history["train"][-1] |= {"tokens_per_s": tok_s}
                bar.set_postfix_str(f"loss {loss_now:.4f}, lr {lr:.2e}, {tok_s:,.0f} tok/s, "
                                    f"MFU {format_mfu(meter.mfu(tok_s))}")
        bar.close()

        if self.average is not None:
            self.average.keep()
        final = self.evaluate(self.data.eval_batches(None))
        return write_log({"final_val_loss_full_split": final, "peak_memory_gib": self.layout.peak_memory_gib()})


def train(model: Transformer, tokenizer: Tokenizer, cfg: TrainConfig, data: RunData, out_dir: str | Path, *,
          layout: SingleDevice, resume: dict | None = None, title: str = "train") -> dict:
    """Train `model` (on layout.device) to cfg.max_steps: `Trainer(...).fit()`."""
    return Trainer(model, tokenizer, cfg, data, out_dir, layout=layout, resume=resume, title=title).fit()
