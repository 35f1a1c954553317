"""Building a token cache from its spec: tokenizing shards, then merging them into the cache.

Shards and caches are read and written through the object store (kiln.artifacts.store), so a
local folder and a bucket take the same code (kiln.data.cache_writer says where they differ).
`python -m kiln.data.tokenize` runs these steps as separate processes; `build_cache` runs them
all in one (tests, and small caches).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from kiln.artifacts import STATUS_FILE, SUCCESS
from kiln.artifacts.folder import ArtifactFolder
from kiln.artifacts.lease import Lease
from kiln.artifacts.local import LocalStore
from kiln.artifacts.store import ObjectStore, read_text
from kiln.data import sources
from kiln.data.cache import CACHE_FILE, FORMAT_VERSION, SHARD_FORMAT_VERSIONS, SHARDS_DIR
from kiln.data.cache_writer import (
    ShardWriter,
    check_shard,
    missing_shard,
    shard_in_place,
    shard_record,
    write_cache,
)
from kiln.data.document import Document
from kiln.data.document_formats import document_encoder
from kiln.data.errors import CacheError, SourceError, SpecError
from kiln.data.levanter_cache import import_levanter_cache
from kiln.data.spec import parse_cache_spec
from kiln.data.tokenizer import EncodedDocuments, LoadedTokenizer, load_tokenizer
from kiln_contract.tokenize import (
    DEFAULT_FRAMING,
    CacheSpec,
    HfSource,
    LevanterCacheSource,
    shard_dir_name,
)

ENCODE_BATCH_DOCUMENTS = 1000
BUILD_SHARDS_DIR = ".building"  # inside CACHE_DIR while `build` runs; removed by merge


def ref(spec: CacheSpec) -> str:
    return f"{spec.name}@{spec.version}"


def already_built(spec: CacheSpec, store: ObjectStore) -> bool:
    """A finished cache of this spec at the root of `store` (a folder or a bucket) is served as
    is (the artifact store resumes, not Pants); a finished cache of another fingerprint under the
    same name and version is refused."""
    if (read_text(store, STATUS_FILE) or "").strip() != SUCCESS:
        return False
    built = json.loads(store.read(CACHE_FILE).data).get("fingerprint")
    if built != spec.fingerprint:
        raise CacheError(
            f"{store.location('')} already holds {ref(spec)} with fingerprint {built}, not "
            f"{spec.fingerprint}: the target's configuration changed. Bump its `version`."
        )
    return True


def served(spec: CacheSpec, store: ObjectStore) -> bool:
    """Whether the cache at the root of `store` is built already (and says so): then there is
    nothing to do."""
    if not already_built(spec, store):
        return False
    print(f"{ref(spec)}: already built at {store.location('')}", file=sys.stderr)
    return True


def build_cache(spec: dict[str, Any], out_dir: Path) -> Path:
    """Tokenizes every shard in this process, then merges: a finished cache at out_dir (a local
    folder). Holds the cache's lease throughout; a finished cache of this spec is served as is."""
    cache_spec = parse_cache_spec(spec)
    out_dir = Path(out_dir)
    with Lease.beside(out_dir, what=f"build {ref(cache_spec)}").acquire(wait=True):
        if already_built(cache_spec, LocalStore(out_dir)):
            return out_dir
        tokenizer = load_tokenizer(cache_spec.tokenizer)
        if isinstance(cache_spec.source, LevanterCacheSource):
            return import_levanter_cache(cache_spec, out_dir, tokenizer)
        staging = out_dir / BUILD_SHARDS_DIR
        shard_dirs = [staging / shard_dir_name(i) for i in range(cache_spec.num_shards)]
        for index, shard_dir in enumerate(shard_dirs):
            write_shard_unless_done(cache_spec, index, LocalStore(shard_dir), None, tokenizer)
        merge_cache(cache_spec, shard_dirs, out_dir, tokenizer)
        shutil.rmtree(staging)
    return out_dir


