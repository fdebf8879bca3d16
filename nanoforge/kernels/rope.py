"""Rotary position embeddings: rotate the pairs (i, i + D/2) of each head by the position's angles (HF layout).

`apply_rope(x, cos, sin)`: x (B, T, H, D), cos and sin (B, T, 1, D) (the angles' halves duplicated, broadcast
over heads). The reference is the textbook `x * cos + rotate_half(x) * sin`, rounded once to x's dtype; with x in
bf16 and cos in fp32 (autocast) it computes in fp32.

The Triton kernel does one token's every head in one program, reading x through its strides (q and k are
views into the fused qkv projection), where the reference launches about six kernels: it matters when a decode
step is a chain of small launches. It rounds each product and the sum to x's dtype as PyTorch's elementwise
ops do, so its result is the reference's bit for bit (x, cos and sin of one dtype). That needs fp fusion off:
with it, Triton turns the rounded product and the difference into one bf16 FMA (one rounding fewer; seen in
the sm_90 PTX and as 1-ulp differences on the H200). It runs only outside
autograd and torch.compile (serving); training and compiled code see the reference, which they fuse themselves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoforge.kernels import pdl
from nanoforge.kernels.dispatch import use_fast

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope_ref(x, cos, sin):
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, D) rotated by cos, sin (B, T, 1, D); the result has x's dtype (contiguous from the kernel)."""
    if not _fast(x, cos, sin):
        return apply_rope_ref(x, cos, sin)
    B, T, H, D = x.shape
    cos, sin = cos.expand(B, T, 1, D), sin.expand(B, T, 1, D)
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.stride() != sin.stride():
        x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    out = torch.empty(B, T, H, D, device=x.device, dtype=x.dtype)
    _rope_kernel[(B * T,)](x, cos, sin, out, T, H, x.stride(0), x.stride(1), x.stride(2), cos.stride(0),
                           cos.stride(1), HALF=D // 2, BLOCK_H=triton.next_power_of_2(H),
                           BLOCK_D=triton.next_power_of_2(D // 2), enable_fp_fusion=False)
    return out


def _fast(x, cos, sin) -> bool:
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad)):
        return False
    return (use_fast(x, cos, sin) and x.dim() == 4 and x.dtype in _DTYPES and cos.dtype == sin.dtype == x.dtype
            and x.shape[-1] % 2 == 0 and cos.shape[2] == 1 and cos.shape[-1] == x.shape[-1] and x.numel() > 0)


