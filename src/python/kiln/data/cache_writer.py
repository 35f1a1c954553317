"""Writing token caches: one shard folder at a time (ShardWriter), then assembling the cache.

Atomicity: a shard is written into a hidden temp sibling and renamed into place after its
shard.json and STATUS; a cache gets STATUS RUNNING before assembly starts, SUCCESS only after
everything else is on disk, and FAILED when assembly fails. A process killed at any point
therefore leaves no folder that claims to be complete. The layout is documented in
kiln.data.cache.

Content records: a shard records the size and sha256 of each of its files in shard.json, read
back from disk once written (TensorStore writes them); the cache's ledger carries them, so
readers can check what they read (kiln.artifacts.content).

Callers are a folder's only writer (they hold its lease, kiln.artifacts.lease): temp folders
left beside a shard or cache by a killed build are deleted when it is next written.

In a bucket (kiln.artifacts.store), which has no rename, nothing is moved into place: a shard
written in a local staging folder is uploaded to its final keys in the cache, `shards/NAME/`,
its STATUS last (`upload_shard`), and the cache's records follow beside the shards, STATUS last
(`write_stored_cache`). The layout is the local one, so either reads the same.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import tensorstore as ts

from kiln.artifacts import (
    FAILED,
    RUNNING,
    STATUS_FILE,
    SUCCESS,
    atomic_write_bytes,
    atomic_write_json,
    clear_stop_reason,
    failure_reason,
    mark_failed,
    read_status,
    record_stop,
    write_status,
)
from kiln.artifacts.content import (
    check_digests,
    check_object_sizes,
    files_under,
    record_files,
)
from kiln.artifacts.store import ObjectStore, copy_folder_into, open_store, read_text
from kiln.data.cache import (
    BYTE_LENGTHS_FILE,
    CACHE_FILE,
    DATA_ARRAY,
    FORMAT_VERSION,
    LEDGER_FILE,
    OFFSETS_ARRAY,
    SHARD_FILE,
    SHARDS_DIR,
    STATS_FILE,
    zarr_spec,
)
from kiln.data.errors import CacheDamaged, CacheError
from kiln.data.tokenizer import EncodedDocuments
from kiln_contract.tokenize import shard_dir_name

# Zarr3 sharding: files ("outer chunks") of 4M elements made of 256K-element compressed chunks.
INNER_CHUNK = 1 << 18
OUTER_CHUNK = 1 << 22


class ShardWriter:
    """Appends encoded documents to one shard folder; `finish` makes it visible, atomically.

    Tokens are buffered and written in whole outer chunks, so each zarr file is written once.
    """

    def __init__(self, out_dir: Path, dtype: np.dtype) -> None:
        self.out_dir = out_dir
        self.dtype = np.dtype(dtype)
        self.tmp_dir = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
        remove_temp_siblings(out_dir)
        self.tmp_dir.mkdir(parents=True)
        self._data = _create_array(self.tmp_dir / DATA_ARRAY, self.dtype)
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0
        self._written_tokens = 0
        self._lengths: list[np.ndarray] = []

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        shutil.rmtree(self.tmp_dir, ignore_errors=True)  # a no-op after finish()

    def append(self, encoded: EncodedDocuments) -> None:
        self._pending.append(encoded.tokens.astype(self.dtype, copy=False))
        self._pending_tokens += len(encoded.tokens)
        self._lengths.append(encoded.lengths)
        if self._pending_tokens >= OUTER_CHUNK:
            self._flush(final=False)

    def finish(self, record: dict[str, Any]) -> dict[str, Any]:
        """Writes the rest, the offsets, shard.json (record + counts) and STATUS; then renames."""
        self._flush(final=True)
        lengths = np.concatenate([np.zeros(0, np.int64), *self._lengths])
        offsets = np.concatenate([[len(lengths)], np.cumsum(lengths)]).astype(np.uint64)
        offsets_array = _create_array(self.tmp_dir / OFFSETS_ARRAY, np.dtype(np.uint64))
        _write_at(offsets_array, 0, offsets)
        record = {
            **record,
            "format_version": FORMAT_VERSION,
            "dtype": self.dtype.name,
            "documents": len(lengths),
            "tokens": self._written_tokens,
            "max_document_tokens": int(lengths.max(initial=0)),
            "files": record_files(self.tmp_dir, files_under(self.tmp_dir)),
        }
        atomic_write_json(self.tmp_dir / SHARD_FILE, record)
        write_status(self.tmp_dir, SUCCESS)
        _replace_dir(self.tmp_dir, self.out_dir)
        return record

    def _flush(self, final: bool) -> None:
        if not self._pending:
            return
        block = np.concatenate(self._pending)
        size = len(block) if final else len(block) // OUTER_CHUNK * OUTER_CHUNK
        _write_at(self._data, self._written_tokens, block[:size])
        self._written_tokens += size
        self._pending = [block[size:]]
        self._pending_tokens = len(block) - size


def read_shard_record(shard_dir: Path) -> dict[str, Any]:
    """The shard.json of a complete shard folder; CacheError if the shard is missing or unfinished."""
    if not shard_dir.is_dir():
        raise CacheError(f"{shard_dir}: no such shard folder.")
    if read_status(shard_dir) != SUCCESS or not (shard_dir / SHARD_FILE).is_file():
        raise CacheError(
            f"{shard_dir}: the shard is incomplete (no {STATUS_FILE} SUCCESS): its tokenize step "
            "was interrupted or failed. Re-run `python -m kiln.data.tokenize shard` for it."
        )
    return json.loads((shard_dir / SHARD_FILE).read_text())


def check_shard_content(shard_dir: Path, record: dict[str, Any]) -> None:
    """Full digest check of a complete shard folder against its shard.json. A damaged shard is
    deleted (its caller holds its lease), so that the next build tokenizes it again."""
    damage = check_digests(shard_dir, record["files"])
    if damage:
        shutil.rmtree(shard_dir, ignore_errors=True)
        raise CacheDamaged(
            f"{shard_dir}: shard {record['index']}: file {damage[0].file} {damage[0].reason}; "
            "the shard was deleted: rerun to tokenize it again."
        )


def stored_shard_record(store: ObjectStore, key: str) -> dict[str, Any] | None:
    """The shard.json of the complete shard at `key` of `store` (STATUS SUCCESS), else None."""
    if (read_text(store, f"{key}/{STATUS_FILE}") or "").strip() != SUCCESS:
        return None
    text = read_text(store, f"{key}/{SHARD_FILE}")
    return None if text is None else json.loads(text)


def upload_shard(store: ObjectStore, key: str, shard_dir: Path) -> None:
    """Uploads a complete local shard folder to `key`, replacing what is there: the old STATUS
    is removed first and the new one uploaded last, so a cut-off upload never reads as a
    complete shard."""
    store.remove(f"{key}/{STATUS_FILE}")
    for stale in set(store.keys(key)) - set(files_under(shard_dir)):
        store.remove(f"{key}/{stale}")
    copy_folder_into(store, key, shard_dir)


def check_stored_shard(store: ObjectStore, key: str, record: dict[str, Any]) -> None:
    """Size check of an uploaded shard's objects against its shard.json (their digests were
    taken from the local files it was uploaded from). A damaged shard loses its STATUS (its
    caller holds its lease), so that the next build tokenizes it again."""
    damage = check_object_sizes(store, key, record["files"])
    if damage:
        store.remove(f"{key}/{STATUS_FILE}")
        raise CacheDamaged(
            f"{store.location(key)}: shard {record['index']}: file {damage[0].file} "
            f"{damage[0].reason}; the shard was marked incomplete: rerun to tokenize it again."
        )


def write_stored_cache(
    store: ObjectStore,
    records: list[dict[str, Any]],
    cache_record: dict[str, Any],
    token_byte_lengths: np.ndarray,
    artifact_record: tuple[str, bytes] | None = None,
) -> None:
    """Writes a cache's records beside its uploaded shards (shard i's record at index i):
    STATUS RUNNING, then the artifact record (name, bytes) if given, byte lengths, ledger,
    stats and cache.json, STATUS SUCCESS last; FAILED if writing fails."""
    store.write(STATUS_FILE, f"{RUNNING}\n".encode())
    clear_stop_reason(store, "")
    try:
        with tempfile.TemporaryDirectory(prefix="kiln-cache-records-") as staging:
            folder = Path(staging)
            if artifact_record is not None:
                (folder / artifact_record[0]).write_bytes(artifact_record[1])
            _write_records(
                folder, _ledger_shards(records), _stats(records), cache_record, token_byte_lengths
            )
            write_status(folder, SUCCESS)
            copy_folder_into(store, "", folder)  # STATUS last
    except BaseException as e:
        with contextlib.suppress(Exception):
            record_stop(store, "", failure_reason(e))
            store.write(STATUS_FILE, f"{FAILED}\n".encode())
        raise


def assemble_cache(
    cache_dir: Path,
    shards: list[tuple[Path, dict[str, Any]]],
    cache_record: dict[str, Any],
    token_byte_lengths: np.ndarray,
) -> None:
    """Moves complete shard folders (in index order) into cache_dir and writes the cache files.

    Shard folders are moved (renamed), falling back to a copy across file systems or for a
    symlinked folder; a shard already at its place (moved there by an interrupted assembly)
    stays. The ledger, stats and cache.json follow, and STATUS SUCCESS last; STATUS is RUNNING
    meanwhile, and FAILED if assembly fails.
    """
    with _writing(cache_dir):
        _assemble(cache_dir, shards, cache_record, token_byte_lengths)


def write_imported_cache(
    cache_dir: Path,
    shard: dict[str, Any],
    cache_record: dict[str, Any],
    token_byte_lengths: np.ndarray,
) -> None:
    """A cache of one imported shard (its arrays stay where they are: `shard["location"]`),
    written like an assembled one: STATUS RUNNING, the records, STATUS SUCCESS last."""
    with _writing(cache_dir):
        totals = {"documents": shard["documents"], "tokens": shard["tokens"]}
        stats = {**totals, "mean_document_tokens": shard["tokens"] / max(shard["documents"], 1)}
        _write_records(cache_dir, [shard], stats, cache_record, token_byte_lengths)


@contextlib.contextmanager
def _writing(cache_dir: Path) -> Iterator[None]:
    """STATUS RUNNING while the body writes the cache, SUCCESS after it, FAILED if it fails."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    write_status(cache_dir, RUNNING)
    clear_stop_reason(open_store(cache_dir), "")
    try:
        yield
    except BaseException as e:
        mark_failed(cache_dir, failure_reason(e))
        raise
    write_status(cache_dir, SUCCESS)


