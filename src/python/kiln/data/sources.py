"""Where documents come from: local files, Hugging Face datasets, the Python stdlib corpus.

`shard_documents(source, text_key, num_shards, index)` yields the documents of one shard, in a
deterministic order; concatenating shards 0..n-1 gives the cache's document order.

Sharding:
  - files: as kiln_contract.sharding cuts and assigns them (which the Pants backend plans from the
    files' sizes alone): by size, greedily; a file of at least 2 * MIN_PIECE_BYTES cut into up to
    num_shards pieces, an uncompressed JSONL file by byte ranges, a parquet file into runs of whole
    row groups, each owning the row groups that start inside its share of the file's bytes (key
    `path#row-groups-start-end`).
  - python_stdlib: the same greedy assignment over its units (one .py file, or the pydoc topics).
  - url_files: downloaded once (kiln.data.downloads), then sharded as local files.
  - hf: planned from the dataset's file list at its revision (`hf_file_sizes`: the files matching
    `data_files`, else the split's files), assigned to shards as local files are; each shard
    downloads and reads only its own files. With a `subset` or `where`, `datasets` streaming
    with `split_dataset_by_node(rank=index, world_size=num_shards)` instead.

Formats (`format: "auto"` picks by extension): `.jsonl`, `.jsonl.gz`, `.jsonl.zst` (one JSON object
per line, blank lines skipped), `.json` (one JSON array of documents: strings, or objects holding
`text_key`), `.parquet` (the `text_key` column), `.txt` (one document per file).
"""

from __future__ import annotations

import fnmatch
import functools
import glob
import gzip
import io
import itertools
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

from kiln.data import downloads, stdlib_corpus
from kiln.data.errors import SourceError
from kiln.data.spec import FilesSource, HfSource, Source, StdlibSource, UrlFilesSource
from kiln_contract import sharding
from kiln_contract.sharding import assign_to_shards

PARQUET_BATCH_ROWS = 4096


@dataclass(frozen=True)
class Document:
    text: str
    origin: str  # where it came from, for error messages: "path:line", "org/name[row 17]"


def shard_documents(
    source: Source, text_key: str, num_shards: int, index: int
) -> Iterator[Document]:
    if not 0 <= index < num_shards:
        raise SourceError(f"shard index {index} is out of range for num_shards={num_shards}.")
    source = _local(source)
    if isinstance(source, FilesSource):
        return _file_shard_documents(source, text_key, num_shards, index)
    if isinstance(source, HfSource):
        return _hf_shard_documents(source, text_key, num_shards, index)
    return _stdlib_shard_documents(_as_stdlib(source), num_shards, index)


def shard_plan(source: Source, num_shards: int, index: int) -> list[str]:
    """What shard `index` reads, in order: file piece keys, stdlib unit keys, or the hf node
    split. Recorded in shard.json, so a shard cut under other sharding rules (an older Kiln) is
    rebuilt rather than merged with shards that may hold the same documents."""
    source = _local(source)
    if isinstance(source, FilesSource):
        return _assigned_keys(_file_pieces(source, num_shards), num_shards, index)
    if isinstance(source, HfSource) and _streamed(source):
        return [f"split_dataset_by_node(rank={index}, world_size={num_shards})"]
    if isinstance(source, HfSource):
        sizes = hf_file_sizes(source)
        return [f"{path} ({sizes[path]} bytes)" for path in hf_shard_files(source, num_shards, index)]
    return _assigned_keys(_stdlib_units(_as_stdlib(source)), num_shards, index)


def shard_sizes(source: Source, num_shards: int, index: int) -> dict[str, int] | None:
    """Bytes of each file (piece, unit) shard `index` reads, in read order; None for a source
    streamed through `datasets`, whose parts are not known before it is read."""
    source = _local(source)
    if isinstance(source, HfSource) and _streamed(source):
        return None
    if isinstance(source, HfSource):
        sizes = hf_file_sizes(source)
        return {path: sizes[path] for path in hf_shard_files(source, num_shards, index)}
    sized = (
        _file_pieces(source, num_shards)
        if isinstance(source, FilesSource)
        else _stdlib_units(_as_stdlib(source))
    )
    return {key: sized[key].size for key in _assigned_keys(sized, num_shards, index)}


