"""Importing a finished Levanter/Marin token cache: read where it is, never re-tokenized.

Levanter's cache of one split (levanter/store/cache.py, jagged_array.py, tree_store.py):

    SPLIT_DIR/shard_ledger.json   CacheLedger: total_num_rows, shard_rows, is_finished,
                                  finished_shards, field_counts, metadata.preprocessor_metadata
                                  (tokenizer, vocab_size, append_bos, append_eos, ...)
    SPLIT_DIR/input_ids/offsets/  zarr3 int64 [2**54]: offsets[0] = rows, offsets[1 + i] = end of row i
    SPLIT_DIR/input_ids/data/     zarr3 token ids (int32 from Levanter's tokenizer), rows concatenated

That is the jagged layout of Kiln's own shards, so the import writes only a Kiln cache folder
whose ledger has one shard naming those arrays (`location`) and the source's identity: the
sha256 of its ledger and both arrays' zarr.json (kiln.data.cache.records_digest), which every
open recomputes. Before that it checks the cache against the declared tokenizer: the vocabulary
size Levanter recorded, and the first documents' ids (in the vocabulary, each ending with EOS).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts

from kiln.artifacts.storage_errors import as_storage_error
from kiln.artifacts.store import ObjectMissing, ObjectStore, open_store
from kiln.data.cache import DATA_ARRAY, FORMAT_VERSION, OFFSETS_ARRAY, records_digest, zarr_spec_in
from kiln.data.cache_writer import write_imported_cache
from kiln.data.errors import SourceError
from kiln.data.spec import CacheSpec, LevanterCacheSource
from kiln.data.tokenizer import LoadedTokenizer

LEDGER_FILE = "shard_ledger.json"
TOKENS_FIELD = "input_ids"
IMPORTED_SHARD = "levanter"
IDENTITY_KEYS = (
    LEDGER_FILE,
    f"{TOKENS_FIELD}/{OFFSETS_ARRAY}/zarr.json",
    f"{TOKENS_FIELD}/{DATA_ARRAY}/zarr.json",
)
# How much of the cache the tokenizer check reads: its first documents, up to this many tokens.
CHECKED_DOCUMENTS = 100
CHECKED_TOKENS = 1 << 20


def import_levanter_cache(spec: CacheSpec, out_dir: Path, tokenizer: LoadedTokenizer) -> Path:
    """Checks the Levanter cache `spec.source` names against `tokenizer` and writes the Kiln
    cache that reads it in place into out_dir. SourceError names the cache and the problem."""
    source = spec.source
    assert isinstance(source, LevanterCacheSource)
    where = f"{spec.name}: the Levanter cache at {source.location}"
    store = open_store(source.location)
    ledger = _finished_ledger(store, where)
    offsets, data = (_open_array(store, name, where) for name in (OFFSETS_ARRAY, DATA_ARRAY))
    documents = int(offsets[0].read().result())
    if documents != ledger.get("total_num_rows", documents) or documents < 1:
        raise SourceError(
            f"{where} holds {documents} rows, its shard_ledger.json says "
            f"{ledger.get('total_num_rows')}: it is empty or was not finished."
        )
    # The first documents' ends only: DCLM's offsets alone are gigabytes.
    first_ends = offsets[1 : min(documents, CHECKED_DOCUMENTS) + 1].read().result()
    _check_tokenizer(where, ledger, first_ends.astype(np.int64), data, tokenizer)
    tokens = int(offsets[documents].read().result())
    shard = {
        "name": IMPORTED_SHARD,
        "location": store.location(TOKENS_FIELD),
        "documents": documents,
        "tokens": tokens,
        "first_document": 0,
        "first_token": 0,
        "files": {},  # the source's files are pinned by `identity`, not listed one by one
        "identity": {
            "location": source.location,
            "keys": list(IDENTITY_KEYS),
            "sha256": records_digest(store, IDENTITY_KEYS),
        },
    }
    record = {
        "format_version": FORMAT_VERSION,
        "name": spec.name,
        "version": spec.version,
        "fingerprint": spec.fingerprint,
        "split": None,
        "source": {
            "kind": source.kind,
            "location": source.location,
            "dtype": data.dtype.name,
            "preprocessor_metadata": _preprocessor_metadata(ledger),
        },
        "num_shards": 1,
        "tokenizer": {**tokenizer.info.to_json(), "spec": tokenizer.spec.to_json()},
    }
    write_imported_cache(out_dir, shard, record, tokenizer.info.token_byte_lengths)
    return out_dir


def _finished_ledger(store: ObjectStore, where: str) -> dict[str, Any]:
    try:
        ledger = json.loads(store.read(LEDGER_FILE).data)
    except ObjectMissing:
        raise SourceError(
            f"{where} has no {LEDGER_FILE}: give the folder of one split (the one holding "
            f"{LEDGER_FILE} and {TOKENS_FIELD}/), e.g. .../train."
        ) from None
    except ValueError as e:
        raise SourceError(f"{where}: {LEDGER_FILE} is not valid JSON ({e}).") from None
    if not isinstance(ledger, dict) or ledger.get("is_finished") is not True:
        raise SourceError(
            f"{where} is not finished ({LEDGER_FILE} has no `is_finished: true`): let Levanter "
            "finish building it first."
        )
    return ledger


def _open_array(store: ObjectStore, name: str, where: str) -> ts.TensorStore:
    key = f"{TOKENS_FIELD}/{name}"
    try:
        array = ts.open(zarr_spec_in(store, key), open=True, read=True).result()
    except ValueError as e:
        failure = as_storage_error(e, store.location(key))
        if failure is not None:
            raise failure from None
        detail = str(e).splitlines()[0]
        raise SourceError(f"{where}: {key} is not a readable zarr3 array ({detail}).") from None
    if array.rank != 1 or not np.issubdtype(np.dtype(array.dtype.numpy_dtype), np.integer):
        raise SourceError(
            f"{where}: {key} is a {array.dtype.name} array of rank {array.rank}; a token "
            "cache's are integer arrays of rank 1 (text caches only: not chat or supervised)."
        )
    return array


def _preprocessor_metadata(ledger: dict[str, Any]) -> dict[str, Any]:
    metadata = ledger.get("metadata") or {}
    return dict(metadata.get("preprocessor_metadata") or {})


def _check_tokenizer(
    where: str,
    ledger: dict[str, Any],
    first_ends: np.ndarray,
    data: ts.TensorStore,
    tokenizer: LoadedTokenizer,
) -> None:
    """The cache must have been tokenized by `tokenizer`: the vocabulary size Levanter
    recorded, and the ids of the documents `first_ends` ends (up to CHECKED_TOKENS) in the
    vocabulary, each document ending with EOS."""
    info = tokenizer.info
    recorded = _preprocessor_metadata(ledger)
    if "vocab_size" in recorded and recorded["vocab_size"] != info.vocab_size:
        raise SourceError(
            f"{where} was tokenized by {recorded.get('tokenizer')!r} with a vocabulary of "
            f"{recorded['vocab_size']}; the target's tokenizer {info.name} has {info.vocab_size}. "
            "Declare the tokenizer the cache was built with."
        )
    checked_ends = first_ends[: int(np.searchsorted(first_ends, CHECKED_TOKENS, "right")) or 1]
    tokens = data[: int(checked_ends[-1])].read().result()
    outside = (tokens < 0) | (tokens >= info.vocab_size)
    if outside.any():
        position = int(np.argmax(outside))
        raise SourceError(
            f"{where} holds token id {int(tokens[position])} at position {position}, not in "
            f"the vocabulary of the target's tokenizer {info.name} ({info.vocab_size}): it was "
            "tokenized by another tokenizer."
        )
    last_tokens = tokens[checked_ends - 1]
    if np.any(last_tokens != info.eos_id):
        document = int(np.argmax(last_tokens != info.eos_id))
        raise SourceError(
            f"{where}: document {document} ends with token {int(last_tokens[document])}, not "
            f"the EOS id {info.eos_id} of the target's tokenizer {info.name}: it was tokenized "
            "by another tokenizer, or without EOS (Kiln's packing needs one per document)."
        )
