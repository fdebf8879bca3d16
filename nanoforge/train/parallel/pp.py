"""Pipeline parallelism with `torch.distributed.pipelining`: the layer stack cut into stages.

The n_layers blocks are cut into pp x v equal stages of consecutive blocks; the embedding goes with the
first stage, the final norm and the LM head with the last. Stage s runs on pp rank s % pp, so with v = 1
rank r holds stage r, and with v > 1 (interleaved 1F1B) it holds stages r, r + pp, ... Each rank keeps
only its stages' modules: the others are set to None in its copy of the model (their names, and so the
checkpoint's names, stay those of the whole model).

A step's `--grad-accum` micro-batches flow through the stages under a schedule:

    gpipe             all forwards, then all backwards (activations of every micro-batch held at once)
    1f1b              after a warm-up of pp - 1 forwards, one forward and one backward in turn (activations
                      of at most pp micro-batches held)
    interleaved-1f1b  1F1B over v stages per rank: the pipeline fills v times faster

With m micro-batches and pp stages a step lasts m + pp - 1 stage-times of which pp - 1 are bubble (idle)
at the ends: bubble fraction (pp - 1) / (m + pp - 1); interleaving divides the bubble by v:
(pp - 1) / (v m + pp - 1).

Each stage's module is a `Stage`: its forward runs the model's own pieces (`Transformer.embed_inputs`,
`rotary`, the blocks, `norm`, `lm_head`), taking the token positions and document ids (whole rows, for
the mask) as keyword arguments that every stage gets for each micro-batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B)

from nanoforge.data.loader import Batch
from nanoforge.model.transformer import Transformer


def bubble_fraction(pp: int, micro_batches: int, stages_per_rank: int = 1) -> float:
    """Share of a step's time that a pipeline rank idles: (pp - 1) / (v m + pp - 1)."""
    return (pp - 1) / (stages_per_rank * micro_batches + pp - 1)


def stage_layers(n_layers: int, n_stages: int, stage: int) -> range:
    per = n_layers // n_stages
    return range(stage * per, (stage + 1) * per)


def rank_stages(pp_rank: int, pp: int, n_stages: int) -> list[int]:
    """The stages that pipeline rank `pp_rank` runs: pp_rank, pp_rank + pp, ..."""
    return list(range(pp_rank, n_stages, pp))


def prune(model: Transformer, stages: list[int], n_stages: int) -> None:
    """Keep only the modules of `stages` (in place): other blocks become None, the embedding goes unless
    stage 0 is here, the final norm and head unless the last stage is."""
    keep = {i for s in stages for i in stage_layers(model.cfg.n_layers, n_stages, s)}
    for i in range(model.cfg.n_layers):
        if i not in keep:
            model.layers[i] = None
    if 0 not in stages:
        model.embed = None
        model.pos_embed = None
    if n_stages - 1 not in stages:
        model.norm = None
        model.lm_head = None


