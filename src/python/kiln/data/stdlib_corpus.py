"""English prose every machine has: the running CPython's standard-library docstrings and pydoc topics.

The quickstart's corpus, so nothing is committed or downloaded. Documents are
  - docstrings (modules, classes, functions; `ast`, cleaned) longer than 80 characters, from the .py
    files under the stdlib path, minus tests, idlelib, site-packages and other non-library folders;
  - the entries of `pydoc_data.topics` (the language reference sections `help()` shows).
The text depends on the Python version: provenance() records it.

Work is split in units (one .py file, or one pydoc topic) so that a shard parses only its own
files. Order is deterministic: sorted path, then position in the file. The train/validation
split is a stable hash of each document's id (`path:line`, `pydoc_topics:<topic>`), 3% validation.
"""

from __future__ import annotations

import ast
import hashlib
import platform
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from kiln.data.document import Document

MIN_DOCSTRING_CHARS = 80
VALIDATION_PER_MILLE = 30
PYDOC_TOPICS_PREFIX = "pydoc_topics:"
# Folders that are tests, GUI tools or third-party code rather than library documentation.
EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "idlelib", "site-packages", "dist-packages", "__pycache__"}
)


@dataclass(frozen=True)
class StdlibUnit:
    """One piece of work: a stdlib .py file (key: its path relative to the stdlib) or one pydoc
    topic (key: "pydoc_topics:<topic>", also its document's id)."""

    key: str
    size: int


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def provenance() -> dict[str, str]:
    return {
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "stdlib_path": str(stdlib_root()),
    }


def units(part: str) -> list[StdlibUnit]:
    """The work units of `part` ("docstrings", "pydoc_topics" or "all"), sorted by key."""
    found = []
    if part in ("docstrings", "all"):
        found += [StdlibUnit(key, size) for key, size in _library_files()]
    if part in ("pydoc_topics", "all"):
        found += [
            StdlibUnit(f"{PYDOC_TOPICS_PREFIX}{topic}", len(text))
            for topic, text in _pydoc_topics().items()
            if text.strip()
        ]
    return sorted(found, key=lambda unit: unit.key)


def documents(unit_key: str, split: str) -> Iterator[Document]:
    """The documents of one unit that fall in `split` ("train" or "validation"), in order."""
    if unit_key.startswith(PYDOC_TOPICS_PREFIX):
        topic = unit_key.removeprefix(PYDOC_TOPICS_PREFIX)
        found: Iterator[Document] = iter([Document(_pydoc_topics()[topic], unit_key)])
    else:
        found = _docstrings(unit_key)
    return (doc for doc in found if split_of(doc.origin) == split)


def split_of(document_id: str) -> str:
    bucket = int.from_bytes(hashlib.sha256(document_id.encode()).digest()[:8], "little") % 1000
    return "validation" if bucket < VALIDATION_PER_MILLE else "train"


@cache
def _library_files() -> tuple[tuple[str, int], ...]:
    root = stdlib_root()
    files = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if EXCLUDED_DIRS.isdisjoint(relative.parts[:-1]):
            files.append((relative.as_posix(), path.stat().st_size))
    return tuple(sorted(files))


def _docstrings(relative_path: str) -> Iterator[Document]:
    source = (stdlib_root() / relative_path).read_bytes()
    try:
        tree = ast.parse(source, filename=relative_path)
    except SyntaxError:
        return  # a few stdlib files are templates or Python-2 fixtures, not library code
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=True)
            if text and len(text) > MIN_DOCSTRING_CHARS:
                line = node.body[0].lineno
                found.append((line, Document(text, f"{relative_path}:{line}")))
    yield from (doc for _, doc in sorted(found, key=lambda item: item[0]))


def _pydoc_topics() -> dict[str, str]:
    from pydoc_data.topics import topics

    return topics
