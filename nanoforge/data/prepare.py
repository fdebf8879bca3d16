"""`nanoforge data prepare`: documents in, tokenized train/val shards out.

Inputs are text files (.txt, .md, .rst; any other name given explicitly is
read as text too), folders of them (recursively), JSONL/JSON records with a
text field, and Parquet tables (needs pyarrow). With no inputs, the built-in
offline corpus (`nanoforge.data.default`) is used.

Output, in `out_dir`:
  train.bin, val.bin      token ids as a flat NumPy memmap (uint16 when the
                          vocabulary fits, else uint32), one end-of-text token
                          between consecutive documents
  meta.json               dtype, token and document counts, split, sources
  tokenizer.json (+ tokenizer_config.json)   the tokenizer that made them

The split is by documents (a seeded random val_fraction of them) when there
are at least MIN_DOCS_FOR_DOC_SPLIT documents; otherwise the token stream is
cut, first (1 - val_fraction) for train, like nanoGPT's Tiny Shakespeare.

Everything is written in a temporary folder inside `out_dir` and renamed into
place at the end, meta.json last, so a failed run never leaves files that look
finished.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from nanoforge.errors import NanoforgeError
from nanoforge.tokenizer import Tokenizer

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".text"}
RECORD_SUFFIXES = {".jsonl", ".json", ".parquet"}
MIN_DOCS_FOR_DOC_SPLIT = 100
OUTPUT_FILES = ("train.bin", "val.bin", "tokenizer.json", "tokenizer_config.json")

_PIECE_CHARS = 1 << 16  # long documents are tokenized in pieces of about this many characters (in parallel)
_BATCH_CHARS = 4 << 20  # characters handed to the tokenizer per encode_batch call
_LINE_START = re.compile(r"\n(?=\S)")


# ---------------------------------------------------------------------- reading


def _read_text(path: Path) -> str:
    """A whole file as UTF-8 text; empty and binary files are errors."""
    data = path.read_bytes()
    if not data.strip():
        raise NanoforgeError(f"{path} is empty", param="inputs")
    if b"\0" in data[:65536]:
        raise NanoforgeError(f"{path} looks like a binary file, not text", param="inputs")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise NanoforgeError(f"{path} is not UTF-8 text (byte {e.start}: {e.reason})", param="inputs") from e


def read_json_records(path: Path) -> Iterator[tuple[str, dict, int]]:
    """Yield (location, record, bytes) from a .jsonl file (one object a line) or a .json list.

    `location` ("data.jsonl line 12", "data.json record 3") is what error messages should name.
    """
    text = _read_text(path)
    if path.suffix == ".jsonl":
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise NanoforgeError(f"{where}: invalid JSON ({e.msg})", param="inputs") from e
            if not isinstance(record, dict):
                raise NanoforgeError(f"{where}: expected a JSON object, got {type(record).__name__}", param="inputs")
            yield where, record, len(line.encode()) + 1
        return
    try:
        records = json.loads(text)
    except json.JSONDecodeError as e:
        raise NanoforgeError(f"{path} line {e.lineno}: invalid JSON ({e.msg})", param="inputs") from e
    if not isinstance(records, list):
        raise NanoforgeError(f"{path} must hold a JSON list of objects (or use .jsonl, one object a line)", param="inputs")
    share = len(text.encode()) // max(len(records), 1)
    for index, record in enumerate(records):
        where = f"{path} record {index}"
        if not isinstance(record, dict):
            raise NanoforgeError(f"{where}: expected a JSON object, got {type(record).__name__}", param="inputs")
        yield where, record, share


def _read_parquet(path: Path, text_field: str) -> Iterator[tuple[str, int]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise NanoforgeError(f"reading {path} needs pyarrow (pip install pyarrow)", param="inputs") from e
    try:
        file = pq.ParquetFile(path)
    except Exception as e:
        raise NanoforgeError(f"{path} is not a valid Parquet file: {e}", param="inputs") from e
    if text_field not in file.schema_arrow.names:
        raise NanoforgeError(f"{path} has no column {text_field!r} (columns: {', '.join(file.schema_arrow.names)})", param="text_field")
    share = path.stat().st_size // max(file.metadata.num_rows, 1)
    for batch in file.iter_batches(columns=[text_field]):
        for row, text in enumerate(batch.column(0).to_pylist()):
            if text is not None and not isinstance(text, str):
                raise NanoforgeError(f"{path} row {row}: column {text_field!r} is not text", param="text_field")
            yield text or "", share


def _read_source(path: Path, text_field: str) -> Iterator[tuple[str, int]]:
    """Yield (document text, bytes of the file it accounts for) for one file."""
    if path.suffix == ".parquet":
        yield from _read_parquet(path, text_field)
    elif path.suffix in (".jsonl", ".json"):
        for where, record, size in read_json_records(path):
            text = record.get(text_field)
            if not isinstance(text, str):
                problem = "is missing" if text_field not in record else "is not a string"
                raise NanoforgeError(f"{where}: field {text_field!r} {problem}", param="text_field")
            yield text, size
    else:
        yield _read_text(path), path.stat().st_size


def source_files(inputs: Iterable[Path]) -> list[Path]:
    """Expand folders (recursively, sorted, known suffixes, no hidden files) into files."""
    files = []
    for path in map(Path, inputs):
        if path.is_dir():
            found = sorted(
                p for p in path.rglob("*")
                if p.is_file() and p.suffix in TEXT_SUFFIXES | RECORD_SUFFIXES and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
            if not found:
                raise NanoforgeError(f"folder {path} has no {', '.join(sorted(TEXT_SUFFIXES | RECORD_SUFFIXES))} files", param="inputs")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise NanoforgeError(f"input not found: {path}", param="inputs")
    return files


def open_documents(inputs: Iterable[Path] | None, text_field: str = "text") -> tuple[Iterator[tuple[str, int]], int]:
    """(iterator of (text, bytes), total bytes) for the inputs, or the default corpus if none."""
    files = source_files(inputs or [])
    if files:
        docs = (doc for f in files for doc in _read_source(f, text_field))
        return docs, sum(f.stat().st_size for f in files)
    from nanoforge.data.default import default_corpus

    corpus = [(text, len(text.encode())) for text in default_corpus()]
    return iter(corpus), sum(size for _, size in corpus)


def iter_documents(inputs: Iterable[Path] | None, text_field: str = "text") -> Iterator[str]:
    """The document texts of the inputs (the default corpus if none), e.g. to train a tokenizer."""
    docs, _ = open_documents(inputs, text_field)
    return (text for text, _ in docs)


# ---------------------------------------------------------------------- tokenizing


def _pieces(text: str) -> list[str]:
    """Cut a long document at line starts (a newline followed by a non-space).

    Byte-level BPE pre-tokenizers (GPT-2's and Llama 3's) never join a token
    across such a point, so the pieces tokenize exactly as the whole would,
    while the tokenizer's memory stays bounded.
    """
    pieces, start = [], 0
    while len(text) - start > _PIECE_CHARS:
        # The last line start in the second half of the window, else a hard cut (a very long line).
        end = max((m.end() for m in _LINE_START.finditer(text, start + _PIECE_CHARS // 2, start + _PIECE_CHARS)), default=start + _PIECE_CHARS)
        pieces.append(text[start:end])
        start = end
    pieces.append(text[start:])
    return pieces


def _document_batches(docs: Iterator[tuple[str, int]]) -> Iterator[list[tuple[str, int]]]:
    batch, chars = [], 0
    for text, size in docs:
        batch.append((text, size))
        chars += len(text)
        if chars >= _BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _tokenize_to_file(docs, tokenizer: Tokenizer, path: Path, dtype, total_bytes: int) -> tuple[np.ndarray, int]:
    """Write all documents, EOT between them, to `path`; return their (start, end) spans and empty-doc count."""
    spans, empty, n_tokens = [], 0, 0
    eot = np.array([tokenizer.eos_id], dtype=dtype)
    with open(path, "wb") as f, tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", dynamic_ncols=True) as bar:
        for batch in _document_batches(docs):
            texts = [text for text, _ in batch if text.strip()]
            empty += len(batch) - len(texts)
            pieces = [_pieces(t) for t in texts]
            ids = iter(tokenizer.encode_batch([p for ps in pieces for p in ps]))
            for ps in pieces:
                if spans:
                    f.write(eot.tobytes())
                    n_tokens += 1
                doc = np.concatenate([np.asarray(next(ids), dtype=dtype) for _ in ps])
                f.write(doc.tobytes())
                spans.append((n_tokens, n_tokens + len(doc)))
                n_tokens += len(doc)
            bar.update(sum(size for _, size in batch))
            bar.set_postfix(docs=len(spans), tokens=n_tokens)
        bar.update(max(0, bar.total - bar.n))  # the bytes of JSON/Parquet records are estimates
    return np.array(spans, dtype=np.int64).reshape(-1, 2), empty


def _split(spans: np.ndarray, n_tokens: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray, str, int, int]:
    """Train and val spans of the token stream, how it was split, and the documents in each part."""
    n_val = round(len(spans) * val_fraction)
    if len(spans) >= MIN_DOCS_FOR_DOC_SPLIT and n_val >= 1:
        is_val = np.zeros(len(spans), dtype=bool)
        is_val[np.random.default_rng(seed).permutation(len(spans))[:n_val]] = True
        return spans[~is_val], spans[is_val], "documents", len(spans) - n_val, n_val
    cut = int(n_tokens * (1 - val_fraction))
    # A document that the cut runs through counts in both parts.
    return np.array([[0, cut]]), np.array([[cut, n_tokens]]), "tokens", int((spans[:, 0] < cut).sum()), int((spans[:, 1] > cut).sum())


def _write_spans(stream: np.ndarray, spans: np.ndarray, path: Path, eot_id: int) -> int:
    """Copy spans of `stream` to `path`, EOT between consecutive spans; return the token count."""
    eot = np.array([eot_id], dtype=stream.dtype).tobytes()
    chunk = 1 << 24
    written = 0
    with open(path, "wb") as f:
        for i, (start, end) in enumerate(spans):
            if i:
                f.write(eot)
            for s in range(start, end, chunk):
                f.write(stream[s : min(end, s + chunk)].tobytes())
            written += int(end - start) + (i > 0)
    return written


def prepare(
    inputs: list[Path] | None,
    out_dir: Path,
    tokenizer: Tokenizer,
    *,
    val_fraction: float = 0.1,
    text_field: str = "text",
    seed: int = 0,
) -> dict:
    """Tokenize `inputs` (the default corpus when empty/None) into out_dir; return meta.json's contents."""
    if not 0 <= val_fraction < 1:
        raise NanoforgeError(f"val_fraction must be in [0, 1), not {val_fraction}", param="val_fraction")
    out_dir = Path(out_dir)
    docs, total_bytes = open_documents(inputs, text_field)
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".prepare-", dir=out_dir))
    try:
        spans, empty = _tokenize_to_file(docs, tokenizer, tmp / "all.bin", dtype, total_bytes)
        if len(spans) == 0:
            raise NanoforgeError("the inputs hold no non-empty documents", param="inputs")
        n_tokens = int(spans[-1, 1])
        stream = np.memmap(tmp / "all.bin", dtype=dtype, mode="r", shape=(n_tokens,))
        train, val, how, train_docs, val_docs = _split(spans, n_tokens, val_fraction, seed)
        meta = {
            "dtype": dtype.name,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "eot_id": tokenizer.eot_id,
            "train_tokens": _write_spans(stream, train, tmp / "train.bin", tokenizer.eos_id),
            "val_tokens": _write_spans(stream, val, tmp / "val.bin", tokenizer.eos_id),
            "documents": len(spans),
            "train_documents": train_docs,
            "val_documents": val_docs,
            "empty_documents_skipped": empty,
            "split": how,
            "val_fraction": val_fraction,
            "seed": seed,
            "text_field": text_field,
            "sources": [str(p) for p in inputs] if inputs else ["nanoforge default corpus"],
            "tokenizer": "tokenizer.json",
        }
        del stream
        tokenizer.save(tmp)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        # Publish: drop the old meta.json first, so a crash midway never pairs it with new shards.
        (out_dir / "meta.json").unlink(missing_ok=True)
        for name in (*OUTPUT_FILES, "meta.json"):
            os.replace(tmp / name, out_dir / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta


# ---------------------------------------------------------------------- CLI


def make_tokenizer(spec: str, inputs: list[Path] | None, text_field: str = "text") -> Tokenizer:
    """`char` (characters of the inputs), `bpe:VOCAB` (trained on the inputs) or a path to load."""
    if spec == "char":
        chars: set[str] = set()
        for text in iter_documents(inputs, text_field):
            chars.update(text)
        return Tokenizer.char_level("".join(sorted(chars)))
    if spec.startswith("bpe:"):
        try:
            vocab_size = int(spec[4:])
        except ValueError:
            raise NanoforgeError(f"--tokenizer bpe:VOCAB needs an integer vocabulary size, not {spec[4:]!r}", param="tokenizer") from None
        return Tokenizer.train_bpe(iter_documents(inputs, text_field), vocab_size)
    return Tokenizer.load(spec)


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="*", type=Path, metavar="INPUT", help="text files, folders, .jsonl/.json or .parquet (none: the built-in offline corpus)")
    parser.add_argument("--out", type=Path, required=True, help="output folder for train.bin, val.bin, meta.json and the tokenizer")
    parser.add_argument("--tokenizer", default="bpe:8192", help="char | bpe:VOCAB (train a byte-level BPE here) | PATH (tokenizer.json or model folder); default bpe:8192")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="share of documents (or of tokens, for few documents) held out for validation")
    parser.add_argument("--text-field", default="text", help="the field holding the text in JSON/JSONL/Parquet inputs")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/val document split")


def run_cli(args: argparse.Namespace) -> int:
    inputs = list(args.inputs)
    tokenizer = make_tokenizer(args.tokenizer, inputs, args.text_field)
    meta = prepare(inputs, args.out, tokenizer, val_fraction=args.val_fraction, text_field=args.text_field, seed=args.seed)
    print(
        f"wrote {args.out}: train {meta['train_tokens']:,} tokens, val {meta['val_tokens']:,} tokens "
        f"({meta['dtype']}, vocab {meta['vocab_size']:,}, {meta['documents']:,} documents split by {meta['split']})"
    )
    return 0