@triton.jit(do_not_specialize=["T", "sxb", "scb"])  # per-step token counts: no variant per value class
def _rope_kernel(X, COS, SIN, OUT, T, H, sxb, sxt, sxh, scb, sct, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """Token pid = b * T + t, all its heads: out1 = x1 c1 - x2 s1, out2 = x2 c2 + x1 s2, each product and the sum
    rounded to the output's dtype (as x * cos + rotate_half(x) * sin is in PyTorch)."""
    pid = tl.program_id(0)
    b = (pid // T).to(tl.int64)
    t = (pid % T).to(tl.int64)
    c1, c2, s1, s2 = _angles(COS, SIN, b * scb + t * sct, HALF, BLOCK_D)
    o1, o2, hs, ds, m = _norm_rope_heads(X + b * sxb + t * sxt, sxh, X, H, c1, c2, s1, s2, 0.0, OUT.dtype.element_ty,
                                         HALF, BLOCK_H, BLOCK_D, False)
    op = OUT + pid.to(tl.int64) * H * 2 * HALF + hs * (2 * HALF) + ds
    tl.store(op, o1, mask=m)
    tl.store(op + HALF, o2, mask=m)


def apply_rope_and_write_kv(k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Rotate k (N, Hkv, D) by cos, sin (N, 1, D) and store it and v at `slot_mapping` (N,) of the paged caches
    (num_blocks, block_size, Hkv, D): `write_kv(apply_rope(k), v, ...)` in one launch where that takes about
    eight (`rope_qkv_and_write_kv`'s kernel without q)."""
    from nanoforge.kernels.paged_attention import write_kv

    if not _kv_write_fused(k, v, cos, sin, k_cache, v_cache, slot_mapping):
        return write_kv(apply_rope(k[None], cos[None], sin[None])[0], v, k_cache, v_cache, slot_mapping)
    _launch_qkv(None, k, v, cos, sin, k_cache, v_cache, slot_mapping)


def rope_qkv_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          qk_norm=None) -> torch.Tensor:
    """The engine's whole step from projections to cache: q (N, Hq, D), k and v (N, Hkv, D), each head of q and k
    first normalised by `qk_norm` = (q_norm, k_norm) (RMSNorm modules: Qwen3) if given, then q and k rotated by
    cos, sin (N, 1, D); K and V stored at `slot_mapping` of the paged caches. Returns the rotated q (N, Hq, D).
    One launch where the parts take four (Qwen3) or two: a decode step is a chain of small launches."""
    qn, kn = qk_norm if qk_norm is not None else (None, None)
    if not qkv_fused(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, qk_norm):
        if qn is not None:
            q, k = qn(q), kn(k)
        apply_rope_and_write_kv(k, v, cos, sin, k_cache, v_cache, slot_mapping)
        return apply_rope(q[None], cos[None], sin[None])[0]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    _launch_qkv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, out, qk_norm)
    return out


def qkv_fused(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, qk_norm=None) -> bool:
    """Whether a fused kernel takes these operands of `rope_qkv_and_write_kv` (its own, or paged attention's
    `rope_write_and_attend`)."""
    qn, kn = qk_norm if qk_norm is not None else (None, None)
    return (_kv_write_fused(k, v, cos, sin, k_cache, v_cache, slot_mapping) and _fast(q[None], cos[None], sin[None])
            and q.dtype == k.dtype and q.shape[-1] == k.shape[-1] and q.stride(-1) == 1
            and (qn is None or (qn.weight.shape == kn.weight.shape == q.shape[-1:] and qn.eps == kn.eps
                                and qn.weight.is_contiguous() and kn.weight.is_contiguous()
                                and use_fast(qn.weight, kn.weight))))


def _kv_write_fused(k, v, cos, sin, k_cache, v_cache, slot_mapping) -> bool:
    """Whether the fused kernel takes these K/V operands (else the reference parts run)."""
    return (_fast(k[None], cos[None], sin[None]) and v.shape == k.shape and k_cache.dtype == v_cache.dtype == k.dtype
            and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[2:] == k.shape[1:]
            and k.stride(-1) == v.stride(-1) == 1 and cos.stride(-1) == sin.stride(-1) == 1
            and cos.stride() == sin.stride() and slot_mapping.shape == k.shape[:1])


def _launch_qkv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, out=None, qk_norm=None) -> None:
    """One program per token: q (if given) normalised (if qk_norm) and rotated into `out`; k likewise and v into
    their cache slots."""
    N, Hkv, D = k.shape
    has_q, norm = q is not None, qk_norm is not None
    qs = q if has_q else k  # without q, any tensor: never read
    qw, kw, eps = (qk_norm[0].weight, qk_norm[1].weight, float(qk_norm[0].eps)) if norm else (qs, k, 0.0)
    hq = q.shape[1] if has_q else 0
    on = pdl.enabled(k)
    _qkv_rope_write_kv_kernel[(N,)](
        qs, k, v, cos, sin, qw, kw, out if has_q else k, k_cache, v_cache,
        slot_mapping, hq, Hkv, qs.stride(0), qs.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), eps,
        HALF=D // 2, BLOCK_HQ=triton.next_power_of_2(max(hq, 1)), BLOCK_HKV=triton.next_power_of_2(Hkv),
        BLOCK_D=triton.next_power_of_2(D // 2), HAS_Q=has_q, HAS_NORM=norm, PDL=on, enable_fp_fusion=False,
        launch_pdl=bool(on),
    )  # fmt: skip


@triton.jit
def _angles(COS, SIN, off, HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    """A token's cos and sin halves (at `off`), in fp32, as (1, BLOCK_D) rows."""
    ds = tl.arange(0, BLOCK_D)[None, :]
    dm = ds < HALF
    c1 = tl.load(COS + off + ds, mask=dm, other=0.0).to(tl.float32)
    c2 = tl.load(COS + off + ds + HALF, mask=dm, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + off + ds, mask=dm, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + off + ds + HALF, mask=dm, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def _norm_rope_heads(X, sxh, W, H, c1, c2, s1, s2, eps, ty: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr):
    """One token's H heads at X (head stride sxh): RMSNorm over each head with weight W (as `rms_norm`'s kernel:
    x * rstd * w in fp32, rounded to ty) if HAS_NORM, then rotated: out1 = x1 c1 - x2 s1, out2 = x2 c2 + x1 s2,
    each product and the sum rounded to ty (as x * cos + rotate_half(x) * sin is in PyTorch). The one rotation
    every RoPE kernel here runs; returns the halves, the head and dim offsets and the mask."""
    hs = tl.arange(0, BLOCK_H)[:, None]
    ds = tl.arange(0, BLOCK_D)[None, :]
    m = (hs < H) & (ds < HALF)
    x1 = tl.load(X + hs * sxh + ds, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(X + hs * sxh + ds + HALF, mask=m, other=0.0).to(tl.float32)
    if HAS_NORM:
        r = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(W + ds, mask=ds < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(W + ds + HALF, mask=ds < HALF, other=0.0).to(tl.float32)
        x1 = (x1 * r * w1).to(ty).to(tl.float32)
        x2 = (x2 * r * w2).to(ty).to(tl.float32)
    o1 = ((x1 * c1).to(ty).to(tl.float32) - (x2 * s1).to(ty).to(tl.float32)).to(ty)
    o2 = ((x2 * c2).to(ty).to(tl.float32) + (x1 * s2).to(ty).to(tl.float32)).to(ty)
    return o1, o2, hs, ds, m


@triton.jit
def _qkv_rope_write_kv_kernel(Q, K, V, COS, SIN, QW, KW, QO, KC, VC, SLOTS, HQ, HKV, sqt, sqh, skt, skh, svt, svh,
                              sct, eps, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
                              BLOCK_D: tl.constexpr, HAS_Q: tl.constexpr, HAS_NORM: tl.constexpr,
                              PDL: tl.constexpr):
    """Token t: its q heads (normalised, rotated) to QO[t] if HAS_Q; its k heads (normalised, rotated) and v heads
    to cache slot SLOTS[t]."""
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    ty = KC.dtype.element_ty
    c1, c2, s1, s2 = _angles(COS, SIN, t * sct, HALF, BLOCK_D)
    if HAS_Q:
        o1, o2, hs, ds, m = _norm_rope_heads(Q + t * sqt, sqh, QW, HQ, c1, c2, s1, s2, eps, ty, HALF, BLOCK_HQ,
                                             BLOCK_D, HAS_NORM)
        qo = QO + t * HQ * 2 * HALF + hs * (2 * HALF) + ds
        tl.store(qo, o1, mask=m)
        tl.store(qo + HALF, o2, mask=m)
    slot = tl.load(SLOTS + t).to(tl.int64)
    o1, o2, hs, ds, m = _norm_rope_heads(K + t * skt, skh, KW, HKV, c1, c2, s1, s2, eps, ty, HALF, BLOCK_HKV, BLOCK_D,
                                         HAS_NORM)
    base = slot * HKV * 2 * HALF + hs * (2 * HALF) + ds
    tl.store(KC + base, o1, mask=m)
    tl.store(KC + base + HALF, o2, mask=m)
    vp = V + t * svt + hs * svh + ds
    tl.store(VC + base, tl.load(vp, mask=m, other=0.0), mask=m)
    tl.store(VC + base + HALF, tl.load(vp + HALF, mask=m, other=0.0), mask=m)
