"""Where documents come from: local files, Hugging Face datasets, the Python stdlib corpus.

Each source kind is one reader (READERS: kind -> class) that answers what Kiln asks of a
source: a shard's documents, its plan (what it reads, recorded in shard.json), the bytes of
each file it reads (for `plan`), and the source's provenance (cache.json).
`shard_documents(source, keys, num_shards, index)` yields the documents of one shard (`keys`: the
text field, or a structured document's fields: kiln.data.document), in a
deterministic order; concatenating shards 0..n-1 gives the cache's document order.

Sharding:
  - files: as kiln_contract.sharding cuts and assigns them (which the Pants backend plans from the
    files' sizes alone): by size, greedily; a file of at least 2 * MIN_PIECE_BYTES cut into up to
    num_shards pieces, an uncompressed JSONL file by byte ranges, a parquet file into runs of whole
    row groups, each owning the row groups that start inside its share of the file's bytes (key
    `path#row-groups-start-end`).
  - python_stdlib: the same greedy assignment over its units (one .py file, or the pydoc topics).
  - url_files: downloaded once (kiln.data.downloads), then sharded as local files.
  - hf: planned from the dataset's file list at its revision (kiln.data.hub_datasets: the files matching
    `data_files`, else the split's files), assigned to shards as local files are; each shard
    downloads and reads only its own files. With a `subset` or `where`, `datasets` streaming
    with `split_dataset_by_node(rank=index, world_size=num_shards)` instead.

Formats (`format: "auto"` picks by extension): `.jsonl`, `.jsonl.gz`, `.jsonl.zst` (one JSON object
per line, blank lines skipped), `.json` (one JSON array of documents: strings, or objects holding
`text_key`), `.parquet` (the `text_key` column, or a structured document's columns), `.txt` (one
document per file).
"""

from __future__ import annotations

import functools
import glob
import gzip
import io
import itertools
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, cast

from kiln.data import downloads, hub_datasets, stdlib_corpus
from kiln.data.document import Document, DocumentKeys
from kiln.data.errors import SourceError
from kiln_contract import sharding
from kiln_contract.tokenize import (
    FilesSource,
    HfSource,
    LevanterCacheSource,
    Source,
    StdlibSource,
    UrlFilesSource,
)

PARQUET_BATCH_ROWS = 4096


class SourceReader(Protocol):
    """What Kiln asks of a source kind; one class per kind answers all of it (READERS)."""

    @property
    def split(self) -> str | None:
        """The split the source names, recorded in cache.json."""
        ...

    def documents(self, keys: DocumentKeys, num_shards: int, index: int) -> Iterator[Document]:
        """Shard `index`'s documents, in order."""
        ...

    def plan(self, num_shards: int, index: int) -> list[str]:
        """What shard `index` reads, in order: file piece keys, stdlib unit keys, hub files and
        their sizes, or the node split of a stream."""
        ...

    def sizes(self, num_shards: int, index: int) -> dict[str, int] | None:
        """Bytes of each file (piece, unit) shard `index` reads, in read order; None for a
        source streamed through `datasets`, whose parts are not known before it is read."""
        ...

    def provenance(self) -> dict[str, Any]:
        """What identifies the source's content, recorded in cache.json."""
        ...


def shard_documents(
    source: Source, keys: DocumentKeys, num_shards: int, index: int
) -> Iterator[Document]:
    if not 0 <= index < num_shards:
        raise SourceError(f"shard index {index} is out of range for num_shards={num_shards}.")
    return reader(source).documents(keys, num_shards, index)


def shard_plan(source: Source, num_shards: int, index: int) -> list[str]:
    """Recorded in shard.json, so a shard cut under other sharding rules (an older Kiln) is
    rebuilt rather than merged with shards that may hold the same documents."""
    return reader(source).plan(num_shards, index)


def shard_sizes(source: Source, num_shards: int, index: int) -> dict[str, int] | None:
    return reader(source).sizes(num_shards, index)


def provenance(source: Source) -> dict[str, Any]:
    return reader(source).provenance()


def split_name(source: Source) -> str | None:
    return reader(source).split