def provenance(source: Source) -> dict[str, Any]:
    """What identifies the source's content, recorded in cache.json."""
    if isinstance(source, UrlFilesSource):
        return source.to_json()
    if isinstance(source, FilesSource):
        files = expand_paths(source.paths)
        return {
            "kind": "files",
            "paths": list(source.paths),
            "files": [{"path": str(p), "bytes": p.stat().st_size} for p in files],
        }
    if isinstance(source, HfSource):
        return {
            "kind": "hf",
            "id": source.id,
            "revision": source.revision,
            "subset": source.subset,
            "data_files": list(source.data_files),
            "where": dict(source.where),
        }
    source = _as_stdlib(source)
    return {"kind": "python_stdlib", "part": source.part, **stdlib_corpus.provenance()}


def _local(source: Source) -> Source:
    """A url_files source as the local files it downloads to (once); any other as it is."""
    if isinstance(source, UrlFilesSource):
        paths = tuple(str(path) for path in downloads.downloaded_files(source))
        return FilesSource(paths, source.format)
    return source


def split_name(source: Source) -> str | None:
    return source.split if isinstance(source, (HfSource, StdlibSource)) else None


def _as_stdlib(source: Source) -> StdlibSource:
    """The one source kind left once files and hf are handled; an imported cache (kind
    levanter_cache, kiln.data.levanter_cache) has no documents to read."""
    if isinstance(source, StdlibSource):
        return source
    raise SourceError(f"a {source.kind} source is imported as it is: it has no documents to read.")


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


def _assigned_keys(sized: dict[str, Any], num_shards: int, index: int) -> list[str]:
    """Shard `index`'s keys of `sized` (key -> something with a .size), in read order."""
    return assign_to_shards({key: item.size for key, item in sized.items()}, num_shards)[index]


def _file_pieces(source: FilesSource, num_shards: int) -> dict[str, _Piece]:
    return {
        piece.key: piece
        for path in expand_paths(source.paths)
        for piece in _pieces(path, source.format, num_shards)
    }


def _file_shard_documents(
    source: FilesSource, text_key: str, num_shards: int, index: int
) -> Iterator[Document]:
    pieces = _file_pieces(source, num_shards)
    for key in _assigned_keys(pieces, num_shards, index):
        yield from pieces[key].documents(source.format, text_key)


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

    def documents(self, file_format: str, text_key: str) -> Iterator[Document]:
        if self.end is None:
            return read_file(self.path, file_format, text_key)
        if self.row_groups:
            return _read_parquet(self.path, text_key, range(self.start, self.end))
        return _jsonl_documents(_lines_in_range(self.path, self.start, self.end), text_key)


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


def read_file(path: Path, file_format: str, text_key: str) -> Iterator[Document]:
    resolved = _format_of(path) if file_format == "auto" else file_format
    if resolved == "jsonl":
        return _read_jsonl(path, text_key)
    if resolved == "parquet":
        return _read_parquet(path, text_key)
    if resolved == "json":
        return _read_json_array(path, text_key)
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


def _read_jsonl(path: Path, text_key: str) -> Iterator[Document]:
    with _open_binary(path) as lines:
        numbered = ((f"{path}:{number}", line) for number, line in enumerate(lines, start=1))
        yield from _jsonl_documents(numbered, text_key)


def _jsonl_documents(lines: Iterable[tuple[str, bytes]], text_key: str) -> Iterator[Document]:
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
        yield Document(text_of(record, text_key, origin), origin)


def _read_json_array(path: Path, text_key: str) -> Iterator[Document]:
    """One JSON array per file (Uncheatable Eval's layout): each item a string or an object."""
    try:
        records = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SourceError(f"{path}: not a valid UTF-8 JSON file ({e}).") from None
    if not isinstance(records, list):
        raise SourceError(f"{path}: expected a JSON array of documents, got {type(records).__name__}.")
    for number, record in enumerate(records):
        origin = f"{path}[{number}]"
        text = record if isinstance(record, str) else text_of(record, text_key, origin)
        yield Document(text, origin)


def _parquet_file(path: Path) -> Any:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a corrupt file
        raise SourceError(f"{path}: not a readable parquet file ({e}).") from None


def _read_parquet(path: Path, text_key: str, row_groups: range | None = None) -> Iterator[Document]:
    """The text_key column, row by row: all of the file, or the row groups in `row_groups`."""
    table = _parquet_file(path)
    columns = table.schema_arrow.names
    if text_key not in columns:
        raise SourceError(
            f"{path}: no column {text_key!r} (the text_key); columns present: {columns}."
        )
    groups = range(table.metadata.num_row_groups) if row_groups is None else row_groups
    row = sum(table.metadata.row_group(group).num_rows for group in range(groups.start))
    batches = table.iter_batches(
        batch_size=PARQUET_BATCH_ROWS, columns=[text_key], row_groups=list(groups)
    )
    for batch in batches:
        for text in batch.column(0).to_pylist():
            origin = f"{path}[row {row}]"
            row += 1
            yield Document(text_of({text_key: text}, text_key, origin), origin)


