"""Checkpoints: a Hugging Face model folder plus the trainer's state, published atomically.

A run's output folder is itself a loadable model (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json: `nanoforge generate --model runs/pretrain`
and `transformers` read it as is) with `trainer_state.pt` beside it: the
optimizer, the step, the RNG states, the data position, the TrainConfig and
the loss history, all that an exact resume needs.

A parallel run (`nanoforge.train.parallel`) writes its weights and optimizer
state as `torch.distributed.checkpoint` shards instead, in `dcp/` (every rank
its own, tensors under layout-independent names: `canonical`), and the main
process exports the model folder from them, so the folder is the same plain
Hugging Face model whatever the layout. Shards load at any other layout,
including one process without a process group: resharding is DCP's.

Publishing is two-phase so that a crash never leaves a mix that looks good:
  1. write every file into `.checkpoint.tmp/`;
  2. rename it to `.checkpoint.ready/` (one atomic rename: the commit point);
  3. move the files into the output folder and remove `.checkpoint.ready/`.
`finish_pending` runs before anything reads a folder: it completes step 3 of a
committed checkpoint and deletes an uncommitted one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from pathlib import Path

import torch

from nanoforge.errors import NanoforgeError
from nanoforge.model.config import ModelConfig
from nanoforge.model.hf import load_model, save_model
from nanoforge.model.transformer import Transformer
from nanoforge.tokenizer import Tokenizer

STATE_FILE = "trainer_state.pt"
_WRITING = ".checkpoint.tmp"
_COMMITTED = ".checkpoint.ready"


SHARDS = "dcp"  # the folder of a parallel run's torch.distributed.checkpoint shards


def finish_pending(out_dir: str | os.PathLike) -> None:
    """Complete a committed but unpublished checkpoint; drop one that was never committed. In a parallel
    run only the main process (RANK 0) touches the folder."""
    if int(os.environ.get("RANK", 0)) != 0:
        return
    out = Path(out_dir)
    shutil.rmtree(out / _WRITING, ignore_errors=True)
    ready = out / _COMMITTED
    if ready.is_dir():
        names = {f.name for f in ready.iterdir()}
        if STATE_FILE in names and SHARDS not in names:  # shards of an earlier parallel checkpoint: stale now
            shutil.rmtree(out / SHARDS, ignore_errors=True)
        for f in ready.iterdir():
            if f.is_dir():
                shutil.rmtree(out / f.name, ignore_errors=True)
            os.replace(f, out / f.name)
        ready.rmdir()


def begin_checkpoint(out_dir: str | os.PathLike) -> Path:
    """The empty folder that a checkpoint is written into before `commit_checkpoint` publishes it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    finish_pending(out)
    tmp = out / _WRITING
    tmp.mkdir()
    return tmp


def commit_checkpoint(out_dir: str | os.PathLike) -> None:
    out = Path(out_dir)
    os.replace(out / _WRITING, out / _COMMITTED)
    finish_pending(out)


def save_checkpoint(out_dir: str | os.PathLike, model: Transformer, tokenizer: Tokenizer, state: dict) -> None:
    tmp = begin_checkpoint(out_dir)
    save_model(model, tmp)
    tokenizer.save(tmp)
    torch.save(state, tmp / STATE_FILE)
    commit_checkpoint(out_dir)


# --- sharded (parallel) checkpoints -----------------------------------------------------------------

def save_shards(tmp: Path, tensors: dict) -> None:
    """Every rank writes its shards of `tensors` ({"model": ..., "optimizer": ..., ...} by canonical names,
    DTensors or plain) into tmp/dcp, collectively."""
    import torch.distributed.checkpoint as dcp

    dcp.save(tensors, checkpoint_id=tmp / SHARDS)


def load_shards(path: str | os.PathLike, template: dict, distributed: bool) -> set[str]:
    """Load a sharded checkpoint in place into `template` (the live tensors of `Trainer.state_dict()`, at any
    layout: DCP reads whatever pieces of the saved shards each rank's tensors cover). Only the top-level parts
    ("model", "optimizer", "average") that the checkpoint holds are read; returns their names."""
    import torch.distributed.checkpoint as dcp

    saved = {key.split(".", 1)[0] for key in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata}
    parts = {k: v for k, v in template.items() if k in saved}
    with _one_process(not distributed):
        dcp.load(parts, checkpoint_id=path, no_dist=not distributed)
    return set(parts)


