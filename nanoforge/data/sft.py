"""Supervised fine-tuning data: load instruction records, render them, pack them.

Records come in two shapes, in a JSON list or JSONL:
  Alpaca  {"instruction": ..., "input": ... (optional), "output": ...}
  chat    {"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}

An Alpaca record becomes a user message (instruction, plus a blank line and
the input when there is one) and an assistant message. `render` writes the
conversation through the tokenizer's chat template and marks the tokens the
model is trained on: each assistant answer and the end-of-turn token that
closes it, nothing else (not the prompt, not the template's markup).

`SFTPacker` packs rendered examples into rows of seq_len tokens without ever
splitting one across rows, and yields the pretraining loader's `Batch` plus a
loss mask, with doc_ids/positions so examples in a row cannot see each other.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from nanoforge.data.loader import IGNORE_INDEX, Batch
from nanoforge.data.prepare import read_json_records
from nanoforge.errors import NanoforgeError
from nanoforge.tokenizer import CHAT_ROLES, Tokenizer, UnknownCharacters



def to_messages(record: dict, where: str = "record") -> list[dict]:
    """The chat messages of an Alpaca or chat record; `where` names the record in errors."""
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise NanoforgeError(f"{where}: 'messages' must be a non-empty list", param="messages")
        for j, m in enumerate(messages):
            if not isinstance(m, dict):
                raise NanoforgeError(f"{where}: messages[{j}] must be an object", param="messages")
            for key in ("role", "content"):
                if not isinstance(m.get(key), str):
                    raise NanoforgeError(f"{where}: messages[{j}] is missing the string field {key!r}", param="messages")
            if m["role"] not in CHAT_ROLES:
                raise NanoforgeError(f"{where}: messages[{j}] has role {m['role']!r}, expected one of {', '.join(CHAT_ROLES)}", param="messages")
        if not any(m["role"] == "assistant" for m in messages):
            raise NanoforgeError(f"{where}: no assistant message to train on", param="messages")
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    if "instruction" not in record and "output" not in record:
        raise NanoforgeError(f"{where}: expected Alpaca fields (instruction, input, output) or chat 'messages'", param="record")
    for key in ("instruction", "output"):
        if not isinstance(record.get(key), str):
            problem = "missing" if key not in record else "not a string"
            raise NanoforgeError(f"{where}: field {key!r} is {problem}", param=key)
    extra = record.get("input") or ""
    if not isinstance(extra, str):
        raise NanoforgeError(f"{where}: field 'input' is not a string", param="input")
    prompt = record["instruction"] + ("\n\n" + extra if extra else "")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]


def load_records(path: str | Path | None) -> list[dict]:
    """Alpaca/chat records from a .json list or .jsonl file (validated, errors name the line);
    None gives the built-in offline instruction set."""
    if path is None:
        from nanoforge.data.default import default_instructions

        return default_instructions()
    path = Path(path)
    if not path.is_file():
        raise NanoforgeError(f"SFT data file not found: {path}", param="data")
    records = []
    for where, record, _ in read_json_records(path):
        to_messages(record, where)  # validate now, so a bad line is reported before training
        records.append(record)
    if not records:
        raise NanoforgeError(f"{path} holds no records", param="data")
    return records


def render(record: dict, tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """Token ids of the whole conversation and a 0/1 loss mask, 1 exactly on answer tokens.

    The template is rendered once in full and tokenized once (so ids match what
    the model will see); each answer's character span is found by rendering the
    conversation up to its generation prompt and up to its end. A token is
    trained if it starts inside a span; a span ends just after the tokenizer's
    end-of-turn token (the template's trailing newline is not trained).
    """
    messages = to_messages(record)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True)
        through = tokenizer.apply_chat_template(messages[: i + 1], add_generation_prompt=False)
        if not (text.startswith(through) and through.startswith(before)):
            raise NanoforgeError("the chat template renders a conversation differently from its prefixes; cannot locate the answers", param="chat_template")
        end = through.find(tokenizer.eot_token, len(before))
        spans.append((len(before), end + len(tokenizer.eot_token) if end >= 0 else len(through)))
    ids, offsets = tokenizer.encode_with_offsets(text, allow_special=True)
    mask = [int(any(start <= s < end for start, end in spans)) for s, _ in offsets]
    return ids, mask


def render_all(records: list[dict], tokenizer: Tokenizer) -> tuple[list[dict], list[tuple[list[int], list[int]]], list[str]]:
    """`render` every record that the tokenizer can encode: (those records, their examples, the characters
    that kept the others out). Only a vocabulary without an unknown token (character-level) leaves any out:
    it cannot read text with characters it has not seen, in training as in `generate` and the server."""
    kept, examples, unknown = [], [], set()
    for record in records:
        try:
            examples.append(render(record, tokenizer))
        except UnknownCharacters as e:
            unknown.update(e.chars)
            continue
        kept.append(record)
    return kept, examples, sorted(unknown)


def _pack(lengths: np.ndarray, order: np.ndarray, capacity: int) -> list[list[int]]:
    """Best-fit decreasing bin packing: longest first, each into the fullest row it still fits.

    Ties in length keep `order` (a seeded shuffle), so the rows differ per epoch.
    """
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row index), sorted by room
    for i in sorted(order, key=lambda i: -lengths[i]):
        k = bisect.bisect_left(free, (lengths[i], -1))  # first row with room >= length
        if k == len(free):
            rows.append([i])
            room, row = capacity - lengths[i], len(rows) - 1
        else:
            room, row = free.pop(k)
            rows[row].append(i)
            room -= lengths[i]
        if room > 0:
            bisect.insort(free, (room, row))
    return rows


class SFTPacker:
    """Endless batches of packed SFT examples, deterministic per seed and resumable.

    An example of n tokens takes n - 1 slots of a row (inputs ids[:-1], targets
    ids[1:]). Examples longer than seq_len + 1 tokens are dropped and counted in
    `dropped` (the caller says so). Each epoch shuffles the examples,
    packs them into rows, shuffles the rows, and serves them batch_size at a time
    (a batch may straddle two epochs). `shard=(i, n)`: a data-parallel rank's rows of each batch (every
    rank packs the same rows and builds only its own).
    """

    def __init__(self, examples: Sequence[tuple[Sequence[int], Sequence[int]]], seq_len: int, batch_size: int, seed: int,
                 shard: tuple[int, int] = (0, 1)):
        if not 0 <= shard[0] < shard[1] or batch_size % shard[1]:
            raise ValueError(f"shard {shard} of batches of {batch_size} rows")
        self.seq_len, self.batch_size, self.seed, self.shard = seq_len, batch_size, seed, shard
        kept = [(np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)) for ids, mask in examples if len(ids) <= seq_len + 1]
        self.dropped = len(examples) - len(kept)
        if not kept:
            raise NanoforgeError(f"all {len(examples)} SFT examples are longer than seq_len + 1 = {seq_len + 1} tokens", param="seq_len")
        # Per example: (inputs, targets with IGNORE_INDEX off the answers, loss mask), each n - 1 long.
        self.examples = [(ids[:-1], np.where(mask[1:], ids[1:], IGNORE_INDEX), mask[1:]) for ids, mask in kept]
        self.lengths = np.array([len(e[0]) for e in self.examples])
        self.epoch, self.row = 0, 0
        self._rows = self._epoch_rows(0)

    def _epoch_rows(self, epoch: int) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, epoch])
        rows = _pack(self.lengths, rng.permutation(len(self.examples)), self.seq_len)
        return [rows[r] for r in rng.permutation(len(rows))]

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        rows = []
        for _ in range(self.batch_size):
            if self.row == len(self._rows):
                self.epoch, self.row = self.epoch + 1, 0
                self._rows = self._epoch_rows(self.epoch)
            rows.append(self._rows[self.row])
            self.row += 1
        i, n = self.shard
        per = self.batch_size // n
        return self._batch(rows[i * per : (i + 1) * per])

    def _batch(self, rows: list[list[int]]) -> Batch:
        shape = (len(rows), self.seq_len)
        inputs = np.zeros(shape, dtype=np.int64)  # padding: id 0, its own document, no loss
        targets = np.full(shape, IGNORE_INDEX, dtype=np.int64)
        loss_mask = np.zeros(shape, dtype=bool)
        doc_ids = np.zeros(shape, dtype=np.int64)
        positions = np.zeros(shape, dtype=np.int64)
        for r, row in enumerate(rows):
            t = 0
            for doc, i in enumerate(row):
                inp, tgt, msk = self.examples[i]
                n = len(inp)
                inputs[r, t : t + n], targets[r, t : t + n], loss_mask[r, t : t + n] = inp, tgt, msk
                doc_ids[r, t : t + n], positions[r, t : t + n] = doc, np.arange(n)
                t += n
            doc_ids[r, t:], positions[r, t:] = len(row), np.arange(self.seq_len - t)
        return Batch(*map(torch.from_numpy, (inputs, targets, doc_ids, positions, loss_mask)))

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "row": self.row, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed") != self.seed:
            raise NanoforgeError(f"packer state was saved with seed {state.get('seed')}, this packer has seed {self.seed}", param="seed")
        self.epoch, self.row = int(state["epoch"]), int(state["row"])
        self._rows = self._epoch_rows(self.epoch)
