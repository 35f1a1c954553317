"""A Hugging Face Hub on loopback, for the hub path's tests: the endpoints `huggingface_hub`
calls to read a dataset, answered as huggingface.co answers them.

No package on PyPI serves them here: `hf-local-hub`'s wheel lacks its Go server, and `olah`
mirrors local git repositories without gated repositories or paginated listings. This server
speaks the Hub's HTTP API for datasets and nothing else, so the real client runs unchanged
against it (through HF_ENDPOINT):

    GET  /api/datasets/{id}[/revision/{rev}]        dataset_info
    GET  /api/datasets/{id}/tree/{rev}[/{path}]     list_repo_tree: `recursive`, pages of
                                                    PAGE_SIZE entries chained by `Link: rel="next"`
    HEAD, GET /datasets/{id}/resolve/{rev}/{path}   hf_hub_download: X-Repo-Commit, ETag,
                                                    Content-Length, the bytes

and its errors: 404 with `X-Error-Code` RepoNotFound, RevisionNotFound or EntryNotFound; for a
gated dataset 401 (no token) or 403 (a token without access) with `X-Error-Code: GatedRepo`.
Every request's method, path and Authorization header are kept in `requests`.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, unquote, urlsplit

PAGE_SIZE = 2  # small, so that a listing of a few files takes several pages


@dataclass
class HubDataset:
    """A dataset repository: its commits (sha -> {path: bytes}) and branches (name -> sha)."""

    id: str
    commits: dict[str, dict[str, bytes]]
    branches: dict[str, str] = field(default_factory=dict)
    granted_tokens: tuple[str, ...] | None = None  # None: public; else gated, these may read

    def commit(self, revision: str) -> str | None:
        return self.branches.get(revision, revision if revision in self.commits else None)


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    authorization: str | None


class HubServer:
    """`with HubServer() as hub:` serves `hub.datasets` at `hub.endpoint` until the block ends."""

    def __init__(self) -> None:
        self.datasets: dict[str, HubDataset] = {}
        self.requests: list[Request] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def add(self, dataset: HubDataset) -> HubDataset:
        self.datasets[dataset.id] = dataset
        return dataset

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def _handler_for(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(_HubHandler):
        server_hub = hub

    return Handler


class _HubHandler(BaseHTTPRequestHandler):
    server_hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        return

    def do_HEAD(self) -> None:  # http.server's naming
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        self.server_hub.requests.append(
            Request(self.command, self.path, self.headers.get("Authorization"))
        )
        if path.startswith("/api/datasets/"):
            self._api(path.removeprefix("/api/datasets/"), parse_qs(url.query))
        elif path.startswith("/datasets/") and "/resolve/" in path:
            repo, _, rest = path.removeprefix("/datasets/").partition("/resolve/")
            revision, _, file_path = rest.partition("/")
            self._file(repo, revision, file_path, body)
        else:
            self._error(404, "RepoNotFound", "Not a path of this hub")

    def _api(self, rest: str, query: dict[str, list[str]]) -> None:
        parts = rest.split("/")
        repo, tail = "/".join(parts[:2]), parts[2:]
        dataset = self._readable(repo)
        if dataset is None:
            return
        if not tail or tail[0] == "revision":
            self._info(dataset, tail[1] if len(tail) > 1 else "main")
        elif tail[0] == "tree" and len(tail) > 1:
            self._tree(dataset, tail[1], "/".join(tail[2:]), query)
        else:
            self._error(404, "EntryNotFound", "Unknown API path")

    def _readable(self, repo: str) -> HubDataset | None:
        """The dataset, or None after answering the error a reader without access gets."""
        dataset = self.server_hub.datasets.get(repo)
        if dataset is None:
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        if dataset.granted_tokens is not None:
            token = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
            if not token:
                self._error(401, "GatedRepo", "Access to this dataset is restricted.")
                return None
            if token not in dataset.granted_tokens:
                self._error(403, "GatedRepo", "Access to this dataset is restricted.")
                return None
        return dataset

    def _commit(self, dataset: HubDataset, revision: str) -> str | None:
        sha = dataset.commit(revision)
        if sha is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return sha

    def _info(self, dataset: HubDataset, revision: str) -> None:
        sha = self._commit(dataset, revision)
        if sha is None:
            return
        files = dataset.commits[sha]
        self._json({
            "id": dataset.id, "sha": sha, "private": False, "disabled": False,
            "gated": "manual" if dataset.granted_tokens is not None else False,
            "downloads": 0, "likes": 0, "tags": [],
            "siblings": [{"rfilename": path} for path in sorted(files)],
        })  # fmt: skip

    def _tree(self, dataset: HubDataset, revision: str, folder: str, query: dict) -> None:
        sha = self._commit(dataset, revision)
        if sha is None:
            return
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        entries = _tree_entries(dataset.commits[sha], folder, recursive)
        start = int(query.get("cursor", ["0"])[0])
        page = entries[start : start + PAGE_SIZE]
        headers = {}
        if start + PAGE_SIZE < len(entries):
            following = f"recursive={str(recursive).lower()}&expand=false&cursor={start + PAGE_SIZE}"
            path = quote(f"/api/datasets/{dataset.id}/tree/{revision}/{folder}".rstrip("/"))
            headers["Link"] = f'<{self.server_hub.endpoint}{path}?{following}>; rel="next"'
        self._json(page, headers)

    def _file(self, repo: str, revision: str, file_path: str, body: bool) -> None:
        dataset = self._readable(repo)
        sha = None if dataset is None else self._commit(dataset, revision)
        if dataset is None or sha is None:
            return
        data = dataset.commits[sha].get(file_path)
        if data is None:
            self._error(404, "EntryNotFound", f"{file_path} does not exist at {revision}")
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("ETag", f'"{_git_blob_id(data)}"')
        self.send_header("X-Repo-Commit", sha)
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _json(self, value: object, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, text in (headers or {}).items():
            self.send_header(name, text)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _error(self, status: int, code: str, message: str) -> None:
        data = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


def _tree_entries(files: dict[str, bytes], folder: str, recursive: bool) -> list[dict]:
    """The Hub's tree listing of `folder`: its files (every one below it when recursive) and
    its sub-folders (only the direct ones unless recursive), in path order."""
    prefix = f"{folder}/" if folder else ""
    entries: dict[str, dict] = {}
    for path, data in sorted(files.items()):
        if not path.startswith(prefix):
            continue
        below = path.removeprefix(prefix).split("/")
        for depth in range(1, len(below) if recursive else min(2, len(below))):
            sub = prefix + "/".join(below[:depth])
            entries.setdefault(sub, {"type": "directory", "oid": _git_blob_id(sub.encode()),
                                     "size": 0, "path": sub})  # fmt: skip
        if recursive or len(below) == 1:
            entries[path] = {"type": "file", "oid": _git_blob_id(data), "size": len(data),
                             "path": path}  # fmt: skip
    return [entries[key] for key in sorted(entries)]


def _git_blob_id(data: bytes) -> str:
    """The id git (and so the Hub) gives a file's bytes."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
