"""A `url_files` source against a real HTTP server on loopback: downloaded once, digest-checked,
a mismatch refused naming the URL, the documents read from the verified copy."""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.data import downloads, sources
from kiln.data.errors import SourceError
from kiln_contract.tokenize import UrlFilesSource

DOCS = ["First document.", "Second document, with \u00e9."]
PAYLOAD = json.dumps(DOCS).encode("utf-8")


class _CountingHandler(http.server.SimpleHTTPRequestHandler):
    requests: list[str]

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.requests.append(self.path)
        super().do_GET()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, list[str]]]:
    served = tmp_path / "served" / "data"
    served.mkdir(parents=True)
    (served / "bbc_news.json").write_bytes(PAYLOAD)
    requests: list[str] = []
    handler = type("Handler", (_CountingHandler,), {"requests": requests})
    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(handler, directory=str(served.parent))
    )
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", requests
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(autouse=True)
def download_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "downloads"
    monkeypatch.setenv(downloads.DOWNLOAD_DIR_VARIABLE, str(folder))
    return folder


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def git_blob(data: bytes) -> str:
    return "git-blob-sha1:" + hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_a_pinned_file_is_downloaded_once_and_read(server: tuple[str, list[str]]) -> None:
    base, requests = server
    url = f"{base}/data/bbc_news.json"
    source = UrlFilesSource(((url, sha256(PAYLOAD)),))
    documents = [doc.text for shard in range(2) for doc in sources.shard_documents(source, "text", 2, shard)]
    assert sorted(documents) == sorted(DOCS)
    assert requests == ["/data/bbc_news.json"]  # the second shard reused the verified copy
    assert sources.provenance(source) == {
        "kind": "url_files",
        "files": {url: sha256(PAYLOAD)},
        "format": "auto",
    }


def test_a_git_blob_id_pins_a_file_too(server: tuple[str, list[str]]) -> None:
    base, _ = server
    path = downloads.fetch_pinned(f"{base}/data/bbc_news.json", git_blob(PAYLOAD))
    assert path.read_bytes() == PAYLOAD


def test_a_digest_mismatch_is_refused_naming_the_url(
    server: tuple[str, list[str]], download_dir: Path
) -> None:
    base, _ = server
    url = f"{base}/data/bbc_news.json"
    wrong = sha256(b"other bytes")
    with pytest.raises(SourceError) as error:
        downloads.fetch_pinned(url, wrong)
    message = str(error.value)
    assert url in message
    assert f"the source pins {wrong.split(':')[1]}" in message
    assert hashlib.sha256(PAYLOAD).hexdigest() in message
    # Nothing is left that could pass as downloaded.
    assert [p for p in download_dir.rglob("*") if p.is_file()] == []


def test_a_missing_file_names_the_url_and_status(server: tuple[str, list[str]]) -> None:
    base, _ = server
    url = f"{base}/data/missing.json"
    with pytest.raises(SourceError, match=f"{url}: the server answered HTTP 404"):
        downloads.fetch_pinned(url, sha256(PAYLOAD))
