"""Pinned downloads for a `url_files` source: each URL is fetched once, streamed to disk, checked
against its declared digest and kept content-addressed, so every shard process (and every later
build) reads the same verified bytes without fetching again.

The folder is `$KILN_DOWNLOAD_DIR`, else `~/.cache/kiln/downloads`; a file lives at
`{folder}/{algorithm}/{hex digest}/{file name}` and appears there only once verified (written to a
temporary name first, renamed last), so a crash never leaves a file that passes as downloaded.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import BinaryIO

from kiln.data.errors import SourceError
from kiln_contract.tokenize import UrlFilesSource

DOWNLOAD_DIR_VARIABLE = "KILN_DOWNLOAD_DIR"
TIMEOUT_S = 60
CHUNK_BYTES = 1 << 20


def download_dir() -> Path:
    configured = os.environ.get(DOWNLOAD_DIR_VARIABLE)
    return Path(configured) if configured else Path.home() / ".cache" / "kiln" / "downloads"


def downloaded_files(source: UrlFilesSource) -> list[Path]:
    """The source's files on local disk, in declaration order, downloading those not there yet."""
    return [fetch_pinned(url, digest) for url, digest in source.files]


def fetch_pinned(url: str, digest: str) -> Path:
    algorithm, _, expected = digest.partition(":")
    name = Path(urllib.parse.urlparse(url).path).name or "download"
    target = download_dir() / algorithm / expected / name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            _stream(url, out)
        actual = file_digest(Path(tmp), algorithm)
        if actual != expected:
            raise SourceError(
                f"{url}: the download's {algorithm} is {actual}, but the source pins {expected}. "
                "The file changed at that URL (or the pin is wrong): check it, then update the "
                "digest in `url_files(...)` and bump the cache's `version`."
            )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _stream(url: str, out: BinaryIO) -> None:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            shutil.copyfileobj(response, out, CHUNK_BYTES)
    except urllib.error.HTTPError as e:
        raise SourceError(f"{url}: the server answered HTTP {e.code} ({e.reason}).") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise SourceError(
            f"{url}: the download failed ({reason}). Without network access, put the verified "
            f"file in ${DOWNLOAD_DIR_VARIABLE} (see docs/token-cache.md) or use a files source."
        ) from None


def file_digest(path: Path, algorithm: str) -> str:
    """sha256 of the bytes, or the git blob id (sha1 of `blob {size}\\0` and the bytes)."""
    if algorithm == "sha256":
        hasher = hashlib.sha256()
    else:
        hasher = hashlib.sha1(usedforsecurity=False)
        hasher.update(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            hasher.update(chunk)
    return hasher.hexdigest()
