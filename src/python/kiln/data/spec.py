"""The tokenized-cache step spec: the JSON contract between the Pants backend and this package.

    {"spec_version": 1, "kind": "tokenized_cache", "name": ..., "version": ..., "fingerprint": ...,
     "config": {"source": {...}, "tokenizer": {...}, "text_key": "text",
                "max_document_chars": 1000000, "num_shards": 4}}

Parsed into frozen dataclasses here, once; every error names the offending field by its JSON path
(e.g. `config.source.paths[2]`). docs/token-cache.md describes each field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from kiln.data.errors import SpecError

SPEC_VERSION = 1
SPEC_KIND = "tokenized_cache"

FILE_FORMATS = ("auto", "jsonl", "parquet", "text")
STDLIB_PARTS = ("docstrings", "pydoc_topics", "all")
STDLIB_SPLITS = ("train", "validation")
JSON_TYPE_NAMES = {
    dict: "a JSON object",
    list: "a JSON array",
    str: "a string",
    int: "an integer",
    bool: "a boolean",
    float: "a number",
    type(None): "null",
}


@dataclass(frozen=True)
class FilesSource:
    """Local files (jsonl, jsonl.gz, jsonl.zst, parquet, txt); globs allowed, relative to CWD."""

    paths: tuple[str, ...]
    format: str = "auto"


@dataclass(frozen=True)
class HfSource:
    """A Hugging Face dataset id (or a local dataset folder), read with `datasets` streaming."""

    id: str
    split: str
    revision: str | None = None
    subset: str | None = None
    # Keep only records whose fields equal these values (one category of a snapshot).
    where: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class StdlibSource:
    """The running CPython's standard-library docstrings and/or pydoc topics (kiln.data.stdlib_corpus)."""

    part: str
    split: str


Source = Union[FilesSource, HfSource, StdlibSource]


@dataclass(frozen=True)
class TokenizerSpec:
    """kind "hf" (id, revision), "local" (path to a folder with tokenizer.json) or "package" (name)."""

    kind: str
    id: str | None = None
    revision: str | None = None
    path: str | None = None
    name: str | None = None

    def to_json(self) -> dict[str, Any]:
        if self.kind == "hf":
            return {"kind": "hf", "id": self.id, "revision": self.revision}
        if self.kind == "local":
            return {"kind": "local", "path": self.path}
        return {"kind": "package", "name": self.name}


@dataclass(frozen=True)
class CacheSpec:
    name: str
    version: str
    fingerprint: str
    source: Source
    tokenizer: TokenizerSpec
    text_key: str = "text"
    max_document_chars: int = 1_000_000
    num_shards: int = 1


class _Fields:
    """Reads one JSON object, naming fields by their path in every error; refuses unknown keys."""

    def __init__(self, obj: Any, where: str) -> None:
        if not isinstance(obj, dict):
            raise SpecError(f"`{where}` must be a JSON object, got {type(obj).__name__}.")
        self.obj = obj
        self.where = where
        self.read: set[str] = set()

    def path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def get(self, key: str, kind: type, default: Any = ..., *, optional: bool = False) -> Any:
        self.read.add(key)
        if key not in self.obj:
            if default is ...:
                raise SpecError(f"`{self.path(key)}` is required but missing.")
            return default
        value = self.obj[key]
        if value is None and optional:
            return None
        # bool is an int in Python; a JSON `true` is never a valid count.
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
            raise SpecError(
                f"`{self.path(key)}` must be {JSON_TYPE_NAMES[kind]}, "
                f"got {JSON_TYPE_NAMES.get(type(value), type(value).__name__)} ({value!r})."
            )
        return value

    def choice(self, key: str, choices: tuple[str, ...], default: Any = ...) -> str:
        value = self.get(key, str, default)
        if value not in choices:
            raise SpecError(f"`{self.path(key)}` must be one of {list(choices)}, got {value!r}.")
        return value

    def done(self) -> None:
        unknown = sorted(set(self.obj) - self.read)
        if unknown:
            raise SpecError(
                f"`{self.where or 'spec'}` has unknown field(s) {unknown}; "
                f"expected only {sorted(self.read)}."
            )


def parse_cache_spec(obj: Any) -> CacheSpec:
    top = _Fields(obj, "")
    version = top.get("spec_version", int)
    if version != SPEC_VERSION:
        raise SpecError(f"`spec_version` is {version}; this kiln reads version {SPEC_VERSION}.")
    top.choice("kind", (SPEC_KIND,))
    config = _Fields(top.get("config", dict), "config")
    spec = CacheSpec(
        name=_non_empty(top, "name"),
        version=_non_empty(top, "version"),
        fingerprint=_non_empty(top, "fingerprint"),
        source=parse_source(config.get("source", dict), "config.source"),
        tokenizer=parse_tokenizer_spec(config.get("tokenizer", dict), "config.tokenizer"),
        text_key=config.get("text_key", str, "text"),
        max_document_chars=_positive(config, "max_document_chars", 1_000_000),
        num_shards=_positive(config, "num_shards", 1),
    )
    config.done()
    top.done()
    return spec


def parse_source(obj: Any, where: str = "source") -> Source:
    fields = _Fields(obj, where)
    kind = fields.choice("kind", ("files", "hf", "python_stdlib"))
    source: Source
    if kind == "files":
        paths = fields.get("paths", list)
        if not paths:
            raise SpecError(f"`{where}.paths` is empty: list at least one file or glob.")
        for i, path in enumerate(paths):
            if not isinstance(path, str) or not path:
                raise SpecError(f"`{where}.paths[{i}]` must be a non-empty string, got {path!r}.")
        source = FilesSource(
            paths=tuple(paths), format=fields.choice("format", FILE_FORMATS, "auto")
        )
    elif kind == "hf":
        source = HfSource(
            id=_non_empty(fields, "id"),
            split=_non_empty(fields, "split"),
            revision=fields.get("revision", str, None, optional=True),
            subset=fields.get("subset", str, None, optional=True),
            where=_string_pairs(fields.get("where", dict, {}), f"{where}.where"),
        )
    else:
        source = StdlibSource(
            part=fields.choice("part", STDLIB_PARTS), split=fields.choice("split", STDLIB_SPLITS)
        )
    fields.done()
    return source


def parse_tokenizer_spec(obj: Any, where: str = "tokenizer") -> TokenizerSpec:
    fields = _Fields(obj, where)
    kind = fields.choice("kind", ("hf", "local", "package"))
    if kind == "hf":
        spec = TokenizerSpec(
            kind,
            id=_non_empty(fields, "id"),
            revision=fields.get("revision", str, None, optional=True),
        )
    elif kind == "local":
        spec = TokenizerSpec(kind, path=_non_empty(fields, "path"))
    else:
        spec = TokenizerSpec(kind, name=_non_empty(fields, "name"))
    fields.done()
    return spec


def _string_pairs(obj: dict[str, Any], where: str) -> tuple[tuple[str, str], ...]:
    for key, value in obj.items():
        if not isinstance(value, str):
            raise SpecError(f"`{where}.{key}` must be a string, got {value!r}.")
    return tuple(sorted(obj.items()))


def _non_empty(fields: _Fields, key: str) -> str:
    value = fields.get(key, str)
    if not value:
        raise SpecError(f"`{fields.path(key)}` must not be empty.")
    return value


def _positive(fields: _Fields, key: str, default: int) -> int:
    value = fields.get(key, int, default)
    if value < 1:
        raise SpecError(f"`{fields.path(key)}` must be at least 1, got {value}.")
    return value
