"""Tensor-parallel inference: one process per device over torch.distributed, the scheduler on the first.

The model is split Megatron's way, on plain tensors (training's `train/parallel/tp.py` splits the same
layers with DTensor for autograd; a DTensor never reaches our Triton kernels or a CUDA graph):

    wqkv        by output rows: rank r keeps query heads r*Hq/N.. and KV heads r*Hkv/N.. (whole groups of
                grouped-query heads, so a query head and the K/V it reads stay on one rank), with their biases
    wo          by input columns (its heads' share): a partial sum, all-reduced
    w_in        by output rows, the gate and up halves split alike, so silu(gate) * up stays local
    w_out       by input columns: a partial sum, all-reduced
    the rest    replicated: embeddings, norms (Qwen3's per-head q/k norms too), the LM head

That is two all-reduces per block. The block is pre-norm and sequential (the MLP's norm reads the
attention's full output), so the two cannot merge into one; a parallel block (GPT-J's attention and MLP
side by side) would allow one. Each rank's KV cache holds its own KV heads.

The first rank runs the engine: it schedules, packs each step's inputs (`InputBatch`) and sends them to
the others over a gloo group (the host's control path; loopback only), then every rank uploads and runs
the step. Only the first rank computes logits and samples; the sampled tokens are broadcast to the others
on the device, where a step that follows asynchronously reads its rows' pending tokens from.

The first rank starts the others as spawned processes (`start`); each loads the model itself (from the
model folder, or from a state dict the first rank hands over), shards it, and agrees with the others on
the KV cache's size (the smallest any rank can hold). A worker dies with its parent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import signal
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from nanoforge.errors import NanoforgeError
from nanoforge.model.config import ModelConfig
from nanoforge.model.transformer import Transformer
from nanoforge.serve.input_batch import StepInputs

TIMEOUT = datetime.timedelta(minutes=30)  # how long a rank waits in a collective (a worker idles between requests)


def check_tensor_parallel(cfg: ModelConfig, n: int) -> None:
    """NanoforgeError (one line) unless the model splits evenly into n ranks of whole heads."""
    if n < 1:
        raise NanoforgeError(f"--tensor-parallel-size must be >= 1, got {n}", param="tensor_parallel_size")
    if cfg.n_heads % n or cfg.n_kv_heads % n or cfg.d_ff % n:
        raise NanoforgeError(f"--tensor-parallel-size {n} must divide the model's query heads ({cfg.n_heads}), KV "
                             f"heads ({cfg.n_kv_heads}) and MLP width ({cfg.d_ff})", param="tensor_parallel_size")


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r @ W_r^T) + b: this rank's input columns of a linear layer, summed over the ranks."""

    def __init__(self, linear: nn.Linear, rank: int, world: int, group):
        super().__init__()
        k = linear.in_features // world
        self.weight = nn.Parameter(linear.weight.detach()[:, rank * k:(rank + 1) * k].contiguous(), requires_grad=False)
        self.bias = linear.bias
        self.group = group

    def forward(self, x):
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


def _keep_rows(linear: nn.Linear, rows: torch.Tensor) -> None:
    linear.weight = nn.Parameter(linear.weight.detach()[rows].contiguous(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[rows].contiguous(), requires_grad=False)
    linear.out_features = len(rows)


def shard_model(model: Transformer, rank: int, world: int, group) -> Transformer:
    """Split `model` in place for rank `rank` of `world` (see the module's docstring); returns it."""
    cfg = model.cfg
    check_tensor_parallel(cfg, world)
    hd, hq, hkv, ff = cfg.head_dim, cfg.n_heads // world, cfg.n_kv_heads // world, cfg.d_ff // world
    dev = model.embed.weight.device
    q = torch.arange(rank * hq * hd, (rank + 1) * hq * hd, device=dev)
    k = cfg.q_dim + torch.arange(rank * hkv * hd, (rank + 1) * hkv * hd, device=dev)
    qkv_rows = torch.cat((q, k, k + cfg.kv_dim))
    mlp = torch.arange(rank * ff, (rank + 1) * ff, device=dev)
    for block in model.layers:
        attn = block.attn
        _keep_rows(attn.wqkv, qkv_rows)
        attn.n_heads, attn.n_kv_heads = hq, hkv
        attn.split = (hq * hd, hkv * hd, hkv * hd)
        attn.wo = RowParallelLinear(attn.wo, rank, world, group)
        m = block.mlp
        _keep_rows(m.w_in, torch.cat((mlp, mlp + cfg.d_ff)) if m.swiglu else mlp)
        m.w_out = RowParallelLinear(m.w_out, rank, world, group)
    return model


class TensorParallel:
    """This process's place in the group: rank, world size, the device group (all-reduces, token
    broadcasts) and the host group (the steps the first rank sends)."""

    def __init__(self, rank: int, world: int, device: torch.device):
        self.rank, self.world, self.device = rank, world, device
        self.group = dist.group.WORLD
        self.host_group = dist.new_group(backend="gloo", timeout=TIMEOUT) if device.type == "cuda" else self.group
        self.workers: list = []

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def send(self, step: StepInputs) -> None:
        dist.broadcast_object_list([dataclasses.replace(step, packed=step.packed.numpy())], src=0,
                                   group=self.host_group)

    def receive(self) -> StepInputs:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.host_group)
        step = box[0]
        return dataclasses.replace(step, packed=torch.from_numpy(step.packed))

    def broadcast_tokens(self, tokens: torch.Tensor) -> None:
        dist.broadcast(tokens, src=0, group=self.group)

    def agree_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.host_group)
        return int(t.item())

    def close(self) -> None:
        """First rank: tell the workers to stop, wait for them, leave the group."""
        if self.is_driver and self.workers:
            self.send(StepInputs(None, torch.zeros(0, dtype=torch.int64), 0, 0, 0, 0, 0, 0, 0, False, stop=True))
            for w in self.workers:
                w.join(timeout=30)
                if w.is_alive():
                    w.kill()
            self.workers = []
        if dist.is_initialized():
            dist.destroy_process_group()


def _init_group(rank: int, world: int, port: int, device: torch.device) -> TensorParallel:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=TIMEOUT)
    return TensorParallel(rank, world, device)


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


def start(world: int, device: torch.device, worker: Callable, worker_args: tuple) -> TensorParallel:
    """Start ranks 1..world-1 as processes running `worker(tp, *worker_args)` and join them as rank 0."""
    from nanoforge.serve.disagg.process import free_port

    if device.type == "cuda" and torch.cuda.device_count() < world:
        raise NanoforgeError(f"--tensor-parallel-size {world} needs {world} GPUs; this machine has "
                             f"{torch.cuda.device_count()}", param="tensor_parallel_size")
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker_main, args=(rank, world, port, device, worker, worker_args), daemon=True,
                         name=f"nanoforge-tp{rank}") for rank in range(1, world)]
    for p in procs:
        p.start()
    tp = _init_group(0, world, port, rank_device(device, 0))
    tp.workers = procs
    return tp


def _worker_main(rank: int, world: int, port: int, device: torch.device, worker: Callable, args: tuple) -> None:
    if sys.platform.startswith("linux"):  # die with the first rank, even when it is killed
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if device.type == "cpu":
        torch.set_num_threads(1)  # ranks share the machine's cores
    tp = _init_group(rank, world, port, rank_device(device, rank))
    try:
        worker(tp, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
