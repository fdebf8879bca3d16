"""Pretraining: tokenize the corpus, build (or resume) the model, run the loop.

The corpus is tokenized once into `<out>/data` (train.bin, val.bin, meta.json
and the tokenizer, by `nanoforge.data.prepare`), unless --data names a folder
that `nanoforge data prepare` already wrote. The model is the TrainConfig's
model preset, freshly initialised with the tokenizer's vocabulary (rounded up
to `pad_vocab`), or, with `init`, a model folder's weights and tokenizer
(continued pretraining of a Hugging Face checkpoint, say).

Under torchrun with parallel flags every rank runs `pretrain` with its
`Parallel` layout: the main rank tokenizes, every rank builds the same model
from the same seed, reads its own rows of each batch, and the layout
parallelizes the model (see `nanoforge.train.parallel`).

nanoGPT's Tiny Shakespeare results, reproduced:
    nanoforge train --preset shakespeare-char-cpu --data tinyshakespeare.txt --out runs/shakespeare-cpu
    nanoforge train --preset shakespeare-char --data tinyshakespeare.txt --out runs/shakespeare   (GPU)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from nanoforge.data.loader import PackedLoader
from nanoforge.data.prepare import make_tokenizer, prepare
from nanoforge.errors import NanoforgeError
from nanoforge.model.config import ModelConfig
from nanoforge.model.config import preset as model_preset
from nanoforge.model.hf import read_config
from nanoforge.model.transformer import Transformer
from nanoforge.runtime import pick_device
from nanoforge.tokenizer import Tokenizer
from nanoforge.train.checkpoint import load_for_training, load_state
from nanoforge.train.config import TrainConfig, sequence_length
from nanoforge.train.trainer import RunData, SingleDevice, train, use_cuda_graph

# Fields that do not change the weights' shapes or meaning.
_NOT_ARCHITECTURE = {"dropout", "bos_token_id", "eos_token_id", "extra"}


def model_config(cfg: TrainConfig, tokenizer: Tokenizer) -> ModelConfig:
    """The model a run trains: the `init` folder's, or its preset with the tokenizer's vocabulary and
    special tokens."""
    if cfg.init:
        found = read_config(cfg.init)
        if tokenizer.vocab_size > found.vocab_size:
            raise NanoforgeError(f"the data's tokenizer has {tokenizer.vocab_size} tokens but the model in "
                                 f"{cfg.init} only {found.vocab_size}; tokenize the data with the model's own "
                                 f"tokenizer", param="data")
        return found.replace(**cfg.model_overrides)
    vocab = -(-tokenizer.vocab_size // cfg.pad_vocab) * cfg.pad_vocab
    return model_preset(cfg.model, **cfg.model_overrides).replace(
        vocab_size=vocab, bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)


def check_same_architecture(expected: ModelConfig, found: ModelConfig, where: str | Path) -> None:
    differ = [f.name for f in dataclasses.fields(ModelConfig)
              if f.name not in _NOT_ARCHITECTURE and getattr(expected, f.name) != getattr(found, f.name)]
    if differ:
        shown = "; ".join(f"{n} is {getattr(found, n)!r} there, {getattr(expected, n)!r} in this run's model"
                          for n in differ[:3])
        raise NanoforgeError(f"{where} holds a checkpoint of another model: {shown}", param="preset")


def prepared_data(cfg: TrainConfig, out_dir: Path, resuming: bool) -> Path:
    """The folder with train.bin / val.bin / meta.json / tokenizer.json that this run reads."""
    if cfg.data and len(cfg.data) == 1 and (Path(cfg.data[0]) / "meta.json").is_file():
        return Path(cfg.data[0])  # already prepared
    target = out_dir / "data"
    if resuming and (target / "meta.json").is_file():
        return target
    inputs = [Path(p) for p in cfg.data] if cfg.data else None
    spec = cfg.init or cfg.tokenizer  # a model folder keeps its own tokenizer
    tokenizer = make_tokenizer(spec, inputs)
    meta = prepare(inputs, target, tokenizer, val_fraction=cfg.val_fraction)
    print(f"tokenized {', '.join(meta['sources'])} with {spec} (vocab {meta['vocab_size']:,}): "
          f"train {meta['train_tokens']:,} tokens, val {meta['val_tokens']:,} tokens, in {target}")
    return target


def pretrain(cfg: TrainConfig, out_dir: str | Path, *, resume: bool = False, layout: SingleDevice | None = None) -> dict:
    """Run (or resume, from the checkpoint in out_dir) a pretraining run; returns its summary.

    `layout`: where it runs (default: one device, cfg.device); a parallel layout's ranks all call this, and
    the main one prepares the data and writes the files."""
    out_dir = Path(out_dir)
    layout = layout or SingleDevice(pick_device(cfg.device))
    device = layout.device
    state = load_state(out_dir) if resume else None
    use_cuda_graph(device, cfg.cuda_graph, layout.name)  # refuse before anything is written
    data_dir = layout.on_main(lambda: prepared_data(cfg, out_dir, resuming=resume))
    tokenizer = Tokenizer.load(data_dir)
    expected = model_config(cfg, tokenizer)
    if state is not None:  # first: a checkpoint of another model is that, not a mismatch of its settings
        check_same_architecture(expected, read_config(out_dir), out_dir)
    seq_len = sequence_length(cfg, expected)
    if state is not None:
        model = load_for_training(out_dir, device, expected.dropout)
    elif cfg.init:
        model = load_for_training(cfg.init, device, expected.dropout)
    else:
        torch.manual_seed(cfg.seed)
        model = Transformer(expected).to(device)
    eos = json.loads((data_dir / "meta.json").read_text())["eos_id"]
    common = dict(seed=cfg.seed, eot_id=eos, doc_masking=cfg.doc_masking, shard=layout.data_shard)
    loader = PackedLoader(data_dir / "train.bin", cfg.batch_size, seq_len, **common)
    val = PackedLoader(data_dir / "val.bin", cfg.batch_size, seq_len, **common)
    if layout.is_main:
        where = f"{layout.world_size} processes ({layout.name}), {device.type}" if layout.distributed else device
        print(f"pretraining {model.num_params() / 1e6:.2f}M parameters ({cfg.init or cfg.model}) on {where}: "
              f"{cfg.batch_size} x {seq_len} tokens x {cfg.grad_accum} micro-batches per step, {cfg.max_steps} steps")
    data = RunData(loader, lambda n: val.iter_eval(cfg.batch_size, seq_len, n))
    return train(model, tokenizer, cfg, data, out_dir, layout=layout, resume=state, title="pretrain")