def write_shard_unless_done(
    spec: CacheSpec,
    index: int,
    shard: ObjectStore,
    cache: ObjectStore | None,
    tokenizer: LoadedTokenizer,
) -> None:
    """Tokenizes shard `index` into `shard` unless that folder, or the cache's own shard folder
    (where an interrupted merge moved it), holds it complete already."""
    done = [shard] + ([cache.under(_shard_key(index))] if cache else [])
    for store in done:
        record = shard_record(store)
        if record is not None and is_shard_of(store, record, spec, index, tokenizer):
            print(f"{spec.name}: shard {index} is already at {store.location('')}", file=sys.stderr)
            return
    with ArtifactFolder(shard, "").local_output() as folder:
        tokenize_shard(spec, index, folder, tokenizer)
    print(f"{spec.name}: shard {index} written to {shard.location('')}", file=sys.stderr)


def tokenize_shard(
    spec: CacheSpec, index: int, out_dir: Path, tokenizer: LoadedTokenizer | None = None
) -> dict[str, Any]:
    """Writes shard `index` of `spec` to out_dir (atomically); returns its shard.json record."""
    tokenizer = tokenizer or load_tokenizer(spec.tokenizer)
    started = time.monotonic()
    encoder = document_encoder(spec, tokenizer)
    documents = sources.shard_documents(spec.source, encoder.keys, spec.num_shards, index)
    counts = {"text_bytes": 0, "skipped_empty_documents": 0}
    quota = spec.shard_token_quota(index)
    tokens = 0
    with ShardWriter(Path(out_dir), tokenizer.info.token_dtype(), spec.masked) as writer:
        # Levanter frames empty texts (" " + EOS); a structured document's text is always "".
        keep_empty = spec.framing != DEFAULT_FRAMING or spec.masked
        for batch in _checked_batches(documents, spec.max_document_chars, counts, keep_empty):
            encoded = encoder.encode(batch)
            if quota is not None:
                encoded = _up_to_quota(encoded, quota - tokens)
                batch = batch[: len(encoded.lengths)]
            writer.append(encoded)
            tokens += len(encoded.tokens)
            counts["text_bytes"] += encoder.text_bytes(batch)
            if quota is not None and tokens >= quota:
                break  # the rest of the shard's files are never opened
        if quota is not None and tokens < quota:
            raise SourceError(_short_of_quota(spec, index, tokens, quota))
        plan = sources.shard_plan(spec.source, spec.num_shards, index)
        bound = {} if quota is None else {"token_quota": quota}
        record = writer.finish(
            {**_identity(spec, tokenizer), "index": index, "plan": plan, **bound, **counts}
        )
    elapsed = time.monotonic() - started
    print(
        f"{spec.name}: shard {index}/{spec.num_shards}: {record['documents']} documents, "
        f"{record['tokens']} tokens in {elapsed:.1f} s ({record['tokens'] / max(elapsed, 1e-9):,.0f} "
        "tokens/s)",
        file=sys.stderr,
    )
    return record


def _up_to_quota(encoded: EncodedDocuments, remaining: int) -> EncodedDocuments:
    """The batch's first documents, up to and including the one whose tokens reach `remaining`
    (documents are kept whole); the whole batch if they never do."""
    ends = encoded.lengths.cumsum()
    keep = int(ends.searchsorted(remaining)) + 1  # first document ending at >= remaining
    if keep >= len(ends):
        return encoded
    end = ends[keep - 1]
    masks = None if encoded.masks is None else encoded.masks[:end]
    return EncodedDocuments(encoded.tokens[:end], encoded.lengths[:keep], masks)


def _short_of_quota(spec: CacheSpec, index: int, tokens: int, quota: int) -> str:
    return (
        f"{ref(spec)}: shard {index} of {spec.num_shards} read all of its part of the source and "
        f"got {tokens:,} tokens, short of its quota of {quota:,} (the target's `max_tokens` "
        f"field, {spec.max_tokens:,}, split evenly over num_shards={spec.num_shards}). The "
        "source holds fewer tokens than max_tokens asks for, or too few of them fall to this "
        "shard: lower `max_tokens` (or num_shards), or remove it to tokenize the whole source."
    )


