"""`Parallel`: the trainer's layout over one DeviceMesh, torchtitan-style.

`Parallel.start(dims)` joins the process group that torchrun set up (loopback on one host, a bounded
timeout on every collective) and builds one DeviceMesh with the named dimensions of `ParallelDims`
(pp, dp_replicate, dp_shard, cp, tp, outermost first) plus three flattened ones:

    dp           dp_replicate x dp_shard: the ranks that read different rows of each batch
    dp_shard_cp  dp_shard x cp: what FSDP shards over (context-parallel ranks reduce gradients too)
    loss         pp x dp_replicate x dp_shard x cp: the ranks that each hold a share of the loss

`parallelize(model)` applies the parallelisms to the unchanged model in torchtitan's order: pipeline
split (this rank's stages), fused projections held as parts, tensor parallelism, per-block compile, then
FSDP2. The other methods are what the trainer asks of any layout (`trainer.SingleDevice` is the
one-device version): this rank's tokens of a batch, its attention, the loss divisor, totals over ranks, the
gradient norm over every shard, the pipeline's forward-backward, and sharded checkpoints.

Numbers agree with one process. The step's loss is divided by the trained tokens of all ranks' rows
(summed over dp), times the FSDP group's size, because FSDP averages gradients over that group while the
loss of one big batch sums them; so every layout computes the gradient of the same global batch.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel

from nanoforge.data.loader import Batch
from nanoforge.errors import NanoforgeError
from nanoforge.model.transformer import Transformer
from nanoforge.train.checkpoint import (SHARDS, STATE_FILE, begin_checkpoint, commit_checkpoint, export_shards,
                                        save_shards)
from nanoforge.train.config import TrainConfig
from nanoforge.train.parallel import cp as cp_
from nanoforge.train.parallel.ac import apply_ac
from nanoforge.train.parallel.dims import MESH_DIMS, ParallelDims
from nanoforge.train.parallel.fsdp import apply_fsdp
from nanoforge.train.parallel.pp import Pipeline, Stage, bubble_fraction, prune, rank_stages
from nanoforge.train.parallel.tp import apply_tp, split_fused_projections, vocab_parallel_logits
from nanoforge.train.trainer import (AttentionFor, LossFn, batch_loss, compute_dtype, device_peak_gib,
                                     forward_backward, logits_loss, trained_targets)


class PeerFailure(RuntimeError):
    """Another rank of the run failed (its error is its own to report); this one stops too."""


_LOST_PEER = ("Connection reset by peer", "Connection closed by peer", "Timed out", "timed out", "Broken pipe",
              "Connection refused")


def lost_peer(e: BaseException) -> bool:
    """Whether an exception says that another rank died or stopped answering (a collective failed or ran past
    the process group's timeout), rather than that this rank went wrong."""
    return isinstance(e, (PeerFailure, dist.DistError)) or (
        isinstance(e, RuntimeError) and any(s in str(e) for s in _LOST_PEER))


class Parallel:
    distributed = True

    def __init__(self, dims: ParallelDims, device: torch.device, mesh, flat: dict):
        self.dims, self.device, self.mesh, self.flat = dims, device, mesh, flat
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.is_main = self.rank == 0
        self.name = dims.describe()
        self.groups = {name: mesh[name].get_group() for name in MESH_DIMS}
        self.groups |= {name: m.get_group() for name, m in flat.items()}
        self.cp_rank = mesh["cp"].get_local_rank()
        self.dp_rank = flat["dp"].get_local_rank()
        self.pipeline: Pipeline | None = None
        self.grad_scale = dims.fsdp_size if dims.enabled("fsdp") else 1  # FSDP divides gradients by this
        self.tp_mesh = mesh["tp"] if dims.enabled("tp") else None
        self.data_shard = (self.dp_rank, dims.dp)

    # --- the process group ---

    @classmethod
    def start(cls, dims: ParallelDims, device: str = "auto") -> Parallel:
        """Join torchrun's process group (every collective bounded by dims.timeout_s) and build the mesh."""
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dev = torch.device(device)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise NanoforgeError(f"device {device!r}: no CUDA GPU is available", param="device")
            dev = torch.device("cuda", local_rank)
            torch.cuda.set_device(dev)
        elif dev.type != "cpu":
            raise NanoforgeError(f"parallel training runs on cuda or cpu, not {device!r}", param="device")
        timeout = datetime.timedelta(seconds=dims.timeout_s)
        if dev.type == "cuda":
            dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timeout, device_id=dev)
        else:
            dist.init_process_group("gloo", timeout=timeout)
        return cls.build(dims, dev)

    @classmethod
    def build(cls, dims: ParallelDims, device: torch.device) -> Parallel:
        """The layout on the process group already joined: one DeviceMesh of dims' degrees."""
        # Under tensor parallelism the model returns this rank's shard of the logits, a view; nothing changes
        # it in place, which is what FSDP warns about.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        mesh = init_device_mesh(device.type, tuple(getattr(dims, n) for n in MESH_DIMS), mesh_dim_names=MESH_DIMS)
        flat = {"dp": mesh["dp_replicate", "dp_shard"]._flatten("dp"),
                "dp_shard_cp": mesh["dp_shard", "cp"]._flatten("dp_shard_cp"),
                "loss": mesh["pp", "dp_replicate", "dp_shard", "cp"]._flatten("loss")}
        return cls(dims, device, mesh, flat)

    def _fsdp_mesh(self):
        """FSDP's mesh: (dp_replicate, dp_shard x cp) for HSDP, else dp_shard x cp (without cp, the mesh's own
        dimensions: no slice of a flattened one)."""
        dims = self.dims
        if dims.dp_replicate > 1 or "dp_replicate" in dims.explicit:
            if dims.cp == 1:
                return self.mesh["dp_replicate", "dp_shard"]
            with warnings.catch_warnings():  # torch would rather we kept this 2-D slice ourselves
                warnings.simplefilter("ignore", UserWarning)
                return self.mesh["dp_replicate", "dp_shard_cp"]
        return self.mesh["dp_shard"] if dims.cp == 1 else self.flat["dp_shard_cp"]

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        """Leave the process group (after a barrier: gloo runs here aborted at exit without one)."""
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    def abort(self) -> None:
        """Leave the process group after a failure, without waiting for ranks that may never come."""
        if dist.is_initialized():
            dist.destroy_process_group()

    def on_main(self, fn: Callable[[], object]) -> object:
        """Run `fn` on the main process only (files, printing); every rank gets its result, or its
        NanoforgeError (one line, exit 2 on every rank), or stops if it failed otherwise."""
        box = [None]
        if self.is_main:
            try:
                box = [("ok", fn())]
            except NanoforgeError as e:
                box = [("bad input", (str(e), e.param))]
            except BaseException as e:
                box = [("failed", repr(e))]
                dist.broadcast_object_list(box, src=0)
                raise
        dist.broadcast_object_list(box, src=0)
        kind, value = box[0]
        if kind == "bad input":
            raise NanoforgeError(value[0], param=value[1])
        if kind == "failed":
            raise PeerFailure(f"rank 0 failed ({value}); see its traceback")
        return value

    # --- the model ---

    def parallelize(self, model: Transformer, cfg: TrainConfig) -> Transformer:
        """Apply the layout to the model (in place; on self.device, the same weights on every rank)."""
        dims = self.dims
        model.to(self.device)
        stages = None
        if dims.n_stages > 1:
            mine = rank_stages(self.mesh["pp"].get_local_rank(), dims.pp, dims.n_stages)
            prune(model, mine, dims.n_stages)
            stages = [Stage(model, i, dims.n_stages) for i in mine]
        split_fused_projections(model)
        if self.tp_mesh is not None:
            apply_tp(model, self.tp_mesh)
        apply_ac(model, cfg.ac)
        if cfg.compile if cfg.compile is not None else self.device.type == "cuda":
            for block in model.layers:
                if block is not None:
                    block.compile(dynamic=False)
        if dims.enabled("fsdp"):
            bf16 = compute_dtype(self.device, cfg.dtype) == "bf16"
            apply_fsdp(model, self._fsdp_mesh(), param_dtype=torch.bfloat16 if bf16 else None, stages=stages)
        if stages is not None:
            self.pipeline = Pipeline(stages, self.groups["pp"], schedule=dims.pp_schedule,
                                     micro_batches=cfg.grad_accum, device=self.device, loss_fn=self._pipeline_loss)
            if self.is_main:
                print(f"pipeline: {dims.n_stages} stages on {dims.pp} ranks, {dims.pp_schedule}, "
                      f"{cfg.grad_accum} micro-batches per step: bubble fraction "
                      f"{bubble_fraction(dims.pp, cfg.grad_accum, dims.stages_per_rank):.1%}", flush=True)
        return model

    # --- batches, attention, losses ---

    def local(self, batch: Batch) -> Batch:
        """This rank's tokens of its rows: 2 load-balanced chunks of each sequence under context parallelism."""
        if self.dims.cp == 1:
            return batch
        return cp_.shard_batch(batch, cp_.chunk_index(batch.input_ids.shape[1], self.dims.cp, self.cp_rank))

    def attention(self, attention: AttentionFor) -> AttentionFor:
        if self.dims.cp == 1:
            return attention
        cp = self.dims.cp

        def cp_attention(batch: Batch):
            seq_len = batch.doc_ids.shape[1]  # doc_ids stay whole: the row's length
            return cp_.cp_attention(attention(batch), cp_.chunk_index(seq_len, cp, self.cp_rank),
                                    cp_.gathered_index(seq_len, cp), self.groups["cp"])

        return cp_attention

    def loss_fn(self, model, attention: AttentionFor, compiled: bool, loss_chunk: int | None) -> LossFn:
        if self.pipeline is not None:
            self.pipeline.set_attention(attention)
            return None
        if self.tp_mesh is None:
            return lambda batch: batch_loss(model, batch, attention, loss_chunk)

        def vocab_parallel_loss(batch: Batch) -> torch.Tensor:
            logits = model(batch.input_ids, batch.positions, attention(batch))
            return logits_loss(vocab_parallel_logits(logits, self.tp_mesh), trained_targets(batch))

        return vocab_parallel_loss

    def _pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.tp_mesh is not None:
            logits = vocab_parallel_logits(logits, self.tp_mesh)
        return logits_loss(logits, targets) / self._divisor

    def forward_backward(self, loss_fn: LossFn, batches: list[Batch], divisor, amp) -> torch.Tensor:
        with loss_parallel() if self.tp_mesh is not None else contextlib.nullcontext():
            if self.pipeline is None:
                loss = forward_backward(loss_fn, batches, divisor, amp)
            else:
                self._divisor = divisor
                with amp:
                    loss = self.pipeline.step(batches, [trained_targets(b) for b in batches])
        return loss.to_local() if isinstance(loss, DTensor) else loss

    def eval_loss(self, loss_fn: LossFn, batch: Batch) -> torch.Tensor:
        with loss_parallel() if self.tp_mesh is not None else contextlib.nullcontext():
            if self.pipeline is None:
                loss = loss_fn(batch)
            else:
                logits = self.pipeline.forward(batch)
                if logits is None:
                    return torch.zeros((), device=self.device)
                if self.tp_mesh is not None:
                    logits = vocab_parallel_logits(logits, self.tp_mesh)
                loss = logits_loss(logits, trained_targets(batch))
        return loss.to_local() if isinstance(loss, DTensor) else loss

    def divisor(self, n_trained: int) -> torch.Tensor:
        n = torch.tensor(float(n_trained), device=self.device)
        dist.all_reduce(n, group=self.groups["dp"])
        return n.clamp_(min=1) / self.grad_scale

    def total(self, loss: torch.Tensor) -> torch.Tensor:
        loss = (loss.to_local() if isinstance(loss, DTensor) else loss).detach().clone()
        dist.all_reduce(loss, group=self.groups["loss"])
        return loss

    def step_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.total(loss) / self.grad_scale  # undo the divisor's scaling for FSDP's averaging

    def peak_memory_gib(self) -> float | None:
        """The most memory torch allocated at once on any rank's device (on GPUs; None elsewhere)."""
        peak = device_peak_gib(self.device)
        if peak is None:
            return None
        t = torch.tensor(peak, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def count(self, n: int) -> int:
        t = torch.tensor(n, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, group=self.groups["dp"])
        return int(t)

    # --- gradients and state ---

    @torch.no_grad()
    def clip_grad_norm_(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Scale the gradients so that their norm over the whole model, every shard of every rank (all of the
        mesh's dimensions), is at most max_norm, as torch.nn.utils.clip_grad_norm_ does on one device."""
        grads = [p.grad for p in params if p.grad is not None]
        by_layout: dict = {}
        for g in grads:  # DTensor norms are reduced over their mesh: one reduction per kind of placement
            key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
            by_layout.setdefault(key, []).append(torch.linalg.vector_norm(g, 2.0))
        squares = torch.zeros((), device=self.device)
        for key, norms in by_layout.items():
            total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
            squares += (total.full_tensor() if isinstance(total, DTensor) else total).float() ** 2
        if self.dims.pp > 1:  # each pipeline rank holds other layers
            dist.all_reduce(squares, group=self.groups["pp"])
        norm = squares.sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
        return norm

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Load a checkpoint's tensor into this run's: a whole tensor (a one-device checkpoint) is cut into
        this rank's shard; shards that DCP loaded in place are left alone."""
        if dst is src:
            return
        if isinstance(dst, DTensor) and not isinstance(src, DTensor):
            src = distribute_tensor(src.to(self.device), dst.device_mesh, dst.placements)
        if isinstance(dst, DTensor):
            dst.to_local().copy_(src.to_local())
        else:
            dst.copy_(src)

    def save_checkpoint(self, out_dir: Path, state: dict, model_cfg, tokenizer) -> None:
        """Every rank writes its shards (DCP); the main process exports the model folder from them (the
        weight average with --ema) and writes the rest of the state, then publishes the checkpoint."""
        tensors = {k: state[k] for k in ("model", "optimizer", "average") if k in state}
        rest = {k: v for k, v in state.items() if k not in tensors} | {"sharded": True, "layout": self.name}
        tmp = self.on_main(lambda: begin_checkpoint(out_dir))
        save_shards(tmp, tensors)

        def publish():
            export_shards(tmp / SHARDS, tmp, model_cfg, tokenizer, "average" if "average" in tensors else "model")
            torch.save(rest, tmp / STATE_FILE)
            commit_checkpoint(out_dir)

        self.on_main(publish)

