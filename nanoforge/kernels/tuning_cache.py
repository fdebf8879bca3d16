"""Per-shape tuning kept on disk, so that a process on the same GPU and software re-times nothing timed before.

A fresh engine start on a GPU tunes the skinny matmul for every decode shape it captures: the autotuner times
each candidate configuration, and `gemv.choose` times the kernel against cuBLAS (20.6 of a 34.9 s start on an
H100 in session 51, every start). What those timings decided is a few KB: `Decisions` keeps it in one JSON file
per GPU model and software stack, and the next start reads it back (session 52, an H100, README command 1 run
twice: the engine's start 44.8 s with 24.4 s tuning, then 23.2 s with none).

A file's name is a hash of everything a decision may depend on: the GPU's name and compute capability, the
torch, CUDA and Triton versions, the caller's `salt` (the deciding module's source: any edit to it tunes
afresh) and every NANOFORGE_* switch set (a lever changes what is fastest; the two below excepted). The file
holds the same identity in words, for whoever opens it. Unreadable, foreign or corrupt files count as empty;
a directory that cannot be written is warned about once and tuning goes on in memory.

  NANOFORGE_TUNING_CACHE  "1" (default) or "0": every process tunes afresh, nothing read or written
  NANOFORGE_CACHE_DIR     where the files go (default $XDG_CACHE_HOME/nanoforge, else ~/.cache/nanoforge)
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path

import torch

from nanoforge.kernels.dispatch import env_choice

_NOT_SALT = ("NANOFORGE_TUNING_CACHE", "NANOFORGE_CACHE_DIR")
_WARNED: list[str] = []


def enabled() -> bool:
    return env_choice("NANOFORGE_TUNING_CACHE", ("1", "0")) == "1"


def directory() -> Path:
    if os.environ.get("NANOFORGE_CACHE_DIR"):
        return Path(os.environ["NANOFORGE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nanoforge"


def identity(device: torch.device, salt: str) -> dict:
    """What the decisions of `salt`'s tuner on `device` depend on (a CUDA device)."""
    import triton

    major, minor = torch.cuda.get_device_capability(device)
    return {"gpu": torch.cuda.get_device_name(device), "capability": f"{major}.{minor}", "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton.__version__, "salt": salt,
            "switches": {k: v for k, v in sorted(os.environ.items())
                         if k.startswith("NANOFORGE_") and k not in _NOT_SALT}}


class Decisions:
    """One tuner's decisions on one GPU model: string keys to JSON values, read from `path` on first use and
    written back (merged with what another process wrote meanwhile, replaced atomically) on each `put`."""

    def __init__(self, path: Path, ident: dict):
        self.path, self.ident = path, ident
        self._entries: dict | None = None

    def get(self, key: str):
        if self._entries is None:
            self._entries = self._read()
        return self._entries.get(key)

    def put(self, key: str, value) -> None:
        if self.get(key) == value:
            return
        self._entries[key] = value
        entries = {**self._read(), **self._entries}  # another process's decisions kept
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, prefix=self.path.name, suffix=".tmp",
                                             delete=False) as f:
                f.write(_dumps(self.ident, entries))
            os.replace(f.name, self.path)
        except OSError as e:
            if str(self.path.parent) not in _WARNED:
                _WARNED.append(str(self.path.parent))
                warnings.warn(f"tuning decisions not saved to {self.path.parent} ({e}); set NANOFORGE_CACHE_DIR "
                              "to a writable directory, or NANOFORGE_TUNING_CACHE=0", stacklevel=2)

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("identity") != self.ident or not isinstance(
                data.get("decisions"), dict):
            return {}
        return data["decisions"]


def _dumps(ident: dict, entries: dict) -> str:
    """The file's text: its identity, then one decision a line."""
    lines = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(entries.items()))
    return f'{{"identity": {json.dumps(ident, sort_keys=True)},\n "decisions": {{\n{lines}\n}}}}\n'


_OPEN: dict[tuple, Decisions] = {}


def decisions(tuner: str, device: torch.device, salt) -> Decisions | None:
    """The disk decisions of `tuner` (a file-name prefix) on this CUDA device, or None: the cache is off
    (NANOFORGE_TUNING_CACHE=0) or the device is not a GPU. `salt()`: what else they depend on (a string)."""
    if device.type != "cuda" or not enabled():
        return None
    ident = identity(device, salt())
    blob = json.dumps(ident, sort_keys=True)
    at = (tuner, blob, str(directory()))
    if at not in _OPEN:
        name = f"{tuner}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}.json"
        _OPEN[at] = Decisions(directory() / name, ident)
    return _OPEN[at]


def source_salt(*parts: str) -> str:
    """A hash of `parts`: strings, and the contents of those that name files (a tuner's source)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(Path(part).read_bytes() if os.path.isfile(part) else part.encode())
    return h.hexdigest()[:16]
