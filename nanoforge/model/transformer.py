"""One Transformer for the GPT-2 / Llama 3 / Qwen2 / Qwen3 family.

Read top to bottom: norms, rotary embeddings, attention, MLP, block, model.
`ModelConfig` switches decide the family:

    GPT-2   learned positions, LayerNorm, GELU MLP, biases everywhere, tied head
    Llama 3 RoPE (+ 3.1 frequency scaling), RMSNorm, SwiGLU, GQA, no biases
    Qwen2   Llama + bias on q, k, v
    Qwen3   Llama + RMSNorm over each head of q and k (before RoPE)

Attention goes through an `AttentionBackend` (model/attention.py) passed to
`forward`, so training (dense, document-masked) and serving (paged KV cache)
run the same modules. q, k, v are projected by one fused matrix; gate and up
by another.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanoforge.errors import NanoforgeError
from nanoforge.kernels import gemv, matmul
from nanoforge.kernels.matmul import swiglu_epilogue
from nanoforge.kernels.rmsnorm import add_rms_norm, rms_norm
from nanoforge.kernels.swiglu import silu_mul
from nanoforge.model.attention import AttentionBackend, DenseAttention
from nanoforge.model.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def make_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    if cfg.is_gpt2:
        return nn.LayerNorm(dim, eps=cfg.norm_eps)
    return RMSNorm(dim, cfg.norm_eps)


# --- rotary position embeddings ----------------------------------------------------------------

def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/D), with Llama 3.1's long-context rescaling if configured."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))  # as HF computes it
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        pass
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_ctx / wavelen - low) / (high - low)).clamp(0, 1)
        inv_freq = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    else:
        raise NanoforgeError(f"unsupported rope_scaling type {kind!r}; nanoforge supports default, linear and llama3",
                             param="rope_scaling")
    return inv_freq


# --- attention and MLP -------------------------------------------------------------------------

class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.split = (cfg.q_dim, cfg.kv_dim, cfg.kv_dim)
        self.wqkv = nn.Linear(cfg.d_model, sum(self.split), bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.q_dim, cfg.d_model, bias=cfg.out_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, rope, attn: AttentionBackend):
        return self.attend(linear(x, self.wqkv), rope, attn)

    def attend(self, qkv, rope, attn: AttentionBackend):
        """The layer after its Q/K/V projection (which a decode step fuses with the norm before it)."""
        B, T, _ = qkv.shape
        q, k, v = qkv.split(self.split, dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv_heads, self.head_dim)
        v = v.view(B, T, self.n_kv_heads, self.head_dim)
        qk_norm = (self.q_norm, self.k_norm) if self.q_norm is not None else None  # Qwen3: applied by the backend
        o = attn.attend_rotary(self.layer_idx, q, k, v, rope, qk_norm)
        return self.dropout(linear(o.reshape(B, T, -1), self.wo))


class MLP(nn.Module):
    """GELU (GPT-2, tanh approximation) or SwiGLU (Llama, Qwen) with gate and up fused."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.swiglu = not cfg.is_gpt2
        self.w_in = nn.Linear(cfg.d_model, cfg.d_ff * (2 if self.swiglu else 1), bias=cfg.mlp_bias)
        self.w_out = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.mlp_bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.down(self.activate(x))

    def activate(self, x):
        """silu(gate) * up of the fused gate-and-up projection (one kernel when serving, or a decode's epilogue),
        or GELU of the input projection."""
        if self.swiglu:
            return linear(x, self.w_in, swiglu=True)
        return F.gelu(linear(x, self.w_in), approximate="tanh")

    def down(self, a):
        return self.dropout(linear(a, self.w_out))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = make_norm(cfg, cfg.d_model)
        self.attn = Attention(cfg, layer_idx)
        self.mlp_norm = make_norm(cfg, cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, attn, pending=None, *, defer: bool = False):
        """x + attention + MLP on the residual stream x. Serving runs the blocks with `defer`: a block returns
        (its residual stream after attention, its MLP's output) and the next one gets that output as `pending`
        and adds it inside its first norm, so that every residual add shares a launch with the norm after it.
        A decode step's few rows go further where the modules allow (`fuses_norms`): each residual add and norm
        runs inside the projection after it, and SwiGLU inside gate-and-up's."""
        if defer and self.fuses_norms(x):
            qkv, x = norm_linear(pending, x, self.attn_norm, self.attn.wqkv)
            a, x = norm_linear(self.attn.attend(qkv, rope, attn), x, self.mlp_norm, self.mlp.w_in, swiglu=True)
            return x, self.mlp.down(a)
        h, x = add_norm(pending, x, self.attn_norm)
        h, x = add_norm(self.attn(h, rope, attn), x, self.mlp_norm)
        m = self.mlp(h)
        return (x, m) if defer else x + m

    def fuses_norms(self, x) -> bool:
        """Whether a decode step may run this block's norms inside its projections: RMSNorm and SwiGLU, rows the
        skinny matmul takes, and modules that nothing hooks into (parallel training's do)."""
        return (self.mlp.swiglu and isinstance(self.attn_norm, RMSNorm) and isinstance(self.mlp_norm, RMSNorm)
                and type(self.attn.wqkv) is nn.Linear and type(self.mlp.w_in) is nn.Linear
                and gemv.fits(x, self.attn.wqkv.weight)
                and all(_bypassable(m, x) for m in (self, self.attn, self.mlp, self.attn_norm, self.mlp_norm,
                                                    self.attn.wqkv, self.mlp.w_in)))