def _read_text(path: Path) -> Iterator[Document]:
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise SourceError(f"{path}:{line}: the file is not valid UTF-8 ({e.reason}).") from None
    yield Document(text, str(path))


def text_of(record: Any, text_key: str, origin: str) -> str:
    if not isinstance(record, dict):
        raise SourceError(f"{origin}: expected a JSON object, got {type(record).__name__}.")
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


# --- Hugging Face datasets -----------------------------------------------------------------------


# Hub file names that put a file in a split (datasets' own convention), by split.
SPLIT_WORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test", "testing", "eval", "evaluation"),
}
DATA_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json", ".json.gz", ".json.zst", ".parquet")


def _streamed(source: HfSource) -> bool:
    """A subset (a dataset config) or a record filter is read through `datasets` streaming."""
    return source.subset is not None or bool(source.where)


@functools.lru_cache(maxsize=8)
def hf_file_sizes(source: HfSource) -> dict[str, int]:
    """The files a hub source reads, repo path -> bytes, at its revision: those matching one of
    `data_files`; without data_files, the files whose path names the split as a word (a folder
    `train/`, a file `train-00000-of-00009.parquet`), or every data file for `train` when no file
    names any split. A local folder as the id is listed the same way."""
    folder = Path(source.id)
    listed = _list_folder(folder) if folder.exists() else _list_hub(source)
    data = {path: size for path, size in listed.items() if path.lower().endswith(DATA_SUFFIXES)}
    if source.data_files:
        chosen = {
            path: size
            for path, size in data.items()
            if any(fnmatch.fnmatchcase(path, pattern) for pattern in source.data_files)
        }
        wanted = f"matching data_files {list(source.data_files)}"
    else:
        chosen = _files_of_split(data, source.split)
        wanted = f"of the split {source.split!r}"
    if not chosen:
        raise SourceError(
            f"The Hugging Face dataset {source.id!r} at revision {source.revision!r} has no data "
            f"files {wanted}; its data files are: {sorted(data)[:20] or 'none'}."
        )
    return chosen


def hf_shard_files(source: HfSource, num_shards: int, index: int) -> list[str]:
    """Shard `index`'s files of a hub source, in read order (sorted)."""
    return assign_to_shards(hf_file_sizes(source), num_shards)[index]


def _split_words(path: str) -> set[str]:
    return set(re.split(r"[/_.\-]", path.lower()))


def _files_of_split(data: dict[str, int], split: str) -> dict[str, int]:
    every_word = {word for words in SPLIT_WORDS.values() for word in words}
    if not any(_split_words(path) & every_word for path in data):
        return dict(data) if split == "train" else {}
    words = set(SPLIT_WORDS.get(split, (split,)))
    return {path: size for path, size in data.items() if _split_words(path) & words}


def _list_folder(folder: Path) -> dict[str, int]:
    return {
        path.relative_to(folder).as_posix(): path.stat().st_size
        for path in sorted(folder.rglob("*"))
        if path.is_file() and not any(p.startswith(".") for p in path.relative_to(folder).parts)
    }


def _list_hub(source: HfSource) -> dict[str, int]:
    if _hf_offline():
        raise SourceError(
            f"Could not list the Hugging Face dataset {source.id!r} (revision "
            f"{source.revision!r}): Offline (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set), and a "
            f"hub dataset's file list comes from the hub. {_hf_advice()}"
        )
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    _probe_hub(source)
    try:
        entries = HfApi().list_repo_tree(
            source.id, revision=source.revision, repo_type="dataset", recursive=True
        )
        return {entry.path: entry.size for entry in entries if isinstance(entry, RepoFile)}
    except Exception as e:  # the probe has named the likely causes; this is the rest
        raise SourceError(
            f"Could not list the files of the Hugging Face dataset {source.id!r} at revision "
            f"{source.revision!r}: {type(e).__name__}: {_first_line(e)}. {_hf_advice()}"
        ) from None


def _hf_local_file(source: HfSource, path: str) -> Path:
    """A hub file on this machine: in the local folder, or downloaded once into the Hugging Face
    cache (HF_HOME / HF_HUB_CACHE) at the source's revision."""
    if Path(source.id).exists():
        return Path(source.id) / path
    from huggingface_hub import hf_hub_download

    try:
        return Path(
            hf_hub_download(
                source.id, path, revision=source.revision, repo_type="dataset"
            )
        )
    except Exception as e:
        raise SourceError(
            f"Could not download {path} of the Hugging Face dataset {source.id!r} at revision "
            f"{source.revision!r}: {type(e).__name__}: {_first_line(e)}. {_hf_advice()}"
        ) from None


