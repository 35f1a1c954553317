"""Build a token cache from a step spec: the CLI the Pants backend runs, and `build_cache` for tests.

    python -m kiln.data.tokenize shard SPEC.json --index I --out DIR
    python -m kiln.data.tokenize merge SPEC.json --shards DIR0 DIR1 ... --out CACHE_DIR
    python -m kiln.data.tokenize build SPEC.json --out CACHE_DIR
    python -m kiln.data.tokenize import SPEC.json --out CACHE_DIR
    python -m kiln.data.tokenize plan SPEC.json [--json]

`import` is for a `levanter_cache` source (kiln.data.levanter_cache): it checks the cache and
writes the Kiln cache that reads it in place; `build` of such a spec imports too. `shard`
tokenizes shard I of config.num_shards into one shard folder; `merge` moves complete shard
folders into CACHE_DIR and writes the ledger, stats, tokenizer metadata and, last, STATUS SUCCESS;
`build` does both in one process (resuming: complete shards of an interrupted build are kept).
`plan` prints the files (pieces, units) and bytes each shard reads (`--json`: as one JSON list,
which `pants plan` reads), or for an import the Levanter cache's layout, parts, documents and
tokens from its ledger, and writes nothing.

In a bucket (`--out s3://…` or `gs://…`: storage="store" with a bucket prefix), `shard`
tokenizes into a local staging folder and uploads the shard to its final keys in the cache,
`--out CACHE/shards/shard-NNNNN` with `--unless-built CACHE`, STATUS last; `merge` (with those
shard URLs) checks the uploaded shards and writes the cache's records beside them, STATUS last;
`import` writes its records the same way. A bucket has no rename: nothing is moved
(kiln.data.cache_writer).

One builder per folder: `shard` holds its shard folder's lease, `merge` the cache's lease and
then each shard's, `build` the cache's (kiln.artifacts.lease). A second builder waits for the
lease, then finds the work done and uses it.

Exit status: 0 done (or already done); 2 bad input or damaged content (one paragraph); 4
(EXIT_STORAGE) a storage error, as one line `error: PATH: CAUSE` (rerun once it is fixed: the
build resumes). See docs/token-cache.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from kiln import lifetime  # before the slow imports: it notes the parent process
from kiln.artifacts import (
    RECORD_FILE,
    STATUS_FILE,
    SUCCESS,
    atomic_write_bytes,
    read_status,
)
from kiln.artifacts.lease import Lease
from kiln.artifacts.storage_errors import EXIT_STORAGE, as_storage_error
from kiln.artifacts.store import ObjectStore, copy_folder_into, open_store, read_text
from kiln.containment import OutsideRoot, within
from kiln.data import sources
from kiln.data.cache import (
    CACHE_FILE,
    FORMAT_VERSION,
    SHARDS_DIR,
    VERIFIED_FORMAT_VERSIONS,
)
from kiln.data.cache_writer import (
    ShardWriter,
    assemble_cache,
    check_shard_content,
    check_stored_shard,
    read_shard_record,
    remove_dead_temporaries,
    stored_shard_record,
    upload_shard,
    write_stored_cache,
)
from kiln.data.errors import CacheError, KilnDataError, SourceError, SpecError
from kiln.data.hub_settings import apply_hub_settings
from kiln.data.levanter_cache import import_levanter_cache, plan_import
from kiln.data.spec import CacheSpec, HfSource, LevanterCacheSource, parse_cache_spec
from kiln.data.tokenizer import EncodedDocuments, LoadedTokenizer, load_tokenizer
from kiln_contract.tokenize import DEFAULT_FRAMING, shard_dir_name

ENCODE_BATCH_DOCUMENTS = 1000
BUILD_SHARDS_DIR = ".building"  # inside CACHE_DIR while `build` runs; removed by merge
# A tokenize process whose Pants process died ends at SIGTERM; SIGKILL follows if it does not.
ORPHAN_GRACE_SECONDS = 5.0


def build_cache(spec: dict[str, Any], out_dir: Path) -> Path:
    """Tokenizes every shard in this process, then merges: a finished cache at out_dir. Holds
    the cache's lease throughout; a finished cache of this spec is served as is."""
    cache_spec = parse_cache_spec(spec)
    out_dir = Path(out_dir)
    with Lease.beside(out_dir, what=f"build {_ref(cache_spec)}").acquire(wait=True):
        if already_built(cache_spec, out_dir):
            return out_dir
        tokenizer = load_tokenizer(cache_spec.tokenizer)
        if isinstance(cache_spec.source, LevanterCacheSource):
            return import_levanter_cache(cache_spec, out_dir, tokenizer)
        staging = out_dir / BUILD_SHARDS_DIR
        shard_dirs = []
        for index in range(cache_spec.num_shards):
            shard_dir = staging / shard_dir_name(index)
            if _reusable_shard_record(shard_dir, cache_spec, index, tokenizer) is None:
                tokenize_shard(cache_spec, index, shard_dir, tokenizer)
            shard_dirs.append(shard_dir)
        merge_cache(cache_spec, shard_dirs, out_dir, tokenizer)
        shutil.rmtree(staging)
    return out_dir


