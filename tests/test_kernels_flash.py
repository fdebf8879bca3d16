"""Flash attention (Triton forward and backward) against a float64 reference.

CPU tests run the kernels under TRITON_INTERPRET=1 (tests/conftest.py sets it on machines without CUDA)
with 16x16 blocks, so the ragged lengths here cut blocks and documents unevenly. Every kernel output is
allocated NaN-filled (the `poisoned` fixture), so an element a kernel fails to write fails the comparison.
`gpu` tests repeat the checks at full size in bfloat16.
"""


import pytest
import torch

from nanoforge.kernels import flash_attention as fa
from nanoforge.kernels.flash_attention import random_doc_ids
from conftest import interpreter, nan_empty, raises_bug

@pytest.fixture
def poisoned(monkeypatch):
    """Force the Triton path and make every kernel output start as NaN."""
    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")
    monkeypatch.setattr(fa, "_empty", nan_empty)


def naive_attention(q, k, v, doc_ids, causal, scale):
    """Independent float64 definition: explicit scores, explicit mask, softmax. (B, T, H, D) layout."""
    B, T, hq, d = q.shape
    k = k.repeat_interleave(hq // k.shape[2], dim=2)
    v = v.repeat_interleave(hq // v.shape[2], dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = torch.ones(B, 1, T, T, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    if doc_ids is not None:
        allowed &= (doc_ids[:, :, None] == doc_ids[:, None, :])[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("bhij,bjhd->bihd", probs, v)


def make_inputs(B, T, hq, hkv, d, dtype, gen):
    q = torch.randn(B, T, hq, d, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(B, T, hkv, d, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(B, T, hkv, d, generator=gen).to(dtype).requires_grad_()
    do = torch.randn(B, T, hq, d, generator=gen).to(dtype)
    return q, k, v, do


def fwd_bwd(fn, q, k, v, do, **kw):
    out = fn(q, k, v, **kw)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


def float64_reference(q, k, v, do, **kw):
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    return fwd_bwd(fa.attention_ref, q64, k64, v64, do.double(), **kw)


def assert_all_close(got, want, rtol, atol):
    """Elementwise |got - want| <= rtol |want| + atol * max|want|; NaN (an unwritten element) fails."""
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, name
        scale = max(1.0, w.abs().max().item())
        torch.testing.assert_close(g.double(), w, rtol=rtol, atol=atol * scale, msg=lambda m: f"{name}: {m}")


# ------------------------------------------------------------------------------ the reference itself


@pytest.mark.parametrize("causal", [True, False])
def test_reference_matches_naive_definition(causal):
    gen = torch.Generator().manual_seed(0)
    q, k, v, _ = make_inputs(2, 29, 6, 2, 8, torch.float64, gen)
    docs = random_doc_ids(2, 29, gen, max_len=40)
    for doc_ids in (None, docs):
        got = fa.attention_ref(q, k, v, doc_ids=doc_ids, causal=causal, scale=0.3)
        torch.testing.assert_close(got, naive_attention(q, k, v, doc_ids, causal, 0.3))


def test_doc_bounds_are_each_tokens_document_range():
    doc_ids = torch.tensor([[7, 7, 3, 9, 9, 9, 7], [1, 1, 1, 1, 1, 1, 1]])
    starts, ends = fa._doc_bounds_ref(doc_ids)
    assert starts.tolist() == [[0, 0, 2, 3, 3, 3, 6], [0] * 7]
    assert ends.tolist() == [[2, 2, 3, 6, 6, 6, 7], [7] * 7]


@interpreter
@pytest.mark.parametrize("T", [1, 7, 16, 45, 100])
def test_doc_bounds_kernel_matches_the_reference(T, poisoned):
    """The one-launch scan kernel (16-token blocks here, so the carry between blocks is exercised) against
    the PyTorch reference, on random documents including length 1 and one spanning the whole row."""
    gen = torch.Generator().manual_seed(T)
    doc_ids = torch.cat([random_doc_ids(3, T, gen, max_len=12), torch.zeros(1, T, dtype=torch.long)])
    got, want = fa.doc_bounds(doc_ids), fa._doc_bounds_ref(doc_ids)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ------------------------------------------------------------------------------ Triton vs float64


# (B, T, Hq, Hkv, D, causal, documents): ragged T (not a multiple of 16), GQA ratios 1, 3, 4 and 2,
# a head size that is not a power of two, and documents of random lengths including length 1.
CASES = [
    (2, 37, 4, 4, 16, True, False),
    (1, 70, 6, 2, 32, True, True),
    (2, 45, 4, 1, 16, False, False),
    (2, 70, 4, 2, 24, False, True),
    (1, 16, 2, 2, 16, True, True),
    (3, 1, 2, 1, 16, True, False),
]


@interpreter
@pytest.mark.parametrize("B,T,hq,hkv,d,causal,docs", CASES)
def test_forward_backward_match_float64(poisoned, B, T, hq, hkv, d, causal, docs):
    gen = torch.Generator().manual_seed(T * 31 + d)
    q, k, v, do = make_inputs(B, T, hq, hkv, d, torch.float32, gen)
    doc_ids = random_doc_ids(B, T, gen, max_len=40) if docs else None
    got = fwd_bwd(fa.attention, q, k, v, do, doc_ids=doc_ids, causal=causal)
    assert_all_close(got, float64_reference(q, k, v, do, doc_ids=doc_ids, causal=causal), rtol=1e-4, atol=1e-5)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(poisoned, dtype):
    gen = torch.Generator().manual_seed(5)
    q, k, v, do = make_inputs(2, 40, 4, 2, 32, dtype, gen)
    doc_ids = random_doc_ids(2, 40, gen, max_len=40)
    got = fwd_bwd(fa.attention, q, k, v, do, doc_ids=doc_ids, scale=0.2)
    assert got[0].dtype == dtype
    # half-precision inputs, and the kernel rounds probabilities to the input dtype before P @ V
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    assert_all_close(got, float64_reference(q, k, v, do, doc_ids=doc_ids, scale=0.2), rtol=4 * ulp, atol=2 * ulp)


@interpreter
def test_strided_inputs_from_a_fused_qkv_projection(poisoned):
    """q, k, v as non-contiguous views of one (B, T, Hq + 2 Hkv, D) tensor, the way a model produces them."""
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 35, 8, 16, generator=gen).requires_grad_()
    q, k, v = qkv.split([4, 2, 2], dim=2)
    do = torch.randn(2, 35, 4, 16, generator=gen)
    got = fwd_bwd(fa.attention, q, k, v, do)
    assert_all_close(got, float64_reference(q, k, v, do), rtol=1e-4, atol=1e-5)


@interpreter
@pytest.mark.filterwarnings("ignore:All-NaN slice")
@pytest.mark.parametrize("causal", [True, False])
def test_blocks_outside_the_documents_are_never_read(poisoned, causal):
    """NaN in the other documents' q, k, v, dO must not reach the middle document's outputs or gradients.

    The documents cover whole 16-token blocks, so kernels that skip out-of-document blocks never load
    the NaNs; a kernel that loads them and masks afterwards gets 0 * NaN = NaN.
    """
    gen = torch.Generator().manual_seed(4)
    q, k, v, do = make_inputs(1, 64, 2, 1, 16, torch.float32, gen)
    doc_ids = torch.tensor([[0] * 16 + [1] * 32 + [2] * 16])
    mid = slice(16, 48)
    outside = torch.ones(64, dtype=torch.bool)
    outside[mid] = False
    with torch.no_grad():
        for x in (q, k, v, do):
            x[:, outside] = float("nan")
    got = fwd_bwd(fa.attention, q, k, v, do, doc_ids=doc_ids, causal=causal)
    want = float64_reference(q[:, mid], k[:, mid], v[:, mid], do[:, mid], causal=causal)
    assert_all_close([g[:, mid] for g in got], want, rtol=1e-4, atol=1e-5)


# (B, T, Hq, Hkv, D, q_offset, Tq, causal, documents): a window of queries against the whole row's keys, as
# context parallelism runs a rank's chunks; offsets inside and across 16-token blocks, up to the row's end.
WINDOWS = [
    (2, 70, 4, 2, 16, 24, 16, True, True),
    (1, 70, 6, 2, 32, 37, 33, True, True),
    (2, 45, 4, 1, 16, 5, 20, True, False),
    (1, 64, 2, 2, 16, 0, 16, True, True),
    (2, 50, 4, 2, 24, 13, 30, False, True),
]


def test_reference_window_is_those_rows_of_the_whole_attention():
    """attention_ref with q_offset gives exactly rows q_offset.. of the whole row's attention, and their gradients."""
    gen = torch.Generator().manual_seed(1)
    q, k, v, do = make_inputs(2, 40, 4, 2, 8, torch.float64, gen)
    doc_ids = random_doc_ids(2, 40, gen, max_len=12)
    rows = slice(11, 29)
    for docs in (None, doc_ids):
        whole = fa.attention_ref(q, k, v, doc_ids=docs)
        window = fa.attention_ref(q[:, rows], k, v, doc_ids=docs, q_offset=11)
        torch.testing.assert_close(window, whole[:, rows])
        torch.testing.assert_close(window, naive_attention(q, k, v, docs, True, 8**-0.5)[:, rows])


@interpreter
@pytest.mark.parametrize("B,T,hq,hkv,d,off,tq,causal,docs", WINDOWS)
def test_query_window_forward_backward_match_float64(poisoned, B, T, hq, hkv, d, off, tq, causal, docs):
    gen = torch.Generator().manual_seed(T + off)
    q, k, v, do = make_inputs(B, T, hq, hkv, d, torch.float32, gen)
    q, do = q[:, off : off + tq].detach().requires_grad_(), do[:, off : off + tq]
    doc_ids = random_doc_ids(B, T, gen, max_len=20) if docs else None
    got = fwd_bwd(fa.attention, q, k, v, do, doc_ids=doc_ids, causal=causal, q_offset=off)
    want = float64_reference(q, k, v, do, doc_ids=doc_ids, causal=causal, q_offset=off)
    assert_all_close(got, want, rtol=1e-4, atol=1e-5)
    if causal and off + tq < T:  # keys after the window's last query get no gradient (the kernels write zeros)
        assert got[2][:, off + tq :].abs().max().item() == 0


def test_bad_shapes_raise_clear_errors():
    q = torch.randn(1, 8, 6, 16)
    with raises_bug("not a multiple of 4 kv heads"):
        fa.attention(q, torch.randn(1, 8, 4, 16), torch.randn(1, 8, 4, 16))
    with raises_bug("must both be"):
        fa.attention(q, torch.randn(1, 9, 2, 16), torch.randn(1, 9, 2, 16))
    with raises_bug("doc_ids"):
        fa.attention(q, torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16), doc_ids=torch.zeros(8, dtype=torch.long))
    with raises_bug("outside the keys"):
        fa.attention(q, torch.randn(1, 12, 2, 16), torch.randn(1, 12, 2, 16), q_offset=5)


def test_cpu_default_is_the_reference_and_differentiable(monkeypatch):
    monkeypatch.setenv("NANOFORGE_KERNELS", "auto")
    gen = torch.Generator().manual_seed(6)
    q, k, v, do = make_inputs(2, 20, 4, 2, 8, torch.float32, gen)
    doc_ids = random_doc_ids(2, 20, gen, max_len=40)
    got = fwd_bwd(fa.attention, q, k, v, do, doc_ids=doc_ids)
    assert_all_close(got, float64_reference(q, k, v, do, doc_ids=doc_ids), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------ full size on the GPU


def rel_error(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "B,T,hq,hkv,d,docs", [(4, 1024, 12, 12, 64, False), (2, 2048, 16, 4, 128, True), (2, 777, 8, 2, 64, True)]
)
def test_gpu_full_size_bf16(poisoned, B, T, hq, hkv, d, docs):
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (x.detach().cuda() for x in make_inputs(B, T, hq, hkv, d, torch.bfloat16, gen))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    doc_ids = random_doc_ids(B, T, gen, max_len=40).cuda() if docs else None
    got = fwd_bwd(fa.attention, q, k, v, do, doc_ids=doc_ids)
    want = float64_reference(q, k, v, do, doc_ids=doc_ids)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert rel_error(g, w) < 1e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("off,tq", [(512, 256), (1536, 512), (100, 700)])
def test_gpu_query_window_bf16(poisoned, off, tq):
    """Context parallelism's windows at full size: a chunk of queries against the whole row's keys, with
    documents and grouped-query heads, the compiled kernels against float64."""
    gen = torch.Generator().manual_seed(off)
    q, k, v, do = (x.detach().cuda() for x in make_inputs(2, 2048, 16, 4, 128, torch.bfloat16, gen))
    q, do = q[:, off : off + tq].contiguous().requires_grad_(), do[:, off : off + tq].contiguous()
    k, v = k.requires_grad_(), v.requires_grad_()
    doc_ids = random_doc_ids(2, 2048, gen, max_len=600).cuda()
    got = fwd_bwd(fa.attention, q, k, v, do, doc_ids=doc_ids, q_offset=off)
    want = float64_reference(q, k, v, do, doc_ids=doc_ids, q_offset=off)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert rel_error(g, w) < 1e-2, name
