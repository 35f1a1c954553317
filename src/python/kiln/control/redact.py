"""Redaction of secrets from what the control page shows: the resolved config and the environment.

A value is hidden when its NAME looks secret (WANDB_API_KEY, HF_TOKEN, db_password, PGPASS, ...)
or when the VALUE looks like a credential wherever it is stored (a JWT, `sk-...`, `hf_...`,
`AKIA...`, a URL with a user or password or a credential in its query, a private key block, or a
long random-looking string such as a generated key). The rules work on the shape of names and
values, not on a list of known variables, so credentials under names never seen are hidden too. Strings holding JSON are parsed and redacted field by field;
other strings that assign to a secret-looking name (`--password=...`, `{'token': ...}`) are hidden
whole. Mistakes cost differently: hiding a harmless value loses a line of display, showing a secret
leaks it, so the rules err towards hiding.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

REDACTED = "[redacted]"

# Whole words (after splitting on separators and camelCase) that mark a name as secret.
_SECRET_WORDS = frozenset(
    {
        "token",
        "key",
        "secret",
        "password",
        "passwd",
        "passphrase",
        "credential",
        "credentials",
        "apikey",
        "auth",
        "authorization",
        "cookie",
        "private",
        "signature",
        "dsn",
        "pass",
        "pwd",
        "pw",
        "pat",
        "bearer",
        "jwt",
        "session",
        "salt",
        "otp",
        "cred",
        "creds",
        "webhook",
        "connstr",
    }
)
# Shell variables whose names contain a secret word but hold a folder.
_HARMLESS_ENVIRONMENT = frozenset({"PWD", "OLDPWD"})
# Word endings that mark run-together names as secret (AUTHTOKEN, SECRETKEY, MYPASSWORD).
_SECRET_WORD_ENDINGS = (
    "token", "secret", "password", "passwd", "pass", "pwd", "apikey", "secretkey", "accesskey",
)  # fmt: skip

# Kiln's own config names that contain a secret word but hold no secret. Listed one by one
# (rather than loosening the word rules) so that every exception is visible and deliberate.
_HARMLESS_NAMES = frozenset(
    {"text_key", "token_ttl_minutes", "eos_token_id", "bos_token_id", "pad_token_id"}
)

_SECRET_VALUE_PATTERNS = tuple(
    re.compile(pattern)
    for pattern in (
        r"eyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{4,}\.",  # JWT: base64url('{"') header.payload.
        r"\bsk-[A-Za-z0-9_-]{8,}",  # OpenAI / Anthropic style API keys
        r"\bhf_[A-Za-z0-9]{8,}",  # Hugging Face tokens
        r"\b(?:AKIA|ASIA)[A-Z0-9]{12,}",  # AWS access key ids
        r"\b(?:gh[pousr]_[A-Za-z0-9]{16,}|github_pat_[A-Za-z0-9_]{16,})",  # GitHub tokens
        r"\bxox[abprs]-[A-Za-z0-9-]{8,}",  # Slack tokens
        r"-----BEGIN [A-Z ]*PRIVATE KEY-----",
        r"[A-Za-z][A-Za-z0-9+.-]*://[^/\s@]+@",  # scheme://user[:password]@host
    )
)
# A generated secret under any name: one run of 32+ key-alphabet characters mixing letters and
# digits (API keys, hex keys, base64 blobs). Readable text, paths and numbers do not look so.
_RANDOM_LOOKING = re.compile(r"[A-Za-z0-9+/_=-]{32,}")
# `name=value` or `"name": value` inside a longer string (command lines, dict reprs).
_ASSIGNMENT = re.compile(r"""["']?([A-Za-z][A-Za-z0-9_.-]*)["']?\s*[:=]""")


def _name_words(name: str) -> list[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    return [word for word in re.split(r"[^A-Za-z0-9]+", spaced.lower()) if word]


def is_secret_name(name: str) -> bool:
    """True when a config key or environment variable name looks like it holds a secret."""
    if name.lower() in _HARMLESS_NAMES:
        return False
    words = _name_words(name)
    return any(
        word in _SECRET_WORDS or word.endswith(_SECRET_WORD_ENDINGS) or "password" in word
        for word in words
    )


def is_secret_value(text: str) -> bool:
    """True when a string looks like a credential or assigns to a secret-looking name."""
    if any(pattern.search(text) for pattern in _SECRET_VALUE_PATTERNS):
        return True
    if any(_looks_random(match.group()) for match in _RANDOM_LOOKING.finditer(text)):
        return True
    return any(is_secret_name(match.group(1)) for match in _ASSIGNMENT.finditer(text))


def _looks_random(run: str) -> bool:
    """Letters and digits mixed through the run (4 digits at least): a key, not words joined by
    `_` (`xla_force_host_platform_device_count=4`) or a path."""
    if "/" in run.strip("/") and not re.search(r"[A-Za-z0-9+=]{32,}", run):
        return False  # a path such as a/b/c: each part short
    return sum(c.isdigit() for c in run) >= 4 and any(c.isalpha() for c in run)


def _redact_string(text: str) -> str:
    stripped = text.strip()
    if stripped[:1] in ("{", "["):
        try:
            parsed = json.loads(stripped)
        except ValueError:
            pass
        else:
            return json.dumps(redact(parsed), sort_keys=True)
    return REDACTED if is_secret_value(text) else text


def redact(value: Any) -> Any:
    """A copy of `value` (JSON-like: dicts, lists, scalars) with secret names and values hidden."""
    if isinstance(value, Mapping):
        return {
            str(key): REDACTED if is_secret_name(str(key)) else redact(item)
            for key, item in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [redact(item) for item in value]
    if isinstance(value, str):
        return _redact_string(value)
    return value


def redact_environment(environment: Mapping[str, str]) -> dict[str, str]:
    """The environment as the page shows it: every variable listed, secrets replaced."""
    return {
        name: value
        if name in _HARMLESS_ENVIRONMENT
        else REDACTED
        if is_secret_name(name)
        else _redact_string(value)
        for name, value in sorted(environment.items())
    }
