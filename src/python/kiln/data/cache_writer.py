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

Every shard and cache is read and written through the object store (kiln.artifacts.store), so
a local folder and a bucket take the same code. Where they differ is said once: a shard is
written in a local folder, its own place in a local store and a staging folder uploaded to its
final keys in a bucket (`ArtifactFolder.local_output`), and a bucket has no rename, so a shard in a bucket
is built at its place in the cache, `shards/NAME/`, while a local one may be moved there
(`write_cache`). The layout is the same, so either reads the same.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts

from kiln.artifacts import RECORD_FILE, RUNNING, STATUS_FILE, SUCCESS, failure_reason
from kiln.artifacts.atomic import atomic_write_bytes, atomic_write_json, json_bytes
from kiln.artifacts.content import (
    check_object_digests,
    check_object_sizes,
    files_under,
    record_bytes,
    record_files,
)
from kiln.artifacts.folder import ArtifactFolder
from kiln.artifacts.local import LocalStore
from kiln.artifacts.store import ObjectStore, read_text
from kiln.data import document_ends
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
from kiln.data.document_ends import OFFSETS_INDEX_FILE, npy_bytes
from kiln.data.errors import CacheDamaged, CacheError
from kiln.data.tokenizer import EncodedDocuments
from kiln_contract.processes import is_running
from kiln_contract.tokenize import LOSS_MASK_FIELD, LOSS_TOKENS, shard_dir_name

# Zarr3 sharding: files ("outer chunks") of 1M tokens made of compressed chunks of 4K, so that a
# window read decodes little more than the window, and each file's index of chunks is 4 kB
# (format 3: 4M-token files of 256K chunks).
INNER_CHUNK = 1 << 12
OUTER_CHUNK = 1 << 20
OFFSETS_CHUNKS_PER_FILE = 256  # of offsets_stride entries each: a 4 kB index too


class ShardWriter:
    """Appends encoded documents to one shard folder; `finish` makes it visible, atomically.

    Tokens are buffered and written in whole outer chunks, so each zarr file is written once.
    A `masked` shard (a chat or supervised cache) also holds each token's loss mask as a jagged
    array of its own, `assistant_masks/{offsets,data}` (uint8), as Levanter's TreeStore keeps a
    field beside `input_ids`.
    """

    def __init__(self, out_dir: Path, dtype: np.dtype, masked: bool = False) -> None:
        self.out_dir = out_dir
        self.dtype = np.dtype(dtype)
        self.tmp_dir = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
        remove_temp_siblings(out_dir)
        self.tmp_dir.mkdir(parents=True)
        self._tokens = _ChunkedColumn(self.tmp_dir, self.dtype)
        mask_folder = self.tmp_dir / LOSS_MASK_FIELD  # a chat or supervised cache's
        self._masks = _ChunkedColumn(mask_folder, np.dtype(np.uint8)) if masked else None
        self._lengths: list[np.ndarray] = []
        self._loss_tokens = 0  # masked in: the tokens a training's loss counts

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.tmp_dir, ignore_errors=True)  # a no-op after finish()

    def append(self, encoded: EncodedDocuments) -> None:
        self._tokens.append(encoded.tokens)
        if self._masks is not None:
            assert encoded.masks is not None  # a masked format's encoder gives them
            self._masks.append(encoded.masks)
            self._loss_tokens += int(encoded.masks.sum())
        self._lengths.append(encoded.lengths)

    def finish(self, record: dict[str, Any]) -> dict[str, Any]:
        """Writes the rest, the offsets, shard.json (record + counts) and STATUS; then renames."""
        lengths = np.concatenate([np.zeros(0, np.int64), *self._lengths])
        offsets = np.concatenate([[len(lengths)], np.cumsum(lengths)]).astype(np.uint64)
        self._tokens.finish(offsets)
        if self._masks is not None:
            self._masks.finish(offsets)  # the same documents: the same offsets
        index = document_ends.offsets_index(offsets, document_ends.OFFSETS_STRIDE)
        atomic_write_bytes(self.tmp_dir / OFFSETS_INDEX_FILE, npy_bytes(index))
        record = {
            **record,
            "format_version": FORMAT_VERSION,
            "offsets_stride": document_ends.OFFSETS_STRIDE,
            "dtype": self.dtype.name,
            "documents": len(lengths),
            "tokens": self._tokens.written,
            **({} if self._masks is None else {LOSS_TOKENS: self._loss_tokens}),
            "max_document_tokens": int(lengths.max(initial=0)),
            "files": record_files(self.tmp_dir, files_under(self.tmp_dir)),
        }
        atomic_write_json(self.tmp_dir / SHARD_FILE, record)
        ArtifactFolder.at(self.tmp_dir).write_status(SUCCESS)
        _replace_dir(self.tmp_dir, self.out_dir)
        return record


