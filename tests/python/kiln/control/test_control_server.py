"""The control endpoint over real HTTP: every refusal, the headers, redaction, and behaviour."""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlencode, urlsplit

import pytest

from kiln.control.server import ACCEPTED_TEXT, SECURITY_HEADERS, ControlServer
from kiln.control.tokens import mint_token, new_key, read_endpoint

HEADER = {"X-Levanter-Training-Control": "request-checkpoint"}
HEADER_LINE = "X-Levanter-Training-Control: request-checkpoint"
FORM = {"Content-Type": "application/x-www-form-urlencoded"}

FAKE_SECRETS = {
    "WANDB_API_KEY": "wandbkey0123456789abcdef0123456789abcdef",
    "AWS_SECRET_ACCESS_KEY": "awsSecretAccessValue9f8e7d6c5b4a",
    "MY_SERVICE_TOKEN": "servicetokenvalue4242424242",
    "DB_PASSWORD": "hunter2hunter2hunter2",
    "HF_TOKEN": "hf_hubtokenvalueABCDEFGHIJKLMNOP",
    # Secret values under innocent names.
    "INNOCENT_SETTING": "hf_innocentlookingHFtoken123456",
    "OPENAI_THING": "sk-proj-fakeopenaivalue1234567890",
    "AWS_ID_SOMEWHERE": "AKIAFAKEACCESSKEY123",
    "SESSION_JWT_HOLDER": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ4In0.c2lnbmF0dXJlZmFrZQ",
    "DATABASE_URL": "postgres://kiln:urlpassword987654@db.example:5432/runs",
    "APP_CONFIG": json.dumps({"host": "db", "nested": {"password": "nestedjsonpassword314"}}),
}


def _request(
    url: str, method: str = "GET", headers: dict[str, str] | None = None, body: bytes = b""
) -> tuple[int, dict[str, str], bytes]:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        connection.request(method, parts.path or "/", body=body or None, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ControlServer]:
    for name, value in FAKE_SECRETS.items():
        monkeypatch.setenv(name, value)
    control = ControlServer(
        tmp_path,
        run_info={
            "run_id": "quickstart-2026.11.29",
            "name": "checkpoints/quickstart",
            "version": "2026.11.29",
            "fingerprint": "1a2b3c4d",
            "output_path": str(tmp_path),
        },
        config={
            "model": {"hidden_dim": 64, "num_layers": 2},
            "tokenizer": "kiln-stdlib-8k",
            "wandb": {"project": "kiln", "api_key": "configapikeyvalue2718"},
            "control": {"token_ttl_minutes": 720},
        },
        stall_seconds=0.5,
    )
    control.url = control.start()  # type: ignore[attr-defined]
    yield control
    control.stop()


def _base(server: ControlServer) -> str:
    return server.url  # type: ignore[attr-defined]


def _origin(server: ControlServer) -> str:
    parts = urlsplit(_base(server))
    return f"{parts.scheme}://{parts.netloc}"


def _csrf_form(token: str) -> bytes:
    return urlencode({"csrf_token": token}).encode()


def _assert_bare_403(status: int, body: bytes) -> None:
    assert status == 403
    assert body == b"forbidden\n"


# --- capability tokens ---------------------------------------------------------------------


def test_page_served_with_valid_token_and_security_headers(server: ControlServer) -> None:
    status, headers, body = _request(_base(server))
    assert status == 200
    for name, value in SECURITY_HEADERS.items():
        assert headers[name] == value
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    assert headers["Cache-Control"] == "no-store"
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert b"quickstart-2026.11.29" in body and b"checkpoints/quickstart" in body
    assert b"Save checkpoint" in body
    assert server.csrf_token.encode() in body
    assert b"hidden_dim" in body and b"kiln-stdlib-8k" in body
    assert b"/c/" not in body  # the page never spells out the capability token


@pytest.mark.parametrize(
    "path",
    [
        "/",
        "/healthz",
        "/checkpoint",
        "/c/",
        "/c//",
        "/c/not-a-token/",
        "/c/" + "A" * 54 + "/",  # right shape, wrong MAC
        "/c/" + "A" * 53 + "%/",  # right length, not base64url
        "/c/../",
    ],
)
def test_missing_or_malformed_token_is_bare_403(server: ControlServer, path: str) -> None:
    for method in ("GET", "POST"):
        status, headers, body = _request(_origin(server) + path, method, HEADER)
        _assert_bare_403(status, body)
        assert headers["Content-Security-Policy"]  # security headers on refusals too