def reader(source: Source) -> SourceReader:
    return READERS[source.kind](source)


def _assigned(sizes: dict[str, int], num_shards: int, index: int) -> dict[str, int]:
    """Shard `index`'s part of `sizes` (key -> bytes), in read order."""
    return {key: sizes[key] for key in sharding.assign_to_shards(sizes, num_shards)[index]}


class FilesReader:
    """Local files, cut into pieces (_pieces) and assigned to shards by size."""

    split = None

    def __init__(self, source: FilesSource) -> None:
        self.source = source

    def documents(self, keys: DocumentKeys, num_shards: int, index: int) -> Iterator[Document]:
        pieces = self._pieces(num_shards)
        for key in self._sizes_of(pieces, num_shards, index):
            yield from pieces[key].documents(self.source.format, keys)

    def plan(self, num_shards: int, index: int) -> list[str]:
        return list(self.sizes(num_shards, index))

    def sizes(self, num_shards: int, index: int) -> dict[str, int]:
        return self._sizes_of(self._pieces(num_shards), num_shards, index)

    def provenance(self) -> dict[str, Any]:
        files = expand_paths(self.source.paths)
        return {
            "kind": "files",
            "paths": list(self.source.paths),
            "files": [{"path": str(p), "bytes": p.stat().st_size} for p in files],
        }

    def _pieces(self, num_shards: int) -> dict[str, _Piece]:
        return {
            piece.key: piece
            for path in expand_paths(self.source.paths)
            for piece in _pieces(path, self.source.format, num_shards)
        }

    @staticmethod
    def _sizes_of(pieces: dict[str, _Piece], num_shards: int, index: int) -> dict[str, int]:
        return _assigned({key: piece.size for key, piece in pieces.items()}, num_shards, index)


class UrlFilesReader:
    """Files at pinned URLs: downloaded once (kiln.data.downloads), then read as local files;
    the URLs and digests are their provenance."""

    split = None

    def __init__(self, source: UrlFilesSource) -> None:
        self.source = source

    @functools.cached_property
    def _files(self) -> FilesReader:
        paths = tuple(str(path) for path in downloads.downloaded_files(self.source))
        return FilesReader(FilesSource(paths, self.source.format))

    def documents(self, keys: DocumentKeys, num_shards: int, index: int) -> Iterator[Document]:
        return self._files.documents(keys, num_shards, index)

    def plan(self, num_shards: int, index: int) -> list[str]:
        return self._files.plan(num_shards, index)

    def sizes(self, num_shards: int, index: int) -> dict[str, int]:
        return self._files.sizes(num_shards, index)

    def provenance(self) -> dict[str, Any]:
        return self.source.to_json()


class HfReader:
    """A hub dataset (kiln.data.hub_datasets), planned from its file list at its revision, each
    shard downloading and reading only its own files; or, with a subset or a record filter,
    streamed through `datasets`, each shard its node's part of the stream."""

    def __init__(self, source: HfSource) -> None:
        self.source = source
        self.streamed = hub_datasets.streamed(source)

    @property
    def split(self) -> str:
        return self.source.split

    def documents(self, keys: DocumentKeys, num_shards: int, index: int) -> Iterator[Document]:
        if self.streamed:
            return self._streamed_documents(keys, num_shards, index)
        return self._file_documents(keys, num_shards, index)

    def plan(self, num_shards: int, index: int) -> list[str]:
        if self.streamed:
            return [f"split_dataset_by_node(rank={index}, world_size={num_shards})"]
        return [f"{path} ({size} bytes)" for path, size in self._files(num_shards, index).items()]

    def sizes(self, num_shards: int, index: int) -> dict[str, int] | None:
        return None if self.streamed else self._files(num_shards, index)

    def provenance(self) -> dict[str, Any]:
        return {
            "kind": "hf",
            "id": self.source.id,
            "revision": self.source.revision,
            "subset": self.source.subset,
            "data_files": list(self.source.data_files),
            "where": dict(self.source.where),
        }

    def _files(self, num_shards: int, index: int) -> dict[str, int]:
        return _assigned(hub_datasets.hf_file_sizes(self.source), num_shards, index)

    def _file_documents(self, keys: DocumentKeys, num_shards: int, index: int) -> Iterator[Document]:
        for path in self._files(num_shards, index):
            yield from read_file(hub_datasets.local_file(self.source, path), "auto", keys)

    def _streamed_documents(self, keys: DocumentKeys, num_shards: int, index: int) -> Iterator[Document]:
        from datasets.distributed import split_dataset_by_node

        dataset = hub_datasets.load_hf_dataset(self.source)
        for row, record in enumerate(split_dataset_by_node(dataset, index, num_shards)):
            if any(record.get(key) != value for key, value in self.source.where):
                continue
            origin = f"{self.source.id}[shard {index}/{num_shards}, row {row}]"
            yield document_of(record, keys, origin)