class _ChunkedColumn:
    """One jagged array in `folder` (`data/` and `offsets/`): values buffered and written in
    whole outer chunks, the offsets (one chunk of them per entry of the index) at the end."""

    def __init__(self, folder: Path, dtype: np.dtype) -> None:
        self._folder = folder
        self._dtype = dtype
        self._data = _create_array(folder / DATA_ARRAY, dtype, INNER_CHUNK, OUTER_CHUNK)
        self._pending: list[np.ndarray] = []
        self._pending_values = 0
        self.written = 0

    def append(self, values: np.ndarray) -> None:
        self._pending.append(values.astype(self._dtype, copy=False))
        self._pending_values += len(values)
        if self._pending_values >= OUTER_CHUNK:
            self._flush(final=False)

    def finish(self, offsets: np.ndarray) -> None:
        self._flush(final=True)
        stride = document_ends.OFFSETS_STRIDE
        offsets_array = _create_array(
            self._folder / OFFSETS_ARRAY, np.dtype(np.uint64), stride, stride * OFFSETS_CHUNKS_PER_FILE
        )
        _write_at(offsets_array, 0, offsets)

    def _flush(self, final: bool) -> None:
        if not self._pending:
            return
        block = np.concatenate(self._pending)
        size = len(block) if final else len(block) // OUTER_CHUNK * OUTER_CHUNK
        _write_at(self._data, self.written, block[:size])
        self.written += size
        self._pending = [block[size:]]
        self._pending_values = len(block) - size


def shard_record(store: ObjectStore) -> dict[str, Any] | None:
    """The shard.json of the complete shard at the root of `store` (STATUS SUCCESS), else None."""
    if (read_text(store, STATUS_FILE) or "").strip() != SUCCESS:
        return None
    text = read_text(store, SHARD_FILE)
    return None if text is None else json.loads(text)


def missing_shard(store: ObjectStore) -> CacheError:
    """Why the root of `store` holds no complete shard."""
    where = store.location("")
    if not store.folder_exists(""):
        return CacheError(f"{where}: no such shard folder.")
    return CacheError(
        f"{where}: the shard is incomplete (no {STATUS_FILE} SUCCESS): its tokenize step "
        "was interrupted or failed. Re-run `python -m kiln.data.tokenize shard` for it."
    )


def check_shard(store: ObjectStore, record: dict[str, Any]) -> None:
    """Checks a complete shard's files against its shard.json: every digest in a local folder,
    each object's size in a bucket (its digests were taken from the local files it was
    uploaded from). A damaged shard loses its STATUS (its caller holds its lease), so that the
    next build tokenizes it again."""
    files = record["files"]
    check = check_object_sizes if store.root_location.in_bucket else check_object_digests
    damage = check(store, "", files)
    if damage:
        store.remove(STATUS_FILE)
        raise CacheDamaged(
            f"{store.location('')}: shard {record['index']}: file {damage[0].file} "
            f"{damage[0].reason}; the shard was marked incomplete: rerun to tokenize it again."
        )


def write_cache(
    cache: ObjectStore,
    shards: list[tuple[ObjectStore, dict[str, Any]]],
    cache_record: dict[str, Any],
    token_byte_lengths: np.ndarray,
    artifact_record: bytes | None = None,
) -> None:
    """Places complete shards (shard i at index i) in the cache at `shards/NAME` and writes its
    records: STATUS RUNNING, the artifact record if given, byte lengths, ledger, stats and
    cache.json, STATUS SUCCESS last; FAILED and the reason (FAILURE_FILE) if writing fails.

    A shard already at its place (built there in a bucket, or moved there by an interrupted
    merge) stays; a local shard folder elsewhere is moved (renamed), falling back to a copy
    across file systems or for a symlinked folder.
    """
    with _writing(cache):
        if artifact_record is not None:
            cache.write(RECORD_FILE, artifact_record)
        for index, (shard, _) in enumerate(shards):
            _place_shard(shard, cache, f"{SHARDS_DIR}/{shard_dir_name(index)}")
        records = [record for _, record in shards]
        _write_records(
            cache, _ledger_shards(records), _stats(records), cache_record, token_byte_lengths
        )


def shard_in_place(shard: ObjectStore, cache: ObjectStore, key: str) -> bool:
    """Whether the shard at the root of `shard` is the cache's folder `key` already."""
    here, there = shard.root_location.folder, cache.root_location.under(key).folder
    if here is None or there is None:
        return shard.location("") == cache.location(key)
    return here.absolute() == there.absolute()


def _place_shard(shard: ObjectStore, cache: ObjectStore, key: str) -> None:
    if shard_in_place(shard, cache, key):
        return
    here, there = shard.root_location.folder, cache.root_location.under(key).folder
    if here is None or there is None:  # refused before: see tokenize
        raise CacheError(f"{shard.location('')} cannot be moved to {cache.location(key)}.")
    _move_dir(here, there)


