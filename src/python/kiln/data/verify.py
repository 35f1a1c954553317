"""`python -m kiln.data.verify CACHE_DIR...`: check token caches against their ledgers.

Each cache must be finished (STATUS SUCCESS); every file's sha256 is compared with the one
recorded when it was written, then the cache is opened as a reader opens it (every file present
with its recorded size, offsets consistent with the ledger). kiln.runner runs the same check
when it places a cache into the artifact store. An imported cache's arrays have no digests (they
are Levanter's, terabytes): its token data is read whole instead, every id checked against the
vocabulary, and each part's rows and tokens against Levanter's ledger (kiln.data.import_check).
One line per cache:

    tokenized/x@v1 at /store/tokenized/x/v1: verified 13 files (41.9 MB)
    tokenized/y@v1 at /store/tokenized/y/v1: verified 1 files (0.0 MB); the Levanter cache at
        /data/train (sharded, 2 parts): 42 documents, 52,471 token ids read, each in [0, 8192),
        offsets increasing, rows and tokens as its shard_ledger.json

Exit status, the gravest over all caches: 1 a cache is damaged or not a finished cache (the
line names the shard and file); 4 a storage error (EXIT_STORAGE); 3 a cache of format_version
1, which records no digests (its offsets were checked; rebuild it to have it verified); 0 every
cache verified.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.artifacts.content import check_digests
from kiln.artifacts.storage_errors import EXIT_STORAGE, StorageError, as_storage_error
from kiln.data.cache import (
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


@dataclass(frozen=True)
class Verification:
    cache: TokenCache
    files: int  # files whose digests were compared (0 for an unverified format)
    bytes: int
    imported: ImportCheck | None = None  # the token data of an imported cache, read whole

    def describe(self) -> str:
        info = self.cache.info
        where = f"{info.get('name')}@{info.get('version')} at {self.cache.path}"
        if not self.cache.verified:
            return (
                f"{where}: unverified: format_version {info.get('format_version')} records no "
                "digests (offsets checked); rebuild it to have it verified"
            )
        line = f"{where}: verified {self.files} files ({self.bytes / 1e6:.1f} MB)"
        return line if self.imported is None else f"{line}; {self.imported.describe()}"


def verify_cache(
    location: str | Path, *, digests: bool = True, token_data: bool = False
) -> Verification:
    """With `digests` (a local folder), compares every file's sha256 with the ledger (before any
    array is decoded, so that altered bytes are named as such), then opens the cache as a reader
    does (a folder or a bucket URL); with `token_data`, reads an imported cache's token data
    whole (kiln.data.import_check: the command does, the runner's placement check does not, an
    import's terabytes being read where they are). CacheDamaged names the first damaged file;
    CacheNotReady an unfinished cache; StorageError a file the OS cannot read."""
    path = location if "://" in str(location) else Path(location)
    try:
        info, ledger = read_cache_records(path)
        files, size = _compare_digests(Path(path), info, ledger) if digests else (0, 0)
        cache = TokenCache(path, info, ledger)
    except (ValueError, KeyError) as e:  # cache.json or ledger.json are not what was written
        raise KilnDataError(f"{path}: the cache's records cannot be read ({e})") from None
    imported = check_import(cache) if token_data and is_import(cache) else None
    return Verification(cache, files, size, imported)


def _compare_digests(path: Path, info: dict[str, Any], ledger: dict[str, Any]) -> tuple[int, int]:
    """(files, bytes) whose digests match; CacheDamaged at the first that does not. A cache
    of the unverified format has no digests: (0, 0)."""
    if info.get("format_version") == UNVERIFIED_FORMAT_VERSION:
        return 0, 0
    folders = [(None, path, ledger["files"])] + [
        (shard["name"], path / SHARDS_DIR / shard["name"], shard["files"])
        for shard in ledger["shards"]
    ]
    files = size = 0
    for shard, folder, records in folders:
        for damage in check_digests(folder, records):
            raise cache_damaged(path, info, shard, damage)
        files += len(records)
        size += sum(int(record["bytes"]) for record in records.values())
    return files, size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kiln.data.verify", description=__doc__.split("\n")[0]
    )
    parser.add_argument("caches", type=Path, nargs="+", metavar="CACHE_DIR")
    args = parser.parse_args(argv)
    codes = set()
    for path in args.caches:
        code, line = _verify_one(path)
        print(line, file=sys.stdout if code == 0 else sys.stderr)
        codes.add(code)
    # The gravest outcome decides: damage, then storage errors, then unverified caches.
    return next((c for c in (EXIT_DAMAGED, EXIT_STORAGE, EXIT_UNVERIFIED) if c in codes), 0)


def _verify_one(path: Path) -> tuple[int, str]:
    try:
        verification = verify_cache(path, token_data=True)
    except KilnDataError as e:
        return EXIT_DAMAGED, f"error: {e}"
    except (StorageError, OSError) as e:
        failure = as_storage_error(e, path) or StorageError(path, str(e))
        return EXIT_STORAGE, f"error: {failure}"
    code = 0 if verification.cache.verified else EXIT_UNVERIFIED
    return code, verification.describe()


if __name__ == "__main__":
    sys.exit(main())
