"""An S3 bucket (or an S3-compatible store: CoreWeave, R2, MinIO) as an object store.

- create: `PutObject` with `If-None-Match: *` (412 when the key exists).
- replace / delete: `If-Match: ETAG`; the generation is the object's ETag.
- upload / download of local files: boto3's transfer manager, in parts of PART_BYTES (a
  multipart upload appears whole when it completes; a download is renamed into place).
- Credentials and endpoint come from boto3's standard chain: AWS_ACCESS_KEY_ID /
  AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, AWS_PROFILE and ~/.aws, instance roles;
  AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) for S3-compatible stores, AWS_REGION.
- botocore retries throttling, server errors and dropped connections with backoff ("standard"
  mode); connecting times out after a few seconds, so a dead endpoint fails fast.

An ETag is a digest of the bytes: two writes of identical bytes have the same generation. The
store's users write objects that differ on every write (leases carry an owner and an expiry).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, BinaryIO

from kiln.artifacts.atomic import atomic_write_with
from kiln.artifacts.bucket import (
    ATTEMPTS,
    CONNECT_TIMEOUT_SECONDS,
    READ_TIMEOUT_SECONDS,
    BucketURL,
    missing_bucket,
    unreachable,
)
from kiln.artifacts.storage_errors import StorageError
from kiln.artifacts.store import (
    BucketStore,
    ListedObject,
    ObjectExists,
    ObjectMissing,
    PreconditionFailed,
    StoredObject,
)

_DENIED = {"AccessDenied", "AllAccessDisabled", "Forbidden", "403"}
_BAD_CREDENTIALS = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
}
_PRECONDITION = {"PreconditionFailed", "412"}
_CONFLICT = {"ConditionalRequestConflict", "409"}  # a concurrent conditional write won
# upload and download: objects above one part go in parts (a multipart upload, ranged GETs),
# a few at once, so memory holds a few parts, never a whole checkpoint file.
PART_BYTES = 32 << 20
PARTS_AT_ONCE = 4
CONNECTIONS = 32  # callers move several files at once (the run mirror: 8), each in parts


_loader_lock = threading.Lock()
_loader: Any = None


def _botocore_session() -> Any:
    """A new botocore session (it reads the environment and ~/.aws now) sharing one loader of
    the service's API model, which costs most of a second to load."""
    import botocore.loaders
    import botocore.session

    global _loader
    with _loader_lock:
        if _loader is None:
            _loader = botocore.loaders.create_loader()
        session = botocore.session.get_session()
        session.register_component("data_loader", _loader)
        return session


