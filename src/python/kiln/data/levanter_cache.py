"""Importing a finished Levanter/Marin token cache: read where it is, never re-tokenized.

Levanter's cache of one split (levanter/store/cache.py `CacheLedger`, `ShardedCacheLayout`;
jagged_array.py; tree_store.py) comes in two layouts, named by its ledger's `layout` field:

    consolidated (Levanter's `build_or_load_cache`; ledgers without `layout` are this one)
        SPLIT_DIR/shard_ledger.json   total_num_rows, shard_rows, is_finished, finished_shards,
                                      field_counts, layout, metadata.preprocessor_metadata
        SPLIT_DIR/input_ids/{offsets,data}
    sharded (Marin's `tokenize` step: Levanter's `write_levanter_cache` per part, then
             `consolidate_shard_cache_ledgers`)
        SPLIT_DIR/shard_ledger.json   as above, plus field_counts_by_shard; finished_shards
                                      names the parts, in order
        SPLIT_DIR/part-00000-of-00002/input_ids/{offsets,data}, ...

Each `input_ids/` is a jagged array: offsets int64 [2**54] (offsets[0] = rows, offsets[1 + i] =
end of row i) and data, the token ids (int64 as Levanter writes them) of the rows concatenated:
the layout of Kiln's own shards. So the import writes only a Kiln cache folder whose ledger has a
shard per part naming that part's arrays (`location`); the first shard also carries the source's
`identity`, the sha256 of Levanter's ledger and every part's array metadata, which every open
recomputes (kiln.data.cache). Before that it checks the ledger's counts against the arrays and
the cache against the declared tokenizer (`check_tokenizer`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts

from kiln.artifacts.locations import open_store
from kiln.artifacts.storage_errors import as_storage_error
from kiln.artifacts.store import ObjectMissing, ObjectStore
from kiln.data.cache import DATA_ARRAY, FORMAT_VERSION, OFFSETS_ARRAY, records_digest, zarr_spec_in
from kiln.data.cache_writer import write_imported_cache
from kiln.data.errors import SourceError
from kiln.data.tokenizer import LoadedTokenizer
from kiln_contract.location import in_bucket
from kiln_contract.tokenize import CacheSpec, LevanterCacheSource

LEDGER_FILE = "shard_ledger.json"
TOKENS_FIELD = "input_ids"
CONSOLIDATED = "consolidated"
SHARDED = "sharded"
LAYOUTS = (CONSOLIDATED, SHARDED)
IMPORTED_SHARD = "levanter"  # the one shard of a consolidated import
# How much of the cache the tokenizer check reads from the start of each part: its first
# documents, up to a share of CHECKED_TOKENS; without tokenizer metadata in the ledger the
# vocabulary rests on the ids alone, so the scan reads up to SCANNED_TOKENS.
CHECKED_DOCUMENTS = 100
CHECKED_TOKENS = 1 << 20
SCANNED_DOCUMENTS = 1 << 16
SCANNED_TOKENS = 1 << 24


@dataclass(frozen=True)
class LevanterPart:
    """One jagged array of the cache: `prefix` + input_ids/ (prefix "" when consolidated)."""

    name: str
    prefix: str
    documents: int
    tokens: int | None  # as the ledger counts them, if it does

    @property
    def key(self) -> str:
        return f"{self.prefix}{TOKENS_FIELD}"


@dataclass(frozen=True)
class LevanterLedger:
    """A finished cache's shard_ledger.json, checked: its layout and parts, in ledger order."""

    layout: str
    documents: int
    parts: tuple[LevanterPart, ...]
    preprocessor_metadata: dict[str, Any]

    @property
    def tokens(self) -> int | None:
        counts = [part.tokens for part in self.parts]
        return None if None in counts else sum(c for c in counts if c is not None)

    def identity_keys(self) -> list[str]:
        """Levanter's ledger and every part's array metadata: what pins the cache's identity."""
        arrays = [f"{part.key}/{array}/zarr.json" for part in self.parts
                  for array in (OFFSETS_ARRAY, DATA_ARRAY)]  # fmt: skip
        return [LEDGER_FILE, *arrays]

    def describe(self) -> dict[str, Any]:
        """What `plan` reports of an import: the layout and the ledger's counts."""
        return {
            "layout": self.layout,
            "parts": len(self.parts),
            "documents": self.documents,
            "tokens": self.tokens,
            "tokenizer": self.preprocessor_metadata.get("tokenizer"),
            "vocab_size": self.preprocessor_metadata.get("vocab_size"),
        }


