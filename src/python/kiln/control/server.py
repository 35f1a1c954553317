"""The training-control endpoint: a small HTTP server on a background thread of process 0.

Routes, all under the capability prefix `/c/<token>/` (see kiln.control.tokens; anything else,
and any missing, malformed, wrong or expired token, gets a bare 403):

    GET  /c/<token>/             the control page (kiln.control.page)
    GET  /c/<token>/healthz      {"status", "step", "seconds_since_last_step"}; 503 when stalled
    POST /c/<token>/checkpoint   202 and a checkpoint request, when the request is authorised:
                                   header `X-Levanter-Training-Control: request-checkpoint`
                                   (what scripts send; a cross-origin page cannot send a custom
                                   header without a CORS preflight, which this server never
                                   grants), OR
                                   form field `csrf_token` equal to this process's token (what the
                                   page's form sends, since HTML forms cannot set headers).
                                 Both are compared in constant time; neither -> 403.

Requests are recorded as one pending flag, so any number of them before the trainer next calls
take_checkpoint_request() produce one save.

Before any of that, the request's `Host` must name this server (`allowed_hosts`): a page whose
own name was rebound to this machine's address (DNS rebinding) sends its own name, and gets 421;
a malformed Host (no name, a port that is not 1-65535) gets 400.
A body over MAX_FORM_BYTES gets 413 and is read away (up to MAX_DISCARD_BYTES) so that the client
sees the answer; a client that goes away mid-request is no error of the run's.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import math
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from kiln.control.page import CSRF_FIELD, Progress, render_page
from kiln.control.tokens import (
    new_key,
    remove_endpoint,
    token_expiring_in,
    verify_token,
    write_endpoint,
)

CONTROL_HEADER = "X-Levanter-Training-Control"
CONTROL_HEADER_VALUE = "request-checkpoint"
ACCEPTED_TEXT = "Checkpoint requested. The save will start after the current training step.\n"
MAX_FORM_BYTES = 4096
# An oversized body is read and dropped up to this size, so that the client gets its 413 rather
# than a reset connection; past it the connection is closed unread.
MAX_DISCARD_BYTES = 16 << 20
# More names the endpoint answers to (comma-separated), e.g. a proxy's or a tunnel's.
ALLOWED_HOSTS_VARIABLE = "KILN_CONTROL_ALLOWED_HOSTS"
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})

log = logging.getLogger(__name__)

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; base-uri 'none'"
    ),
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}


def _same(a: str, b: str) -> bool:
    # compare_digest refuses non-ASCII str; bytes keep it constant-time for any input.
    return hmac.compare_digest(a.encode("utf-8", "surrogateescape"), b.encode("utf-8"))


class ControlServer:
    """Serves the control endpoint for one training process; see the module docstring."""

    def __init__(
        self,
        run_dir: Path,
        run_info: dict[str, Any],
        config: dict[str, Any],
        host: str = "127.0.0.1",
        port: int = 0,
        token_ttl_minutes: float = 720,
        stall_seconds: float = 600.0,
        allowed_hosts: Iterable[str] | None = None,
    ) -> None:
        token_expiring_in(b"", token_ttl_minutes)  # refuses a TTL out of range before serving
        if not 0 < stall_seconds < math.inf:
            raise ValueError(f"stall_seconds must be positive, got {stall_seconds}")
        self.run_dir = Path(run_dir)
        self.run_info = dict(run_info)
        self.config = dict(config)
        self.host = host
        self.port = port
        self.token_ttl_minutes = token_ttl_minutes
        self.stall_seconds = stall_seconds
        self.allowed_hosts = served_names(host, allowed_hosts)
        self.csrf_token = secrets.token_urlsafe(32)
        self._key = new_key()
        self._lock = threading.Lock()
        self._progress = Progress()
        self._last_step_time = time.monotonic()
        self._checkpoint_requested = False
        self._httpd: _ControlHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- the trainer's side -------------------------------------------------------------------

    def start(self) -> str:
        """Starts serving on a daemon thread; returns a capability URL valid for token_ttl_minutes."""
        if self._httpd is not None:
            raise RuntimeError("ControlServer.start() was called twice")
        httpd = _ControlHTTPServer((self.host, self.port), self)
        try:
            port = httpd.server_address[1]
            endpoint = write_endpoint(self.run_dir, _reachable_host(self.host), port, self._key)
        except BaseException:
            httpd.server_close()
            raise
        self._httpd = httpd
        self._last_step_time = time.monotonic()
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            # How long stop() may wait for the loop to notice; 10 idle wake-ups a second are free.
            kwargs={"poll_interval": 0.1},
            name="kiln-control",
            daemon=True,
        )
        self._thread.start()
        return endpoint.url(self.mint_token())

    def update(
        self,
        *,
        step: int,
        total_steps: int | None = None,
        loss: float | None = None,
        tokens_per_second: float | None = None,
        eta_seconds: float | None = None,
        last_checkpoint: str | None = None,
    ) -> None:
        """Records progress. A value left as None keeps what was reported before."""
        given = {
            "total_steps": total_steps,
            "loss": loss,
            "tokens_per_second": tokens_per_second,
            "eta_seconds": eta_seconds,
            "last_checkpoint": last_checkpoint,
        }
        with self._lock:
            if step != self._progress.step:
                self._last_step_time = time.monotonic()
            updates: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
            self._progress = replace(self._progress, step=step, **updates)

    def take_checkpoint_request(self) -> bool:
        """True once per batch of requests received since the previous call."""
        with self._lock:
            requested, self._checkpoint_requested = self._checkpoint_requested, False
        return requested

    def stop(self) -> None:
        """Stops serving and removes the endpoint record and key, so no URL works any more."""
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join()
        self._httpd = self._thread = None
        remove_endpoint(self.run_dir)

    # --- the handler's side -------------------------------------------------------------------

    def mint_token(self) -> str:
        return token_expiring_in(self._key, self.token_ttl_minutes)

    def token_is_valid(self, token: str) -> bool:
        return verify_token(self._key, token)

    def host_is_allowed(self, name: str) -> bool:
        """Whether a request's Host name (see host_name) names this server. A wildcard server
        answers any IP address, which no rebound name can pose as."""
        if name in self.allowed_hosts:
            return True
        return self.host in WILDCARD_HOSTS and _is_ip_address(name)

    def request_checkpoint(self) -> None:
        with self._lock:
            self._checkpoint_requested = True

    def health(self) -> tuple[bool, dict[str, Any]]:
        with self._lock:
            step = self._progress.step
            idle = time.monotonic() - self._last_step_time
        healthy = idle <= self.stall_seconds
        body = {
            "status": "ok" if healthy else "stalled",
            "step": step,
            "seconds_since_last_step": round(idle, 3),
        }
        return healthy, body

    def page(self) -> bytes:
        with self._lock:
            progress = self._progress
        return render_page(progress, self.run_info, self.config, os.environ, self.csrf_token)


def _reachable_host(host: str) -> str:
    """The host to put in URLs: a wildcard bind address is not something a browser can open."""
    return socket.getfqdn() if host in WILDCARD_HOSTS else host


def served_names(host: str, configured: Iterable[str] | None = None) -> frozenset[str]:
    """The names a request's Host may give: the bound address and the one in URLs, loopback
    names, this machine's names when every interface is served, and the configured ones
    (`configured`, else $KILN_CONTROL_ALLOWED_HOSTS)."""
    if configured is None:
        configured = os.environ.get(ALLOWED_HOSTS_VARIABLE, "").split(",")
    names = {host, _reachable_host(host), *LOOPBACK_NAMES, *configured}
    if host in WILDCARD_HOSTS:
        names |= {socket.gethostname(), socket.getfqdn()}
    served = set()
    for name in filter(str.strip, names):
        parsed = host_name(name)
        if parsed is None:
            raise ValueError(
                f"{ALLOWED_HOSTS_VARIABLE}: {name.strip()!r} is not a host name; "
                "give NAME, NAME:PORT or [IPV6]:PORT, comma-separated"
            )
        served.add(parsed)
    return frozenset(served)


def host_name(value: str) -> str | None:
    """`name:port`, `[v6]:port`, `[v6]`, a bare name or a bare IPv6 address, as a lower-case
    name without its port (the port is not compared: an SSH tunnel forwards another one).
    None when malformed: a port that is not 1-65535, anything else after `]`, no name."""
    value = value.strip().lower()
    if value.startswith("["):
        name, bracket, rest = value[1:].partition("]")
        if not bracket or (rest and not (rest.startswith(":") and _is_port(rest[1:]))):
            return None
    elif value.count(":") == 1:
        name, _, port = value.partition(":")
        if not _is_port(port):
            return None
    else:
        name = value  # a name without a port, or an IPv6 address without brackets
    return name or None


def _is_port(text: str) -> bool:
    return text.isascii() and text.isdigit() and 1 <= int(text) <= 65535


def _is_ip_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class _ControlHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], control: ControlServer) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.control = control
        super().__init__(address, _ControlHandler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up mid-request is its own business; anything else is one line on
        the run's log, never a traceback in it."""
        error = sys.exception()
        if isinstance(error, (ConnectionError, TimeoutError)):
            return
        log.warning("training control: a request failed: %s", error or "unknown error")


