"""TrainConfig: everything that defines a training run, and the named presets.

One flat dataclass (like nanoGPT's globals, but typed and saved with every
checkpoint), so a run is described by one object that `--resume` restores.
Pretraining reads the model and tokenizer fields; SFT starts from `init`
instead and reads `val_fraction`. A preset is a TrainConfig; command-line
flags replace its fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from nanoforge.errors import NanoforgeError
from nanoforge.model.config import PRESETS as MODEL_PRESETS
from nanoforge.model.config import ModelConfig

DTYPES = ("auto", "bf16", "fp32")  # what training runs in; fp16 would need loss scaling


@dataclass
class TrainConfig:
    # --- model and data (pretraining builds the model; SFT loads `init`) ---
    model: str = "tiny-llama"  # a model preset of nanoforge.model.config
    model_overrides: dict = field(default_factory=dict)  # fields replaced in that preset
    tokenizer: str = "bpe:4096"  # for raw text: char | bpe:VOCAB | a tokenizer.json / model folder
    pad_vocab: int = 64  # round the model's vocabulary up to a multiple of this (matmul-friendly); 1 = exact
    data: list[str] | None = None  # text files/folders or a prepared folder; SFT: one .json/.jsonl; None: built in
    init: str | None = None  # the model folder to start from (SFT always; pretraining instead of a preset's init)
    val_fraction: float = 0.1  # share of the data held out for validation
    epochs: float | None = None  # SFT: when set, max_steps covers this many passes over the training examples
    doc_masking: bool = True  # packed documents never attend to each other
    # --- batch ---
    batch_size: int = 16  # sequences per micro-batch
    seq_len: int | None = None  # None: the model's context length, at most DEFAULT_MAX_SEQ_LEN
    grad_accum: int = 1  # micro-batches per optimizer step
    # --- AdamW with warmup and cosine decay ---
    max_steps: int = 2000
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    lr_decay_steps: int | None = None  # None: max_steps (fixed when the run starts)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # 0: no clipping
    ema: float = 0.0  # decay of a moving average of the weights that evaluation, checkpoints and the result use; 0: off
    # --- evaluation, logging ---
    eval_interval: int = 250  # validate and checkpoint every this many steps
    eval_iters: int | None = 200  # validation batches; None: the whole split
    log_interval: int = 10  # steps between progress updates (and non-finite checks)
    # --- runtime ---
    seed: int = 1337
    device: str = "auto"
    dtype: str = "auto"  # one of DTYPES; auto: bf16 autocast on GPU, fp32 on CPU
    compile: bool | None = None  # torch.compile the model; None: on GPU only
    cuda_graph: bool | None = None  # capture the whole optimizer step in a CUDA graph; None: on GPU only
    loss_chunk: int | None = None  # fuse the LM head and cross-entropy, this many tokens at a time; None: off
    ac: str = "none"  # activation checkpointing: none, full, or N (every N-th block); train/parallel/ac.py

    def __post_init__(self):
        positive = ("batch_size", "grad_accum", "max_steps", "eval_interval", "log_interval", "pad_vocab")
        for name in positive:
            if getattr(self, name) <= 0:
                raise NanoforgeError(f"{name} must be positive, got {getattr(self, name)}", param=name)
        for name in ("seq_len", "lr_decay_steps", "eval_iters", "epochs", "loss_chunk"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise NanoforgeError(f"{name} must be positive, got {getattr(self, name)}", param=name)
        if not 0 < self.lr or not 0 <= self.min_lr <= self.lr:
            raise NanoforgeError(f"need 0 < lr and 0 <= min_lr <= lr, got lr {self.lr}, min_lr {self.min_lr}",
                                 param="lr")
        if self.warmup_steps < 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise NanoforgeError("warmup_steps, weight_decay and grad_clip must be >= 0", param="warmup_steps")
        if not 0 <= self.ema < 1:
            raise NanoforgeError(f"ema must be in [0, 1), got {self.ema}", param="ema")
        if not 0 < self.val_fraction < 1:
            raise NanoforgeError(f"val_fraction must be in (0, 1), got {self.val_fraction}", param="val_fraction")
        if self.dtype not in DTYPES:
            raise NanoforgeError(f"dtype {self.dtype!r} cannot be trained in; choose one of {', '.join(DTYPES)} "
                                 "(fp16 would need loss scaling)", param="dtype")
        from nanoforge.train.parallel.ac import ac_every

        ac_every(self.ac)  # one line naming the problem if it is none of the modes
        if self.model not in MODEL_PRESETS:
            raise NanoforgeError(f"no model preset named {self.model!r}; choose one of {', '.join(MODEL_PRESETS)}",
                                 param="model")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def replace(self, **kw) -> TrainConfig:
        return dataclasses.replace(self, **kw)


# The recipes (lr_decay_steps left at None decays over max_steps, so --max-steps shortens the
# whole schedule). nanoGPT's are copied from its config/train_shakespeare_char.py, its README's
# CPU command line, and config/train_gpt2.py (whose 5 x 8-GPU gradient accumulation becomes
# 32 micro-batches of 16 x 1024 = 524k tokens per step on one device).
PRESETS: dict[str, TrainConfig] = {
    # Sized for `nanoforge train` on 2 CPU cores with the built-in corpus: a ~2M-parameter Llama.
    "default": TrainConfig(model="tiny-llama", model_overrides=dict(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                                                                     d_ff=384, max_seq_len=256, tie_embeddings=True),
                           tokenizer="bpe:2048", batch_size=16, seq_len=128, max_steps=2000, lr=2e-3, min_lr=2e-4,
                           warmup_steps=50, eval_interval=100, eval_iters=8),
    # The first run's model on a GPU (`nanoforge serve` with no --model): the default corpus again, with a 23M
    # Llama that an H200 trains in ~25 s. It learns the documentation by heart (the loss on held-out modules is
    # lowest at step ~250 and rises after), which is what its answers after SFT are made of; on 2 CPU cores it
    # would take hours, so the CPU keeps `default`.
    "default-gpu": TrainConfig(model="tiny-llama", model_overrides=dict(d_model=512, n_layers=8, n_heads=8,
                                                                         n_kv_heads=4, d_ff=1408, max_seq_len=512,
                                                                         tie_embeddings=True, dropout=0.1),
                               tokenizer="bpe:8192", batch_size=32, seq_len=512, max_steps=1000, lr=1e-3,
                               min_lr=1e-4, warmup_steps=100, eval_interval=250, eval_iters=20, compile=False),
    # nanoGPT's recipe (train_shakespeare_char.py), plus a moving average of the weights (ema 0.995) that
    # evaluation and checkpoints use: training is unchanged, and the average scores ~0.035 lower (H200, 3 seeds
    # each: best val 1.430-1.439 against 1.460-1.476 without; --ema 0 gives nanoGPT's run back).
    # Tiny Shakespeare is one document, and nanoGPT attends causally: no document mask (it would change no
    # score, but would keep attention dropout off SDPA's flash path). No torch.compile: for this small model
    # it takes ~18 s to save 1.8 ms of a graphed step's 8.1, so it pays off only after ~10,000 steps.
    "shakespeare-char": TrainConfig(model="shakespeare-char", tokenizer="char", pad_vocab=1, doc_masking=False,
                                    batch_size=64, seq_len=256, max_steps=5000, lr=1e-3, min_lr=1e-4,
                                    warmup_steps=100, beta2=0.99, weight_decay=0.1, grad_clip=1.0, eval_interval=250,
                                    eval_iters=200, ema=0.995, compile=False),
    # nanoGPT's CPU command line (4 x 4 x 128, context 64, batch 12, 2000 iterations, no dropout) with a 5x
    # higher learning rate: nanoGPT keeps its GPU recipe's lr 1e-3 / min_lr 1e-4, but this 0.8M-parameter
    # model sees 1.5M tokens, far from overfitting, and learns faster (whole-split val loss ~1.77, not ~1.89).
    "shakespeare-char-cpu": TrainConfig(model="shakespeare-char-cpu", tokenizer="char", pad_vocab=1,
                                        doc_masking=False, batch_size=12, seq_len=64, max_steps=2000, lr=5e-3,
                                        min_lr=5e-4, warmup_steps=100, beta2=0.99, eval_interval=250, eval_iters=20),
    "gpt2-124m": TrainConfig(model="gpt2-124m", tokenizer="bpe:50257", batch_size=16, seq_len=1024, grad_accum=32,
                             max_steps=600000, lr=6e-4, min_lr=6e-5, warmup_steps=2000, beta2=0.95,
                             eval_interval=1000, eval_iters=200),
}

# Any model preset (or --init folder) without a recipe of its own trains with this one: a Llama-3-style
# schedule (AdamW beta2 0.95, peak lr 3e-4 decaying 10x, weight decay 0.1, clipping at 1), a byte-level BPE
# trained on the data, and sequences of the model's context up to DEFAULT_MAX_SEQ_LEN tokens. Flags change
# any of it (--lr, --batch-size, --seq-len, --tokenizer, ...).
GENERIC = TrainConfig(tokenizer="bpe:8192", batch_size=8, max_steps=2000, lr=3e-4, min_lr=3e-5, warmup_steps=100,
                      beta2=0.95, weight_decay=0.1, eval_interval=250, eval_iters=50)
DEFAULT_MAX_SEQ_LEN = 2048  # real models' contexts (8k-128k) are no default length for a training sequence

# Defaults of `nanoforge sft` (no preset): three passes over the examples, a gentler schedule.
SFT_DEFAULTS = TrainConfig(init="runs/pretrain", epochs=3, batch_size=8, lr=5e-4, min_lr=5e-5, warmup_steps=20,
                           weight_decay=0.0, eval_interval=50, eval_iters=16)


def sequence_length(cfg: TrainConfig, model: ModelConfig) -> int:
    """Tokens per training sequence: cfg.seq_len, else the model's context up to DEFAULT_MAX_SEQ_LEN."""
    seq_len = cfg.seq_len or min(model.max_seq_len, DEFAULT_MAX_SEQ_LEN)
    if seq_len > model.max_seq_len:
        raise NanoforgeError(f"seq_len {seq_len} is longer than the model's context ({model.max_seq_len})",
                             param="seq_len")
    return seq_len


def preset_names() -> list[str]:
    """What `train --preset` takes: the recipes above, then every other model preset (with GENERIC)."""
    return [*PRESETS, *(m for m in MODEL_PRESETS if m not in PRESETS)]


def preset(name: str, **overrides) -> TrainConfig:
    """The recipe of a training preset, or GENERIC for any other model preset."""
    if name in PRESETS:
        return PRESETS[name].replace(**overrides)
    if name in MODEL_PRESETS:
        return GENERIC.replace(model=name, **overrides)
    raise NanoforgeError(f"no training preset named {name!r}; choose one of {', '.join(preset_names())}",
                         param="preset")