def write_imported_cache(
    cache_dir: Path,
    shards: list[dict[str, Any]],
    cache_record: dict[str, Any],
    token_byte_lengths: np.ndarray,
) -> None:
    """A cache of imported shards (their arrays stay where they are: each shard's `location`),
    written like an assembled one: STATUS RUNNING, the records, STATUS SUCCESS last."""
    cache = LocalStore(cache_dir)
    with _writing(cache):
        documents = sum(shard["documents"] for shard in shards)
        tokens = sum(shard["tokens"] for shard in shards)
        stats = {
            "documents": documents, "tokens": tokens,
            "mean_document_tokens": tokens / max(documents, 1),
        }  # fmt: skip
        _write_records(cache, shards, stats, cache_record, token_byte_lengths)


@contextlib.contextmanager
def _writing(cache: ObjectStore) -> Iterator[None]:
    """STATUS RUNNING while the body writes the cache, SUCCESS after it, FAILED if it fails."""
    folder = ArtifactFolder(cache, "")
    folder.write_status(RUNNING)
    folder.clear_stop_reason()
    try:
        yield
    except BaseException as e:
        with contextlib.suppress(Exception):  # as far as the store allows; the error goes on
            folder.mark_failed(failure_reason(e))
        raise
    folder.write_status(SUCCESS)


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
                **{key: record[key] for key in ("offsets_stride", LOSS_TOKENS) if key in record},
            }
        )
        first_document += record["documents"]
        first_token += record["tokens"]
    return ledger_shards


def _write_records(
    cache: ObjectStore,
    ledger_shards: list[dict[str, Any]],
    stats: dict[str, Any],
    cache_record: dict[str, Any],
    token_byte_lengths: np.ndarray,
) -> None:
    totals = {
        "documents": sum(shard["documents"] for shard in ledger_shards),
        "tokens": sum(shard["tokens"] for shard in ledger_shards),
        **_loss_tokens(ledger_shards),
    }
    byte_lengths = npy_bytes(token_byte_lengths)
    cache.write(BYTE_LENGTHS_FILE, byte_lengths)
    ledger = {
        "format_version": cache_record["format_version"],
        "shards": ledger_shards,
        **totals,
        "files": {BYTE_LENGTHS_FILE: record_bytes(byte_lengths)},
        "finished": True,
    }
    cache.write(LEDGER_FILE, json_bytes(ledger))
    cache.write(STATS_FILE, json_bytes(stats))
    cache.write(CACHE_FILE, json_bytes({**cache_record, **totals}))


def _stats(records: list[dict[str, Any]]) -> dict[str, Any]:
    documents = sum(r["documents"] for r in records)
    tokens = sum(r["tokens"] for r in records)
    return {
        "documents": documents,
        "tokens": tokens,
        **_loss_tokens(records),
        "text_bytes": sum(r["text_bytes"] for r in records),
        "skipped_empty_documents": sum(r["skipped_empty_documents"] for r in records),
        "mean_document_tokens": tokens / documents if documents else 0.0,
        "max_document_tokens": max((r["max_document_tokens"] for r in records), default=0),
    }


def _loss_tokens(shards: list[dict[str, Any]]) -> dict[str, int]:
    """A chat or supervised cache's masked-in tokens, summed over its shards; {} for text."""
    if not shards or LOSS_TOKENS not in shards[0]:
        return {}
    return {LOSS_TOKENS: sum(shard[LOSS_TOKENS] for shard in shards)}


def _create_array(path: Path, dtype: np.dtype, inner_chunk: int, outer: int) -> ts.TensorStore:
    outer_chunk = max(inner_chunk, outer // inner_chunk * inner_chunk)  # whole chunks a file
    blosc = {"cname": "zstd", "clevel": 3, "shuffle": "shuffle", "typesize": dtype.itemsize}
    metadata = {
        "shape": [0],
        "data_type": dtype.name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [outer_chunk]}},
        "codecs": [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": [inner_chunk],
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


def remove_dead_temporaries(folder: Path) -> None:
    """Removes the temporaries (`.NAME.tmp-PID` folders and files, kiln.artifacts.atomic) in
    `folder` whose process has ended: what a killed build left behind. A live process's
    temporaries are its own to finish or remove."""
    if not folder.is_dir():
        return
    for entry in folder.iterdir():
        pid = _temporary_owner(entry.name)
        if pid is None or is_running(pid):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _temporary_owner(name: str) -> int | None:
    head, marker, pid = name.rpartition(".tmp-")
    if not (name.startswith(".") and marker and pid.isdigit()):
        return None
    return int(pid)


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