def tokenize_shard(
    spec: CacheSpec, index: int, out_dir: Path, tokenizer: LoadedTokenizer | None = None
) -> dict[str, Any]:
    """Writes shard `index` of `spec` to out_dir (atomically); returns its shard.json record."""
    tokenizer = tokenizer or load_tokenizer(spec.tokenizer)
    started = time.monotonic()
    documents = sources.shard_documents(spec.source, spec.text_key, spec.num_shards, index)
    counts = {"text_bytes": 0, "skipped_empty_documents": 0}
    quota = spec.shard_token_quota(index)
    tokens = 0
    with ShardWriter(Path(out_dir), tokenizer.info.token_dtype()) as writer:
        keep_empty = spec.framing != DEFAULT_FRAMING  # Levanter frames them: " " + EOS
        for texts in _checked_batches(documents, spec.max_document_chars, counts, keep_empty):
            encoded = tokenizer.encode_documents(texts, spec.framing)
            if quota is not None:
                encoded = _up_to_quota(encoded, quota - tokens)
                texts = texts[: len(encoded.lengths)]
            writer.append(encoded)
            tokens += len(encoded.tokens)
            counts["text_bytes"] += sum(len(text.encode("utf-8")) for text in texts)
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
    return EncodedDocuments(encoded.tokens[: ends[keep - 1]], encoded.lengths[:keep])


