"""ParallelDims: the degrees of a run's parallelisms, checked before any process group exists.

Five named mesh dimensions, outermost first, in the order Llama 3 nests them:

    pp            pipeline stages (layers cut into consecutive groups)
    dp_replicate  data-parallel replicas that all-reduce gradients (the R of HSDP)
    dp_shard      data-parallel ranks that shard weights, gradients and optimizer state (FSDP2)
    cp            context parallelism: each rank holds 1/cp of every sequence's tokens
    tp            tensor parallelism: each rank holds 1/tp of every weight matrix

Their product is the number of processes. Ranks next to each other (same host, NVLink) share the innermost
dimensions: tp talks in every layer, cp once per layer (K and V), dp once per step, pp only between stages.

Everything here is arithmetic on flags, the world size and the model's shapes, so a layout that cannot run
is one line and exit 2 before `torch.distributed` is touched.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from nanoforge.errors import NanoforgeError
from nanoforge.model.config import ModelConfig

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


def launched_by_torchrun() -> bool:
    """torchrun (and every launcher of its kind) tells each process its rank and the world size."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


@dataclass
class ParallelDims:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: whatever the other degrees leave of the world
    cp: int = 1
    tp: int = 1
    pp_schedule: str = "1f1b"
    stages_per_rank: int | None = None  # pipeline stages per pp rank (interleaved 1F1B: default 2, else 1)
    timeout_s: float = 600.0  # the longest any collective may wait for a peer before the run fails
    world_size: int = 1
    explicit: frozenset = field(default_factory=frozenset)  # degrees given as flags: applied even at degree 1

    def __post_init__(self):
        for name in ("pp", "dp_replicate", "cp", "tp"):
            if getattr(self, name) < 1:
                raise NanoforgeError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}", param=name)
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise NanoforgeError(f"--dp-shard must be >= 1, or -1 for what the other degrees leave; "
                                 f"got {self.dp_shard}", param="dp_shard")
        if self.pp_schedule not in SCHEDULES:
            raise NanoforgeError(f"--pp-schedule {self.pp_schedule!r}: choose one of {', '.join(SCHEDULES)}",
                                 param="pp_schedule")
        interleaved = self.pp_schedule == "interleaved-1f1b"
        if self.stages_per_rank is None:
            self.stages_per_rank = 2 if interleaved else 1
        if self.stages_per_rank < 1 or (self.stages_per_rank > 1 and not interleaved):
            raise NanoforgeError(f"--pp-stages-per-rank {self.stages_per_rank}: more than one stage per rank needs "
                                 f"--pp-schedule interleaved-1f1b", param="pp_stages_per_rank")
        if self.timeout_s <= 0:
            raise NanoforgeError(f"--dist-timeout must be positive, got {self.timeout_s:g}", param="dist_timeout")
        others = self.pp * self.dp_replicate * self.cp * self.tp
        needed = others * max(self.dp_shard, 1)
        if self.world_size == 1 and needed > 1:
            raise NanoforgeError(f"{self._product(max(self.dp_shard, 1))} needs {needed} processes and this is one: "
                                 f"launch with torchrun --nproc-per-node {needed}", param="dp_shard")
        if self.dp_shard == -1:
            if self.world_size % others:
                raise NanoforgeError(f"{self.world_size} processes cannot be split into {self._product(None)}: "
                                     f"{self.world_size} is not a multiple of {others}", param="dp_shard")
            self.dp_shard = self.world_size // others
        if others * self.dp_shard != self.world_size:
            raise NanoforgeError(f"{self._product(self.dp_shard)} = {others * self.dp_shard} processes, but "
                                 f"{self.world_size} were launched", param="dp_shard")

    def _product(self, dp_shard: int | None) -> str:
        shown = {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": dp_shard, "cp": self.cp, "tp": self.tp}
        return " x ".join(f"{k} {'?' if v is None else v}" for k, v in shown.items() if v != 1 or k == "dp_shard")

    # --- derived sizes ---

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each reads its own rows of every batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_size(self) -> int:
        """Ranks whose gradients FSDP averages: every rank of a model replica's weights that saw other data
        (dp_replicate x dp_shard) or other tokens of the same data (cp)."""
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def enabled(self, name: str) -> bool:
        """Whether a parallelism is applied: at degree > 1, or when asked for by its flag (degree 1 too)."""
        if name == "fsdp":
            return self.fsdp_size > 1 or bool({"dp_shard", "dp_replicate"} & self.explicit)
        return getattr(self, name) > 1 or name in self.explicit

    def describe(self) -> str:
        parts = [f"{name} {getattr(self, name)}" for name in MESH_DIMS
                 if getattr(self, name) > 1 or name in self.explicit or (name == "dp_shard" and self.enabled("fsdp"))]
        text = " x ".join(parts) or "1 process"
        if self.pp > 1:
            text += f", {self.pp_schedule}" + (f" ({self.stages_per_rank} stages per rank)"
                                               if self.stages_per_rank > 1 else "")
        return text

    # --- does the model and the batch fit this layout? ---

    def check(self, model: ModelConfig, *, seq_len: int, batch_size: int, grad_accum: int,
              loss_chunk: int | None = None) -> None:
        """One NanoforgeError for the first reason the run cannot be laid out this way."""
        if self.tp > 1:
            for what, n in (("n_heads", model.n_heads), ("n_kv_heads", model.n_kv_heads)):
                if n % self.tp:
                    raise NanoforgeError(f"--tp {self.tp} must divide the model's {what} ({n}): each rank keeps whole "
                                         f"attention heads (and whole groups of query heads per KV head)", param="tp")
            widths = {"d_ff": model.d_ff}
            for what, n in widths.items():
                if n % self.tp:
                    raise NanoforgeError(f"--tp {self.tp} must divide the model's {what} ({n})", param="tp")
            if loss_chunk:
                raise NanoforgeError("--loss-chunk fuses the LM head with the loss on one device; with --tp the "
                                     "vocabulary-parallel loss does its work (drop --loss-chunk)", param="loss_chunk")
        if self.n_stages > 1:
            if model.n_layers % self.n_stages:
                raise NanoforgeError(f"{model.n_layers} layers cannot be cut into {self.n_stages} equal pipeline stages "
                                     f"(--pp {self.pp}" + (f" x {self.stages_per_rank} stages per rank" if
                                                            self.stages_per_rank > 1 else "") + ")", param="pp")
            if model.tie_embeddings:
                raise NanoforgeError("pipeline parallelism puts the embedding on the first stage and the LM head on "
                                     "the last; this model ties them (tie_embeddings)", param="pp")
            if self.pp_schedule != "gpipe" and grad_accum < self.pp:
                raise NanoforgeError(f"--pp-schedule {self.pp_schedule} needs at least --pp {self.pp} micro-batches "
                                     f"per step; got --grad-accum {grad_accum}", param="grad_accum")
            if self.pp_schedule == "interleaved-1f1b" and grad_accum % self.pp:
                raise NanoforgeError(f"interleaved 1F1B needs --grad-accum a multiple of --pp {self.pp}; got "
                                     f"{grad_accum}", param="grad_accum")
            if loss_chunk:
                raise NanoforgeError("--loss-chunk is not supported with pipeline parallelism", param="loss_chunk")
        if batch_size % self.dp:
            raise NanoforgeError(f"--batch-size {batch_size} (sequences per micro-batch, all ranks together) must be "
                                 f"a multiple of the {self.dp} data-parallel ranks", param="batch_size")
        tokens = 2 * self.cp * (self.tp if self.tp > 1 else 1)
        if seq_len % tokens:
            raise NanoforgeError(f"seq_len {seq_len} must be a multiple of {tokens}: "
                                 + (f"2 x --cp {self.cp} load-balanced chunks" if self.cp > 1 else "")
                                 + (" x " if self.cp > 1 and self.tp > 1 else "")
                                 + (f"--tp {self.tp} sequence-parallel shards" if self.tp > 1 else ""),
                                 param="seq_len")
        if self.cp > 1 and loss_chunk:
            raise NanoforgeError("--loss-chunk is not supported with context parallelism", param="loss_chunk")


def parallel_dims(*, tp: int | None, cp: int | None, pp: int | None, dp_shard: int | None,
                  dp_replicate: int | None, pp_schedule: str | None = None, stages_per_rank: int | None = None,
                  timeout_s: float | None = None) -> ParallelDims | None:
    """The layout that the flags (None: not given) and the launcher ask for; None for one process without
    any parallel flag: the single-device trainer, exactly as it runs without torch.distributed."""
    given = {"tp": tp, "cp": cp, "pp": pp, "dp_shard": dp_shard, "dp_replicate": dp_replicate}
    explicit = frozenset(k for k, v in given.items() if v is not None)
    launched = launched_by_torchrun()
    if not explicit and not launched:
        if pp_schedule is not None or stages_per_rank is not None:
            raise NanoforgeError("--pp-schedule and --pp-stages-per-rank need --pp", param="pp_schedule")
        return None
    world = int(os.environ["WORLD_SIZE"]) if launched else 1
    return ParallelDims(**{k: v for k, v in given.items() if v is not None}, pp_schedule=pp_schedule or "1f1b",
                        stages_per_rank=stages_per_rank, timeout_s=600.0 if timeout_s is None else timeout_s,
                        world_size=world, explicit=explicit)