def test_expired_token_is_403(server: ControlServer) -> None:
    key = read_endpoint(server.run_dir)[1]
    expired = mint_token(key, int(time.time()) - 1)
    status, _, body = _request(f"{_origin(server)}/c/{expired}/")
    _assert_bare_403(status, body)
    fresh = mint_token(key, int(time.time()) + 60)
    assert _request(f"{_origin(server)}/c/{fresh}/")[0] == 200


def test_token_for_a_different_key_is_403(server: ControlServer) -> None:
    foreign = mint_token(new_key(), int(time.time()) + 3600)
    for suffix in ("", "healthz"):
        status, _, body = _request(f"{_origin(server)}/c/{foreign}/{suffix}")
        _assert_bare_403(status, body)
    status, _, body = _request(f"{_origin(server)}/c/{foreign}/checkpoint", "POST", HEADER)
    _assert_bare_403(status, body)
    assert server.take_checkpoint_request() is False


def test_tampered_token_is_403(server: ControlServer) -> None:
    token = urlsplit(_base(server)).path.split("/")[2]
    later_expiry = mint_token(b"x" * 32, int(time.time()) + 10**6)[:11]  # forged expiry bytes
    tampered = later_expiry + token[11:]
    status, _, body = _request(f"{_origin(server)}/c/{tampered}/")
    _assert_bare_403(status, body)


def test_token_without_trailing_slash_redirects_only_when_valid(server: ControlServer) -> None:
    status, headers, _ = _request(_base(server).rstrip("/"))
    assert status == 308
    assert headers["Location"].endswith("/")


# --- POST /checkpoint -----------------------------------------------------------------------


def test_checkpoint_with_header_is_accepted(server: ControlServer) -> None:
    status, _, body = _request(_base(server) + "checkpoint", "POST", HEADER)
    assert status == 202
    assert body.decode() == ACCEPTED_TEXT
    assert server.take_checkpoint_request() is True


@pytest.mark.parametrize(
    "headers",
    [{}, {"X-Levanter-Training-Control": "yes"}, {"X-Levanter-Training-Control": ""}],
)
def test_checkpoint_without_the_header_is_403(
    server: ControlServer, headers: dict[str, str]
) -> None:
    status, _, body = _request(_base(server) + "checkpoint", "POST", headers)
    _assert_bare_403(status, body)
    assert server.take_checkpoint_request() is False


def test_checkpoint_with_form_token(server: ControlServer) -> None:
    status, _, _ = _request(
        _base(server) + "checkpoint", "POST", FORM, _csrf_form(server.csrf_token)
    )
    assert status == 202
    assert server.take_checkpoint_request() is True


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"csrf_token=",
        b"csrf_token=wrong",
        "csrf_token=\u00e9t\u00e9".encode(),
        b"other_field=1",
    ],
)
def test_checkpoint_with_bad_form_token_is_403(server: ControlServer, body: bytes) -> None:
    status, _, response = _request(_base(server) + "checkpoint", "POST", FORM, body)
    _assert_bare_403(status, response)
    assert server.take_checkpoint_request() is False


def test_form_token_twice_or_in_wrong_content_type_is_403(server: ControlServer) -> None:
    token = server.csrf_token
    twice = _csrf_form(token) + b"&" + _csrf_form(token)
    assert _request(_base(server) + "checkpoint", "POST", FORM, twice)[0] == 403
    as_text = {"Content-Type": "text/plain"}
    assert _request(_base(server) + "checkpoint", "POST", as_text, _csrf_form(token))[0] == 403
    assert server.take_checkpoint_request() is False


def test_get_on_checkpoint_is_refused(server: ControlServer) -> None:
    status, headers, _ = _request(_base(server) + "checkpoint", "GET", HEADER)
    assert status == 405
    assert headers["Allow"] == "POST"
    assert server.take_checkpoint_request() is False


def test_unknown_post_path_is_404_only_with_valid_token(server: ControlServer) -> None:
    assert _request(_base(server) + "shutdown", "POST", HEADER)[0] == 404
    assert _request(_base(server) + "", "POST", HEADER)[0] == 404
    status, _, body = _request(_origin(server) + "/c/bogus/shutdown", "POST", HEADER)
    _assert_bare_403(status, body)


def test_oversized_body_is_refused(server: ControlServer) -> None:
    body = _csrf_form(server.csrf_token) + b"&pad=" + b"x" * 10_000
    assert _request(_base(server) + "checkpoint", "POST", FORM, body)[0] == 413
    assert server.take_checkpoint_request() is False