def _short_of_quota(spec: CacheSpec, index: int, tokens: int, quota: int) -> str:
    return (
        f"{_ref(spec)}: shard {index} of {spec.num_shards} read all of its part of the source and "
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
    """Checks that the shard folders are exactly this spec's complete shards, with the content
    their records describe (full digests), then assembles. A shard folder that is gone because
    an interrupted merge already moved it into out_dir is taken from there."""
    tokenizer = tokenizer or load_tokenizer(spec.tokenizer)
    expected = _identity(spec, tokenizer)
    out_dir = Path(out_dir)
    by_index: dict[int, tuple[Path, dict[str, Any]]] = {}
    for shard_dir in map(Path, shard_dirs):
        if not shard_dir.exists() and (out_dir / SHARDS_DIR).is_dir():
            continue  # looked for in out_dir below
        record = read_shard_record(shard_dir)
        _check_shard_identity(shard_dir, record, expected)
        if record["index"] in by_index:
            raise CacheError(
                f"{shard_dir} and {by_index[record['index']][0]} are both shard {record['index']}."
            )
        by_index[record["index"]] = (shard_dir, record)
        _check_shard_plan(shard_dir, record, spec)
    for index in sorted(set(range(spec.num_shards)) - set(by_index)):
        merged = out_dir / SHARDS_DIR / shard_dir_name(index)
        reusable = _reusable_shard_record(merged, spec, index, tokenizer)
        if reusable is not None:
            by_index[index] = (merged, reusable)
    missing = sorted(set(range(spec.num_shards)) - set(by_index))
    if missing:
        raise CacheError(
            f"Cannot merge {spec.name}: shard(s) {missing} of {spec.num_shards} are missing."
        )
    shards = [by_index[index] for index in range(spec.num_shards)]
    if sum(record["documents"] for _, record in shards) == 0:
        raise SourceError(
            f"{spec.name}: the dataset is empty (every document was empty or the source has "
            "none); check the source's paths / split and text_key."
        )
    for shard_dir, record in shards:
        check_shard_content(shard_dir, record)
    assemble_cache(
        Path(out_dir), shards, _cache_record(spec, tokenizer), tokenizer.info.token_byte_lengths
    )
    return Path(out_dir)


def _identity(spec: CacheSpec, tokenizer: LoadedTokenizer) -> dict[str, Any]:
    """What a shard must share with the cache it is merged into."""
    return {
        "name": spec.name,
        "version": spec.version,
        "fingerprint": spec.fingerprint,
        "num_shards": spec.num_shards,
        "tokenizer_digest": tokenizer.info.digest,
        **({} if spec.framing == DEFAULT_FRAMING else {"framing": spec.framing}),
    }


def _check_shard_identity(
    shard_dir: str | Path, record: dict[str, Any], expected: dict[str, Any]
) -> None:
    differing = {k: (record.get(k), v) for k, v in expected.items() if record.get(k) != v}
    if record.get("format_version") not in VERIFIED_FORMAT_VERSIONS:  # shards are alike in both
        differing["format_version"] = (record.get("format_version"), FORMAT_VERSION)
    if differing:
        details = ", ".join(
            f"{k}: shard has {a!r}, spec has {b!r}" for k, (a, b) in differing.items()
        )
        raise CacheError(f"{shard_dir} was built from a different spec ({details}).")


def _check_shard_plan(shard_dir: str | Path, record: dict[str, Any], spec: CacheSpec) -> None:
    plan = sources.shard_plan(spec.source, spec.num_shards, record["index"])
    if record.get("plan") != plan and isinstance(spec.source, HfSource):
        raise CacheError(
            f"{shard_dir} read other files of the Hugging Face dataset {spec.source.id!r} than "
            f"shard {record['index']} reads now (it read {record.get('plan')}, now {plan}): the "
            f"dataset's file list changed under revision {spec.source.revision!r}. Pin the "
            "target's `revision` to a commit (a branch moves), and delete the shard folder so it "
            "is rebuilt."
        )
    if record.get("plan") != plan:
        raise CacheError(
            f"{shard_dir} read other parts of the source than shard {record['index']} reads now "
            f"(it read {record.get('plan')}, now {plan}): it was cut under other sharding rules "
            "(another Kiln version); delete it so it is rebuilt."
        )


def _reusable_shard_record(
    shard_dir: Path, spec: CacheSpec, index: int, tokenizer: LoadedTokenizer
) -> dict[str, Any] | None:
    """The record of a complete shard folder holding shard `index` of `spec`, else None."""
    try:
        record = read_shard_record(shard_dir)
    except KilnDataError:
        return None
    return record if _is_shard_of(shard_dir, record, spec, index, tokenizer) else None


def _is_shard_of(
    where: str | Path,
    record: dict[str, Any],
    spec: CacheSpec,
    index: int,
    tokenizer: LoadedTokenizer,
) -> bool:
    """Whether the complete shard at `where`, with this record, is shard `index` of `spec`."""
    try:
        _check_shard_identity(where, record, _identity(spec, tokenizer))
        _check_shard_plan(where, record, spec)
    except KilnDataError:
        return False
    return bool(record["index"] == index)


def _ref(spec: CacheSpec) -> str:
    return f"{spec.name}@{spec.version}"


def _cache_record(spec: CacheSpec, tokenizer: LoadedTokenizer) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "name": spec.name,
        "version": spec.version,
        "fingerprint": spec.fingerprint,
        "split": sources.split_name(spec.source),
        "source": sources.provenance(spec.source),
        "text_key": spec.text_key,
        "max_document_chars": spec.max_document_chars,
        "num_shards": spec.num_shards,
        **({} if spec.max_tokens is None else {"max_tokens": spec.max_tokens}),
        **({} if spec.framing == DEFAULT_FRAMING else {"framing": spec.framing}),
        "tokenizer": {**tokenizer.info.to_json(), "spec": tokenizer.spec.to_json()},
    }