class StdlibReader:
    """The running CPython's stdlib corpus (kiln.data.stdlib_corpus), its units sharded by size."""

    def __init__(self, source: StdlibSource) -> None:
        self.source = source

    @property
    def split(self) -> str:
        return self.source.split

    def documents(self, keys: DocumentKeys, num_shards: int, index: int) -> Iterator[Document]:
        for key in self.plan(num_shards, index):
            yield from stdlib_corpus.documents(key, self.source.split)

    def plan(self, num_shards: int, index: int) -> list[str]:
        return list(self.sizes(num_shards, index))

    def sizes(self, num_shards: int, index: int) -> dict[str, int]:
        units = {unit.key: unit.size for unit in stdlib_corpus.units(self.source.part)}
        return _assigned(units, num_shards, index)

    def provenance(self) -> dict[str, Any]:
        return {"kind": "python_stdlib", "part": self.source.part, **stdlib_corpus.provenance()}


class ImportedReader:
    """An imported cache (levanter_cache: kiln.data.levanter_cache) is used as it is: it has no
    documents to read and no shards to plan."""

    split = None

    def __init__(self, source: LevanterCacheSource) -> None:
        self.source = source

    def documents(self, keys: DocumentKeys, num_shards: int, index: int) -> Iterator[Document]:
        raise self._refusal()

    def plan(self, num_shards: int, index: int) -> list[str]:
        raise self._refusal()

    def sizes(self, num_shards: int, index: int) -> dict[str, int]:
        raise self._refusal()

    def provenance(self) -> dict[str, Any]:
        raise self._refusal()

    def _refusal(self) -> SourceError:
        return SourceError(
            f"a {self.source.kind} source is imported as it is: it has no documents to read."
        )


# One reader per source kind: a new kind is one class and one line here.
READERS: dict[str, Callable[[Any], SourceReader]] = {
    FilesSource.kind: FilesReader,
    UrlFilesSource.kind: UrlFilesReader,
    HfSource.kind: HfReader,
    StdlibSource.kind: StdlibReader,
    LevanterCacheSource.kind: ImportedReader,
}


# --- local files ---------------------------------------------------------------------------------


def expand_paths(patterns: Iterable[str]) -> list[Path]:
    """Expands globs (`**` allowed), relative to CWD; every pattern must match a non-empty file."""
    found: set[Path] = set()
    for pattern in patterns:
        matches = (
            sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        )
        if glob.has_magic(pattern) and not matches:
            raise SourceError(f"{pattern}: the glob matches no file (CWD is {os.getcwd()}).")
        for match in matches:
            path = Path(match)
            if not path.is_file():
                raise SourceError(f"{path}: no such file (CWD is {os.getcwd()}).")
            if path.stat().st_size == 0:
                raise SourceError(f"{path}: the file is empty; remove it from the source's paths.")
            found.add(path)
    return sorted(found)


