"""The offline default corpus and instruction set, built from Python itself.

A machine with Python but no network still has real English prose about one
subject: the language reference topics behind `help()` (`pydoc_data.topics`)
and the docstrings of the standard library. `nanoforge train` pretrains on
`default_corpus()` and `nanoforge sft` fine-tunes on `default_instructions()`
when no data is given. Both are deterministic for a given Python version.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

# Standard-library modules whose docstrings we read: importing them has no side
# effects (unlike `this` or `antigravity`); any that a Python build lacks are skipped.
_MODULES = (
    "abc argparse array ast asyncio base64 bisect builtins calendar cmath collections "
    "contextlib copy csv dataclasses datetime decimal difflib enum fnmatch fractions "
    "functools gc getopt gettext glob gzip hashlib heapq hmac html inspect io ipaddress "
    "itertools json keyword linecache locale logging math mimetypes numbers operator os "
    "pathlib pickle pkgutil platform pprint queue random re reprlib sched secrets select "
    "selectors shelve shlex shutil signal socket sqlite3 ssl stat statistics string struct "
    "subprocess sys tarfile tempfile textwrap threading time timeit tokenize traceback types "
    "typing unicodedata uuid warnings weakref zipfile zlib zoneinfo"
).split()

# A heading in the topic texts: a line underlined with *, = or -.
_HEADING = re.compile(r"^(\S[^\n]*)\n([*=\-])\2{3,}$", re.MULTILINE)


@dataclass(frozen=True)
class _ApiDoc:
    module: str  # "json"
    name: str  # "json.dumps", "str.split", "json"
    signature: str  # "json.dumps(obj, *, skipkeys=False, ...)" or "" when unknown
    doc: str
    kind: str  # "module", "class" or "function"


def _paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def _summary(text: str) -> str | None:
    """The first prose paragraph, unwrapped to one line; None if there is none.

    Skips headings, indented code/grammar blocks and old-style signature lines
    such as "S.split(sep=None) -> list of strings".
    """
    for p in _paragraphs(text):
        if p.startswith(" ") or _HEADING.search(p) or "->" in p or re.fullmatch(r"[\w.]+\(.*\)", p.strip()):
            continue
        line = " ".join(p.split())
        if len(line) >= 20:
            return line
    return None


def _topic_sections(text: str) -> list[tuple[str, str]]:
    """Split a pydoc topic into (heading, body) sections."""
    headings = list(_HEADING.finditer(text))
    return [(h.group(1).strip(), text[h.end() : nxt.start() if nxt else len(text)]) for h, nxt in zip(headings, headings[1:] + [None])]


@functools.cache
def _topics() -> tuple[tuple[str, str], ...]:
    from pydoc_data.topics import topics

    return tuple(sorted(topics.items()))


def _signature(name: str, obj) -> str:
    try:
        return f"{name}{inspect.signature(obj)}"
    except (TypeError, ValueError):  # many builtins have no introspectable signature
        return ""


@functools.cache
def _api_docs() -> tuple[_ApiDoc, ...]:
    """Docstrings of the modules above, their public functions and classes, and the classes' methods."""
    with warnings.catch_warnings():  # reading e.g. typing.io warns that it is deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        return tuple(d for d in _read_api_docs() if d.doc)


def _read_api_docs() -> Iterator[_ApiDoc]:
    seen = set()
    for module_name in _MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        yield _ApiDoc(module_name, module_name, "", inspect.getdoc(module) or "", "module")
        for name, obj in sorted(vars(module).items()):
            # Public names defined in this module (not re-exported from another one).
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if not (inspect.isclass(obj) or inspect.isroutine(obj)) or id(obj) in seen:
                continue
            seen.add(id(obj))  # aliases (array.ArrayType is array.array) appear once
            qualified = name if module_name == "builtins" else f"{module_name}.{name}"
            kind = "class" if inspect.isclass(obj) else "function"
            yield _ApiDoc(module_name, qualified, _signature(qualified, obj), inspect.getdoc(obj) or "", kind)
            if inspect.isclass(obj):
                for attr, member in sorted(vars(obj).items()):
                    if not attr.startswith("_") and inspect.isroutine(member) and member.__doc__:
                        yield _ApiDoc(module_name, f"{qualified}.{attr}", _signature(f"{qualified}.{attr}", member), inspect.getdoc(member) or "", "function")


def default_corpus() -> list[str]:
    """Documents: one per language-reference topic, then one per standard-library module."""
    corpus = [text for _, text in _topics()]
    by_module: dict[str, list[str]] = {}
    for d in _api_docs():
        by_module.setdefault(d.module, []).append(f"{d.signature or d.name}\n\n{d.doc}")
    corpus += ["\n\n".join(parts) for parts in by_module.values()]
    return corpus


def default_instructions() -> list[dict]:
    """Alpaca-style records ({"instruction", "input", "output"}) about Python."""
    records = []
    for _, text in _topics():
        for heading, body in _topic_sections(text):
            answer = _summary(body)
            if answer:
                records.append({"instruction": f"Explain this part of the Python language reference: {heading}.", "input": "", "output": answer})
    for d in _api_docs():
        answer = _summary(d.doc)
        if not answer:
            continue
        if d.kind == "module":
            records.append({"instruction": f"What is the Python module `{d.name}` for?", "input": "", "output": answer})
            continue
        records.append({"instruction": f"What does `{d.name}` do?", "input": "", "output": answer})
        # the way people ask, too ("What does the zip function do?"): the model should not need the backticks;
        # lower-case classes (zip, map, str) are called like functions and asked about as such
        noun = "class" if d.kind == "class" and d.name.rpartition(".")[2][:1].isupper() else "function"
        records.append({"instruction": f"What does the {d.name} {noun} do?", "input": "", "output": answer})
        if d.signature:
            records.append({"instruction": "Give the call signature of this Python callable.", "input": d.name, "output": f"`{d.signature}`"})
    return records