def _checked_batches(
    documents: Iterator[sources.Document],
    max_chars: int,
    counts: dict[str, int],
    keep_empty: bool = False,
) -> Iterator[list[str]]:
    """Batches of document texts; over-long ones refused, empty ones (empty or whitespace)
    skipped and counted unless `keep_empty`."""
    batch: list[str] = []
    for document in documents:
        if len(document.text) > max_chars:
            raise SourceError(
                f"{document.origin}: the document has {len(document.text):,} characters, more "
                f"than max_document_chars={max_chars:,}; raise config.max_document_chars or split "
                "the document."
            )
        if not keep_empty and not document.text.strip():
            counts["skipped_empty_documents"] += 1
            continue
        batch.append(document.text)
        if len(batch) == ENCODE_BATCH_DOCUMENTS:
            yield batch
            batch = []
    if batch:
        yield batch


# --- the command line ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    # transformers warns on import that PyTorch is absent: true, and irrelevant for tokenizing.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    # A cache's shards run as parallel processes, up to one per core (Pants' process limit, 1-CPU
    # Ray tasks): each encodes on one thread, as `plan`'s CPU-hours and the benchmark count them,
    # instead of every process's Rust encoder spreading over all the cores.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    apply_hub_settings()  # before huggingface_hub is imported: it reads HF_HOME etc. once
    args = _parser().parse_args(argv)
    lifetime.stop_when_orphaned(ORPHAN_GRACE_SECONDS)
    try:
        in_bucket = _in_bucket(args)
        _check_contained(args)
        raw_spec = _read_spec_file(args.spec)
        spec = parse_cache_spec(raw_spec)
        if args.command == "plan":
            _plan_command(spec, args.json)
            return 0
        finished = args.out if args.command != "shard" else args.unless_built
        if finished is not None and already_built(spec, finished):  # no lease needed to see it
            print(f"{_ref(spec)}: already built at {finished}", file=sys.stderr)
            return 0
        _check_command_fits_source(spec, args.command)
        if in_bucket:
            _bucket_command(spec, args)
        elif args.command == "shard":
            _shard_command(spec, args)
        elif args.command == "merge":
            _merge_command(spec, args)
        elif args.command == "import":
            _import_command(spec, args)
        else:
            build_cache(raw_spec, args.out)
            print(f"{_ref(spec)}: cache ready at {args.out}", file=sys.stderr)
    except KilnDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        failure = as_storage_error(e, getattr(args, "out", None) or args.spec)  # plan: no --out
        if failure is None:
            raise
        print(f"error: {failure}", file=sys.stderr)
        return EXIT_STORAGE
    return 0


def _check_command_fits_source(spec: CacheSpec, command: str) -> None:
    imported = isinstance(spec.source, LevanterCacheSource)
    if imported and command in ("shard", "merge"):
        raise SpecError(
            f"{_ref(spec)}: a {spec.source.kind} source is imported, not tokenized: run "
            "`python -m kiln.data.tokenize import` (or `build`)."
        )
    if not imported and command == "import":
        raise SpecError(
            f"{_ref(spec)}: only a levanter_cache source is imported; a {spec.source.kind} "
            "source is tokenized with `shard` and `merge` (or `build`)."
        )