def import_levanter_cache(spec: CacheSpec, out_dir: Path, tokenizer: LoadedTokenizer) -> Path:
    """Checks the Levanter cache `spec.source` names against `tokenizer` and writes the Kiln
    cache that reads it in place into out_dir. SourceError names the cache and the problem."""
    source = spec.source
    assert isinstance(source, LevanterCacheSource)
    where = _where(spec)
    store, ledger = _source_ledger(spec)
    arrays = [_open_part(store, part, where) for part in ledger.parts]
    tokens = [_checked_counts(part, offsets, where) for part, (offsets, _) in zip(ledger.parts, arrays)]
    scanned = check_tokenizer(where, ledger, arrays, tokenizer)
    shards = _ledger_shards(store, ledger, tokens)
    keys = ledger.identity_keys()
    shards[0]["identity"] = {
        "location": source.location, "keys": keys, "sha256": records_digest(store, keys),
    }  # fmt: skip
    record = {
        "format_version": FORMAT_VERSION,
        "name": spec.name,
        "version": spec.version,
        "fingerprint": spec.fingerprint,
        "split": None,
        "source": {
            "kind": source.kind,
            "location": source.location,
            "layout": ledger.layout,
            "parts": len(ledger.parts),
            "dtype": arrays[0][1].dtype.name,
            "preprocessor_metadata": ledger.preprocessor_metadata,
            "tokenizer_check": scanned,
        },
        "num_shards": len(shards),
        "tokenizer": {**tokenizer.info.to_json(), "spec": tokenizer.spec.to_json()},
    }
    write_imported_cache(out_dir, shards, record, tokenizer.info.token_byte_lengths)
    return out_dir


def _ledger_shards(
    store: ObjectStore, ledger: LevanterLedger, tokens: list[int]
) -> list[dict[str, Any]]:
    """The Kiln ledger's shards: one per part, in ledger order, each naming its arrays."""
    shards, first_document, first_token = [], 0, 0
    for part, part_tokens in zip(ledger.parts, tokens):
        shards.append({
            "name": IMPORTED_SHARD if ledger.layout == CONSOLIDATED else part.name,
            "location": store.location(part.key),
            "documents": part.documents,
            "tokens": part_tokens,
            "first_document": first_document,
            "first_token": first_token,
            "files": {},  # the source's files are pinned by `identity`, not listed one by one
        })  # fmt: skip
        first_document += part.documents
        first_token += part_tokens
    return shards


def plan_import(spec: CacheSpec) -> dict[str, Any]:
    """The import `plan` shows: the cache's location, layout, parts, documents and tokens, from
    its ledger alone (no array is opened). SourceError for a ledger Kiln cannot import."""
    store, ledger = _source_ledger(spec)
    assert isinstance(spec.source, LevanterCacheSource)
    # The ids' type as Levanter stored them (the first part's array metadata, one small read).
    dtype = _open_part(store, ledger.parts[0], _where(spec))[1].dtype.name if ledger.parts else None
    return {"location": spec.source.location, "dtype": dtype, **ledger.describe()}


def _source_ledger(spec: CacheSpec) -> tuple[ObjectStore, LevanterLedger]:
    """The store of the Levanter cache `spec` imports (where its location enters, from the
    spec) and its ledger."""
    assert isinstance(spec.source, LevanterCacheSource)
    store = open_store(spec.source.location)
    return store, read_ledger(store, _where(spec))


def _where(spec: CacheSpec) -> str:
    assert isinstance(spec.source, LevanterCacheSource)
    return f"{spec.name}: the Levanter cache at {spec.source.location}"