class S3Store(BucketStore):
    def __init__(self, url: str) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.url = BucketURL.parse(url)
        config = Config(
            connect_timeout=CONNECT_TIMEOUT_SECONDS,
            read_timeout=READ_TIMEOUT_SECONDS,
            retries={"max_attempts": ATTEMPTS, "mode": "standard"},
            max_pool_connections=CONNECTIONS,
        )
        session = boto3.session.Session(botocore_session=_botocore_session())
        self._client: Any = session.client("s3", config=config)
        self._transfer = TransferConfig(
            multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES,
            max_concurrency=PARTS_AT_ONCE, use_threads=True,
        )  # fmt: skip

    @property
    def endpoint(self) -> str:
        return str(self._client.meta.endpoint_url)

    def check(self) -> None:
        self._call("", "head_bucket")

    def read(self, key: str) -> StoredObject:
        reply = self._call(key, "get_object", Key=self.url.name(key))
        return StoredObject(reply["Body"].read(), reply["ETag"])

    def size(self, key: str) -> int:
        return int(self._call(key, "head_object", Key=self.url.name(key))["ContentLength"])

    def generation(self, key: str) -> str:
        return str(self._call(key, "head_object", Key=self.url.name(key))["ETag"])

    def kvstore(self, key: str) -> dict[str, Any]:
        spec = {
            "driver": "s3",
            "bucket": self.url.bucket,
            "path": self.url.folder(key),
            "aws_region": self._client.meta.region_name,
        }
        if not self.endpoint.endswith(".amazonaws.com"):  # AWS_ENDPOINT_URL: S3-compatible
            spec["endpoint"] = self.endpoint
        if os.environ.get("AWS_ACCESS_KEY_ID"):
            # Keys in the environment: TensorStore's default chain would look for ~/.aws files
            # first, and log each one it does not find.
            spec["aws_credentials"] = {"type": "environment"}
        return spec

    def write(self, key: str, data: bytes) -> str:
        return str(self._call(key, "put_object", Key=self.url.name(key), Body=data)["ETag"])

    def upload(self, key: str, path: Path) -> None:
        with open(path, "rb") as f:
            self._call(key, "upload_fileobj", Fileobj=f, Key=self.url.name(key),
                       Config=self._transfer)  # fmt: skip

    def download(self, key: str, path: Path) -> None:
        def fetch(f: BinaryIO) -> None:
            self._call(key, "download_fileobj", Fileobj=f, Key=self.url.name(key),
                       Config=self._transfer)  # fmt: skip

        atomic_write_with(path, fetch)

    def create(self, key: str, data: bytes) -> str:
        try:
            reply = self._call(
                key, "put_object", Key=self.url.name(key), Body=data, IfNoneMatch="*"
            )
        except PreconditionFailed:
            raise ObjectExists(self.location(key)) from None
        return str(reply["ETag"])

    def replace(self, key: str, data: bytes, *, generation: str) -> str:
        reply = self._call(key, "put_object", Key=self.url.name(key), Body=data, IfMatch=generation)
        return str(reply["ETag"])

    def delete(self, key: str, *, generation: str) -> None:
        self._call(key, "delete_object", Key=self.url.name(key), IfMatch=generation)

    def listing(self, key: str) -> list[ListedObject]:
        folder = self.url.name(key).rstrip("/") + "/"
        found: list[ListedObject] = []
        token: dict[str, str] = {}
        while True:  # pages of at most 1000 keys
            reply = self._call(key, "list_objects_v2", Prefix=folder, **token)
            for item in reply.get("Contents", []):
                modified = item["LastModified"].timestamp()
                found.append(ListedObject(item["Key"][len(folder) :], item["Size"], modified))
            if not reply.get("IsTruncated"):
                return sorted(found, key=lambda listed: listed.name)
            token = {"ContinuationToken": reply["NextContinuationToken"]}

    def remove(self, key: str) -> None:
        self._call(key, "delete_object", Key=self.url.name(key))  # S3: no error when absent

    def copy(self, source: str, destination: str) -> None:
        """On the server (boto3's managed copy: in parts above PART_BYTES)."""
        origin = {"Bucket": self.url.bucket, "Key": self.url.name(source)}
        self._call(source, "copy", CopySource=origin, Key=self.url.name(destination),
                   Config=self._transfer)  # fmt: skip

    def _call(self, key: str, operation: str, **arguments: Any) -> Any:
        """The client's `operation` on the bucket, its failures as the store's exceptions."""
        from boto3.exceptions import RetriesExceededError
        from botocore.exceptions import (
            ClientError,
            ConnectionError,
            NoCredentialsError,
            PartialCredentialsError,
        )

        try:
            return getattr(self._client, operation)(Bucket=self.url.bucket, **arguments)
        except ClientError as e:
            raise self._client_error(key, e) from None
        # After botocore's retries; a download's streamed body after the transfer manager's.
        except (ConnectionError, RetriesExceededError) as e:
            raise unreachable(self.url, self.endpoint, e, "AWS_ENDPOINT_URL") from None
        except (NoCredentialsError, PartialCredentialsError):
            raise StorageError(
                self.url.url(),
                "no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                "AWS_PROFILE with ~/.aws/credentials",
            ) from None

    def _client_error(self, key: str, error: Any) -> Exception:
        code = str(error.response.get("Error", {}).get("Code", ""))
        if code in _PRECONDITION or code in _CONFLICT:
            return PreconditionFailed(f"{self.location(key)} is another generation now ({code})")
        if code in {"NoSuchKey", "404"} and key:
            return ObjectMissing(self.location(key))
        if code in {"NoSuchBucket", "404"}:
            return missing_bucket(self.url)
        if code in _DENIED:
            return StorageError(
                self.location(key),
                "access denied: check that these credentials (AWS_PROFILE, AWS_ACCESS_KEY_ID) "
                "may read and write the bucket",
            )
        if code in _BAD_CREDENTIALS:
            return StorageError(
                self.location(key),
                f"the credentials were refused ({code}): check AWS_ACCESS_KEY_ID, "
                "AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN or the profile in ~/.aws",
            )
        return StorageError(self.location(key), f"{code or 'error'} from {self.endpoint}")
