"""RoPE (kernels/rope.py): the Triton kernel rotates q and k, strided views of a fused projection, as the
PyTorch reference does; the reference is the rotation by the position's angle (checked in float64 against
complex multiplication); autograd and compiled code keep the reference."""

from __future__ import annotations

import pytest
import torch

from conftest import interpreter
from nanoforge.kernels import rope
from nanoforge.kernels.rope import apply_rope, apply_rope_ref
from nanoforge.model.config import preset
from nanoforge.model.transformer import Transformer


def angles(B, T, D, dtype, offset=0):
    """cos and sin (B, T, 1, D) as the model computes them, for a model whose heads have D dims."""
    model = Transformer(preset("tiny-llama", max_seq_len=8192, d_model=4 * D, n_heads=4, n_kv_heads=2, head_dim=D))
    pos = torch.arange(offset, offset + T).expand(B, T)
    return model.rope(pos, dtype)


def test_reference_is_a_rotation_of_each_pair():
    B, T, H, D = 2, 5, 3, 16
    x = torch.randn(B, T, H, D, dtype=torch.float64)
    cos, sin = angles(B, T, D, torch.float64)
    got = apply_rope_ref(x, cos, sin)
    z = torch.complex(x[..., :D // 2], x[..., D // 2:])  # pair (i, i + D/2) as one complex number
    theta = torch.atan2(sin[..., :D // 2], cos[..., :D // 2])
    want = z * torch.polar(torch.ones_like(theta), theta)
    assert torch.allclose(got, torch.cat((want.real, want.imag), dim=-1), atol=1e-12)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_rotates_strided_q_and_k_as_the_reference(dtype, monkeypatch):
    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")
    B, T, H, Hkv, D = 2, 3, 4, 2, 16
    qkv = torch.randn(B, T, (H + 2 * Hkv) * D).to(dtype)
    q = qkv[..., :H * D].view(B, T, H, D)  # views with the fused row's stride, as Attention.forward makes them
    k = qkv[..., H * D:(H + Hkv) * D].view(B, T, Hkv, D)
    cos, sin = angles(B, T, D, dtype, offset=1000)
    for x in (q, k):
        got = apply_rope(x, cos, sin)
        want = apply_rope_ref(x, cos, sin)
        assert got.dtype == dtype and got.shape == x.shape
        if dtype == torch.float32:
            assert torch.equal(got, want)
        else:  # the interpreter truncates where the GPU rounds: one ulp (the GPU test asks for equality)
            ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
            assert torch.allclose(got.float(), want.float(), rtol=2 * ulp, atol=2 * ulp)
    # one position broadcast over the batch (cos of batch 1)
    c1, s1 = angles(1, T, D, dtype)
    assert torch.allclose(apply_rope(q, c1, s1).float(), apply_rope_ref(q, c1, s1).float(), rtol=1e-2, atol=1e-2)


@interpreter
def test_autograd_keeps_the_reference(monkeypatch):
    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")
    x = torch.randn(1, 2, 2, 8, requires_grad=True)
    cos, sin = angles(1, 2, 8, torch.float32)
    assert not rope._fast(x, cos, sin)
    apply_rope(x, cos, sin).sum().backward()
    assert x.grad is not None
    with torch.no_grad():
        assert rope._fast(x, cos, sin)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_kernel_equals_the_reference_bit_for_bit(dtype):
    B, T, H, D = 1, 7, 32, 128
    qkv = torch.randn(B, T, 48 * D, device="cuda").to(dtype)
    q = qkv[..., :H * D].view(B, T, H, D)
    cos, sin = (t.cuda() for t in angles(B, T, D, dtype, offset=4000))
    with torch.no_grad():
        assert torch.equal(apply_rope(q, cos, sin), apply_rope_ref(q, cos, sin))


@interpreter
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_serving_forward_with_fused_kernels_is_the_training_forward(name, monkeypatch):
    """No gradient: RoPE in one kernel and the residual add fused into the MLP's RMSNorm (Triton, interpreted);
    with gradients: the reference ops. The logits agree."""
    torch.manual_seed(0)
    model = Transformer(preset(name)).eval()
    ids = torch.randint(0, 256, (2, 9))
    want = model(ids)
    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")
    with torch.no_grad():
        got = model(ids)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_kv_write_in_one_kernel_fill_the_cache_as_the_reference(dtype, monkeypatch):
    from nanoforge.kernels.paged_attention import write_kv
    from nanoforge.kernels.rope import apply_rope_and_write_kv

    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")
    N, H, Hkv, D, blocks, bs = 5, 4, 2, 16, 6, 4
    qkv = torch.randn(N, (H + 2 * Hkv) * D).to(dtype)
    k = qkv[:, H * D:(H + Hkv) * D].view(N, Hkv, D)  # strided views, as the engine's step has them
    v = qkv[:, (H + Hkv) * D:].view(N, Hkv, D)
    cos, sin = (t[0] for t in angles(1, N, D, dtype, offset=37))
    slots = torch.tensor([3, 9, 10, 22, 0])
    caches = [torch.full((blocks, bs, Hkv, D), float("nan"), dtype=dtype) for _ in range(4)]
    apply_rope_and_write_kv(k, v, cos, sin, caches[0], caches[1], slots)
    write_kv(apply_rope_ref(k[None], cos[None], sin[None])[0], v, caches[2], caches[3], slots)
    flat = [c.view(-1, Hkv, D) for c in caches]
    assert torch.equal(flat[1][slots], flat[3][slots])  # V copied unchanged
    if dtype == torch.float32:
        assert torch.equal(flat[0][slots], flat[2][slots])
    else:  # the interpreter truncates where the GPU rounds
        assert torch.allclose(flat[0][slots].float(), flat[2][slots].float(), rtol=2 ** -6, atol=2 ** -6)
    untouched = torch.ones(blocks * bs, dtype=torch.bool)
    untouched[slots] = False
    assert flat[0][untouched].isnan().all() and flat[1][untouched].isnan().all()  # nothing else written


@interpreter
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_and_kv_write_in_one_kernel_equal_the_parts(dtype, norm, monkeypatch):
    """`rope_qkv_and_write_kv`: Qwen3's per-head q/k RMSNorm, RoPE of q and k and the paged KV write in one
    launch give what the reference parts give (rms_norm_ref per head, apply_rope_ref, write_kv), reading q, k
    and v as strided views of the fused projection and writing nothing but the tokens' slots."""
    from nanoforge.kernels.paged_attention import write_kv
    from nanoforge.kernels.rmsnorm import rms_norm_ref
    from nanoforge.kernels.rope import rope_qkv_and_write_kv
    from nanoforge.model.transformer import RMSNorm

    N, H, Hkv, D, blocks, bs = 5, 6, 2, 16, 6, 4
    torch.manual_seed(1)
    qkv = (3 * torch.randn(N, (H + 2 * Hkv) * D)).to(dtype)
    q = qkv[:, :H * D].view(N, H, D)
    k = qkv[:, H * D:(H + Hkv) * D].view(N, Hkv, D)
    v = qkv[:, (H + Hkv) * D:].view(N, Hkv, D)
    cos, sin = (t[0] for t in angles(1, N, D, dtype, offset=37))
    slots = torch.tensor([3, 9, 10, 22, 0])
    qk_norm = None
    if norm:
        qk_norm = (RMSNorm(D, 0.5), RMSNorm(D, 0.5))  # an eps large enough to matter
        with torch.no_grad():
            for m in qk_norm:
                m.weight.copy_(torch.rand(D) + 0.5)
                m.to(dtype)
    caches = [torch.full((blocks, bs, Hkv, D), float("nan"), dtype=dtype) for _ in range(4)]
    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")
    with torch.no_grad():
        got = rope_qkv_and_write_kv(q, k, v, cos, sin, caches[0], caches[1], slots, qk_norm)
    monkeypatch.setenv("NANOFORGE_KERNELS", "torch")
    with torch.no_grad():
        qn, kn = (rms_norm_ref(q, qk_norm[0].weight, 0.5), rms_norm_ref(k, qk_norm[1].weight, 0.5)) if norm \
            else (q, k)
        want = apply_rope_ref(qn[None], cos[None], sin[None])[0]
        write_kv(apply_rope_ref(kn[None], cos[None], sin[None])[0], v, caches[2], caches[3], slots)
    flat = [c.view(-1, Hkv, D) for c in caches]
    assert torch.equal(flat[1][slots], flat[3][slots])  # V copied unchanged
    if dtype == torch.float32:  # the norm's sum in another order: the last bits
        tol = dict(rtol=1e-5, atol=1e-5) if norm else dict(rtol=0, atol=0)
    else:  # the interpreter truncates where the GPU rounds, and a norm rounds once more before the rotation
        tol = dict(rtol=2 ** -5, atol=2 ** -5)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    torch.testing.assert_close(flat[0][slots].float(), flat[2][slots].float(), **tol)
    untouched = torch.ones(blocks * bs, dtype=torch.bool)
    untouched[slots] = False
    assert flat[0][untouched].isnan().all() and flat[1][untouched].isnan().all()  # nothing else written