def _plan_command(spec: CacheSpec, as_json: bool) -> None:
    if isinstance(spec.source, LevanterCacheSource):
        _plan_import_command(spec, as_json)
        return
    if as_json:  # for `pants plan`: one object per shard, in index order
        print(json.dumps([_shard_plan_json(spec, index) for index in range(spec.num_shards)]))
        return
    for index in range(spec.num_shards):
        sizes = sources.shard_sizes(spec.source, spec.num_shards, index)
        if sizes is None:
            streamed = sources.shard_plan(spec.source, spec.num_shards, index)[0]
            print(f"shard {index}/{spec.num_shards}: {streamed}")
            continue
        print(f"shard {index}/{spec.num_shards}: {len(sizes)} files, {sum(sizes.values()):,} bytes")
        for key, size in sizes.items():
            print(f"  {key} ({size:,} bytes)")


def _plan_import_command(spec: CacheSpec, as_json: bool) -> None:
    """An import's plan is its ledger: layout, parts, documents and tokens (`--json`: a list of
    one object {"imported": ...})."""
    imported = plan_import(spec)
    if as_json:
        print(json.dumps([{"imported": imported}]))
        return
    tokens = "an unrecorded number of" if imported["tokens"] is None else f"{imported['tokens']:,}"
    print(
        f"imports the Levanter cache at {imported['location']}: {imported['layout']} layout, "
        f"{imported['parts']} part(s), {imported['documents']:,} documents, {tokens} tokens"
    )


def _shard_plan_json(spec: CacheSpec, index: int) -> dict[str, Any]:
    """{"files": {key: bytes}} in read order, or {"streamed": how} for a streamed source."""
    sizes = sources.shard_sizes(spec.source, spec.num_shards, index)
    if sizes is None:
        return {"streamed": sources.shard_plan(spec.source, spec.num_shards, index)[0]}
    return {"files": sizes}


def _import_command(spec: CacheSpec, args: argparse.Namespace) -> None:
    """Imports under the cache's lease, the artifact record placed before STATUS."""
    with Lease.beside(args.out, what=f"import {_ref(spec)}").acquire(wait=True):
        if already_built(spec, args.out):
            print(f"{_ref(spec)}: already built at {args.out}", file=sys.stderr)
            return
        tokenizer = load_tokenizer(spec.tokenizer)
        if args.record is not None:
            atomic_write_bytes(args.out / RECORD_FILE, args.record.read_bytes())
        import_levanter_cache(spec, args.out, tokenizer)
        print(f"{_ref(spec)}: imported at {args.out}", file=sys.stderr)


def _shard_command(spec: CacheSpec, args: argparse.Namespace) -> None:
    """Tokenizes shard --index into --out unless it is done: that folder complete, or (store
    mode) the cache built or holding the shard already."""
    if not 0 <= args.index < spec.num_shards:
        raise SpecError(
            f"--index {args.index} is out of range: config.num_shards is {spec.num_shards}."
        )
    cache = args.unless_built
    what = f"tokenize {_ref(spec)} shard {args.index}"
    with Lease.beside(args.out, what=what).acquire(wait=True):
        if cache is not None and already_built(spec, cache):
            print(f"{_ref(spec)}: already built at {cache}", file=sys.stderr)
        else:
            _tokenize_unless_done(spec, args.index, args.out, cache)
    if cache is not None and read_status(cache) == SUCCESS:
        _remove_if_empty(args.out.parent)  # merged while this waited: its lease was the last


def _tokenize_unless_done(spec: CacheSpec, index: int, out: Path, cache: Path | None) -> None:
    tokenizer = load_tokenizer(spec.tokenizer)
    done = [out] + ([cache / SHARDS_DIR / shard_dir_name(index)] if cache else [])
    for folder in done:
        if _reusable_shard_record(folder, spec, index, tokenizer) is not None:
            print(f"{spec.name}: shard {index} is already at {folder}", file=sys.stderr)
            return
    tokenize_shard(spec, index, out, tokenizer)


