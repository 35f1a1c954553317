"""What the bucket stores share: their URL, and their failures as one line with advice.

A bucket store's location is `SCHEME://BUCKET/PATH`; keys live under `PATH/`. Failures that are
no fault of Kiln (a missing bucket, denied access, an endpoint that does not answer) become a
StorageError naming the URL and what to check, so commands print one line and exit
EXIT_STORAGE. Messages carry URLs and endpoints, never credentials.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kiln.artifacts.storage_errors import StorageError

CONNECT_TIMEOUT_SECONDS = 3.0  # an endpoint that does not answer fails in seconds
READ_TIMEOUT_SECONDS = 60.0
ATTEMPTS = 4  # one try and three retries of a transient failure: ~0.2 + 0.4 + 0.8 s of backoff
_FIRST_BACKOFF_SECONDS = 0.2

T = TypeVar("T")


@dataclass(frozen=True)
class BucketURL:
    scheme: str  # "s3" or "gs"
    bucket: str
    path: str  # no leading or trailing "/"; "" for the bucket's root

    @classmethod
    def parse(cls, url: str) -> BucketURL:
        scheme, sep, rest = url.partition("://")
        bucket, _, path = rest.partition("/")
        if not sep or not bucket:
            raise ValueError(f"{url}: not a bucket URL; write it as {scheme or 's3'}://BUCKET/PATH")
        return cls(scheme, bucket, path.strip("/"))

    def name(self, key: str) -> str:
        """The object name of `key` in the bucket."""
        return f"{self.path}/{key}" if self.path else key

    def folder(self, key: str) -> str:
        """The name prefix of the objects under `key/`: ends in "/", or "" for the bucket's root."""
        name = self.name(key).strip("/")
        return f"{name}/" if name else ""

    def under(self, key: str) -> BucketURL:
        """The URL of the folder `key`, as a root of its own."""
        return BucketURL(self.scheme, self.bucket, self.name(key).strip("/"))

    def url(self, key: str = "") -> str:
        name = self.name(key) if key else self.path
        return f"{self.scheme}://{self.bucket}/{name}"


class Transient(Exception):
    """A failure worth retrying (throttling, a server error, a dropped connection)."""


def with_retries(action: Callable[[], T], *, attempts: int = ATTEMPTS) -> T:
    """`action()`, retried with exponential backoff while it raises Transient; the last
    Transient's cause is raised when the attempts are spent."""
    delay = _FIRST_BACKOFF_SECONDS
    for attempt in range(attempts):
        try:
            return action()
        except Transient as e:
            if attempt == attempts - 1:
                raise e.__cause__ or e from None
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")


def missing_bucket(url: BucketURL) -> StorageError:
    return StorageError(
        url.url(),
        f"the bucket {url.bucket} does not exist (or is not visible to these credentials): "
        "check the bucket name in the prefix",
    )


def unreachable(url: BucketURL, endpoint: str, cause: object, setting: str) -> StorageError:
    """`setting`: the environment variable that chooses the endpoint."""
    return StorageError(
        url.url(),
        f"cannot reach {endpoint} ({type(cause).__name__}): check {setting} and the network",
    )