def test_a_chunked_body_is_refused_whatever_its_size(server: ControlServer) -> None:
    """A chunked body's length is unknown until read: refused (413), no checkpoint."""
    parts = urlsplit(_base(server))
    chunk = b"x" * 20_000
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as connection:
        connection.sendall(
            f"POST {parts.path}checkpoint HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"{HEADER_LINE}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
            + f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n0\r\n\r\n"
        )
        answer = connection.recv(4096).decode()
    assert answer.split(" ", 2)[1] == "413", answer
    assert server.take_checkpoint_request() is False


def test_a_path_sent_with_a_leading_double_slash_is_not_a_route(server: ControlServer) -> None:
    """http.server would read `//c/TOKEN/` as `/c/TOKEN/`; Kiln links to neither form but the
    one it mints, so it answers a bare 403."""
    parts = urlsplit(_base(server))
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as connection:
        connection.sendall(
            f"GET /{parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n\r\n".encode()
        )
        answer = connection.recv(4096).decode()
    assert answer.split(" ", 2)[1] == "403", answer


def test_a_huge_body_or_a_client_that_hangs_up_leaves_no_traceback(
    server: ControlServer, capfd: pytest.CaptureFixture[str]
) -> None:
    huge = b"x" * 5_000_000
    assert _request(_base(server) + "checkpoint", "POST", FORM, huge)[0] == 413
    parts = urlsplit(_base(server))
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as hanging_up:
        hanging_up.sendall(
            f"POST {parts.path}checkpoint HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            "Content-Length: 100000000\r\n\r\n".encode() + b"x" * 100_000
        )
    assert _request(_base(server) + "healthz")[0] in (200, 503)  # still serving
    assert server.take_checkpoint_request() is False
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("host", ["evil.example", "evil.example:80", "127.0.0.1.evil.example"])
def test_a_host_that_is_not_this_server_is_misdirected(server: ControlServer, host: str) -> None:
    """A DNS-rebinding page reaches the port under its own name: even with a stolen URL it gets
    421, and its POST requests no checkpoint."""
    for method, route in (("GET", ""), ("POST", "checkpoint")):
        status, _, body = _request(_base(server) + route, method, {**HEADER, "Host": host})
        assert (status, body) == (421, b"misdirected request\n")
    assert server.take_checkpoint_request() is False


@pytest.mark.parametrize(
    "host",
    ["[::1]:abc", "localhost:99999", "localhost:0", "localhost:", "localhost:+80", "[::1]x",
     "[::1]:80x", "[::1", "[]:80", ":80", "", "  "],
)
def test_a_malformed_host_is_a_bad_request(server: ControlServer, host: str) -> None:
    """A port that is not 1-65535 digits, junk after `]` or no name is 400, not a name to look
    up (the port of a well-formed Host is not compared: an SSH tunnel forwards another one)."""
    for method, route in (("GET", ""), ("POST", "checkpoint")):
        status, _, body = _request(_base(server) + route, method, {**HEADER, "Host": host})
        assert (status, body) == (400, b"malformed Host header\n"), host
    assert server.take_checkpoint_request() is False


def test_a_malformed_configured_host_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILN_CONTROL_ALLOWED_HOSTS", "tunnel.example,proxy.example:https")
    with pytest.raises(ValueError, match="KILN_CONTROL_ALLOWED_HOSTS: 'proxy.example:https'"):
        ControlServer(tmp_path, {"run_id": "r"}, {})


@pytest.mark.parametrize("hosts", [[], ["{good}", "evil.example"], ["{good}", "{good}"]])
def test_no_host_or_several_is_a_bad_request(server: ControlServer, hosts: list[str]) -> None:
    """RFC 9112, 3.2: a request without a Host, or with several (the good one first), is 400."""
    parts = urlsplit(_base(server))
    lines = "".join(f"Host: {host.format(good=parts.netloc)}\r\n" for host in hosts)
    for method, route in (("GET", ""), ("POST", "checkpoint")):
        with socket.create_connection((parts.hostname, parts.port), timeout=10) as connection:
            connection.sendall(
                f"{method} {parts.path}{route} HTTP/1.1\r\n{lines}Content-Length: 0\r\n"
                "Connection: close\r\n\r\n".encode()
            )
            reply = connection.makefile("rb").read()
        assert reply.startswith(b"HTTP/1.1 400 ") or reply.startswith(b"HTTP/1.0 400 "), reply[:80]
    assert server.take_checkpoint_request() is False