def _merge_command(spec: CacheSpec, args: argparse.Namespace) -> None:
    """Merges under the cache's lease and each shard's (none is being written meanwhile); a
    cache another builder finished while this one waited is served."""
    with contextlib.ExitStack() as leases:
        leases.enter_context(Lease.beside(args.out, what=f"merge {_ref(spec)}").acquire(wait=True))
        if already_built(spec, args.out):
            print(f"{_ref(spec)}: already built at {args.out}", file=sys.stderr)
        else:
            for shard in args.shards:
                what = f"merge {_ref(spec)} (shard {shard.name})"
                leases.enter_context(Lease.beside(shard, what=what).acquire(wait=True))
            if args.record is not None:  # the artifact record (docs/artifacts.md), before STATUS
                atomic_write_bytes(args.out / RECORD_FILE, args.record.read_bytes())
            merge_cache(spec, args.shards, args.out)
            print(f"{_ref(spec)}: cache ready at {args.out}", file=sys.stderr)
    for staging in {shard.parent for shard in args.shards}:  # store mode's .{version}.shards/
        remove_dead_temporaries(staging)  # what killed builds left
        _remove_if_empty(staging)


def _remove_if_empty(folder: Path) -> None:
    """Removes a shard staging folder once nothing is left in it (no shard, no lease)."""
    with contextlib.suppress(OSError):
        folder.rmdir()


# --- caches built in a bucket (storage="store" with an s3:// or gs:// prefix) ---------------------


def _bucket_command(spec: CacheSpec, args: argparse.Namespace) -> None:
    """`shard`, `merge` or `import` of a cache in a bucket. The bucket is checked first (a
    missing bucket or an unreachable endpoint fails here), then the lease is taken (a denied
    write fails here): either way one line naming the URL, before anything is tokenized."""
    cache = args.unless_built if args.command == "shard" else args.out
    if cache is None:
        raise SpecError(
            f"shard --out {args.out}: a shard in a bucket is built at its place in the cache; "
            "give the cache as --unless-built CACHE_URL."
        )
    store = open_store(cache)
    store.check()
    if args.command == "shard":
        _bucket_shard(spec, args.index, args.out, cache, store)
    elif args.command == "merge":
        _bucket_merge(spec, args.shards, cache, store, args.record)
    else:
        _bucket_import(spec, cache, store, args.record)


def _stored_shard_key(spec: CacheSpec, cache: str, url: str, index: int) -> str:
    """The key of shard `index` in the cache's store, after checking `url` is where it goes."""
    key = f"{SHARDS_DIR}/{shard_dir_name(index)}"
    if url != f"{cache}/{key}":
        raise SpecError(
            f"{url}: shard {index} of {_ref(spec)} in a bucket is built at its place in the "
            f"cache, {cache}/{key}: buckets have no rename to move it there later."
        )
    return key


def _bucket_shard(spec: CacheSpec, index: int, url: str, cache: str, store: ObjectStore) -> None:
    """Tokenizes shard `index` into a local staging folder and uploads it, under the shard's
    lease, unless the cache is built or the shard is in the bucket already."""
    if not 0 <= index < spec.num_shards:
        raise SpecError(f"--index {index} is out of range: config.num_shards is {spec.num_shards}.")
    key = _stored_shard_key(spec, cache, url, index)
    with Lease.beside(url, what=f"tokenize {_ref(spec)} shard {index}").acquire(wait=True):
        if already_built(spec, cache):
            print(f"{_ref(spec)}: already built at {cache}", file=sys.stderr)
            return
        tokenizer = load_tokenizer(spec.tokenizer)
        record = stored_shard_record(store, key)
        if record is not None and _is_shard_of(url, record, spec, index, tokenizer):
            print(f"{spec.name}: shard {index} is already at {url}", file=sys.stderr)
            return
        with tempfile.TemporaryDirectory(prefix="kiln-shard-") as staging:
            shard_dir = Path(staging) / shard_dir_name(index)
            tokenize_shard(spec, index, shard_dir, tokenizer)
            upload_shard(store, key, shard_dir)
        print(f"{spec.name}: shard {index} uploaded to {url}", file=sys.stderr)


