"""ModelConfig: one dataclass that describes every model nanoforge runs.

GPT-2, Llama 3 and Qwen2/Qwen3 differ in a handful of switches (how positions
enter, which norm, which MLP, where biases live, whether q and k are
normalised). `arch` names the family for checkpoint conversion; the other
fields say what the forward pass does, so one `Transformer` covers them all.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from nanoforge.errors import NanoforgeError

ARCHS = ("gpt2", "llama", "qwen2", "qwen3")


@dataclass
class ModelConfig:
    arch: str = "llama"
    vocab_size: int = 32000
    d_model: int = 512
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int | None = None  # None: same as n_heads (multi-head attention)
    head_dim: int | None = None  # None: d_model // n_heads
    d_ff: int = 1376
    max_seq_len: int = 2048
    norm_eps: float = 1e-5
    dropout: float = 0.0  # residual/embedding dropout for training small models (nanoGPT); not saved to HF
    # positions
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # Llama 3.1: {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    # family switches, derived from `arch` unless given
    tie_embeddings: bool = False
    qkv_bias: bool | None = None  # GPT-2, Qwen2: bias on q, k, v
    out_bias: bool | None = None  # GPT-2: bias on the attention output projection
    mlp_bias: bool | None = None  # GPT-2: biases in the MLP
    qk_norm: bool | None = None  # Qwen3: RMSNorm over each head of q and k
    # special tokens (for checkpoint export and generation defaults)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict = field(default_factory=dict)  # HF fields we carry through unchanged

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise NanoforgeError(f"unsupported architecture {self.arch!r}; nanoforge runs {', '.join(ARCHS)}", param="arch")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise NanoforgeError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}; give head_dim", param="head_dim")
            self.head_dim = self.d_model // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise NanoforgeError(f"n_kv_heads {self.n_kv_heads} must divide n_heads {self.n_heads}", param="n_kv_heads")
        if self.qkv_bias is None:
            self.qkv_bias = self.arch in ("gpt2", "qwen2")
        if self.out_bias is None:
            self.out_bias = self.is_gpt2
        if self.mlp_bias is None:
            self.mlp_bias = self.is_gpt2
        if self.qk_norm is None:
            self.qk_norm = self.arch == "qwen3"

    # --- what the forward pass does -------------------------------------------------
    @property
    def is_gpt2(self) -> bool:
        return self.arch == "gpt2"

    @property
    def learned_positions(self) -> bool:
        return self.is_gpt2

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def fused_parts(self) -> dict[str, list[tuple[str, int]]]:
        """The projections that one matrix computes together, by module name within a block, and the parts
        they stack along dim 0 (name, rows): q, k, v in `attn.wqkv`; gate and up in a SwiGLU `mlp.w_in`.
        Checkpoint conversion splits and joins them; tensor parallelism shards each part by itself."""
        parts = {"attn.wqkv": [("q", self.q_dim), ("k", self.kv_dim), ("v", self.kv_dim)]}
        if not self.is_gpt2:
            parts["mlp.w_in"] = [("gate", self.d_ff), ("up", self.d_ff)]
        return parts

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count from the shapes alone (no model needed)."""
        d, L = self.d_model, self.n_layers
        attn = d * (self.q_dim + 2 * self.kv_dim) + self.q_dim * d
        mlp = (2 if self.is_gpt2 else 3) * d * self.d_ff
        n = L * (attn + mlp)
        if not non_embedding:
            n += self.vocab_size * d * (1 if self.tie_embeddings else 2)
            if self.learned_positions:
                n += self.max_seq_len * d
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), PaLM appendix B: 6N + 12 L H Q T,
        N counting the output projection (the vocab matmul) but not the embedding lookups."""
        n = self.num_params() + self.vocab_size * self.d_model
        return 6 * n + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len

    # --- (de)serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise NanoforgeError(f"unknown model config fields: {', '.join(sorted(unknown))}", param="config")
        return cls(**d)

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


# --- presets ---------------------------------------------------------------------------------
# Real shapes people use, and tiny ones for tests. Vocab sizes are the real ones;
# a preset trained from scratch gets the vocab of the tokenizer it is trained with.
PRESETS: dict[str, ModelConfig] = {
    "gpt2-124m": ModelConfig(arch="gpt2", vocab_size=50257, d_model=768, n_layers=12, n_heads=12, d_ff=3072,
                             max_seq_len=1024, norm_eps=1e-5, tie_embeddings=True, bos_token_id=50256, eos_token_id=50256),
    "gpt2-350m": ModelConfig(arch="gpt2", vocab_size=50257, d_model=1024, n_layers=24, n_heads=16, d_ff=4096,
                             max_seq_len=1024, tie_embeddings=True, bos_token_id=50256, eos_token_id=50256),
    # Llama 3.2 1B: GQA 32/8, tied embeddings, Llama 3.1 RoPE scaling.
    "llama3-1b": ModelConfig(arch="llama", vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                             d_ff=8192, max_seq_len=131072, norm_eps=1e-5, rope_theta=500000.0, tie_embeddings=True,
                             rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                             bos_token_id=128000, eos_token_id=128001),
    "llama3-8b": ModelConfig(arch="llama", vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                             d_ff=14336, max_seq_len=131072, norm_eps=1e-5, rope_theta=500000.0,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                             bos_token_id=128000, eos_token_id=128001),
    # Llama 3.1 70B and 405B: shapes for the parallel-training planner (`nanoforge plan`), far beyond one GPU.
    "llama3-70b": ModelConfig(arch="llama", vocab_size=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                              d_ff=28672, max_seq_len=131072, norm_eps=1e-5, rope_theta=500000.0,
                              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                              bos_token_id=128000, eos_token_id=128001),
    "llama3-405b": ModelConfig(arch="llama", vocab_size=128256, d_model=16384, n_layers=126, n_heads=128,
                               n_kv_heads=8, d_ff=53248, max_seq_len=131072, norm_eps=1e-5, rope_theta=500000.0,
                               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                               bos_token_id=128000, eos_token_id=128001),
    "qwen2-0.5b": ModelConfig(arch="qwen2", vocab_size=151936, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2,
                              d_ff=4864, max_seq_len=32768, norm_eps=1e-6, rope_theta=1000000.0, tie_embeddings=True,
                              eos_token_id=151643),
    # Qwen3-0.6B: head_dim 128 with d_model 1024 (q_dim 2048 != d_model), q/k norm.
    "qwen3-0.6b": ModelConfig(arch="qwen3", vocab_size=151936, d_model=1024, n_layers=28, n_heads=16, n_kv_heads=8,
                              head_dim=128, d_ff=3072, max_seq_len=40960, norm_eps=1e-6, rope_theta=1000000.0,
                              tie_embeddings=True, bos_token_id=151643, eos_token_id=151645),
    # nanoGPT's baby GPT for Tiny Shakespeare (character level) and its CPU variant.
    "shakespeare-char": ModelConfig(arch="gpt2", vocab_size=65, d_model=384, n_layers=6, n_heads=6, d_ff=1536,
                                    max_seq_len=256, tie_embeddings=True, dropout=0.2),
    "shakespeare-char-cpu": ModelConfig(arch="gpt2", vocab_size=65, d_model=128, n_layers=4, n_heads=4, d_ff=512,
                                        max_seq_len=64, tie_embeddings=True),
    # Tiny shapes for tests and the offline default run.
    "tiny-gpt2": ModelConfig(arch="gpt2", vocab_size=256, d_model=64, n_layers=2, n_heads=4, d_ff=256, max_seq_len=128,
                             tie_embeddings=True),
    "tiny-llama": ModelConfig(arch="llama", vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=176,
                              max_seq_len=128, rope_theta=10000.0),
    "tiny-qwen2": ModelConfig(arch="qwen2", vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=160,
                              max_seq_len=128, norm_eps=1e-6, tie_embeddings=True),
    "tiny-qwen3": ModelConfig(arch="qwen3", vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=1,
                              head_dim=32, d_ff=160, max_seq_len=128, norm_eps=1e-6, tie_embeddings=True),
}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise NanoforgeError(f"no model preset named {name!r}; choose one of {', '.join(PRESETS)}", param="preset")
    return PRESETS[name].replace(**overrides)