@contextlib.contextmanager
def _one_process(quiet: bool):
    """DCP warns that it runs without a process group: here that is the intent."""
    with warnings.catch_warnings():
        if quiet:
            warnings.filterwarnings("ignore", message=".*assuming the intent is to", category=UserWarning)
        yield


def export_shards(path: str | os.PathLike, out_dir: Path, cfg: ModelConfig, tokenizer: Tokenizer,
                  part: str = "model") -> None:
    """The Hugging Face model folder of a sharded checkpoint (its weight average, with part="average"):
    the whole model read into one process, without a process group, and saved as `save_model` does."""
    import torch.distributed.checkpoint as dcp

    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    model.reset_buffers("cpu")
    model.requires_grad_(False)  # DCP loads in place, into views of the weights
    with _one_process(True):
        dcp.load({part: canonical(model.named_parameters(), cfg)}, checkpoint_id=path, no_dist=True)
    save_model(model, out_dir)
    tokenizer.save(out_dir)


def remove_checkpoint(out_dir: str | os.PathLike) -> None:
    """Delete a run folder's checkpoint and logs (by name; anything else in the folder stays)."""
    out = Path(out_dir)
    finish_pending(out)
    for name in (STATE_FILE, "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "log.json", "loss.png", "answers.json"):
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / SHARDS, ignore_errors=True)


def has_checkpoint(out_dir: str | os.PathLike) -> bool:
    out = Path(out_dir)
    if not out.is_dir():
        return False
    finish_pending(out)
    return (out / STATE_FILE).is_file()


def load_state(out_dir: str | os.PathLike) -> dict:
    """The trainer state of a checkpoint folder (tensors on the CPU)."""
    path = Path(out_dir) / STATE_FILE
    if not has_checkpoint(out_dir):
        raise NanoforgeError(f"{path}: not found; {out_dir} holds no training checkpoint to resume", param="resume")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise NanoforgeError(f"{path}: cannot read the trainer state ({str(e).splitlines()[0]})",
                             param="resume") from None
    if "training_weights" in state:  # the model folder holds the weight average; these are the trained ones
        state["model"] = state.pop("training_weights")
    if state.get("sharded"):  # a parallel run's: weights and optimizer state are in the shards beside it
        state["sharded"] = str(Path(out_dir) / SHARDS)
    return state


def load_for_training(model_dir: str | os.PathLike, device: torch.device, dropout: float = 0.0) -> Transformer:
    """A model folder as trainable fp32 weights, with the run's dropout (a training setting that the
    Hugging Face config does not hold). Every parameter is made contiguous: GPT-2's transposed Conv1D
    tensors load as strided views, which would round differently from the weights that were saved."""
    model = load_model(model_dir, device=device, dtype=torch.float32)
    for p in model.parameters():
        p.data = p.data.contiguous()
    model.cfg = model.cfg.replace(dropout=dropout)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = dropout
    return model.train()


def canonical(named, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Tensors by their layout-independent names: a model's weights (or anything shaped like them: optimizer
    moments, a weight average) with each fused projection split into its parts as row views, so that
    `layers.0.attn.wqkv.weight` becomes `layers.0.attn.wqkv.q.weight`, `.k.weight`, `.v.weight`. A
    parallelized model holds those parts as separate weights already and passes through unchanged. These
    names are what checkpoints store, so a run saved at one parallel layout resumes at any other."""
    fused = cfg.fused_parts()
    out = {}
    for name, t in named:
        prefix, _, leaf = name.rpartition(".")  # "layers.0.attn.wqkv", "weight"
        parts = fused.get(prefix.split(".", 2)[-1]) if prefix.startswith("layers.") else None
        if parts is None:
            out[name] = t
            continue
        start = 0
        for part, rows in parts:
            out[f"{prefix}.{part}.{leaf}"] = t[start : start + rows]
            start += rows
    return out


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