def _bucket_merge(
    spec: CacheSpec, urls: list[str], cache: str, store: ObjectStore, record_file: Path | None
) -> None:
    """Under the cache's lease and each shard's: checks the uploaded shards (identity, plan,
    object sizes) and writes the cache's records beside them, STATUS last."""
    if len(urls) != spec.num_shards:
        raise SpecError(f"merge: {len(urls)} shard(s) given; config.num_shards is {spec.num_shards}.")
    keys = [_stored_shard_key(spec, cache, url, index) for index, url in enumerate(urls)]
    with contextlib.ExitStack() as leases:
        leases.enter_context(Lease.beside(cache, what=f"merge {_ref(spec)}").acquire(wait=True))
        if already_built(spec, cache):
            print(f"{_ref(spec)}: already built at {cache}", file=sys.stderr)
            return
        for index, url in enumerate(urls):
            what = f"merge {_ref(spec)} (shard {index})"
            leases.enter_context(Lease.beside(url, what=what).acquire(wait=True))
        tokenizer = load_tokenizer(spec.tokenizer)
        records = [_stored_shard(spec, store, key, i, tokenizer) for i, key in enumerate(keys)]
        missing = [index for index, record in enumerate(records) if record is None]
        if missing:
            raise CacheError(
                f"Cannot merge {spec.name}: shard(s) {missing} of {spec.num_shards} are not "
                f"complete in {cache}; rerun so their `shard` processes upload them."
            )
        complete = [record for record in records if record is not None]
        if sum(record["documents"] for record in complete) == 0:
            raise SourceError(
                f"{spec.name}: the dataset is empty (every document was empty or the source has "
                "none); check the source's paths / split and text_key."
            )
        for key, record in zip(keys, complete):
            check_stored_shard(store, key, record)
        artifact = (RECORD_FILE, record_file.read_bytes()) if record_file is not None else None
        write_stored_cache(
            store,
            complete,
            _cache_record(spec, tokenizer),
            tokenizer.info.token_byte_lengths,
            artifact,
        )
        print(f"{_ref(spec)}: cache ready at {cache}", file=sys.stderr)


def _stored_shard(
    spec: CacheSpec, store: ObjectStore, key: str, index: int, tokenizer: LoadedTokenizer
) -> dict[str, Any] | None:
    """The record of the complete shard at `key`, checked to be this spec's (None if the shard
    is not complete); a shard of another spec is refused, as in a local merge."""
    record = stored_shard_record(store, key)
    if record is None:
        return None
    where = store.location(key)
    _check_shard_identity(where, record, _identity(spec, tokenizer))
    if record["index"] != index:
        raise CacheError(f"{where} holds shard {record['index']}, not shard {index}.")
    _check_shard_plan(where, record, spec)
    return record


def _bucket_import(
    spec: CacheSpec, cache: str, store: ObjectStore, record_file: Path | None
) -> None:
    """Imports under the cache's lease: the records are written in a local staging folder and
    uploaded, STATUS last (the imported arrays stay where they are)."""
    with Lease.beside(cache, what=f"import {_ref(spec)}").acquire(wait=True):
        if already_built(spec, cache):
            print(f"{_ref(spec)}: already built at {cache}", file=sys.stderr)
            return
        tokenizer = load_tokenizer(spec.tokenizer)
        with tempfile.TemporaryDirectory(prefix="kiln-import-") as staging:
            folder = Path(staging) / "cache"
            if record_file is not None:
                atomic_write_bytes(folder / RECORD_FILE, record_file.read_bytes())
            import_levanter_cache(spec, folder, tokenizer)
            copy_folder_into(store, "", folder)  # STATUS last
        print(f"{_ref(spec)}: imported at {cache}", file=sys.stderr)


