"""A graphed step's inputs and tokens through page-locked host memory, not copies (NANOFORGE_STEP_IO=mapped).

By default a step's packed inputs go up in one host-to-device copy before its graph, and its sampled tokens come
back in one copy after it (`ModelRunner._upload`, `ModelRunner.launch`). With `mapped`, every captured graph
begins with `fetch_inputs` (a kernel that reads the inputs from a host ring into the upload buffer) and ends with
`post_tokens` (one that writes the tokens to a host ring and counts the step): between two replayed decode
graphs the device then runs no copy at all (`kernels/host_io.py` says why that matters at batch 1).

The host's half: the two rings, the device's step counter, and which side the next graphed step takes. A side
is refilled only once the step that last read it has finished (an event a side): with one step in flight that
never waits, but a step that samples nothing is not waited for by `collect`, so the host can get further ahead.
A step whose table or parameter updates need the upload buffer (`ModelRunner._upload`) still copies them up; its
graph's fetch then copies the same layout again.
"""

from __future__ import annotations

import numpy as np
import torch

from nanoforge.kernels.dispatch import env_choice
from nanoforge.kernels.host_io import fetch_inputs, post_tokens


def mode() -> str:
    """NANOFORGE_STEP_IO: `copy` (the default) or `mapped`."""
    return env_choice("NANOFORGE_STEP_IO", ("copy", "mapped"))


class StepIO:
    def __init__(self, input_words: int, token_rows: int, device: torch.device):
        pin = device.type == "cuda"
        self.inputs = torch.zeros(2, input_words, dtype=torch.int64, pin_memory=pin)  # the host fills, graphs read
        self.tokens = torch.zeros(2, token_rows, dtype=torch.int64, pin_memory=pin)  # graphs write, the host reads
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)  # graphed steps run (the device's count)
        self.steps = 0  # graphed steps launched (the host's count): the next takes side steps & 1
        self._cuda = pin
        self._read: list[torch.cuda.Event | None] = [None, None]  # per side: recorded after the step that read it

    def fill_both(self, packed: np.ndarray) -> None:
        """Both sides hold `packed` (a graph's idle inputs: its warm-up run fetches from either side)."""
        self.inputs[:, :len(packed)] = torch.from_numpy(packed)

    def restart(self) -> None:
        """Both counts back to 0 (after the captures and the warm-ups, which ran the kernels)."""
        self.counter.zero_()
        self.steps = 0
        self._read = [None, None]

    def put(self, packed: torch.Tensor, size: int) -> int:
        """The next graphed step's inputs (the first `size` words of `packed`) into its side; returns the side."""
        side = self.steps & 1
        if self._read[side] is not None:
            self._read[side].synchronize()
        self.inputs[side, :size].copy_(packed[:size])
        return side

    def launched(self, side: int) -> None:
        """The graph that reads `side` is queued: count it, and mark where its reads end."""
        if self._cuda:
            event = self._read[side] or torch.cuda.Event()
            event.record()
            self._read[side] = event
        self.steps += 1

    def fetch(self, dst: torch.Tensor) -> None:
        """Inside a graph, first: the step's inputs from the side the device's count names, into dst."""
        fetch_inputs(self.inputs, self.counter, dst)

    def post(self, sampled: torch.Tensor) -> None:
        """Inside a graph, last: its sampled tokens to that side, and the step counted."""
        post_tokens(sampled, self.tokens, self.counter)