class Stage(nn.Module):
    """Stage `index` of `n_stages` of a pruned Transformer: what `PipelineStage` runs. Its modules are the
    model's own (the same objects, registered here too, under the model's names)."""

    def __init__(self, model: Transformer, index: int, n_stages: int):
        super().__init__()
        self.index, self.n_stages = index, n_stages
        self.first, self.last = index == 0, index == n_stages - 1
        self.layer_ids = list(stage_layers(model.cfg.n_layers, n_stages, index))
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in self.layer_ids})
        if self.first:
            self.embed, self.pos_embed = model.embed, model.pos_embed
        if self.last:
            self.norm, self.lm_head = model.norm, model.lm_head
        self._model = [model]  # not a submodule: the rest of it belongs to other stages
        self.attention = None  # AttentionFor, set by the layout for the step (training) or the evaluation

    def forward(self, x: torch.Tensor, positions: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
        model = self._model[0]
        if self.first:
            x = model.embed_inputs(x, positions)
        rope = model.rotary(positions, x.dtype)
        attn = self.attention(Batch(None, None, doc_ids, positions))
        for i in self.layer_ids:
            x = model.layers[i](x, rope, attn)
        return self.lm_head(self.norm(x)) if self.last else x


class Pipeline:
    """This rank's stages of the pipeline and the schedule that runs a step's micro-batches through them.

    `step` runs forward and backward of every micro-batch (the last stage computes each one's loss with
    `loss_fn(logits, targets)`) and returns the sum of the losses (0 on other stages); `forward` runs one
    batch through every stage without gradients, for evaluation."""

    def __init__(self, stages: list[Stage], pp_group, *, schedule: str, micro_batches: int, device: torch.device,
                 loss_fn):
        self.pp_rank, self.pp = dist.get_rank(pp_group), dist.get_world_size(pp_group)
        self.group, self.device, self.stages = pp_group, device, stages
        self.indices = [s.index for s in stages]
        self.n_stages = n_stages = stages[0].n_stages
        self.has_first, self.has_last = 0 in self.indices, n_stages - 1 in self.indices
        pipes = [PipelineStage(s, i, n_stages, device, group=pp_group) for s, i in zip(self.stages, self.indices)]
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B}[schedule]
        # The losses are divided by the step's trained tokens already: no division by the micro-batch count.
        if schedule == "interleaved-1f1b":
            self.schedule = kind(pipes, micro_batches, loss_fn=loss_fn, scale_grads=False)
        else:
            self.schedule = kind(pipes[0], micro_batches, loss_fn=loss_fn, scale_grads=False)

    def set_attention(self, attention) -> None:
        for s in self.stages:
            s.attention = attention

    def step(self, batches: list[Batch], targets: list[torch.Tensor]) -> torch.Tensor:
        """All micro-batches (this rank's rows, on the device) through the schedule, as one tensor that it
        splits back into them."""
        ids, positions, docs = (torch.cat([getattr(b, f) for b in batches]) for f in ("input_ids", "positions",
                                                                                    "doc_ids"))
        losses: list[torch.Tensor] = []
        self.schedule.step(ids, target=torch.cat(targets), losses=losses, positions=positions, doc_ids=docs)
        if not self.has_last:
            return torch.zeros((), device=self.device)
        return torch.stack([loss.to_local() if hasattr(loss, "to_local") else loss for loss in losses]).sum()

    @torch.no_grad()
    def forward(self, batch: Batch) -> torch.Tensor | None:
        """The last stage's output (logits) for one batch, on the rank that holds it (None elsewhere): each
        stage's output goes to the next stage's rank (a shape header, then the tensor)."""
        x = batch.input_ids
        for i in range(self.n_stages):
            owner, previous = i % self.pp, (i - 1) % self.pp
            if owner != self.pp_rank:
                continue
            if i > 0:
                x = self._recv(previous)
            x = self.stages[self.indices.index(i)](x, positions=batch.positions, doc_ids=batch.doc_ids)
            if i < self.n_stages - 1:
                self._send(x, (i + 1) % self.pp)
        for stage in self.stages:  # FSDP keeps a pipeline's weights gathered after forward, for a backward
            for module in stage.modules():  # that an evaluation never runs: shard them again
                if isinstance(module, FSDPModule):
                    module.reshard()
        return x if self.has_last else None

    _DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]

    def _send(self, x: torch.Tensor, to: int) -> None:
        peer = dist.get_global_rank(self.group, to)
        header = torch.tensor([x.dim(), *x.shape, self._DTYPES.index(x.dtype)], device=self.device)
        dist.send(torch.tensor([header.numel()], device=self.device), peer, group=self.group)
        dist.send(header, peer, group=self.group)
        dist.send(x.contiguous(), peer, group=self.group)

    def _recv(self, frm: int) -> torch.Tensor:
        peer = dist.get_global_rank(self.group, frm)
        n = torch.zeros(1, dtype=torch.int64, device=self.device)
        dist.recv(n, peer, group=self.group)
        header = torch.zeros(int(n), dtype=torch.int64, device=self.device)
        dist.recv(header, peer, group=self.group)
        shape, dtype = header[1:-1].tolist(), self._DTYPES[int(header[-1])]
        x = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(x, peer, group=self.group)
        return x