def _assemble(
    cache_dir: Path,
    shards: list[tuple[Path, dict[str, Any]]],
    cache_record: dict[str, Any],
    token_byte_lengths: np.ndarray,
) -> None:
    for index, (shard_dir, _) in enumerate(shards):
        destination = cache_dir / SHARDS_DIR / shard_dir_name(index)
        if shard_dir.absolute() != destination.absolute():
            _move_dir(shard_dir, destination)
    records = [record for _, record in shards]
    _write_records(
        cache_dir, _ledger_shards(records), _stats(records), cache_record, token_byte_lengths
    )


def _ledger_shards(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ledger's entries of the shards with these records, in index order, at shards/NAME."""
    ledger_shards, first_document, first_token = [], 0, 0
    for index, record in enumerate(records):
        ledger_shards.append(
            {
                "name": shard_dir_name(index),
                "documents": record["documents"],
                "tokens": record["tokens"],
                "first_document": first_document,
                "first_token": first_token,
                "files": record["files"],
            }
        )
        first_document += record["documents"]
        first_token += record["tokens"]
    return ledger_shards


def _write_records(
    cache_dir: Path,
    ledger_shards: list[dict[str, Any]],
    stats: dict[str, Any],
    cache_record: dict[str, Any],
    token_byte_lengths: np.ndarray,
) -> None:
    totals = {
        "documents": sum(shard["documents"] for shard in ledger_shards),
        "tokens": sum(shard["tokens"] for shard in ledger_shards),
    }
    atomic_write_bytes(cache_dir / BYTE_LENGTHS_FILE, _npy_bytes(token_byte_lengths))
    atomic_write_json(
        cache_dir / LEDGER_FILE,
        {
            "format_version": cache_record["format_version"],
            "shards": ledger_shards,
            **totals,
            "files": record_files(cache_dir, [BYTE_LENGTHS_FILE]),
            "finished": True,
        },
    )
    atomic_write_json(cache_dir / STATS_FILE, stats)
    atomic_write_json(cache_dir / CACHE_FILE, {**cache_record, **totals})


def _stats(records: list[dict[str, Any]]) -> dict[str, Any]:
    documents = sum(r["documents"] for r in records)
    tokens = sum(r["tokens"] for r in records)
    return {
        "documents": documents,
        "tokens": tokens,
        "text_bytes": sum(r["text_bytes"] for r in records),
        "skipped_empty_documents": sum(r["skipped_empty_documents"] for r in records),
        "mean_document_tokens": tokens / documents if documents else 0.0,
        "max_document_tokens": max((r["max_document_tokens"] for r in records), default=0),
    }


def _create_array(path: Path, dtype: np.dtype) -> ts.TensorStore:
    blosc = {"cname": "zstd", "clevel": 3, "shuffle": "shuffle", "typesize": dtype.itemsize}
    metadata = {
        "shape": [0],
        "data_type": dtype.name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [OUTER_CHUNK]}},
        "codecs": [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": [INNER_CHUNK],
                    "codecs": [
                        {"name": "bytes", "configuration": {"endian": "little"}},
                        {"name": "blosc", "configuration": blosc},
                    ],
                    "index_codecs": [
                        {"name": "bytes", "configuration": {"endian": "little"}},
                        {"name": "crc32c"},
                    ],
                },
            }
        ],
    }
    return ts.open({**zarr_spec(path), "metadata": metadata}, create=True).result()


