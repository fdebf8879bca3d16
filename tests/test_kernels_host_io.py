"""A graph's inputs fetched from, and its tokens posted to, host rings (kernels/host_io.py): the Triton kernels
(interpreter; compiled on a GPU, with the rings in page-locked host memory and inside a CUDA graph) against the
references, and the references against plain indexing, side by side over several steps."""

from __future__ import annotations

import pytest
import torch
from conftest import interpreter

from nanoforge.kernels.host_io import fetch_inputs, fetch_inputs_ref, post_tokens, post_tokens_ref


def steps(fetch, post, device, n: int, rows: int, pin: bool = False, count: int = 5):
    """`count` steps: the host fills side `step & 1` of the input ring, the device fetches it into dst and posts
    `rows` tokens made from it; returns what each step fetched and what the host read from the token ring."""
    ring_in = torch.full((2, n + 9), -7, dtype=torch.int64, pin_memory=pin)  # (longer than a step's inputs)
    ring_out = torch.full((2, rows + 3), -7, dtype=torch.int64, pin_memory=pin)
    counter = torch.zeros(1, dtype=torch.int64, device=device)
    dst = torch.zeros(n, dtype=torch.int64, device=device)
    fetched, posted = [], []
    for step in range(count):
        ring_in[step & 1, :n] = torch.arange(n) * 10 + step
        fetch(ring_in, counter, dst)
        post((dst[:rows] + 1).contiguous(), ring_out, counter)
        if device != "cpu":
            torch.cuda.synchronize()
        fetched.append(dst.cpu().tolist())
        posted.append(ring_out[step & 1, :rows].tolist())
    assert int(counter.item()) == count
    return fetched, posted


def test_the_references_read_and_write_the_side_the_count_names():
    fetched, posted = steps(fetch_inputs_ref, post_tokens_ref, "cpu", n=6, rows=4)
    assert fetched == [[10 * i + s for i in range(6)] for s in range(5)]
    assert posted == [[10 * i + s + 1 for i in range(4)] for s in range(5)]


def test_a_ring_too_short_or_of_another_type_is_a_bug_not_a_fetch():
    counter, dst = torch.zeros(1, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)
    with pytest.raises(ValueError, match="ring"):
        fetch_inputs(torch.zeros(2, 4, dtype=torch.int64), counter, dst)
    with pytest.raises(ValueError, match="ring"):
        post_tokens(dst, torch.zeros(2, 8, dtype=torch.int32), counter)


@interpreter
@pytest.mark.parametrize("n,rows", [(6, 4), (150, 70)])  # 150, 70: several of the interpreter's 64-word blocks
def test_triton_fetch_and_post_equal_the_references(n, rows, monkeypatch):
    want = steps(fetch_inputs_ref, post_tokens_ref, "cpu", n, rows)
    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")
    assert steps(fetch_inputs, post_tokens, "cpu", n, rows) == want


@pytest.mark.gpu
@pytest.mark.parametrize("n,rows", [(8, 1), (3000, 600)])
def test_gpu_fetch_and_post_through_page_locked_memory_equal_the_references(n, rows):
    """Compiled, the rings in page-locked host memory (read and written by the kernels over the bus), eagerly and
    replayed in a CUDA graph (its pointers fixed: the counter alone picks the side)."""
    want = steps(fetch_inputs_ref, post_tokens_ref, "cpu", n, rows)
    assert steps(fetch_inputs, post_tokens, "cuda", n, rows, pin=True) == want
    ring_in = torch.zeros(2, n, dtype=torch.int64, pin_memory=True)
    ring_out = torch.zeros(2, rows, dtype=torch.int64, pin_memory=True)
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    dst = torch.zeros(n, dtype=torch.int64, device="cuda")

    def step():
        fetch_inputs(ring_in, counter, dst)
        post_tokens((dst[:rows] * 3).contiguous(), ring_out, counter)

    step()  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    counter.zero_()
    for s in range(4):
        ring_in[s & 1] = torch.arange(n) + 100 * s
        g.replay()
        torch.cuda.synchronize()
        assert ring_out[s & 1].tolist() == [3 * (i + 100 * s) for i in range(rows)]
        assert dst.cpu().tolist() == [i + 100 * s for i in range(n)]
    assert int(counter.item()) == 4