class _ControlHandler(BaseHTTPRequestHandler):
    server: _ControlHTTPServer
    server_version = "kiln-control"
    # Seconds a connection may sit idle: a client that opens connections and sends nothing
    # cannot pile up handler threads for ever.
    timeout = 30
    # Errors raised inside http.server itself (malformed request lines, unknown methods) get a
    # one-line plain body instead of the default HTML page.
    error_message_format = "%(code)d %(message)s\n"
    error_content_type = "text/plain; charset=utf-8"

    def version_string(self) -> str:
        return self.server_version  # no Python version: nothing for a scanner to fingerprint

    def log_message(self, format: str, *args: Any) -> None:
        # The default logs every request line to stderr, and request lines carry the token.
        pass

    def end_headers(self) -> None:
        for name, value in SECURITY_HEADERS.items():
            self.send_header(name, value)
        super().end_headers()

    # --- routing ------------------------------------------------------------------------------

    def _route(self) -> str | None:
        """The path after `/c/<token>/` when the Host is this server's and the token is valid;
        None (and a 400, 421 or 403 sent) if not."""
        hosts = self.headers.get_all("Host") or []
        if len(hosts) != 1:  # RFC 9112, 3.2: none or several is a bad request
            self._send_text(HTTPStatus.BAD_REQUEST, "exactly one Host header is required\n")
            return None
        name = host_name(hosts[0])
        if name is None:
            self._send_text(HTTPStatus.BAD_REQUEST, "malformed Host header\n")
            return None
        if not self.server.control.host_is_allowed(name):
            self._send_text(HTTPStatus.MISDIRECTED_REQUEST, "misdirected request\n")
            return None
        # The path as the client sent it: http.server turns a leading `//` into `/`, and a path
        # Kiln never links to is not one of its routes.
        sent = self.requestline.split(" ")[1] if self.requestline.count(" ") >= 2 else self.path
        parts = urlsplit(sent).path.split("/", 3) if not sent.startswith("//") else []
        well_placed = len(parts) >= 3 and not parts[0] and parts[1] == "c"
        if not (well_placed and self.server.control.token_is_valid(parts[2])):
            self._forbidden()
            return None
        if len(parts) == 3:  # /c/<token> without the slash: relative links would break
            self._send(HTTPStatus.PERMANENT_REDIRECT, b"", extra={"Location": f"{parts[2]}/"})
            return None
        return parts[3]

    def do_GET(self) -> None:
        route = self._route()
        if route is None:
            return
        control = self.server.control
        if route == "":
            self._send(HTTPStatus.OK, control.page(), "text/html; charset=utf-8")
        elif route == "healthz":
            healthy, body = control.health()
            status = HTTPStatus.OK if healthy else HTTPStatus.SERVICE_UNAVAILABLE
            self._send_json(status, body)
        elif route == "checkpoint":
            self._send_text(HTTPStatus.METHOD_NOT_ALLOWED, "use POST\n", extra={"Allow": "POST"})
        else:
            self._send_text(HTTPStatus.NOT_FOUND, "not found\n")

    def do_POST(self) -> None:
        # The body is read (bounded) before anything is answered: a server that replies and
        # closes with unread data pending makes the client see a connection reset, not the reply.
        body = self._read_body()
        route = self._route()
        if route is None:
            return
        if route != "checkpoint":
            self._send_text(HTTPStatus.NOT_FOUND, "not found\n")
        elif body is None:
            self._send_text(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "body too large or unreadable\n")
        elif not self._checkpoint_authorised(self._form_fields(body)):
            self._forbidden()
        else:
            self.server.control.request_checkpoint()
            self._send_text(HTTPStatus.ACCEPTED, ACCEPTED_TEXT)

    def _checkpoint_authorised(self, form: dict[str, list[str]]) -> bool:
        header_ok = _same(self.headers.get(CONTROL_HEADER, ""), CONTROL_HEADER_VALUE)
        tokens = form.get(CSRF_FIELD, [])
        form_ok = len(tokens) == 1 and _same(tokens[0], self.server.control.csrf_token)
        return header_ok or form_ok

    def _read_body(self) -> bytes | None:
        """The request body, or None when its length is missing-but-malformed or too large, or
        it comes in a transfer coding (chunked: its length is unknown until read; the
        connection then ends after the answer)."""
        if self.headers.get("Transfer-Encoding") is not None:
            self.close_connection = True
            return None
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            return None
        if length < 0:
            return None
        if length > MAX_FORM_BYTES:
            self._discard(length)
            return None
        return self.rfile.read(length)

    def _discard(self, length: int) -> None:
        """Reads away an oversized body (up to MAX_DISCARD_BYTES), then ends the connection
        after the answer: what is left unread is the client's to lose."""
        self.close_connection = True
        left = min(length, MAX_DISCARD_BYTES)
        while left > 0:
            chunk = self.rfile.read(min(left, 1 << 16))
            if not chunk:
                return
            left -= len(chunk)

    def _form_fields(self, body: bytes) -> dict[str, list[str]]:
        """The fields of a urlencoded form body; {} for any other body."""
        content_type = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if content_type != "application/x-www-form-urlencoded":
            return {}
        try:
            return parse_qs(body.decode("utf-8", "replace"), max_num_fields=16)
        except ValueError:  # more fields than any form of ours has
            return {}

    # --- responses ----------------------------------------------------------------------------

    def _forbidden(self) -> None:
        self._send_text(HTTPStatus.FORBIDDEN, "forbidden\n")

    def _send_text(
        self, status: HTTPStatus, text: str, extra: Mapping[str, str] | None = None
    ) -> None:
        self._send(status, text.encode("utf-8"), "text/plain; charset=utf-8", extra)

    def _send_json(self, status: HTTPStatus, body: Mapping[str, Any]) -> None:
        self._send(status, (json.dumps(body) + "\n").encode("utf-8"), "application/json")

    def _send(
        self,
        status: HTTPStatus,
        body: bytes,
        content_type: str = "text/plain; charset=utf-8",
        extra: Mapping[str, str] | None = None,
    ) -> None:
        self.send_response(status)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
