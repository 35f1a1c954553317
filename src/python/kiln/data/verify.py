"""`python -m kiln.data.verify CACHE_DIR...`: check token caches against their ledgers.

Each cache must be finished (STATUS SUCCESS); every file's sha256 is compared with the one
recorded when it was written, then the cache is opened as a reader opens it (every file present
with its recorded size, offsets consistent with the ledger), and every token id of every chunk
is checked against the tokenizer's vocabulary. An imported cache's arrays have no digests (they
are Levanter's, terabytes): the command reads its token data whole instead, every id checked
against the vocabulary, and each part's rows and tokens against Levanter's ledger
(kiln.data.import_check). One line per cache:

    tokenized/x@v1 at /store/tokenized/x/v1: verified 13 files (41.9 MB), 20.9M token ids
    tokenized/y@v1 at /store/tokenized/y/v1: verified 1 files (0.0 MB), 0.0M token ids; the
        Levanter cache at /data/train (sharded, 2 parts): 42 documents, 52,471 token ids read,
        each in [0, 8192), offsets increasing, rows and tokens as its shard_ledger.json

kiln.runner runs the same check on every cache a run reads before its first step (`verify_once`),
an import's token data excepted (read where it is, by the trainer), unless the cache was
verified when it was placed: the check then writes VERIFIED_FILE into the cache's folder, the
generation of each of its files as it was verified (a local file's inode, modification time and
size; an object's ETag or generation), and a later run that finds every file at the same
generation skips the full check. A file written since (replaced, rewritten in place, deleted)
has another generation, so the cache is checked again in full.

Exit status, the gravest over all caches: 1 a cache is damaged or not a finished cache (the
line names the shard and file); 4 a storage error (EXIT_STORAGE); 3 a cache of format_version
1, which records no digests (its offsets were checked; rebuild it to have it verified); 0 every
cache verified.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from kiln.artifacts.content import check_object_digests
from kiln.artifacts.locations import open_store
from kiln.artifacts.storage_errors import EXIT_STORAGE, StorageError, as_storage_error
from kiln.artifacts.store import ObjectMissing, ObjectStore, read_text
from kiln.data.cache import (
    CACHE_FILE,
    LEDGER_FILE,
    SHARDS_DIR,
    UNVERIFIED_FORMAT_VERSION,
    TokenCache,
    cache_damaged,
    read_cache_records,
)
from kiln.data.errors import KilnDataError
from kiln.data.import_check import ImportCheck, check_import, is_import

EXIT_DAMAGED = 1
EXIT_UNVERIFIED = 3
VERIFIED_FILE = "verified.json"  # in the cache's folder; no part of the cache or its ledger
VERIFIED_FORMAT = 1


@dataclass(frozen=True)
class Verification:
    cache: TokenCache
    files: int  # files whose digests were compared (0 for an unverified format)
    bytes: int
    token_ids: int = 0  # ids checked against the vocabulary
    earlier: bool = False  # verified earlier, every file unchanged since (VERIFIED_FILE)
    imported: ImportCheck | None = None  # the token data of an imported cache, read whole

    def describe(self) -> str:
        info = self.cache.info
        where = f"{info.get('name')}@{info.get('version')} at {self.cache.path}"
        if not self.cache.verified:
            return (
                f"{where}: unverified: format_version {info.get('format_version')} records no "
                "digests (offsets checked); rebuild it to have it verified"
            )
        if self.earlier:
            return f"{where}: verified when placed, every file unchanged since"
        line = (
            f"{where}: verified {self.files} files ({self.bytes / 1e6:.1f} MB), "
            f"{self.token_ids / 1e6:.1f}M token ids"
        )
        return line if self.imported is None else f"{line}; {self.imported.describe()}"


def verify_cache(
    store: ObjectStore, *, digests: bool = True, token_data: bool = False
) -> Verification:
    """With `digests` (the full check), compares every file's sha256 with the ledger (before any
    array is decoded, so that altered bytes are named as such), opens the cache as a reader
    does, and checks every token id against the vocabulary (an import's excepted); without,
    opens it only. With `token_data`, reads an imported cache's token data whole
    (kiln.data.import_check: the command does, the runner does not, an import's terabytes being
    read where they are). CacheDamaged names the first damaged file; CacheNotReady an
    unfinished cache; StorageError a file the storage cannot read. The cache is at the root of
    `store` (ArtifactFolder.as_store, for one in a folder of a store)."""
    try:
        info, ledger = read_cache_records(store)
        files, size = _compare_digests(store, info, ledger) if digests else (0, 0)
        cache = TokenCache(store, info, ledger)
    except (ValueError, KeyError) as e:  # cache.json or ledger.json are not what was written
        raise KilnDataError(
            f"{store.location('')}: the cache's records cannot be read ({e})"
        ) from None
    token_ids = 0
    if digests and not is_import(cache):
        cache.check_every_token_id()
        token_ids = cache.num_tokens
    imported = check_import(cache) if token_data and is_import(cache) else None
    return Verification(cache, files, size, token_ids, imported=imported)


def verify_once(store: ObjectStore, *, record: bool = True) -> Verification:
    """The full check of `verify_cache`, unless VERIFIED_FILE says the cache passed it with
    every file as it is now (then it is only opened); with `record`, a cache that passes is
    marked so (a cache whose folder is not the caller's to write, such as a Pants sandbox's
    output, is checked in full every time)."""
    if _marked_unchanged(store):
        return Verification(verify_cache(store, digests=False).cache, 0, 0, earlier=True)
    verification = verify_cache(store)
    if record and verification.cache.verified:
        mark_verified(store)
    return verification


def mark_verified(store: ObjectStore) -> None:
    """Writes VERIFIED_FILE: the generation of every file of the (checked) cache at the root
    of `store`."""
    mark = {"format": VERIFIED_FORMAT, "generations": _generations(store, _cache_keys(store))}
    store.write(VERIFIED_FILE, (json.dumps(mark, sort_keys=True) + "\n").encode())


def _marked_unchanged(store: ObjectStore) -> bool:
    try:
        mark = json.loads(read_text(store, VERIFIED_FILE) or "null")
        recorded = mark["generations"] if mark["format"] == VERIFIED_FORMAT else None
    except (ValueError, KeyError, TypeError):
        return False  # no mark, or not one this Kiln wrote: check in full
    if not isinstance(recorded, dict):
        return False
    try:
        keys = _cache_keys(store)
    except (ObjectMissing, ValueError, KeyError, TypeError):
        return False  # the records themselves changed or went: the full check says how
    return set(keys) == set(recorded) and _generations(store, keys) == recorded


def _cache_keys(store: ObjectStore) -> list[str]:
    """The keys of every file the cache consists of: its records and the ledger's files."""
    ledger = json.loads(store.read(LEDGER_FILE).data)
    keys = [CACHE_FILE, LEDGER_FILE, *ledger.get("files", {})]
    for shard in ledger["shards"]:
        keys += [f"{SHARDS_DIR}/{shard['name']}/{name}" for name in shard.get("files", {})]
    return keys


def _generations(store: ObjectStore, keys: list[str]) -> dict[str, str | None]:
    def generation(key: str) -> str | None:
        try:
            return store.generation(key)
        except ObjectMissing:
            return None

    return {key: generation(key) for key in keys}


def _compare_digests(
    store: ObjectStore, info: dict[str, Any], ledger: dict[str, Any]
) -> tuple[int, int]:
    """(files, bytes) whose digests match; CacheDamaged at the first that does not. A cache
    of the unverified format has no digests: (0, 0)."""
    if info.get("format_version") == UNVERIFIED_FORMAT_VERSION:
        return 0, 0
    folders = [(None, "", ledger["files"])] + [
        (shard["name"], f"{SHARDS_DIR}/{shard['name']}", shard["files"])
        for shard in ledger["shards"]
    ]
    files = size = 0
    for shard, folder, records in folders:
        for damage in check_object_digests(store, folder, records):
            raise cache_damaged(store.location(""), info, shard, damage)
        files += len(records)
        size += sum(int(record["bytes"]) for record in records.values())
    return files, size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kiln.data.verify", description=__doc__.split("\n")[0]
    )
    parser.add_argument("caches", nargs="+", metavar="CACHE_DIR", help="a folder or a bucket URL")
    args = parser.parse_args(argv)
    codes = set()
    for path in args.caches:
        code, line = _verify_one(path)
        print(line, file=sys.stdout if code == 0 else sys.stderr)
        codes.add(code)
    # The gravest outcome decides: damage, then storage errors, then unverified caches.
    return next((c for c in (EXIT_DAMAGED, EXIT_STORAGE, EXIT_UNVERIFIED) if c in codes), 0)


def _verify_one(path: str) -> tuple[int, str]:
    try:
        verification = verify_cache(open_store(path), token_data=True)
    except KilnDataError as e:
        return EXIT_DAMAGED, f"error: {e}"
    except (StorageError, OSError) as e:
        failure = as_storage_error(e, path) or StorageError(path, str(e))
        return EXIT_STORAGE, f"error: {failure}"
    code = 0 if verification.cache.verified else EXIT_UNVERIFIED
    return code, verification.describe()


if __name__ == "__main__":
    sys.exit(main())