def _write_at(array: ts.TensorStore, start: int, values: np.ndarray) -> None:
    if not len(values):
        return
    end = start + len(values)
    resized = array.resize(exclusive_max=[end], expand_only=True).result()
    resized[start:end].write(values).result()


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def remove_dead_temporaries(folder: Path) -> None:
    """Removes the temp folders (`.NAME.tmp-PID`) in `folder` whose process has ended: what a
    killed build left behind. A live process's temporaries are its own to finish or remove."""
    if not folder.is_dir():
        return
    for entry in folder.iterdir():
        pid = _temporary_owner(entry.name)
        if pid is not None and not _is_running(pid):
            shutil.rmtree(entry, ignore_errors=True)


def _temporary_owner(name: str) -> int | None:
    head, marker, pid = name.rpartition(".tmp-")
    if not (name.startswith(".") and marker and pid.isdigit()):
        return None
    return int(pid)


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True


def _replace_dir(source: Path, destination: Path) -> None:
    if destination.exists():
        shutil.rmtree(destination)
    os.rename(source, destination)


def remove_temp_siblings(folder: Path) -> None:
    """Deletes the temp folders `.{name}.tmp-PID` beside `folder`: left by killed writers, or
    this process's own from an earlier attempt."""
    for temp in folder.parent.glob(f".{folder.name}.tmp-*"):
        shutil.rmtree(temp, ignore_errors=True)


def _move_dir(source: Path, destination: Path) -> None:
    destination.parent.mkdir(parents=True, exist_ok=True)
    remove_temp_siblings(destination)
    if destination.exists():
        shutil.rmtree(destination)
    if not source.is_symlink():
        try:
            os.rename(source, destination)
            return
        except OSError:
            pass  # another file system: copy below
    staging = destination.parent / f".{destination.name}.tmp-{os.getpid()}"
    shutil.copytree(source, staging)
    os.rename(staging, destination)