def _hf_shard_documents(
    source: HfSource, text_key: str, num_shards: int, index: int
) -> Iterator[Document]:
    if _streamed(source):
        yield from _hf_streamed_shard_documents(source, text_key, num_shards, index)
        return
    for path in hf_shard_files(source, num_shards, index):
        yield from read_file(_hf_local_file(source, path), "auto", text_key)


def _hf_streamed_shard_documents(
    source: HfSource, text_key: str, num_shards: int, index: int
) -> Iterator[Document]:
    from datasets.distributed import split_dataset_by_node

    dataset = split_dataset_by_node(load_hf_dataset(source), rank=index, world_size=num_shards)
    for row, record in enumerate(dataset):
        if any(record.get(key) != value for key, value in source.where):
            continue
        origin = f"{source.id}[shard {index}/{num_shards}, row {row}]"
        yield Document(text_of(record, text_key, origin), origin)


def load_hf_dataset(source: HfSource) -> Any:
    """The streaming IterableDataset of `source`; a local dataset folder works as an id too.

    Unreachable hub: with HF_DATASETS_OFFLINE / HF_HUB_OFFLINE set, `datasets` fails in well under a
    second; without them it retries for ~25 s, so we probe the hub once first and fail at once.
    """
    import datasets

    is_local = Path(source.id).exists()
    if not is_local and not _hf_offline():
        _probe_hub(source)
    try:
        return datasets.load_dataset(
            source.id,
            name=source.subset,
            data_files={source.split: list(source.data_files)} if source.data_files else None,
            split=source.split,
            revision=source.revision,
            streaming=True,
        )
    except Exception as e:  # datasets raises ConnectionError, FileNotFoundError, ValueError, ...
        offline = (
            " Offline (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set): only the local Hugging Face "
            "cache (HF_HOME) is read, and it does not hold this dataset."
            if _hf_offline() and not is_local
            else ""
        )
        raise SourceError(
            f"Could not load the Hugging Face dataset {source.id!r} (split {source.split!r}): "
            f"{type(e).__name__}: {_first_line(e)}.{offline} {_hf_advice()}"
        ) from None


def _probe_hub(source: HfSource) -> None:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        HfApi().dataset_info(source.id, revision=source.revision, timeout=10)
    except GatedRepoError:  # before RepositoryNotFoundError: it is one
        raise SourceError(
            f"The Hugging Face dataset {source.id!r} is gated: accept its terms on "
            f"huggingface.co with your account, then set HF_TOKEN to a token of that account "
            f"{_token_state()}."
        ) from None
    except RevisionNotFoundError:
        raise SourceError(
            f"The Hugging Face dataset {source.id!r} has no revision {source.revision!r}: "
            "check the target's `revision` field."
        ) from None
    except RepositoryNotFoundError:
        raise SourceError(
            f"The Hugging Face dataset {source.id!r} does not exist, or is private: check the id, "
            f"or set HF_TOKEN to a token that can read it {_token_state()}. {_hf_advice()}"
        ) from None
    except Exception as e:  # connection errors come from httpx / requests, whichever hub uses
        raise SourceError(
            f"The Hugging Face hub is unreachable while looking up dataset {source.id!r} "
            f"({type(e).__name__}: {_first_line(e)}). {_hf_advice()}"
        ) from None


def _token_state() -> str:
    return "(HF_TOKEN is set, but that token has no access)" if os.environ.get("HF_TOKEN") else (
        "(HF_TOKEN is not set)"
    )


def _hf_offline() -> bool:
    return any(
        os.environ.get(var, "").upper() in ("1", "ON", "YES", "TRUE")
        for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
    )


def _hf_advice() -> str:
    return (
        "Without the hub, use a files source instead: download the data elsewhere as "
        'jsonl/parquet and point {"kind": "files", "paths": [...]} at it.'
    )


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "no message"


# --- the Python standard library -----------------------------------------------------------------


def _stdlib_units(source: StdlibSource) -> dict[str, Any]:
    return {unit.key: unit for unit in stdlib_corpus.units(source.part)}


def _stdlib_shard_documents(
    source: StdlibSource, num_shards: int, index: int
) -> Iterator[Document]:
    for key in _assigned_keys(_stdlib_units(source), num_shards, index):
        for doc in stdlib_corpus.documents(key, source.split):
            yield Document(doc.text, doc.id)
