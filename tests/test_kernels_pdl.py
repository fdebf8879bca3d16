"""Programmatic dependent launch (kernels/pdl.py): the switch, and on a GPU that the decode chain's kernels
launched with it compute exactly what they compute without it, replayed from a CUDA graph as the engine runs
them (a kernel that touched memory before waiting on its predecessor would race and differ)."""

import pytest
import torch

from nanoforge.errors import NanoforgeError
from nanoforge.kernels import pdl


def test_a_bad_setting_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("NANOFORGE_PDL", "yes")
    with pytest.raises(NanoforgeError, match="NANOFORGE_PDL must be auto, 1 or 0, not 'yes'"):
        pdl.enabled(torch.zeros(1))


@pytest.mark.parametrize("setting", ["auto", "1", "0"])
def test_never_on_the_cpu(monkeypatch, setting):
    monkeypatch.setenv("NANOFORGE_PDL", setting)
    assert pdl.enabled(torch.zeros(1)) == pdl.OFF


@pytest.mark.gpu
def test_gpu_the_decode_chain_with_pdl_equals_it_without(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (runs on the H200 machine)")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    from nanoforge.kernels import gemv as gv
    from nanoforge.kernels.rmsnorm import add_rms_norm
    from nanoforge.kernels.swiglu import silu_mul

    gen = torch.Generator(device="cuda").manual_seed(0)
    d, ff, layers = 1024, 3072, 8
    ws = [[(torch.randn(n, k, generator=gen, device="cuda") / k**0.5).bfloat16() for n, k in
           ((d, d), (2 * ff, d), (d, ff))] for _ in range(layers)]
    g = (1 + 0.1 * torch.randn(d, generator=gen, device="cuda")).bfloat16()
    x0 = torch.randn(1, d, generator=gen, device="cuda").bfloat16()

    def chain():
        x, p = x0, torch.zeros_like(x0)
        for w_qkv, w_in, w_out in ws:
            qkv, x = gv.norm_gemv(p, x, g, 1e-6, w_qkv)
            h, x = add_rms_norm(qkv, x, g, 1e-6)  # the separate kernels, launched with PDL too
            p = gv.gemv(silu_mul(gv.gemv(h, w_in)), w_out) + gv.norm_gemv(None, x, g, 1e-6, w_in, swiglu=True)[0][:, :d]
        return x + p

    def replayed(setting: str) -> torch.Tensor:
        monkeypatch.setenv("NANOFORGE_PDL", setting)
        monkeypatch.setenv("NANOFORGE_KERNELS", "triton")
        chain()  # compile and autotune outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
        outs = []
        for _ in range(20):
            graph.replay()
            outs.append(out.clone())
        torch.cuda.synchronize()
        assert all(torch.equal(o, outs[0]) for o in outs), setting  # replays agree with each other
        return outs[0]

    assert torch.equal(replayed("1"), replayed("0"))