def read_ledger(store: ObjectStore, where: str) -> LevanterLedger:
    """The split's shard_ledger.json, finished, of a known layout, its counts consistent."""
    ledger = _finished_ledger(store, where)
    layout = ledger.get("layout", CONSOLIDATED)
    if layout not in LAYOUTS:
        raise SourceError(
            f"{where}: {LEDGER_FILE} field `layout` is {layout!r}; Kiln imports the layouts "
            f"{CONSOLIDATED!r} ({TOKENS_FIELD}/ beside the ledger) and {SHARDED!r} (an "
            f"{TOKENS_FIELD}/ in each part `finished_shards` names). Consolidate it with "
            "Levanter, or import it with a Kiln that reads this layout."
        )
    documents = _count(ledger, "total_num_rows", where)
    metadata = dict((ledger.get("metadata") or {}).get("preprocessor_metadata") or {})
    parts = _sharded_parts(ledger, where) if layout == SHARDED else (
        LevanterPart(IMPORTED_SHARD, "", documents, _field_count(ledger.get("field_counts"))),
    )  # fmt: skip
    counted = sum(part.documents for part in parts)
    if counted != documents:
        raise SourceError(
            f"{where}: {LEDGER_FILE} field `shard_rows` counts {counted} rows over "
            f"`finished_shards`, its `total_num_rows` says {documents}: the ledger is damaged."
        )
    parts = tuple(part for part in parts if part.documents)  # an empty part holds nothing
    if not parts:
        raise SourceError(f"{where} holds no rows ({LEDGER_FILE}): there is nothing to import.")
    return LevanterLedger(layout, documents, parts, metadata)


def _finished_ledger(store: ObjectStore, where: str) -> dict[str, Any]:
    try:
        ledger = json.loads(store.read(LEDGER_FILE).data)
    except ObjectMissing:
        raise SourceError(
            f"{where} has no {LEDGER_FILE}: give the folder of one split (the one holding "
            f"{LEDGER_FILE}), e.g. .../train."
        ) from None
    except ValueError as e:
        raise SourceError(f"{where}: {LEDGER_FILE} is not valid JSON ({e}).") from None
    if not isinstance(ledger, dict) or ledger.get("is_finished") is not True:
        raise SourceError(
            f"{where} is not finished ({LEDGER_FILE} has no `is_finished: true`): let Levanter "
            "finish building it first."
        )
    return ledger


def _sharded_parts(ledger: dict[str, Any], where: str) -> tuple[LevanterPart, ...]:
    names = ledger.get("finished_shards")
    rows = ledger.get("shard_rows")
    by_shard = ledger.get("field_counts_by_shard") or {}
    if not isinstance(names, list) or not isinstance(rows, dict) or not isinstance(by_shard, dict):
        raise SourceError(
            f"{where}: a sharded {LEDGER_FILE} needs the list `finished_shards` and the objects "
            "`shard_rows` and `field_counts_by_shard`: the ledger is damaged."
        )
    parts = []
    for index, name in enumerate(names):
        field = f"finished_shards[{index}]"
        if not isinstance(name, str) or not name or in_bucket(name) or name.startswith("/") or (
            ".." in name.split("/")
        ):
            raise SourceError(
                f"{where}: {LEDGER_FILE} field `{field}` is {name!r}, not a part's folder "
                "relative to the split: the ledger is damaged."
            )
        if not isinstance(rows.get(name), int) or rows[name] < 0:
            raise SourceError(
                f"{where}: {LEDGER_FILE} field `shard_rows` has no row count for the part "
                f"{name!r} (`{field}`): the ledger is damaged."
            )
        tokens = _field_count(by_shard.get(name))
        parts.append(LevanterPart(name, f"{name.rstrip('/')}/", rows[name], tokens))
    return tuple(parts)


def _count(ledger: dict[str, Any], field: str, where: str) -> int:
    value = ledger.get(field)
    if not isinstance(value, int) or value < 0:
        raise SourceError(f"{where}: {LEDGER_FILE} field `{field}` is {value!r}, not a count.")
    return value


def _field_count(counts: Any) -> int | None:
    """The token count of input_ids in a ledger's `counts` object, if it records one."""
    value = counts.get(TOKENS_FIELD) if isinstance(counts, dict) else None
    return value if isinstance(value, int) else None