def _in_bucket(args: argparse.Namespace) -> bool:
    """Whether this command writes into a bucket: its --out, and every other folder it names,
    are bucket URLs (str); else they are local paths (Path), as the arguments were parsed."""
    named = [
        getattr(args, "out", None),  # `plan` writes nothing
        getattr(args, "unless_built", None),
        *(getattr(args, "shards", None) or []),
    ]
    urls = [isinstance(location, str) for location in named if location is not None]
    if any(urls) and not all(urls):
        raise SpecError(
            f"{args.command}: --out and the shard folders must all be local paths or all be "
            "bucket URLs; a cache in a bucket is built in that bucket."
        )
    if args.command == "build" and isinstance(args.out, str):
        raise SpecError(
            f"build --out {args.out}: a cache in a bucket is built with `shard` and `merge` "
            "(storage=\"store\"), or built locally and uploaded."
        )
    if any(urls) and args.root is not None:
        raise SpecError("--root confines local folders; a bucket cache's keys are its own.")
    return any(urls)


def _check_contained(args: argparse.Namespace) -> None:
    """With --root (the artifact store, for store-mode caches), every folder this command writes
    or moves must resolve inside it, before anything is written."""
    if args.root is None:
        return
    written = [args.out, *(args.shards if args.command == "merge" else [])]
    try:
        for path in written:
            within(path, args.root, "the folder")
    except OutsideRoot as e:
        raise SpecError(str(e)) from None


def already_built(spec: CacheSpec, out_dir: str | Path) -> bool:
    """A finished cache of this spec (in a folder or a bucket) is served as is (the artifact
    store resumes, not Pants); a finished cache of another fingerprint under the same name and
    version is refused."""
    store = open_store(out_dir)
    if (read_text(store, STATUS_FILE) or "").strip() != SUCCESS:
        return False
    built = json.loads(store.read(CACHE_FILE).data).get("fingerprint")
    if built != spec.fingerprint:
        raise CacheError(
            f"{out_dir} already holds {spec.name}@{spec.version} with fingerprint {built}, not "
            f"{spec.fingerprint}: the target's configuration changed. Bump its `version`."
        )
    return True


def _read_spec_file(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SpecError(f"{path}: no such spec file.") from None
    except json.JSONDecodeError as e:
        raise SpecError(f"{path}: not valid JSON ({e}).") from None


def _location(text: str) -> str | Path:
    """A folder argument: a bucket URL stays text (a Path would fold its `//`), else a Path."""
    return text.rstrip("/") if "://" in text else Path(text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kiln.data.tokenize", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    shard = commands.add_parser("shard", help="tokenize one shard into a shard folder")
    shard.add_argument("spec", type=Path)
    shard.add_argument("--index", type=int, required=True)
    shard.add_argument("--out", type=_location, required=True)
    shard.add_argument(
        "--unless-built",
        type=_location,
        help="do nothing if this cache is already built (store mode)",
    )
    merge = commands.add_parser("merge", help="assemble shard folders into a cache")
    merge.add_argument("spec", type=Path)
    merge.add_argument("--shards", type=_location, nargs="+", required=True)
    merge.add_argument("--out", type=_location, required=True)
    merge.add_argument("--record", type=Path, help="an artifact.json to place in the cache")
    build = commands.add_parser("build", help="all shards in this process, then merge")
    build.add_argument("spec", type=Path)
    build.add_argument("--out", type=_location, required=True)
    imported = commands.add_parser("import", help="import a levanter_cache source")
    imported.add_argument("spec", type=Path)
    imported.add_argument("--out", type=_location, required=True)
    imported.add_argument("--record", type=Path, help="an artifact.json to place in the cache")
    plan = commands.add_parser("plan", help="print the files and bytes each shard reads")
    plan.add_argument("spec", type=Path)
    plan.add_argument("--json", action="store_true", help="one JSON list: each shard's files")
    plan.set_defaults(root=None)  # it writes nothing
    for command in (shard, merge, build, imported):
        command.add_argument(
            "--root", type=Path, help="every folder written must resolve inside this one"
        )
    return parser


if __name__ == "__main__":
    sys.exit(main())