def merge_cache(
    spec: CacheSpec,
    shard_dirs: Iterable[Path],
    out_dir: Path,
    tokenizer: LoadedTokenizer | None = None,
) -> Path:
    """merge_shards of local shard folders into the local folder out_dir."""
    merge_shards(spec, [LocalStore(d) for d in shard_dirs], LocalStore(out_dir), tokenizer)
    return Path(out_dir)


def merge_shards(
    spec: CacheSpec,
    shards: Iterable[ObjectStore],
    cache: ObjectStore,
    tokenizer: LoadedTokenizer | None = None,
    artifact_record: bytes | None = None,
) -> None:
    """Checks that the shards (in any order) are exactly this spec's complete shards, with the
    content their records describe, then writes the cache: the shards in place, its records,
    STATUS last. A shard folder that is gone because an interrupted merge already moved it
    into the cache is taken from there."""
    tokenizer = tokenizer or load_tokenizer(spec.tokenizer)
    by_index = _given_shards(spec, list(shards), cache, tokenizer)
    for index in sorted(set(range(spec.num_shards)) - set(by_index)):
        merged = cache.under(_shard_key(index))
        record = shard_record(merged)
        if record is not None and is_shard_of(merged, record, spec, index, tokenizer):
            by_index[index] = (merged, record)
    missing = sorted(set(range(spec.num_shards)) - set(by_index))
    if missing:
        raise CacheError(
            f"Cannot merge {spec.name}: shard(s) {missing} of {spec.num_shards} are missing."
        )
    complete = [by_index[index] for index in range(spec.num_shards)]
    if sum(record["documents"] for _, record in complete) == 0:
        raise SourceError(
            f"{spec.name}: the dataset is empty (every document was empty or the source has "
            "none); check the source's paths / split and text_key."
        )
    for shard, record in complete:
        check_shard(shard, record)
    cache_record = _cache_record(spec, tokenizer)
    byte_lengths = tokenizer.info.token_byte_lengths
    write_cache(cache, complete, cache_record, byte_lengths, artifact_record)


def _given_shards(
    spec: CacheSpec, shards: list[ObjectStore], cache: ObjectStore, tokenizer: LoadedTokenizer
) -> dict[int, tuple[ObjectStore, dict[str, Any]]]:
    """The given shards by index, each checked to be one of this spec's; a missing one is
    skipped when the cache holds shards already (looked for there by the caller)."""
    expected = _identity(spec, tokenizer)
    by_index: dict[int, tuple[ObjectStore, dict[str, Any]]] = {}
    for shard in shards:
        where = shard.location("")
        record = shard_record(shard)
        if record is None and not shard.folder_exists("") and cache.keys(SHARDS_DIR):
            continue  # moved into the cache by an interrupted merge
        if record is None:
            raise missing_shard(shard)
        _check_shard_identity(where, record, expected)
        index = record["index"]
        if index in by_index:
            raise CacheError(f"{where} and {by_index[index][0].location('')} are both shard {index}.")
        check_placeable(spec, index, shard, cache)
        _check_shard_plan(where, record, spec)
        by_index[index] = (shard, record)
    return by_index


def check_placeable(spec: CacheSpec, index: int, shard: ObjectStore, cache: ObjectStore) -> None:
    """A shard is moved into its cache by a rename, which a bucket does not have: in a bucket it
    must be built at its place in the cache."""
    if not (shard.root_location.in_bucket or cache.root_location.in_bucket):
        return
    if not shard_in_place(shard, cache, _shard_key(index)):
        raise SpecError(
            f"{shard.location('')}: shard {index} of {ref(spec)} in a bucket is built at its "
            f"place in the cache, {cache.location(_shard_key(index))}: buckets have no rename "
            "to move it there later."
        )


def _shard_key(index: int) -> str:
    return f"{SHARDS_DIR}/{shard_dir_name(index)}"


