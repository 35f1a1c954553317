"""A Google Cloud Storage bucket as an object store, over the JSON API.

- create: a multipart upload with `ifGenerationMatch=0` (412 when the object exists).
- replace / delete: `ifGenerationMatch=N`; the generation is the object's `generation`.
- read: `alt=media`, the generation from the `X-Goog-Generation` header of the same reply.
- upload / download of local files: files above CHUNK_BYTES go as a resumable upload in
  chunks (the object appears when the last one arrives); downloads stream into a temp file.
- Endpoint: https://storage.googleapis.com; or TENSORSTORE_GCS_HTTP_URL, the variable that
  points TensorStore's `gcs` driver elsewhere too (a private endpoint: credentials are sent);
  or STORAGE_EMULATOR_HOST (an emulator: no credentials are sent). Credentials: google-auth's
  default chain (GOOGLE_APPLICATION_CREDENTIALS, gcloud's application-default credentials,
  the metadata server on Google Cloud), sent as `Authorization: Bearer TOKEN`.
- Throttling (429), server errors (5xx) and dropped connections are retried with backoff
  (kiln.artifacts.bucket.with_retries); connecting times out after a few seconds.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import threading
import uuid
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import quote

import requests
from requests.exceptions import ChunkedEncodingError

from kiln.artifacts.atomic import atomic_write_with
from kiln.artifacts.bucket import (
    CONNECT_TIMEOUT_SECONDS,
    READ_TIMEOUT_SECONDS,
    BucketURL,
    Transient,
    missing_bucket,
    unreachable,
    with_retries,
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

GCS_ENDPOINT = "https://storage.googleapis.com"
EMULATOR_VARIABLE = "STORAGE_EMULATOR_HOST"
ENDPOINT_VARIABLE = "TENSORSTORE_GCS_HTTP_URL"
_SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"
_TIMEOUTS = (CONNECT_TIMEOUT_SECONDS, READ_TIMEOUT_SECONDS)
# upload and download of local files stream in chunks of this size (a multiple of 256 KiB, as
# resumable uploads require): memory holds a chunk, never a whole checkpoint file.
CHUNK_BYTES = 32 << 20


def gcs_endpoint() -> str:
    """The JSON API's base URL: the emulator's when STORAGE_EMULATOR_HOST is set, else
    TENSORSTORE_GCS_HTTP_URL's, else Google's."""
    endpoint = os.environ.get(EMULATOR_VARIABLE) or os.environ.get(ENDPOINT_VARIABLE)
    if not endpoint:
        return GCS_ENDPOINT
    return endpoint.rstrip("/") if "://" in endpoint else f"http://{endpoint.rstrip('/')}"


class GCSStore(BucketStore):
    def __init__(self, url: str) -> None:
        self.url = BucketURL.parse(url)
        self.endpoint = gcs_endpoint()
        self._emulated = bool(os.environ.get(EMULATOR_VARIABLE))  # emulators take no credentials
        self._session = requests.Session()
        self._credentials: Any = None
        self._credentials_lock = threading.Lock()

    def check(self) -> None:
        self._request("", "GET", f"/storage/v1/b/{self.url.bucket}")

    def read(self, key: str) -> StoredObject:
        reply = self._request(key, "GET", self._object_path(key), params={"alt": "media"})
        return StoredObject(reply.content, reply.headers["X-Goog-Generation"])

    def size(self, key: str) -> int:
        return int(self._request(key, "GET", self._object_path(key)).json()["size"])

    def generation(self, key: str) -> str:
        return str(self._request(key, "GET", self._object_path(key)).json()["generation"])

    def kvstore(self, key: str) -> dict[str, Any]:
        # TensorStore reaches an emulator through TENSORSTORE_GCS_HTTP_URL, not this spec.
        return {"driver": "gcs", "bucket": self.url.bucket, "path": self.url.folder(key)}

    def write(self, key: str, data: bytes) -> str:
        return self._upload(key, data, if_generation=None)

    def upload(self, key: str, path: Path) -> None:
        size = path.stat().st_size
        if size <= CHUNK_BYTES:  # one request
            self._upload(key, path.read_bytes(), if_generation=None)
            return
        with open(path, "rb") as f:
            self._upload_resumable(key, f, size)

    def download(self, key: str, path: Path) -> None:
        atomic_write_with(path, lambda f: self._download_into(key, f))

    def create(self, key: str, data: bytes) -> str:
        try:
            return self._upload(key, data, if_generation="0")
        except PreconditionFailed:
            raise ObjectExists(self.location(key)) from None

    def replace(self, key: str, data: bytes, *, generation: str) -> str:
        return self._upload(key, data, if_generation=generation)

    def delete(self, key: str, *, generation: str) -> None:
        params = {"ifGenerationMatch": generation}
        self._request(key, "DELETE", self._object_path(key), params=params)

    def listing(self, key: str) -> list[ListedObject]:
        folder = self.url.name(key).rstrip("/") + "/"
        found: list[ListedObject] = []
        params = {"prefix": folder, "fields": "items(name,size,updated),nextPageToken"}
        while True:
            reply = self._request(key, "GET", f"/storage/v1/b/{self.url.bucket}/o", params=params)
            page = reply.json()
            for item in page.get("items", []):
                modified = _seconds(item["updated"])
                found.append(ListedObject(item["name"][len(folder) :], int(item["size"]), modified))
            if "nextPageToken" not in page:
                return sorted(found, key=lambda listed: listed.name)
            params = {**params, "pageToken": page["nextPageToken"]}

    def remove(self, key: str) -> None:
        with contextlib.suppress(ObjectMissing):
            self._request(key, "DELETE", self._object_path(key))

    def _object_path(self, key: str) -> str:
        return f"/storage/v1/b/{self.url.bucket}/o/{quote(self.url.name(key), safe='')}"

    def _upload(self, key: str, data: bytes, *, if_generation: str | None) -> str:
        """A multipart upload (metadata + bytes in one request): the object appears whole."""
        boundary = uuid.uuid4().hex
        metadata = json.dumps({"name": self.url.name(key)}).encode()
        body = b"".join([
            f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n".encode(),
            metadata,
            f"\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n".encode(),
            data,
            f"\r\n--{boundary}--\r\n".encode(),
        ])  # fmt: skip
        params = {"uploadType": "multipart"}
        if if_generation is not None:
            params["ifGenerationMatch"] = if_generation
        reply = self._request(
            key,
            "POST",
            f"/upload/storage/v1/b/{self.url.bucket}/o",
            params=params,
            data=body,
            headers={"Content-Type": f"multipart/related; boundary={boundary}"},
        )
        return str(reply.json()["generation"])

    def _download_into(self, key: str, f: BinaryIO) -> None:
        """The object's bytes into `f`, streamed; a connection dropped mid-body starts over."""

        def attempt() -> None:
            f.seek(0)
            f.truncate()
            reply = self._request(key, "GET", self._object_path(key), params={"alt": "media"},
                                  stream=True)  # fmt: skip
            with reply:
                try:
                    for chunk in reply.iter_content(CHUNK_BYTES):
                        f.write(chunk)
                except (requests.ConnectionError, requests.Timeout, ChunkedEncodingError) as e:
                    raise Transient() from e

        try:
            with_retries(attempt)
        except (requests.ConnectionError, requests.Timeout, ChunkedEncodingError) as e:
            raise self._unreachable(e) from None

    def _upload_resumable(self, key: str, f: BinaryIO, size: int) -> None:
        """A resumable upload in chunks of CHUNK_BYTES: the object appears whole when its last
        chunk arrives. After each chunk the server says how much it has kept (`Range`), and
        the next chunk starts there."""
        started = self._request(
            key,
            "POST",
            f"/upload/storage/v1/b/{self.url.bucket}/o",
            params={"uploadType": "resumable"},
            json={"name": self.url.name(key)},
        )
        session = started.headers["Location"]  # a full URL, valid for this upload only
        offset = 0
        while True:
            f.seek(offset)
            chunk = f.read(CHUNK_BYTES)
            end = offset + len(chunk)
            total = str(size) if end == size else "*"
            reply = self._request(key, "PUT", session, data=chunk,
                                  headers={"Content-Range": f"bytes {offset}-{end - 1}/{total}"},
                                  expected=(308,))  # fmt: skip
            if reply.status_code != 308:
                return  # 200 or 201: complete
            kept = reply.headers.get("Range")  # "bytes=0-N", absent when nothing was kept
            offset = int(kept.rpartition("-")[2]) + 1 if kept else 0

    def _request(
        self, key: str, method: str, path: str, *, expected: tuple[int, ...] = (), **options: Any
    ) -> requests.Response:
        """One JSON API request (`path` under the endpoint, or a full URL), retried while
        transient; failures other than an `expected` status as store exceptions."""

        extra_headers = options.pop("headers", {})

        def attempt() -> requests.Response:
            headers = {**extra_headers, **self._auth_headers()}
            url = path if "://" in path else self.endpoint + path
            try:
                reply = self._session.request(
                    method, url, headers=headers, timeout=_TIMEOUTS, **options
                )
            except (requests.ConnectionError, requests.Timeout) as e:
                raise Transient() from e
            if reply.status_code == 429 or reply.status_code >= 500:
                raise Transient() from StorageError(
                    self.location(key), f"HTTP {reply.status_code} from {self.endpoint}"
                )
            return reply

        try:
            reply = with_retries(attempt)
        except (requests.ConnectionError, requests.Timeout) as e:
            raise self._unreachable(e) from None
        if reply.ok or reply.status_code in expected:
            return reply
        raise self._http_error(key, reply) from None

    def _unreachable(self, cause: Exception) -> StorageError:
        setting = (
            EMULATOR_VARIABLE if self._emulated
            else ENDPOINT_VARIABLE if self.endpoint != GCS_ENDPOINT
            else "the proxy settings (HTTPS_PROXY)"
        )  # fmt: skip
        return unreachable(self.url, self.endpoint, cause, setting)

    def _http_error(self, key: str, reply: requests.Response) -> Exception:
        status = reply.status_code
        if status == 412:
            return PreconditionFailed(f"{self.location(key)} is another generation now")
        if status == 404:
            # Real GCS says which is missing; an upload's 404 can only be the bucket.
            names_bucket = "bucket" in _error_message(reply).lower()
            if key and reply.request.method in ("GET", "DELETE") and not names_bucket:
                return ObjectMissing(self.location(key))
            return missing_bucket(self.url)
        if status in (401, 403):
            return StorageError(
                self.location(key),
                f"access denied (HTTP {status}): check that these credentials "
                "(GOOGLE_APPLICATION_CREDENTIALS, gcloud's application-default login, the VM's "
                "service account) may read and write the bucket",
            )
        return StorageError(self.location(key), f"HTTP {status} from {self.endpoint}")

    def _auth_headers(self) -> dict[str, str]:
        if self._emulated:
            return {}
        with self._credentials_lock:
            if self._credentials is None:
                self._credentials = _default_credentials(self.url)
            if not self._credentials.valid:
                _refresh(self._credentials, self.url)
            return {"Authorization": f"Bearer {self._credentials.token}"}


def _default_credentials(url: BucketURL) -> Any:
    import google.auth
    import google.auth.exceptions

    try:
        credentials, _ = google.auth.default(scopes=[_SCOPE])
    except google.auth.exceptions.DefaultCredentialsError:
        raise StorageError(
            url.url(),
            "no Google credentials found: set GOOGLE_APPLICATION_CREDENTIALS to a service "
            "account key file, run `gcloud auth application-default login`, or run on a VM with "
            "a service account",
        ) from None
    return credentials


def _refresh(credentials: Any, url: BucketURL) -> None:
    import google.auth.exceptions
    import google.auth.transport.requests

    try:
        credentials.refresh(google.auth.transport.requests.Request())
    except google.auth.exceptions.GoogleAuthError as e:
        raise StorageError(
            url.url(),
            f"could not get an access token ({type(e).__name__}): check "
            "GOOGLE_APPLICATION_CREDENTIALS or the VM's service account",
        ) from None


def _error_message(reply: requests.Response) -> str:
    try:
        return str(reply.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return reply.text[:200]


def _seconds(rfc3339: str) -> float:
    """'2026-12-02T19:30:00.123Z' (the JSON API's `updated`) as unix seconds."""
    return datetime.datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()