def _open_part(
    store: ObjectStore, part: LevanterPart, where: str
) -> tuple[ts.TensorStore, ts.TensorStore]:
    """(offsets, data) of one part, each opened and checked to be an integer array of rank 1."""
    opened = []
    for name in (OFFSETS_ARRAY, DATA_ARRAY):
        key = f"{part.key}/{name}"
        try:
            array = ts.open(zarr_spec_in(store, key), open=True, read=True).result()
        except ValueError as e:
            failure = as_storage_error(e, store.location(key))
            if failure is not None:
                raise failure from None
            detail = str(e).splitlines()[0]
            raise SourceError(
                f"{where}: {key} is not a readable zarr3 array ({detail}); the {part.documents} "
                f"rows {LEDGER_FILE} records for it are missing."
            ) from None
        if array.rank != 1 or not np.issubdtype(np.dtype(array.dtype.numpy_dtype), np.integer):
            raise SourceError(
                f"{where}: {key} is a {array.dtype.name} array of rank {array.rank}; a token "
                "cache's are integer arrays of rank 1 (text caches only: not chat or supervised)."
            )
        opened.append(array)
    return opened[0], opened[1]


def _checked_counts(part: LevanterPart, offsets: ts.TensorStore, where: str) -> int:
    """The part's token count, after checking its rows and tokens against the ledger."""
    rows = int(offsets[0].read().result())
    if rows != part.documents:
        raise SourceError(
            f"{where}: {part.key}/offsets holds {rows} rows, {LEDGER_FILE} field `shard_rows` "
            f"says {part.documents}: the part is damaged or was not finished."
        )
    tokens = int(offsets[rows].read().result())
    if part.tokens is not None and tokens != part.tokens:
        raise SourceError(
            f"{where}: {part.key} holds {tokens} tokens, {LEDGER_FILE} field "
            f"`field_counts{'' if part.prefix == '' else '_by_shard'}` says {part.tokens}: "
            "the part is damaged or was not finished."
        )
    return tokens


def check_tokenizer(
    where: str,
    ledger: LevanterLedger,
    arrays: list[tuple[ts.TensorStore, ts.TensorStore]],
    tokenizer: LoadedTokenizer,
) -> dict[str, Any]:
    """The cache must have been tokenized by `tokenizer`: the vocabulary size Levanter recorded
    (Marin's ledgers record none), and the ids at the start of every part: in the vocabulary,
    each document ending with EOS. Returns what was checked, for cache.json."""
    info = tokenizer.info
    recorded = ledger.preprocessor_metadata.get("vocab_size")
    if recorded is not None and recorded != info.vocab_size:
        raise SourceError(
            f"{where} was tokenized by {ledger.preprocessor_metadata.get('tokenizer')!r} with a "
            f"vocabulary of {recorded}; the target's tokenizer {info.name} has {info.vocab_size}. "
            "Declare the tokenizer the cache was built with."
        )
    documents, budget = (
        (CHECKED_DOCUMENTS, CHECKED_TOKENS) if recorded else (SCANNED_DOCUMENTS, SCANNED_TOKENS)
    )
    share = max(budget // len(arrays), 1)
    ends = [
        offsets[1 : min(part.documents, documents) + 1].read()
        for part, (offsets, _) in zip(ledger.parts, arrays)
    ]
    scanned = 0
    for part, (_, data), read in zip(ledger.parts, arrays, ends):
        part_ends = read.result().astype(np.int64)
        kept = part_ends[: int(np.searchsorted(part_ends, share, "right")) or 1]
        _check_ids(where, part, data[: int(kept[-1])].read().result(), kept, tokenizer)
        scanned += int(kept[-1])
    return {"vocab_size": "ledger" if recorded else "ids", "scanned_tokens": scanned}


def _check_ids(
    where: str, part: LevanterPart, tokens: np.ndarray, ends: np.ndarray, tokenizer: LoadedTokenizer
) -> None:
    info = tokenizer.info
    in_part = "" if part.prefix == "" else f" (part {part.name})"
    outside = (tokens < 0) | (tokens >= info.vocab_size)
    if outside.any():
        position = int(np.argmax(outside))
        raise SourceError(
            f"{where} holds token id {int(tokens[position])} at position {position}{in_part}, "
            f"not in the vocabulary of the target's tokenizer {info.name} ({info.vocab_size}): "
            "it was tokenized by another tokenizer."
        )
    last_tokens = tokens[ends - 1]
    if np.any(last_tokens != info.eos_id):
        document = int(np.argmax(last_tokens != info.eos_id))
        raise SourceError(
            f"{where}: document {document}{in_part} ends with token {int(last_tokens[document])}, "
            f"not the EOS id {info.eos_id} of the target's tokenizer {info.name}: it was "
            "tokenized by another tokenizer, or without EOS (Kiln's packing needs one per document)."
        )