def _identity(spec: CacheSpec, tokenizer: LoadedTokenizer) -> dict[str, Any]:
    """What a shard must share with the cache it is merged into."""
    return {
        "name": spec.name,
        "version": spec.version,
        "fingerprint": spec.fingerprint,
        "num_shards": spec.num_shards,
        "tokenizer_digest": tokenizer.info.digest,
        **({} if spec.framing == DEFAULT_FRAMING else {"framing": spec.framing}),
        **({"format": spec.format} if spec.masked else {}),
    }


def _check_shard_identity(where: str, record: dict[str, Any], expected: dict[str, Any]) -> None:
    differing = {k: (record.get(k), v) for k, v in expected.items() if record.get(k) != v}
    if record.get("format_version") not in SHARD_FORMAT_VERSIONS:
        differing["format_version"] = (record.get("format_version"), FORMAT_VERSION)
    if differing:
        details = ", ".join(
            f"{k}: shard has {a!r}, spec has {b!r}" for k, (a, b) in differing.items()
        )
        raise CacheError(f"{where} was built from a different spec ({details}).")


def _check_shard_plan(where: str, record: dict[str, Any], spec: CacheSpec) -> None:
    plan = sources.shard_plan(spec.source, spec.num_shards, record["index"])
    if record.get("plan") != plan and isinstance(spec.source, HfSource):
        raise CacheError(
            f"{where} read other files of the Hugging Face dataset {spec.source.id!r} than "
            f"shard {record['index']} reads now (it read {record.get('plan')}, now {plan}): the "
            f"dataset's file list changed under revision {spec.source.revision!r}. Pin the "
            "target's `revision` to a commit (a branch moves), and delete the shard folder so it "
            "is rebuilt."
        )
    if record.get("plan") != plan:
        raise CacheError(
            f"{where} read other parts of the source than shard {record['index']} reads now "
            f"(it read {record.get('plan')}, now {plan}): it was cut under other sharding rules "
            "(another Kiln version); delete it so it is rebuilt."
        )


def is_shard_of(
    store: ObjectStore,
    record: dict[str, Any],
    spec: CacheSpec,
    index: int,
    tokenizer: LoadedTokenizer,
) -> bool:
    """Whether the complete shard in `store`, with this record, is shard `index` of `spec`."""
    where = store.location("")
    try:
        _check_shard_identity(where, record, _identity(spec, tokenizer))
        _check_shard_plan(where, record, spec)
    except CacheError:
        return False
    return bool(record["index"] == index)


def _cache_record(spec: CacheSpec, tokenizer: LoadedTokenizer) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "name": spec.name,
        "version": spec.version,
        "fingerprint": spec.fingerprint,
        "split": sources.split_name(spec.source),
        "source": sources.provenance(spec.source),
        **spec.format_config(),
        "max_document_chars": spec.max_document_chars,
        "num_shards": spec.num_shards,
        **({} if spec.max_tokens is None else {"max_tokens": spec.max_tokens}),
        **({} if spec.framing == DEFAULT_FRAMING else {"framing": spec.framing}),
        "tokenizer": {**tokenizer.info.to_json(), "spec": tokenizer.spec.to_json()},
    }


def _checked_batches(
    documents: Iterator[Document],
    max_chars: int,
    counts: dict[str, int],
    keep_empty: bool = False,
) -> Iterator[list[Document]]:
    """Batches of documents; over-long texts refused, empty ones (empty or whitespace) skipped
    and counted unless `keep_empty`."""
    batch: list[Document] = []
    for document in documents:
        if document.chars > max_chars:
            raise SourceError(
                f"{document.origin}: the document has {document.chars:,} characters, more "
                f"than max_document_chars={max_chars:,}; raise config.max_document_chars or split "
                "the document."
            )
        if not keep_empty and not document.text.strip():
            counts["skipped_empty_documents"] += 1
            continue
        batch.append(document)
        if len(batch) == ENCODE_BATCH_DOCUMENTS:
            yield batch
            batch = []
    if batch:
        yield batch
