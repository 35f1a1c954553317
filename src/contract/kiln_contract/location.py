"""A store location: where an artifact store's root is, a local folder or a bucket URL, parsed
once where it enters a process (a BUILD field, a command line, a spec's JSON).

Both halves ask the same of it: is it a bucket, which local folder is it, where is a key under
it. Which client opens it is the runtime's business (kiln.artifacts.locations.open_store).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Artifact stores in buckets (s3://BUCKET/PATH, gs://BUCKET/PATH), by scheme: the service's name.
BUCKET_SCHEMES = {"s3": "S3", "gs": "Google Cloud Storage"}


@dataclass(frozen=True)
class StoreLocation:
    """`s3://BUCKET/PATH`, `gs://BUCKET/PATH` (any `SCHEME://` is a bucket's, for the runtime to
    accept or refuse) or a local folder, absolute or relative."""

    text: str  # as written; a URL without its trailing "/" (a Path would fold its "//")
    scheme: str  # "" for a local folder

    @classmethod
    def parse(cls, location: str | os.PathLike | StoreLocation) -> StoreLocation:
        if isinstance(location, StoreLocation):
            return location
        text = os.fspath(location)
        scheme, sep, rest = text.partition("://")
        return cls(f"{scheme}://{rest.rstrip('/')}", scheme) if sep else cls(text, "")

    @property
    def in_bucket(self) -> bool:
        return bool(self.scheme)

    @property
    def folder(self) -> Path | None:
        """The local folder; None for a bucket."""
        return None if self.scheme else Path(self.text)

    def under(self, key: str) -> StoreLocation:
        """The location of the folder `key` below this one."""
        key = key.strip("/")
        if not key:
            return self
        if self.scheme:
            return StoreLocation(f"{self.text}/{key}", self.scheme)
        return StoreLocation(str(Path(self.text) / key), "")

    def as_argument(self) -> str | Path:
        """A Path for a folder, the URL's text for a bucket: what a spec's JSON field or a
        command-line argument of a path or a URL holds."""
        return self.folder or self.text

    def __str__(self) -> str:
        return self.text


def in_bucket(location: str | os.PathLike | StoreLocation) -> bool:
    """Whether `location` names a bucket (a URL) rather than a local folder."""
    return StoreLocation.parse(location).in_bucket


def location_argument(text: str) -> str | Path:
    """A command line's or a spec's path-or-URL value: a Path for a folder, the URL's text (no
    trailing "/") for a bucket."""
    return StoreLocation.parse(text).as_argument()


def is_bucket_url(value: Any) -> bool:
    """Whether `value` is a URL of a bucket Kiln stores artifacts in, its bucket named."""
    if not isinstance(value, str):
        return False
    where = StoreLocation.parse(value)
    bucket = where.text.partition("://")[2].partition("/")[0]
    return where.scheme in BUCKET_SCHEMES and bool(bucket)
