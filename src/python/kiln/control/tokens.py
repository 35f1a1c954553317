"""Capability tokens for the control endpoint, and the endpoint record that lets a CLI mint them.

Kiln has no cluster proxy to put in front of the endpoint, so the endpoint checks its own tokens.
A token is `base64url(expiry || HMAC-SHA256(key, DOMAIN || expiry))` with `expiry` the Unix time
in seconds as 8 big-endian bytes: 40 bytes, 54 characters, no padding. Each token has exactly one
accepted spelling: the last character carries 2 bits and 4 zero bits, and a spelling whose unused
bits are set (decoding to the same bytes) is refused. It carries no state, so any
holder of the key (the server, or `python -m kiln.control mint` reading the key file) can mint one
and the server needs no list of issued tokens. It travels as a path prefix (`/c/<token>/`) so that
relative links and form actions on the page keep it without the page ever spelling it out.

Files under RUN_DIR/control/ (written atomically; both removed when the server stops):
    endpoint.json   {"host", "port", "pid", "hostname", "key_file"}: where the server listens
    key             32 random bytes, mode 0600: a new key per server process, so a URL from an
                    earlier run of the same artifact stops working when that process ends
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import os
import re
import secrets
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from kiln.artifacts.atomic import atomic_write_bytes, atomic_write_json
from kiln_contract.vocabulary import MAX_TOKEN_TTL_MINUTES

CONTROL_DIR = "control"
ENDPOINT_FILE = "endpoint.json"
KEY_FILE = "key"
KEY_BYTES = 32

# Binds a MAC to this use, so the key could never be made to sign something else by accident.
_DOMAIN = b"kiln-control-token-v1\0"
_EXPIRY = struct.Struct(">Q")
_TOKEN_BYTES = _EXPIRY.size + hashlib.sha256().digest_size
_TOKEN_CHARS = 54  # ceil(40 * 4 / 3) without padding
_TOKEN_SHAPE = re.compile(rf"[A-Za-z0-9_-]{{{_TOKEN_CHARS}}}")
# A token where a capability URL carries it, in any text.
_TOKEN_IN_URL = re.compile(rf"(?<=/c/){_TOKEN_SHAPE.pattern}(?![A-Za-z0-9_-])")
HIDDEN_TOKEN = "[hidden]"


class EndpointError(RuntimeError):
    """The endpoint record under a run directory is missing or unusable."""


def _mac(key: bytes, expiry: bytes) -> bytes:
    return hmac.new(key, _DOMAIN + expiry, hashlib.sha256).digest()


def _spelling(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def mint_token(key: bytes, expires_at: int) -> str:
    """A token valid until `expires_at` (Unix seconds)."""
    expiry = _EXPIRY.pack(expires_at)
    return _spelling(expiry + _mac(key, expiry))


def token_expiring_in(key: bytes, ttl_minutes: float) -> str:
    if not 0 < ttl_minutes <= MAX_TOKEN_TTL_MINUTES:  # False for NaN too
        raise ValueError(
            f"token_ttl_minutes must be > 0 and <= {MAX_TOKEN_TTL_MINUTES}, got {ttl_minutes}"
        )
    return mint_token(key, int(time.time() + ttl_minutes * 60))


def verify_token(key: bytes, token: str, now: float | None = None) -> bool:
    """True for a well-formed, unexpired token made with `key`; the MAC is compared in constant time."""
    if not _TOKEN_SHAPE.fullmatch(token):
        return False
    raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
    if len(raw) != _TOKEN_BYTES or _spelling(raw) != token:
        return False
    expiry, mac = raw[: _EXPIRY.size], raw[_EXPIRY.size :]
    if not hmac.compare_digest(mac, _mac(key, expiry)):
        return False
    return _EXPIRY.unpack(expiry)[0] > (time.time() if now is None else now)


def hide_tokens(text: str) -> str:
    """`text` with the token of every capability URL in it replaced by HIDDEN_TOKEN: for output
    that others read (a cluster job's log)."""
    return _TOKEN_IN_URL.sub(HIDDEN_TOKEN, text)


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


@dataclass(frozen=True)
class Endpoint:
    """Where a control server listens; what `endpoint.json` holds."""

    host: str
    port: int
    pid: int
    hostname: str
    key_file: str

    def url(self, token: str) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/c/{token}/"


def control_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CONTROL_DIR


def write_endpoint(run_dir: Path, host: str, port: int, key: bytes) -> Endpoint:
    """Writes the key (0600) and then endpoint.json, which names it; returns the record."""
    key_path = control_dir(run_dir) / KEY_FILE
    # atomic_write_bytes creates its temp file with mkstemp, which is mode 0600 from the start,
    # so the key is never readable by others, not even briefly; chmod states the intent.
    atomic_write_bytes(key_path, key)
    os.chmod(key_path, 0o600)
    endpoint = Endpoint(
        host=host, port=port, pid=os.getpid(), hostname=socket.gethostname(), key_file=KEY_FILE
    )
    atomic_write_json(control_dir(run_dir) / ENDPOINT_FILE, endpoint.__dict__)
    return endpoint


def remove_endpoint(run_dir: Path) -> None:
    """Removes the endpoint record and key, and their folder once it holds nothing else."""
    folder = control_dir(run_dir)
    for name in (ENDPOINT_FILE, KEY_FILE):
        (folder / name).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        folder.rmdir()  # OSError: not empty (another file a person put there stays)


def read_endpoint(run_dir: Path) -> tuple[Endpoint, bytes]:
    """The endpoint record and its key, with errors that say what to do."""
    path = control_dir(run_dir) / ENDPOINT_FILE
    try:
        record = json.loads(path.read_text())
        endpoint = Endpoint(**record)
    except FileNotFoundError:
        raise EndpointError(
            f"{path} does not exist: no control server is running for {run_dir} "
            "(is the run training, with runtime.control.enabled true?)"
        ) from None
    except (ValueError, TypeError) as e:
        raise EndpointError(f"{path} is not a valid endpoint record ({e}); restart the run") from e
    key_path = control_dir(run_dir) / endpoint.key_file
    try:
        key = key_path.read_bytes()
    except OSError as e:
        raise EndpointError(
            f"cannot read the control key {key_path} ({e.strerror}); run this as the user "
            "who started the training run"
        ) from e
    if len(key) != KEY_BYTES:
        raise EndpointError(f"{key_path} holds {len(key)} bytes, expected {KEY_BYTES}")
    return endpoint, key