def test_loopback_names_and_configured_names_are_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILN_CONTROL_ALLOWED_HOSTS", "tunnel.example, Proxy.Example")
    control = ControlServer(tmp_path, {"run_id": "r"}, {})
    url = control.start()
    try:
        served = ("localhost:8080", "LocalHost:65535", "127.0.0.1", "[::1]:1", "[::1]", "::1")
        for host in (*served, "tunnel.example", "proxy.example:443"):
            assert _request(url, headers={"Host": host})[0] == 200, host
        assert _request(url, headers={"Host": "other.example"})[0] == 421
    finally:
        control.stop()


# --- redaction ------------------------------------------------------------------------------


def test_no_secret_appears_in_the_page(server: ControlServer) -> None:
    status, _, page = _request(_base(server))
    assert status == 200
    secrets = [
        "wandbkey0123456789abcdef0123456789abcdef",
        "awsSecretAccessValue9f8e7d6c5b4a",
        "servicetokenvalue4242424242",
        "hunter2hunter2hunter2",
        "hf_hubtokenvalueABCDEFGHIJKLMNOP",
        "hf_innocentlookingHFtoken123456",
        "sk-proj-fakeopenaivalue1234567890",
        "AKIAFAKEACCESSKEY123",
        "c2lnbmF0dXJlZmFrZQ",
        "urlpassword987654",
        "nestedjsonpassword314",
        "configapikeyvalue2718",
    ]
    for secret in secrets:
        assert secret.encode() not in page, secret
        assert secret[:12].encode() not in page, secret  # not even a prefix
    # Names stay visible so the operator can see what is set; harmless nested values too.
    for name in ("WANDB_API_KEY", "INNOCENT_SETTING", "APP_CONFIG", "token_ttl_minutes"):
        assert name.encode() in page
    assert b"db.example" not in page  # the whole URL holding a password is hidden
    assert b"&quot;host&quot;: &quot;db&quot;" in page  # the JSON value, redacted field by field


# --- behaviour ------------------------------------------------------------------------------


def test_several_requests_make_one_checkpoint(server: ControlServer) -> None:
    for _ in range(3):
        assert _request(_base(server) + "checkpoint", "POST", HEADER)[0] == 202
    assert server.take_checkpoint_request() is True
    assert server.take_checkpoint_request() is False
    assert _request(_base(server) + "checkpoint", "POST", HEADER)[0] == 202
    assert server.take_checkpoint_request() is True


def test_healthz_reports_progress_then_stall(server: ControlServer) -> None:
    server.update(step=7, total_steps=100, loss=3.25, tokens_per_second=1500.0, eta_seconds=90)
    status, headers, body = _request(_base(server) + "healthz")
    assert status == 200
    assert headers["Content-Type"] == "application/json"
    health = json.loads(body)
    assert health["status"] == "ok" and health["step"] == 7
    assert health["seconds_since_last_step"] >= 0

    time.sleep(server.stall_seconds + 0.2)
    status, _, body = _request(_base(server) + "healthz")
    assert status == 503
    health = json.loads(body)
    assert health["status"] == "stalled" and health["step"] == 7
    assert health["seconds_since_last_step"] > server.stall_seconds

    server.update(step=8)
    assert _request(_base(server) + "healthz")[0] == 200


def test_page_shows_progress(server: ControlServer) -> None:
    server.update(
        step=42,
        total_steps=100,
        loss=2.5,
        tokens_per_second=12345.0,
        eta_seconds=3723,
        last_checkpoint="checkpoints/step-40",
    )
    server.update(step=43)  # values not given are kept
    page = _request(_base(server))[2].decode()
    assert "43 / 100" in page
    assert "2.5000" in page and "12,345" in page and "1:02:03" in page
    assert "checkpoints/step-40" in page


def test_stop_removes_the_endpoint_and_closes_the_port(tmp_path: Path) -> None:
    control = ControlServer(tmp_path, {"run_id": "r"}, {})
    url = control.start()
    endpoint, key = read_endpoint(tmp_path)
    assert endpoint.url("T").startswith(url.split("/c/")[0])
    assert (tmp_path / "control" / "key").stat().st_mode & 0o777 == 0o600
    assert len(key) == 32
    control.stop()
    assert not (tmp_path / "control").exists()  # no empty folder left behind either
    with pytest.raises(OSError):
        _request(url)
