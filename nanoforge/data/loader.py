"""The packed pretraining loader: random windows of a token memmap, with document ids.

A prepared split (`train.bin`, `val.bin` from `nanoforge.data.prepare`) is one
long stream of documents separated by an end-of-text token. A batch row is a
window of seq_len + 1 consecutive tokens: inputs are the first seq_len,
targets the last seq_len. A window usually spans several documents, so every
token also carries

  doc_ids    0 for the first document in the row, +1 after each end-of-text
             token (the end-of-text token belongs to the document it ends);
  positions  the token's index inside its document, restarting at 0 after
             each end-of-text token (what RoPE sees).

The model's document mask lets token i attend to token j only if j <= i and
doc_ids[i] == doc_ids[j]; packed documents never see each other.

Batches are a pure function of (seed, step), so resuming from a saved step
gives exactly the batches a run that never stopped would have seen. In a
data-parallel run each of the n ranks reads its own rows of every batch
(`shard=(i, n)`: rows i*B/n .. (i+1)*B/n), so the ranks together read what
one process would, at any layout.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch

from nanoforge.errors import NanoforgeError


IGNORE_INDEX = -100  # targets value for tokens without loss (PyTorch cross_entropy's default ignore_index)


@dataclass
class Batch:
    """One training batch; every tensor is (batch, seq_len)."""

    input_ids: torch.Tensor  # int64
    targets: torch.Tensor  # int64, -100 where no loss is taken
    doc_ids: torch.Tensor  # int64, document index within the row
    positions: torch.Tensor  # int64, position within the document
    loss_mask: torch.Tensor | None = None  # bool, SFT only: True on trained (answer) tokens

    def to(self, device, non_blocking: bool = False) -> Batch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        """The batch in page-locked host memory, so that a non-blocking copy to the GPU really is
        asynchronous (a copy from pageable memory can make the host wait for the GPU's queue)."""
        return self._map(torch.Tensor.pin_memory)

    def _map(self, fn) -> Batch:
        tensors = (getattr(self, f.name) for f in fields(self))
        return Batch(*(t if t is None else fn(t) for t in tensors))

    def rows(self, shard: tuple[int, int]) -> Batch:
        """Rank i of n's rows (the batch size must be a multiple of n)."""
        i, n = shard
        per = self.input_ids.shape[0] // n
        return self._map(lambda t: t[i * per : (i + 1) * per])

    def padded(self, rows: int) -> Batch:
        """The batch with rows appended up to `rows`, each one token-0 document with no loss (an evaluation's
        last batch, so that every data-parallel rank gets a share)."""
        extra = rows - self.input_ids.shape[0]
        if extra <= 0:
            return self
        T = self.input_ids.shape[1]
        fill = {"input_ids": torch.zeros(extra, T, dtype=torch.int64),
                "targets": torch.full((extra, T), IGNORE_INDEX, dtype=torch.int64),
                "doc_ids": torch.zeros(extra, T, dtype=torch.int64),
                "positions": torch.arange(T).expand(extra, T),
                "loss_mask": torch.zeros(extra, T, dtype=torch.bool)}
        return Batch(*(None if getattr(self, f.name) is None else torch.cat([getattr(self, f.name), fill[f.name]])
                       for f in fields(self)))


def doc_ids_and_positions(input_ids: torch.Tensor, eot_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Document ids and in-document positions of (B, T) ids whose documents end with eot_id."""
    is_eot = (input_ids == eot_id).long()
    doc_ids = torch.cumsum(is_eot, dim=1) - is_eot  # EOTs strictly before each token
    index = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    # A document starts at 0 and right after each EOT; position = index - latest start.
    starts_here = torch.zeros_like(is_eot, dtype=torch.bool)
    starts_here[:, 1:] = is_eot[:, :-1].bool()
    latest_start = torch.where(starts_here, index, torch.zeros_like(index)).cummax(dim=1).values
    return doc_ids, index - latest_start


def open_tokens(bin_path: str | Path) -> np.memmap:
    """Memory-map a prepared split, with the dtype recorded in meta.json beside it."""
    bin_path = Path(bin_path)
    meta_path = bin_path.parent / "meta.json"
    if not bin_path.is_file():
        raise NanoforgeError(f"token file not found: {bin_path}", param="data")
    if not meta_path.is_file():
        raise NanoforgeError(f"{meta_path} not found: {bin_path} is not a finished `nanoforge data prepare` output", param="data")
    try:
        dtype = np.dtype(json.loads(meta_path.read_text())["dtype"])
    except (ValueError, KeyError, TypeError) as e:
        raise NanoforgeError(f"{meta_path} is corrupt: {e}", param="data") from e
    if bin_path.stat().st_size % dtype.itemsize:
        raise NanoforgeError(f"{bin_path} size is not a multiple of {dtype.itemsize} bytes ({dtype.name}): truncated?", param="data")
    if bin_path.stat().st_size == 0:
        raise NanoforgeError(f"{bin_path} holds no tokens", param="data")
    return np.memmap(bin_path, dtype=dtype, mode="r")


class PackedLoader:
    """Endless random (B, T) windows of one prepared split, deterministic per (seed, step).

    `shard=(i, n)`: this data-parallel rank's rows of each batch (and of each evaluation batch); it reads
    only those windows.
    """

    def __init__(
        self,
        bin_path: str | Path,
        batch_size: int,
        seq_len: int,
        *,
        seed: int,
        eot_id: int,
        doc_masking: bool = True,
        shard: tuple[int, int] = (0, 1),
    ):
        if not 0 <= shard[0] < shard[1] or batch_size % shard[1]:
            raise ValueError(f"shard {shard} of batches of {batch_size} rows")
        self.tokens = open_tokens(bin_path)
        self.bin_path = Path(bin_path)
        self.batch_size, self.seq_len = batch_size, seq_len
        self.seed, self.eot_id, self.doc_masking, self.shard = seed, eot_id, doc_masking, shard
        if len(self.tokens) < seq_len + 1:
            raise NanoforgeError(f"{bin_path} has {len(self.tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}", param="seq_len")
        self.step = 0

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        rng = np.random.default_rng([self.seed, 0, self.step])  # (the 0 keeps a seed's batches what they were)
        starts = rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)
        i, n = self.shard
        per = self.batch_size // n
        self.step += 1
        return self._batch(np.stack([self.tokens[s : s + self.seq_len + 1] for s in starts[i * per : (i + 1) * per]]))

    def _batch(self, windows: np.ndarray) -> Batch:
        windows = torch.from_numpy(windows.astype(np.int64))
        inputs, targets = windows[:, :-1], windows[:, 1:]
        if self.doc_masking:
            doc_ids, positions = doc_ids_and_positions(inputs, self.eot_id)
        else:
            doc_ids = torch.zeros_like(inputs)
            positions = torch.arange(inputs.shape[1]).expand_as(inputs).clone()
        return Batch(inputs.contiguous(), targets.contiguous(), doc_ids, positions)

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed") != self.seed:
            raise NanoforgeError(f"loader state was saved with seed {state.get('seed')}, this loader has seed {self.seed}", param="seed")
        self.step = int(state["step"])

    def iter_eval(self, batch_size: int, seq_len: int, max_batches: int | None = None) -> Iterator[Batch]:
        """Consecutive, non-overlapping windows from the start of the split (for validation loss); with a
        shard, its rows of each batch (the last batch padded with untrained rows to a multiple of n)."""
        n_windows = (len(self.tokens) - 1) // seq_len
        if n_windows == 0:
            raise NanoforgeError(f"{self.bin_path} has {len(self.tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}", param="seq_len")
        if max_batches is not None:
            n_windows = min(n_windows, max_batches * batch_size)
        i, n = self.shard
        for first in range(0, n_windows, batch_size):
            rows = range(first, min(first + batch_size, n_windows))
            if n == 1:
                yield self._batch(np.stack([self.tokens[r * seq_len : r * seq_len + seq_len + 1] for r in rows]))
                continue
            per = -(-len(rows) // n)
            mine = rows[i * per : (i + 1) * per]
            batch = self._batch(np.stack([self.tokens[r * seq_len : r * seq_len + seq_len + 1] for r in mine])
                                if len(mine) else np.zeros((0, seq_len + 1), dtype=np.int64))
            yield batch.padded(per)