@dataclass(frozen=True)
class _Piece:
    """A whole file (end None); or [start, end) of a file: the lines of an uncompressed JSONL
    file that start in that byte range, or those row groups of a parquet file."""

    path: Path
    size: int
    start: int = 0
    end: int | None = None
    row_groups: bool = False  # start/end count row groups, not bytes

    @property
    def key(self) -> str:  # zero-padded: a file's pieces sort in file order
        if self.row_groups:
            return f"{self.path}#row-groups-{self.start:09d}-{self.end:09d}"
        return sharding.FilePiece(str(self.path), self.size, self.start, self.end).key

    def documents(self, file_format: str, keys: DocumentKeys) -> Iterator[Document]:
        if self.end is None:
            return read_file(self.path, file_format, keys)
        if self.row_groups:
            return _read_parquet(self.path, keys, range(self.start, self.end))
        return _jsonl_documents(_lines_in_range(self.path, self.start, self.end), keys)


def _pieces(path: Path, file_format: str, num_shards: int) -> list[_Piece]:
    size = path.stat().st_size
    resolved = _format_of(path) if file_format == "auto" else file_format
    cut = sharding.file_pieces(str(path), size, resolved, num_shards)
    if cut is None:  # parquet, cut by its row groups
        count = min(num_shards, size // sharding.MIN_PIECE_BYTES)
        return _row_group_pieces(path, size, count)
    return [_Piece(path, piece.size, piece.start, piece.end) for piece in cut]


def _row_group_pieces(path: Path, size: int, count: int) -> list[_Piece]:
    """Up to `count` runs of whole row groups: run i owns the row groups whose first byte (by
    their compressed sizes, in file order) lies in the i-th of `count` equal shares of the data."""
    metadata = _parquet_file(path).metadata
    group_bytes = [
        sum(group.column(c).total_compressed_size for c in range(group.num_columns))
        for group in map(metadata.row_group, range(metadata.num_row_groups))
    ]
    total = sum(group_bytes)
    owner, first_byte = [], 0
    for nbytes in group_bytes:
        owner.append(min(count - 1, first_byte * count // max(total, 1)))
        first_byte += nbytes
    runs, start = [], 0
    for _, members in itertools.groupby(owner):  # owner never decreases: runs are contiguous
        end = start + len(list(members))
        runs.append((start, end))
        start = end
    if len(runs) < 2:
        return [_Piece(path, size)]
    return [_Piece(path, size // len(runs), start, end, row_groups=True) for start, end in runs]


def _lines_in_range(path: Path, start: int, end: int) -> Iterator[tuple[str, bytes]]:
    """(origin, line) for each line of `path` whose first byte lies in [start, end)."""
    with open(path, "rb") as file:
        if start > 0:
            file.seek(start - 1)
            file.readline()  # Ends the line running through start - 1: the previous piece's.
        offset = file.tell()
        while offset < end:
            line = file.readline()
            if not line:
                return
            yield f"{path}:byte {offset}", line
            offset += len(line)


def read_file(path: Path, file_format: str, keys: DocumentKeys) -> Iterator[Document]:
    resolved = _format_of(path) if file_format == "auto" else file_format
    if resolved == "jsonl":
        return _read_jsonl(path, keys)
    if resolved == "parquet":
        return _read_parquet(path, keys)
    if resolved == "json":
        return _read_json_array(path, keys)
    return _read_text(path)


def _format_of(path: Path) -> str:
    resolved = sharding.format_of(path.name)
    if resolved is not None:
        return resolved
    raise SourceError(
        f"{path}: cannot tell the format from the extension; use .json, .jsonl, .jsonl.gz, "
        '.jsonl.zst, .parquet or .txt, or set the source\'s "format" to "json", "jsonl", '
        '"parquet" or "text".'
    )


def _open_binary(path: Path) -> IO[bytes]:
    if path.name.endswith(".gz"):
        return cast(IO[bytes], gzip.open(path, "rb"))
    if path.name.endswith(".zst"):
        import zstandard

        # BufferedReader gives the zstd stream line iteration. zstandard's stubs do not declare
        # its reader a RawIOBase, though it implements readinto as BufferedReader needs.
        reader = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
        return io.BufferedReader(reader)  # type: ignore[arg-type]
    return open(path, "rb")


def _read_jsonl(path: Path, keys: DocumentKeys) -> Iterator[Document]:
    with _open_binary(path) as lines:
        numbered = ((f"{path}:{number}", line) for number, line in enumerate(lines, start=1))
        yield from _jsonl_documents(numbered, keys)


def _jsonl_documents(lines: Iterable[tuple[str, bytes]], keys: DocumentKeys) -> Iterator[Document]:
    """Documents from (origin, line) pairs: lines are decoded one by one, so an error names its
    line; blank lines are skipped."""
    for origin, line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise SourceError(f"{origin}: the line is not valid UTF-8 ({e.reason}).") from None
        except json.JSONDecodeError as e:
            raise SourceError(f"{origin}: the line is not valid JSON ({e.msg}).") from None
        yield document_of(record, keys, origin)


def _read_json_array(path: Path, keys: DocumentKeys) -> Iterator[Document]:
    """One JSON array per file (Uncheatable Eval's layout): each item a string or an object."""
    try:
        records = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SourceError(f"{path}: not a valid UTF-8 JSON file ({e}).") from None
    if not isinstance(records, list):
        raise SourceError(f"{path}: expected a JSON array of documents, got {type(records).__name__}.")
    for number, record in enumerate(records):
        origin = f"{path}[{number}]"
        if isinstance(record, str) and isinstance(keys, str):
            yield Document(record, origin)
        else:
            yield document_of(record, keys, origin)


def _parquet_file(path: Path) -> Any:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a corrupt file
        raise SourceError(f"{path}: not a readable parquet file ({e}).") from None


def _read_parquet(path: Path, keys: DocumentKeys, row_groups: range | None = None) -> Iterator[Document]:
    """The documents' columns, row by row: all of the file, or the row groups in `row_groups`."""
    table = _parquet_file(path)
    columns = table.schema_arrow.names
    wanted = [keys] if isinstance(keys, str) else list(keys)
    for column in wanted:
        if column not in columns:
            raise SourceError(
                f"{path}: no column {column!r} ({_key_role(keys)}); columns present: {columns}."
            )
    groups = range(table.metadata.num_row_groups) if row_groups is None else row_groups
    row = sum(table.metadata.row_group(group).num_rows for group in range(groups.start))
    batches = table.iter_batches(
        batch_size=PARQUET_BATCH_ROWS, columns=wanted, row_groups=list(groups)
    )
    for batch in batches:
        # A text column is read as values (the fast path); a structured document's as records.
        records = batch.column(0).to_pylist() if isinstance(keys, str) else batch.to_pylist()
        for record in records:
            origin = f"{path}[row {row}]"
            row += 1
            yield document_of({keys: record} if isinstance(keys, str) else record, keys, origin)


def _read_text(path: Path) -> Iterator[Document]:
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise SourceError(f"{path}:{line}: the file is not valid UTF-8 ({e.reason}).") from None
    yield Document(text, str(path))


def document_of(record: Any, keys: DocumentKeys, origin: str) -> Document:
    """The document in a record: the text under a text key, or a structured document's fields
    (each present; what they hold is checked where they are encoded, kiln.data.document_formats)."""
    if isinstance(keys, str):
        return Document(text_of(record, keys, origin), origin)
    _check_object(record, origin)
    for key in keys:
        if key not in record:
            raise SourceError(
                f"{origin}: no field {key!r} ({_key_role(keys)}); fields present: "
                f"{sorted(record)}. Name the right field in the target's {_key_role(keys)}."
            )
    return Document("", origin, {key: record[key] for key in keys})


def _key_role(keys: DocumentKeys) -> str:
    """What the key names are called in a BUILD file, for errors."""
    return "the text_key" if isinstance(keys, str) else "the format's keys: " + ", ".join(keys)


def _check_object(record: Any, origin: str) -> None:
    if not isinstance(record, dict):
        raise SourceError(f"{origin}: expected a JSON object, got {type(record).__name__}.")


def text_of(record: Any, text_key: str, origin: str) -> str:
    _check_object(record, origin)
    if text_key not in record:
        raise SourceError(
            f"{origin}: no field {text_key!r} (the text_key); fields present: {sorted(record)}."
        )
    text = record[text_key]
    if not isinstance(text, str):
        raise SourceError(
            f"{origin}: field {text_key!r} must be a string, got {type(text).__name__}."
        )
    return text