def _bypassable(module: nn.Module, *tensors: torch.Tensor) -> bool:
    """Whether a serving kernel may stand in for `module` on these tensors: outside autograd and torch.compile
    (which fuse on their own), a module without hooks, plain tensors (parallel training's DTensors and
    sequence-parallel hooks take the module)."""
    return (not torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and not (module._forward_hooks or module._forward_pre_hooks)
            and all(type(t) is torch.Tensor for t in tensors))


def linear(x, layer: nn.Module, *, swiglu: bool = False):
    """layer(x), then silu(gate) * up of its two halves with `swiglu`. A decode's few rows (`kernels.gemv.fits`)
    through a bypassable nn.Linear take the fastest way for their shape (`kernels.gemv.skinny_linear`: cuBLAS or
    the skinny matmul with SwiGLU in its epilogue, measured; NANOFORGE_GEMV); tensor-parallel serving's
    row-parallel layers (not nn.Linear) never do. A prefill's rows with `swiglu` take `kernels.matmul` with SwiGLU
    in its epilogue (the (rows, 2F) product never written) where `matmul.swiglu_epilogue` says so (by default
    1,024 rows or more on a Hopper GPU); else cuBLAS, then the SwiGLU kernel."""
    if _our_linear(x, layer):
        if gemv.fits(x, layer.weight):  # a decode's few rows
            return gemv.skinny_linear(x, layer.weight, layer.bias, swiglu=swiglu)
        if swiglu and (schedule := swiglu_epilogue(x)):  # a prefill's rows: one GEMM
            return matmul.linear(x, layer.weight, layer.bias, activation="swiglu", schedule=schedule)
    y = layer(x)
    return silu_mul(y) if swiglu else y


def _our_linear(x, layer: nn.Module) -> bool:
    """Whether our kernels may stand in for `layer` on x: a plain nn.Linear, bypassable."""
    return type(layer) is nn.Linear and _bypassable(layer, x, layer.weight.data)


def norm_linear(a, x, norm: RMSNorm, layer: nn.Linear, *, swiglu: bool = False):
    """(linear(norm(x + a), layer), x + a) for a decode's rows (`Block.fuses_norms`): the add, the norm, the
    projection (and SwiGLU) in one launch where that is the faster way for the shape (`kernels.gemv.norm_linear`)."""
    return gemv.norm_linear(a, x, norm.weight, norm.eps, layer.weight, layer.bias, swiglu=swiglu)


