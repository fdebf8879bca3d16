"""A batch-1 decode step's layers in one launch (`kernels/decode_layers.py`), where the model allows it.

NANOFORGE_DECODE_LAYERS picks how a decode step of one sequence runs the model's layers: `kernels` (layer by
layer, each projection the faster of cuBLAS and the skinny matmul, `Block.forward`), `persistent` (one persistent
kernel for all of them) or `auto` (the default on a GPU since session 42; `kernels` elsewhere, where the kernel
runs interpreted: the engine times its batch-1 decode step each way when it starts, the kernel also with its
weights through a shared-memory ring, and keeps the fastest: `ModelRunner._choose_decode_layers`). The kernel
runs the Llama / Qwen2 / Qwen3 families: RMSNorm, rotary positions, SwiGLU, biases only on Q/K/V, plain
`nn.Linear` layers (not tensor-parallel ones).
Steps of more than one token (prefill, mixed, a batch of decodes) always run layer by layer.

The kernel indexes each kind of weight by layer, so `LayerKernel` stacks them once: every layer's tensor becomes
a view into one (L, ...) tensor (the model's parameters keep their values and their modules, and the memory
is not doubled, except for one kind at a time while it is copied).
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from nanoforge.kernels.decode_layers import Layers, barrier_timeouts, decode_layers
from nanoforge.kernels.dispatch import env_choice, use_fast
from nanoforge.model.transformer import RMSNorm, Transformer

AUTO_RING = 3  # the stages of the weight rings `auto` times the kernel with (where NANOFORGE_DECODE_RING is unset)
# the ways `auto` times, in the order it names them, each (its words, its weight ring: the kernel's `ring`,
# `ring_on`): the kernel; with the ring on every projection, on gate-and-up alone; layer by layer
WAYS = {"persistent": ("persistent kernel", None),
        f"persistent_ring{AUTO_RING}": (f"with a {AUTO_RING}-stage weight ring", (AUTO_RING, "all")),
        f"persistent_ring{AUTO_RING}_gate_up": ("with it on gate-and-up alone", (AUTO_RING, "gate_up")),
        "kernels": ("kernel by kernel", None)}


def mode(device: torch.device | None = None) -> str:
    """NANOFORGE_DECODE_LAYERS; unset, `auto` on a CUDA device and `kernels` elsewhere (on the CPU the kernel
    runs interpreted: tests ask for it)."""
    if "NANOFORGE_DECODE_LAYERS" not in os.environ:
        return "auto" if device is not None and device.type == "cuda" else "kernels"
    return env_choice("NANOFORGE_DECODE_LAYERS", ("kernels", "persistent", "auto"))


def describe(choice: dict) -> str:
    """What NANOFORGE_DECODE_LAYERS=auto chose (`ModelRunner.decode_layers`), in words, with each way's time."""
    tagged = " with tagged vectors" if choice.get("tagged") else ""
    times = ", ".join(f"{label}{tagged if way == 'persistent' else ''} {choice[f'{way}_us']:,.0f} us"
                      for way, (label, _) in WAYS.items() if f"{way}_us" in choice)
    return f"{choice['chosen']} ({times})"


def supported(model: Transformer) -> bool:
    """Whether the persistent kernel can run this model's layers (on this device and dtype)."""
    cfg = model.cfg
    w = model.layers[0].attn.wqkv.weight
    return (not cfg.learned_positions and not cfg.out_bias and not cfg.mlp_bias
            and w.dtype in (torch.float16, torch.bfloat16, torch.float32) and use_fast(w)
            and all(b.mlp.swiglu and isinstance(b.attn_norm, RMSNorm) and isinstance(b.mlp_norm, RMSNorm)
                    and all(type(m) is nn.Linear for m in (b.attn.wqkv, b.attn.wo, b.mlp.w_in, b.mlp.w_out))
                    for b in model.layers))


def _stack(params: list[nn.Parameter]) -> torch.Tensor:
    """One (L, ...) tensor holding the parameters' values; each parameter re-pointed at its slice."""
    stacked = torch.stack([p.data for p in params])
    for i, p in enumerate(params):
        p.data = stacked[i]
    return stacked


class LayerKernel:
    """The model's layers as the persistent kernel takes them; called by the paged attention backend with a
    decode step of one token."""

    def __init__(self, model: Transformer):
        blocks, cfg = model.layers, model.cfg
        with torch.no_grad():
            self.layers = Layers(
                attn_norm=_stack([b.attn_norm.weight for b in blocks]),
                wqkv=_stack([b.attn.wqkv.weight for b in blocks]),
                bqkv=_stack([b.attn.wqkv.bias for b in blocks]) if cfg.qkv_bias else None,
                q_norm=_stack([b.attn.q_norm.weight for b in blocks]) if cfg.qk_norm else None,
                k_norm=_stack([b.attn.k_norm.weight for b in blocks]) if cfg.qk_norm else None,
                wo=_stack([b.attn.wo.weight for b in blocks]),
                mlp_norm=_stack([b.mlp_norm.weight for b in blocks]),
                w_in=_stack([b.mlp.w_in.weight for b in blocks]),
                w_out=_stack([b.mlp.w_out.weight for b in blocks]),
                n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, eps=cfg.norm_eps)
        self.ring: tuple[int, str] | None = None  # the weight ring's stages and projections (None: the
        # environment's, NANOFORGE_DECODE_RING and _RING_ON); `auto` sets it

    def __call__(self, x: torch.Tensor, rope, k_cache, v_cache, block_tables, seq_lens, slot_mapping):
        """x (1, 1, D) of one token; rope its (cos, sin) views; the rest the paged backend's: (x, pending)."""
        cos, sin = (r.reshape(-1) for r in rope)
        d = cos.numel()
        if sin.data_ptr() == cos.data_ptr() + d * cos.element_size() and cos.stride(-1) == 1:
            cos_sin = cos.as_strided((2, d), (d, 1))  # the engine's RoPE table row: cos then sin
        else:
            cos_sin = torch.stack((cos, sin))
        ring, ring_on = self.ring or (None, None)
        x, pending = decode_layers(self.layers, x[0], cos_sin, k_cache, v_cache, block_tables[0], seq_lens,
                                   slot_mapping, ring=ring, ring_on=ring_on)
        return x[None], pending[None]

    def check(self, device: torch.device) -> None:
        """Raise if a launch on this device gave up waiting at a barrier, or for a tagged vector, since the last
        check (it syncs): a launch whose programs were not all resident at once, whose numbers are wrong. The
        engine checks after its warm-up, which runs the kernel."""
        n = barrier_timeouts(device)
        if n:
            raise RuntimeError(
                f"the persistent decode kernel gave up waiting {n} time(s) on {device} (at a grid barrier, or for a "
                "vector another program writes): its programs were not all running at once (a bug, or another kernel "
                "holding SMs), so its results are wrong; NANOFORGE_DECODE_LAYERS=kernels runs the layers one by one")
