"""GCS with credentials: google-auth's default chain gets a token, and every request carries
it as `Authorization: Bearer TOKEN`, to an endpoint set by TENSORSTORE_GCS_HTTP_URL (the
variable TensorStore's `gcs` driver reads too). The credentials are a service account key file
(GOOGLE_APPLICATION_CREDENTIALS) made here, whose token URI is an OAuth server on loopback that
google-auth sends its signed JWT to; the bucket is fake-gcs-server behind a gate that records
each request's header."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs

import pytest
from kiln_testing.buckets import BucketGate, fresh_url

from kiln.artifacts.locations import open_store
from kiln.artifacts.store import ObjectExists

ACCESS_TOKEN = "ya29.kiln-test-access-token"


class TokenServer:
    """OAuth 2.0's token endpoint: answers every grant with ACCESS_TOKEN, valid for an hour;
    `grants` keeps each request's form."""

    def __init__(self) -> None:
        self.grants: list[dict[str, list[str]]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:  # http.server's naming
                form = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
                server.grants.append(parse_qs(form))
                body = json.dumps(
                    {"access_token": ACCESS_TOKEN, "expires_in": 3600, "token_type": "Bearer"}
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/token"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def tokens() -> Iterator[TokenServer]:
    server = TokenServer()
    yield server
    server.close()


def service_account_key(path: Path, token_uri: str) -> Path:
    """A service account key file as Google issues one, with a fresh RSA key."""
    from cryptography.hazmat.primitives import serialization  # pants: no-infer-dep
    from cryptography.hazmat.primitives.asymmetric import rsa  # pants: no-infer-dep

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path.write_text(json.dumps({
        "type": "service_account", "project_id": "kiln-test", "private_key_id": "kiln-test-key",
        "private_key": pem.decode(), "client_email": "kiln@kiln-test.iam.gserviceaccount.com",
        "client_id": "1", "token_uri": token_uri,
    }))  # fmt: skip
    return path


def test_gcs_requests_carry_the_default_credentials_token(
    gcs_server: str, tokens: TokenServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    credentials = service_account_key(tmp_path / "key.json", tokens.url)
    gate = BucketGate(gcs_server)
    try:
        monkeypatch.delenv("STORAGE_EMULATOR_HOST")
        monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", gate.endpoint)
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(credentials))
        store = open_store(fresh_url("gs"))
        store.check()
        generation = store.create("lease", b"one")
        with pytest.raises(ObjectExists):
            store.create("lease", b"two")
        store.replace("lease", b"three", generation=generation)
        assert store.read("lease").data == b"three"
    finally:
        gate.close()
    assert gate.authorizations and set(gate.authorizations) == {f"Bearer {ACCESS_TOKEN}"}
    # One grant (a JWT signed with the key); the access token is reused after it.
    grants = [grant["grant_type"] for grant in tokens.grants]
    assert grants == [["urn:ietf:params:oauth:grant-type:jwt-bearer"]]
