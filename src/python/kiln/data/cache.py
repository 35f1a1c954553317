"""The token cache: its on-disk layout (format_version 4, docs/token-cache.md) and its reader.

    CACHE_DIR/
      STATUS                    RUNNING while merge writes, SUCCESS (written last) or FAILED
      cache.json                format_version, name, version, fingerprint, tokenizer, source, split, totals
      ledger.json               per shard: name, documents, tokens, first_document, first_token,
                                files (size and sha256 of each); files of the cache itself; finished
      stats.json                tokens, documents, text bytes, mean/max document length
      token_byte_lengths.npy    int32 [vocab_size]: UTF-8 bytes per token id, for bits-per-byte
      shards/shard-00000/       one jagged array in TensorStore zarr3 (as Marin/Levanter):
          offsets/              uint64 [documents + 1]: offsets[0] = documents, offsets[1 + i] = end of doc i,
                                in chunks of `offsets_stride` (1024) entries
          offsets_index.npy     uint64: the start of the first document of every offsets chunk
          data/                 uint16 (vocab <= 65536) or uint32 token ids, all documents concatenated,
                                in files of 1M tokens made of compressed chunks of 4K
          shard.json, STATUS    the shard's own record and success marker
          assistant_masks/      a chat or supervised cache only (cache.json `format`): each token's
                                loss mask, uint8, a jagged array of its own (offsets/, data/) with
                                the same offsets, as Levanter stores `assistant_masks`

An imported Levanter cache (kiln.data.levanter_cache) has no shard folder: its one ledger shard
names the `location` of Levanter's own `offsets`/`data` arrays (the same jagged layout) and the
`identity` (sha256 of Levanter's ledger and array metadata) it had when imported; the reader
recomputes that identity on open, so a cache changed under its location is never read.

The packed stream is all documents in cache order (each ends with EOS); window i of length L is
stream[i*L : (i+1)*L]. Reads touch only the shard slices a window needs: the 4K-token chunks
holding its tokens and the offsets chunks holding its documents' starts, found through the
index (kiln.data.document_ends), so opening a cache reads no array and costs the same whatever
its document count.

What the reader checks, cheaply, so that damaged content never trains a model: on open, that
every file the ledger lists is present with its recorded size, and that each shard's offsets
are consistent with the ledger (the document count, the last end the shard's token count, an
index of the right length); on every read, that token ids are below the tokenizer's vocabulary
size, and that each chunk of offsets read increases strictly and agrees with the index. Full digests are checked by
kiln.data.verify. A cache of format_version 1 records no sizes or digests: it is read with the
offsets and id checks only, and said to be unverified. Formats 2 and 3 (and imported shards)
have no offsets index: their offsets are read whole when the cache is opened and checked then.
Format 2 is format 3 without imported shards.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import io
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import tensorstore as ts

from kiln.artifacts import FAILED, SUCCESS
from kiln.artifacts.content import Damage, check_object_sizes
from kiln.artifacts.folder import ArtifactFolder
from kiln.artifacts.local import LocalStore
from kiln.artifacts.locations import open_store
from kiln.artifacts.storage_errors import as_storage_error
from kiln.artifacts.store import ObjectStore
from kiln.data.document_ends import OFFSETS_INDEX_FILE, read_ends
from kiln.data.errors import CacheDamaged, CacheError, KilnDataError
from kiln.data.tokenizer import TokenizerInfo
from kiln_contract.tokenize import LOSS_MASK_FIELD, MASKED_FORMATS

log = logging.getLogger(__name__)

FORMAT_VERSION = 4  # 4: offsets in small chunks with an index, tokens in chunks of 4K
# 2: each file's size and sha256; 3: a ledger shard may be an imported cache's arrays, elsewhere.
VERIFIED_FORMAT_VERSIONS = (2, 3, FORMAT_VERSION)
SHARD_FORMAT_VERSIONS = (FORMAT_VERSION,)  # shards a merge takes: older ones are tokenized again
UNVERIFIED_FORMAT_VERSION = 1  # still read, without size or digest checks
READABLE_FORMAT_VERSIONS = (UNVERIFIED_FORMAT_VERSION, *VERIFIED_FORMAT_VERSIONS)
CACHE_FILE = "cache.json"
LEDGER_FILE = "ledger.json"
STATS_FILE = "stats.json"
BYTE_LENGTHS_FILE = "token_byte_lengths.npy"
SHARDS_DIR = "shards"
SHARD_FILE = "shard.json"
OFFSETS_ARRAY = "offsets"
DATA_ARRAY = "data"
MASK_DATA = f"{LOSS_MASK_FIELD}/{DATA_ARRAY}"  # the loss mask's values in a shard
# Decoded chunks kept in memory: neighbouring windows usually share a 256K-token chunk.
READ_CACHE_BYTES = 256 << 20
TOKENS_PER_CHECK = 1 << 22  # tokens read at a time when every id of a cache is checked


def zarr_spec(path: Path) -> dict[str, Any]:
    """The spec of a zarr3 array in a local folder."""
    return zarr_spec_in(LocalStore(path), "")


def zarr_spec_in(store: ObjectStore, key: str) -> dict[str, Any]:
    """The spec of the zarr3 array under `key` in `store` (a folder or a bucket)."""
    return {"driver": "zarr3", "kvstore": store.kvstore(key)}


def records_digest(store: ObjectStore, keys: Sequence[str]) -> str:
    """sha256 over the objects `keys` of `store` (each key, its size, its bytes): the identity
    of an imported cache, from its small records rather than its terabytes of arrays."""
    digest = hashlib.sha256()
    for key in keys:
        data = store.read(key).data
        digest.update(f"{key}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


class CacheNotReady(KilnDataError):
    """The folder is not a finished cache (no STATUS SUCCESS): never read a partial cache."""


@dataclass(frozen=True)
class PackedBatch:
    """Windows of the packed stream, each array [n, seq_len].

    segment_ids number the documents within each window from 0 (a window that starts mid-document
    starts at 0 too); loss_mask[t] = 1 where tokens[t] predicts tokens[t+1] of the same segment,
    and in a chat or supervised cache only where tokens[t+1] is masked in (as Levanter shifts
    its `assistant_masks` into the loss weights). assistant_masks (None for text): 1 at each
    token the loss counts, the assistant's or the answer's, as the cache stores it.
    """

    tokens: np.ndarray  # int32
    segment_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # float32
    assistant_masks: np.ndarray | None = None  # uint8


@dataclass(frozen=True)
class _SliceRead:
    """A pending read of tokens [local, local + n) of one shard, for columns from `column`."""

    column: int
    shard: int
    local: int
    length: int
    future: ts.Future


def read_cache_records(store: ObjectStore) -> tuple[dict[str, Any], dict[str, Any]]:
    """(cache.json, ledger.json) of the finished cache at the root of `store` (a folder or a
    bucket), of a format this Kiln reads; CacheNotReady otherwise. Reads no array."""
    location = store.location("")
    folder = ArtifactFolder(store, "")
    status = folder.status()
    if status != SUCCESS:
        found = "no STATUS file" if status is None else f"STATUS {status}"
        reason = folder.stop_reason() if status == FAILED else None
        found += f": {reason}" if reason else ""
        raise CacheNotReady(
            f"{location} is not a finished token cache ({found}); build it with "
            "`python -m kiln.data.tokenize build` (or its Pants target) first."
        )
    info = json.loads(store.read(CACHE_FILE).data)
    version = info.get("format_version")
    if version not in READABLE_FORMAT_VERSIONS:
        readable = ", ".join(map(str, READABLE_FORMAT_VERSIONS))
        raise CacheNotReady(
            f"{location}: cache format_version {version}; this kiln reads {readable}. "
            "Rebuild the cache with this version of kiln."
        )
    if version == UNVERIFIED_FORMAT_VERSION:
        log.warning(
            "%s: cache format_version 1 records no file sizes or digests, so its files are "
            "read unverified; rebuild it (a new version) to have them checked",
            location,
        )
    return info, json.loads(store.read(LEDGER_FILE).data)


def cache_damaged(
    path: str | Path, info: dict[str, Any], shard: str | None, damage: Damage
) -> CacheDamaged:
    """The error for a damaged file of the cache at `path` (`shard` None: the cache's own)."""
    where = f"shard {shard}, file {damage.file}" if shard else f"file {damage.file}"
    return CacheDamaged(
        f"token cache {info.get('name')}@{info.get('version')} at {path}: "
        f"{where} {damage.reason}. The cache is damaged: delete the folder and rebuild it, "
        "or restore it from a good copy."
    )


class ImportedSource:
    """The other tool's cache an imported Kiln cache reads in place (kiln.data.levanter_cache):
    opened once, at the location its first shard's `identity` records; each shard's arrays are
    under the `location` it records, a folder of that cache."""

    def __init__(self, identity: dict[str, Any]) -> None:
        self.identity = identity
        self.store = open_store(identity["location"])
        self._root = self.store.location("").rstrip("/") + "/"

    @classmethod
    def of(cls, ledger: dict[str, Any]) -> ImportedSource | None:
        """The source of a ledger whose shards are an import's (they record a `location`)."""
        if not any("location" in shard for shard in ledger["shards"]):
            return None
        identity = next((s["identity"] for s in ledger["shards"] if "identity" in s), None)
        if identity is None:
            raise CacheDamaged(
                f"{LEDGER_FILE}: its shards are an import's but none records the import's "
                "identity; rebuild the cache."
            )
        return cls(identity)

    def array_spec(self, shard: dict[str, Any], array: str) -> dict[str, Any]:
        """The spec of a shard's `array` where the imported cache keeps it."""
        location = str(shard["location"]).rstrip("/") + "/"
        if not location.startswith(self._root):
            raise CacheDamaged(
                f"{LEDGER_FILE}: shard {shard['name']} is at {shard['location']}, outside the "
                f"imported cache at {self.identity['location']}; rebuild the cache."
            )
        return zarr_spec_in(self.store, location[len(self._root) :] + array)


class TokenCache:
    """A finished cache in a local folder or a bucket (`s3://`, `gs://`): its records are read
    through the object store, its arrays through TensorStore's matching kvstore driver."""

    def __init__(self, store: ObjectStore, info: dict[str, Any], ledger: dict[str, Any]) -> None:
        self.path = store.root_location.as_argument()  # for people
        self.store = store
        self.info = info
        self.ledger = ledger
        self.verified = info.get("format_version") in VERIFIED_FORMAT_VERSIONS
        self.num_documents = int(ledger["documents"])
        self.num_tokens = int(ledger["tokens"])
        # A chat or supervised cache stores each token's loss mask (LOSS_MASK_FIELD) beside its ids.
        self.masked = info.get("format") in MASKED_FORMATS
        shards = ledger["shards"]
        self._shard_names = [str(s["name"]) for s in shards]
        if self.verified:
            self._check_sizes()
        self.imported = ImportedSource.of(ledger)
        if self.imported is not None:
            self._check_imported_identity(self.imported)
        self.tokenizer = TokenizerInfo(
            **{key: value for key, value in info["tokenizer"].items() if key != "spec"},
            token_byte_lengths=np.load(io.BytesIO(self.store.read(BYTE_LENGTHS_FILE).data)),
        )
        context = ts.Context({"cache_pool": {"total_bytes_limit": READ_CACHE_BYTES}})
        self._first_documents = [int(s["first_document"]) for s in shards]
        self._first_tokens = [int(s["first_token"]) for s in shards]
        # Opens and reads are issued for all shards at once; TensorStore overlaps them.
        data = [self._open(s, DATA_ARRAY, context) for s in shards]
        offsets = [self._open(s, OFFSETS_ARRAY, context) for s in shards]
        masks = [self._open(s, MASK_DATA, context) for s in shards] if self.masked else []
        self._data = [self._wait(future, i, DATA_ARRAY) for i, future in enumerate(data)]
        self._masks = [self._wait(future, i, MASK_DATA) for i, future in enumerate(masks)]
        ends = [
            read_ends(
                self._wait(future, i, OFFSETS_ARRAY),
                shard,
                self._offsets_index(shard),
                functools.partial(self._wait, shard=i, array=OFFSETS_ARRAY),
                functools.partial(self._damaged_offsets, i),
            )
            for i, (future, shard) in enumerate(zip(offsets, shards))
        ]
        self._ends = [checked() for checked in ends]

    @classmethod
    def open(cls, location: str | Path) -> TokenCache:
        """The cache at a local path or a bucket URL; CacheNotReady unless it is finished."""
        store = open_store(location)
        return cls(store, *read_cache_records(store))

    @property
    def token_byte_lengths(self) -> np.ndarray:
        return self.tokenizer.token_byte_lengths

    def document(self, i: int) -> np.ndarray:
        return self._read_range(*self._document_range(i))

    def document_mask(self, i: int) -> np.ndarray:
        """Document i's loss mask, uint8, one per token: 1 where the loss counts the token (the
        assistant's turns of a chat, the answer of a prompt/answer pair)."""
        start, end = self._document_range(i)
        out = np.empty(end - start, np.uint8)
        for read in self._slice_reads(start, end, self._mask_arrays()):
            out[read.column : read.column + read.length] = self._wait(
                read.future, read.shard, MASK_DATA
            )
        return out

    def _document_range(self, i: int) -> tuple[int, int]:
        """Document i's [start, end) in the packed stream."""
        if not 0 <= i < self.num_documents:
            raise IndexError(f"document {i} out of range: the cache has {self.num_documents}.")
        shard = bisect.bisect_right(self._first_documents, i) - 1
        start, end = self._ends[shard].bounds(i - self._first_documents[shard])
        first = self._first_tokens[shard]
        return first + start, first + end

    def _mask_arrays(self) -> list[ts.TensorStore]:
        if not self.masked:
            raise CacheError(
                f"token cache {self.info.get('name')}@{self.info.get('version')} at {self.path} "
                "is a text cache: it stores no loss mask (a chat or supervised cache does)."
            )
        return self._masks

    def num_windows(self, seq_len: int) -> int:
        return self.num_tokens // seq_len

    def windows(self, indices: Sequence[int], seq_len: int) -> PackedBatch:
        available = self.num_windows(seq_len)
        starts = np.asarray(indices, np.int64) * seq_len
        if len(starts) and not (0 <= min(indices) and max(indices) < available):
            raise IndexError(
                f"window indices must be in [0, {available}) for seq_len {seq_len}; got {list(indices)}."
            )
        tokens, documents = self._read_windows(starts, seq_len)
        segment_ids = (documents - documents[:, :1]).astype(np.int32)
        loss_mask = np.zeros((len(starts), seq_len), np.float32)
        loss_mask[:, :-1] = segment_ids[:, 1:] == segment_ids[:, :-1]
        assistant_masks = self._read_window_masks(starts, seq_len) if self.masked else None
        if assistant_masks is not None:  # the loss counts a prediction of a masked-in token
            loss_mask[:, :-1] *= assistant_masks[:, 1:]
        return PackedBatch(tokens, segment_ids, loss_mask, assistant_masks)

    def _read_window_masks(self, starts: np.ndarray, seq_len: int) -> np.ndarray:
        out = np.empty((len(starts), seq_len), np.uint8)
        pending = [
            (row, read)
            for row, start in enumerate(starts)
            for read in self._slice_reads(int(start), int(start) + seq_len, self._masks)
        ]
        for row, read in pending:
            columns = slice(read.column, read.column + read.length)
            out[row, columns] = self._wait(read.future, read.shard, MASK_DATA)
        return out

    def check_every_token_id(self, tokens_per_read: int = TOKENS_PER_CHECK) -> None:
        """Reads the whole stream, every id checked against the vocabulary: CacheDamaged names
        the shard, file and position of the first one outside it. The next piece is read while
        one is checked (kiln.data.verify's full check)."""
        pending = self._slice_reads(0, min(tokens_per_read, self.num_tokens))
        for start in range(tokens_per_read, self.num_tokens + tokens_per_read, tokens_per_read):
            after = self._slice_reads(start, min(start + tokens_per_read, self.num_tokens))
            for read in pending:
                self._checked_tokens(read)
            pending = after

    def damaged(self, shard: str | None, damage: Damage) -> CacheDamaged:
        """The error for a damaged file of `shard` (None: a file of the cache itself)."""
        return cache_damaged(self.path, self.info, shard, damage)

    def _check_sizes(self) -> None:
        for damage in check_object_sizes(self.store, "", self.ledger.get("files", {})):
            raise self.damaged(None, damage)
        for shard in self.ledger["shards"]:
            folder = f"{SHARDS_DIR}/{shard['name']}"
            for damage in check_object_sizes(self.store, folder, shard["files"]):
                raise self.damaged(shard["name"], damage)

    def _check_imported_identity(self, imported: ImportedSource) -> None:
        """An imported cache's source must still be what was imported (same records digest)."""
        identity = imported.identity
        found = records_digest(imported.store, identity["keys"])
        if found != identity["sha256"]:
            raise CacheDamaged(
                f"token cache {self.info.get('name')}@{self.info.get('version')} at "
                f"{self.path}: the imported cache at {identity['location']} changed since it "
                f"was imported (its records' sha256 is {found[:12]}, was "
                f"{identity['sha256'][:12]}). Bump the target's version to import it again."
            )

    def _offsets_index(self, shard: dict[str, Any]) -> bytes | None:
        """A format-4 shard's offsets index (kiln.data.document_ends); None for older shards."""
        if "offsets_stride" not in shard:
            return None
        return self.store.read(f"{SHARDS_DIR}/{shard['name']}/{OFFSETS_INDEX_FILE}").data

    def _damaged_offsets(self, shard: int, problem: str) -> CacheDamaged:
        record = self.ledger["shards"][shard]
        return self.damaged(
            self._shard_names[shard],
            Damage(
                OFFSETS_ARRAY,
                f"(document boundaries) {problem}, but the ledger records {record['documents']} "
                f"documents of {record['tokens']} tokens",
            ),
        )

    def _wait(self, future: Any, shard: int, array: str) -> Any:
        """The result of a TensorStore open or read of `array` in shard `shard`; a failure is a
        StorageError (the OS refused) or CacheDamaged (the bytes are not a valid array)."""
        try:
            return future.result()
        except ValueError as e:
            shard_key = f"{SHARDS_DIR}/{self._shard_names[shard]}"
            failure = as_storage_error(e, self.store.location(shard_key))
            if failure is not None:
                raise failure from None
            detail = str(e).splitlines()[0]
            raise self.damaged(
                self._shard_names[shard], Damage(array, f"cannot be read ({detail})")
            ) from None

    def _read_windows(self, starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """The windows' tokens, and the (global) document each token is part of."""
        out = np.empty((len(starts), seq_len), np.int32)
        documents = np.empty((len(starts), seq_len), np.int64)
        # Issue every read first, then wait: TensorStore runs them concurrently.
        pending = [
            (row, read, self._ends[read.shard].locate(read.local, read.local + read.length - 1))
            for row, start in enumerate(starts)
            for read in self._slice_reads(int(start), int(start) + seq_len)
        ]
        for row, read, locate in pending:
            columns = slice(read.column, read.column + read.length)
            out[row, columns] = self._checked_tokens(read)
            found = locate(read.local + np.arange(read.length))
            documents[row, columns] = self._first_documents[read.shard] + found
        return out, documents

    def _read_range(self, start: int, end: int) -> np.ndarray:
        out = np.empty(end - start, np.int32)
        for read in self._slice_reads(start, end):
            piece = self._checked_tokens(read)
            out[read.column : read.column + len(piece)] = piece
        return out

    def _checked_tokens(self, read: _SliceRead) -> np.ndarray:
        """The tokens of `read`, after checking that every id is in the vocabulary."""
        piece = self._wait(read.future, read.shard, DATA_ARRAY)
        vocab_size = self.tokenizer.vocab_size
        if len(piece) and not (int(piece.max()) < vocab_size and int(piece.min()) >= 0):
            offset = int(np.argmax((piece >= vocab_size) | (piece < 0)))
            position = read.local + offset
            file_elements = self._data[read.shard].chunk_layout.write_chunk.shape[0]
            raise self.damaged(
                self._shard_names[read.shard],
                Damage(
                    f"{DATA_ARRAY}/c/{position // file_elements}",
                    f"holds token id {int(piece[offset])} at position {position}, not in the "
                    f"tokenizer's vocabulary of {vocab_size}",
                ),
            )
        return piece

    def _slice_reads(
        self, start: int, end: int, arrays: Sequence[ts.TensorStore] | None = None
    ) -> list[_SliceRead]:
        """Reads of global tokens [start, end) from the shards that hold them: their ids, or
        the values of `arrays` (one per shard, aligned with the ids: the loss masks)."""
        arrays = self._data if arrays is None else arrays
        reads = []
        shard = bisect.bisect_right(self._first_tokens, start) - 1
        position = start
        while position < end:
            shard_end = (
                self._first_tokens[shard + 1] if shard + 1 < len(self._data) else self.num_tokens
            )
            stop = min(end, shard_end)
            if stop > position:
                local = position - self._first_tokens[shard]
                future = arrays[shard][local : local + stop - position].read()
                reads.append(_SliceRead(position - start, shard, local, stop - position, future))
            position = stop
            shard += 1
        return reads

    def _open(self, shard: dict[str, Any], array: str, context: ts.Context) -> ts.Future:
        """Opens `array` of a shard: in its folder, or where an imported shard's arrays are."""
        if self.imported is not None and "location" in shard:
            spec = self.imported.array_spec(shard, array)
        else:
            spec = zarr_spec_in(self.store, f"{SHARDS_DIR}/{shard['name']}/{array}")
        return ts.open(spec, open=True, read=True, context=context)


class NamedCachePath(Protocol):
    """A cache as a run names it (kiln.train.spec.DatasetInput): errors say which dataset failed."""

    @property
    def name(self) -> str: ...

    @property
    def path(self) -> Path | str: ...


def open_caches(inputs: Sequence[NamedCachePath]) -> list[TokenCache]:
    """The caches a run reads, in order; a CacheError names the dataset that cannot be opened."""
    caches = []
    for item in inputs:
        try:
            caches.append(TokenCache.open(item.path))
        except (KilnDataError, OSError, ValueError) as e:
            raise CacheError(f"dataset {item.name} ({item.path}): {e}") from None
    return caches


def shared_tokenizer(
    inputs: Sequence[NamedCachePath], caches: Sequence[TokenCache]
) -> TokenizerInfo:
    """The tokenizer every cache was built with. Caches of one run must share it (same digest):
    token ids mean nothing across tokenizers. A CacheError lists each dataset's otherwise."""
    digests = {item.name: cache.tokenizer.digest for item, cache in zip(inputs, caches)}
    if len(set(digests.values())) > 1:
        listing = ", ".join(f"{name}: {cache.tokenizer.name} {digest[:12]}"
                            for (name, digest), cache in zip(digests.items(), caches))  # fmt: skip
        raise CacheError(
            f"the datasets were tokenized with different tokenizers ({listing}); "
            "retokenize them with one tokenizer"
        )
    return caches[0].tokenizer