def add_norm(a, x, norm: nn.Module):
    """(norm(x + a), x + a), or (norm(x), x) without `a`; one launch (kernels/rmsnorm.py) for a bypassable
    RMSNorm with one dtype (autocast training keeps an fp32 residual stream)."""
    if a is None:
        return norm(x), x
    if isinstance(norm, RMSNorm) and a.dtype == x.dtype and _bypassable(norm, a, x, norm.weight.data):
        return add_rms_norm(a, x, norm.weight, norm.eps)
    x = x + a
    return norm(x), x


# --- the model ---------------------------------------------------------------------------------

class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.learned_positions else None
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = make_norm(cfg, cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("inv_freq", None if cfg.learned_positions else rope_inv_freq(cfg), persistent=False)
        self.apply(self._init_weights)
        # GPT-2's scaled init: residual projections get std / sqrt(2 * n_layers).
        for name, p in self.named_parameters():
            if name.endswith(("attn.wo.weight", "mlp.w_out.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init_weights(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def reset_buffers(self, device=None) -> None:
        """Recompute non-persistent buffers (after building on the meta device and loading weights)."""
        if not self.cfg.learned_positions:
            self.inv_freq = rope_inv_freq(self.cfg).to(device or self.embed.weight.device)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos and sin of shape (B, T, 1, D) for the given positions, computed in fp32 then cast."""
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attn: AttentionBackend | None = None, *, return_hidden: bool = False, rope=None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids and positions (B, T); returns logits (B, T, V), or the final hidden states.

        Without `positions`, tokens are at 0..T-1; without `attn`, plain causal attention. `rope`: the positions'
        (cos, sin), and `inputs_embeds` (B, T, D): `embed_inputs`'s result, where the caller has them (the serving
        engine gathers both in one kernel with its tokens).
        """
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        if attn is None:
            attn = DenseAttention()
        x = self.embed_inputs(input_ids, positions) if inputs_embeds is None else self.drop(inputs_embeds)
        if rope is None:
            rope = self.rotary(positions, x.dtype)
        defer, pending = not torch.is_grad_enabled(), None  # serving: each residual add fused with the next norm
        ran = attn.run_layers(x, rope) if defer else None  # a backend that runs every layer at once, where it can
        if ran is not None:
            x, pending = ran
        elif defer:
            for layer in self.layers:
                x, pending = layer(x, rope, attn, pending, defer=True)
        else:
            for layer in self.layers:
                x = layer(x, rope, attn)
        x = add_norm(pending, x, self.norm)[0]
        return x if return_hidden else self.lm_head(x)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The LM head on final hidden states (rows, d_model), into `out` if given. A decode's few rows take the
        faster way for the shape, as the projections do (`linear`): at one row the head is the largest matrix a
        step reads (Llama-3.2-1B's 525 MB of 2.47 GB, Qwen3-0.6B's 311 MB of 1.19 GB)."""
        if _our_linear(hidden, self.lm_head) and gemv.fits(hidden, self.lm_head.weight):
            return gemv.skinny_linear(hidden, self.lm_head.weight, out=out)
        return torch.matmul(hidden, self.lm_head.weight.t(), out=out)

    # The forward pass in pieces, for a pipeline stage that runs only some of them.
    def embed_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token embeddings (plus learned position embeddings, GPT-2), after dropout: the residual stream."""
        x = self.embed(input_ids)
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        return self.drop(x)

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype):
        """What attention rotates q and k by: RoPE's (cos, sin), or None for learned positions."""
        return None if self.pos_embed is not None else self.rope(positions, dtype)

    def rope_table(self, n: int, dtype: torch.dtype) -> torch.Tensor | None:
        """(n, 2, D): the cos and sin of positions 0..n-1, element for element as `rope` computes them, for a
        caller that indexes them every step instead (one gather where the formula takes ~7 small kernels);
        None for learned positions."""
        if self.pos_embed is not None:
            return None
        cos, sin = self.rope(torch.arange(n, device=self.inv_freq.device)[None], dtype)
        return torch.stack((cos[0, :, 0], sin[0, :, 0]), dim=1)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
