"""Redaction of secrets from what the control page shows: the resolved config and the environment.

A value is hidden when its NAME looks secret or when the VALUE looks like a credential, wherever
it is stored. The rules work on the shape of names and values, not on a list of known variables,
so credentials under names never seen are hidden too (docs/training-control.md, "Redaction"):

- a name is secret when one of its words (split on separators and camelCase, any case) contains
  a secret part (PASS, PWD, SECRET, TOKEN, KEY, SIGNING, CREDENTIAL, AUTH, ...) in any position:
  `LDAP_BINDPW`, `GIT_SIGNINGKEY`, `vaultCreds`;
- a value is secret when it holds a known credential shape (a JWT, `sk-...`, a private key
  block), a URL with a user or password, any run of 16 or more characters that looks random
  (mixed character classes, high entropy, no readable words), a long key-alphabet run with many
  digits (hex digests, base64 blobs), or an assignment to a secret-looking name
  (`--password=...`, `{'token': ...}`), or a web address (http, https) with a path or a query:
  webhooks and signed links carry their secret there, however readable it is. A bare host
  (`http://127.0.0.1:8080`) and other schemes' paths (`s3://bucket/run`) stay readable.

Strings holding JSON are parsed and redacted field by field. Mistakes cost differently: hiding a
harmless value loses a line of display, showing a secret leaks it, so the rules err towards
hiding.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

REDACTED = "[redacted]"

# Parts that mark a name as secret wherever they appear inside one of its words.
_SECRET_PARTS = ("pass", "pwd", "secret", "token", "key", "signing", "credential", "auth")
# Whole words that mark a name as secret (too short, or too common inside other words, to be
# matched as parts).
_SECRET_WORDS = frozenset(
    {"pw", "pat", "cred", "creds", "bearer", "jwt", "session", "cookie", "salt", "otp",
     "private", "signature", "dsn", "webhook", "connstr"}
)  # fmt: skip
_SECRET_WORD_ENDINGS = ("pw", "cred", "creds")  # LDAP_BINDPW, vaultcreds
# Words holding a secret part that name no secret: the tokenizer and its counts, authors.
_HARMLESS_WORDS = frozenset(
    {"tokens", "tokenizer", "tokenizers", "tokenized", "tokenize", "tokenization",
     "author", "authors", "authored"}
)  # fmt: skip
# Shell variables whose names contain a secret part but hold a folder.
_HARMLESS_ENVIRONMENT = frozenset({"PWD", "OLDPWD"})
# Kiln's own config names that contain a secret part but hold no secret, and the names of its
# digests (fingerprints look random by design). Listed one by one, rather than loosening the
# rules, so that every exception is visible and deliberate.
_HARMLESS_NAMES = frozenset(
    {"text_key", "token_ttl_minutes", "eos_token_id", "bos_token_id", "pad_token_id",
     "fingerprint", "run_id"}
)  # fmt: skip

_SECRET_VALUE_PATTERNS = tuple(
    re.compile(pattern)
    for pattern in (
        r"eyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{4,}\.",  # JWT: base64url('{"') header.payload.
        r"\bsk-[A-Za-z0-9_-]{8,}",  # OpenAI / Anthropic style API keys
        r"\bhf_[A-Za-z0-9]{8,}",  # Hugging Face tokens
        r"\b(?:AKIA|ASIA)[A-Z0-9]{12,}",  # AWS access key ids
        r"\b(?:gh[pousr]_[A-Za-z0-9]{16,}|github_pat_[A-Za-z0-9_]{16,})",  # GitHub tokens
        r"\bxox[abprs]-[A-Za-z0-9-]{8,}",  # Slack tokens
        r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY[A-Z ]*-----",  # PEM, OpenSSH, PGP key blocks
        r"[A-Za-z][A-Za-z0-9+.-]*://[^/\s@]+@",  # scheme://user[:password]@host
        # A web address with a path or a query: webhooks and signed links carry their secret
        # there, in segments that may read as words. A bare host (an endpoint) stays readable.
        r"\bhttps?://[^/?#\s]+[/?][^\s]*[^/\s]",
    )
)
# A long generated value: 32+ key-alphabet characters holding 4 digits or more (hex digests,
# base64 blobs), unless it is a path of short parts.
_LONG_RUN = re.compile(r"[A-Za-z0-9+/_=-]{32,}")
# Runs judged by their look: a URL's path segments and query values are runs of their own.
_RUN = re.compile(r"[A-Za-z0-9+_-]{16,}")
# Readable words inside a run: a capital and lower case letters, or an upper-case word, each
# with a vowel and a consonant (`Hugging`, `linux`, `GPT`); random letters rarely make them.
_WORD = re.compile(r"[A-Z]?[a-z]{2,}|[A-Z]{3,}")
_VOWELS = frozenset("aeiouy")
MIN_RANDOM_LENGTH = 16
# Per character; random 16-character strings average about 3.7 bits (base62), 3.4 (hex).
MIN_ENTROPY_BITS = 2.75
# Random strings change character class (letter case, letter/digit) between about half of
# their neighbours; names and words rarely do (`GPT2TokenizerFast`: 3 of 16).
MIN_RANDOM_CLASS_CHANGES = 0.25
MIN_READABLE_WORDS = 0.5  # the share of a readable run's characters inside words
# `name=value` or `"name": value` inside a longer string (command lines, dict reprs).
_ASSIGNMENT = re.compile(r"""["']?([A-Za-z][A-Za-z0-9_.-]*)["']?\s*[:=]""")


def _name_words(name: str) -> list[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    return [word for word in re.split(r"[^A-Za-z0-9]+", spaced.lower()) if word]


def _secret_word(word: str) -> bool:
    if word in _HARMLESS_WORDS:
        return False
    return (
        word in _SECRET_WORDS
        or word.endswith(_SECRET_WORD_ENDINGS)
        or any(part in word for part in _SECRET_PARTS)
    )


def is_secret_name(name: str) -> bool:
    """True when a config key or environment variable name looks like it holds a secret."""
    if name.lower() in _HARMLESS_NAMES:
        return False
    # Also the name's run-together spelling: `signingKey` and `SIGNING_KEY` have the words
    # `signing`, `key`; `MYAPIKEY` has one word, caught by its parts.
    return any(_secret_word(word) for word in _name_words(name))


def is_secret_value(text: str) -> bool:
    """True when a string looks like a credential or assigns to a secret-looking name."""
    if any(pattern.search(text) for pattern in _SECRET_VALUE_PATTERNS):
        return True
    if any(_long_and_generated(match.group()) for match in _LONG_RUN.finditer(text)):
        return True
    if any(looks_random(match.group()) for match in _RUN.finditer(text)):
        return True
    return any(is_secret_name(match.group(1)) for match in _ASSIGNMENT.finditer(text))


def _long_and_generated(run: str) -> bool:
    """Letters and digits mixed through a long run (4 digits at least): a key, not words joined
    by `_` (`xla_force_host_platform_device_count=4`) or a path of short parts."""
    if "/" in run.strip("/") and not re.search(r"[A-Za-z0-9+=]{32,}", run):
        return False
    return sum(c.isdigit() for c in run) >= 4 and any(c.isalpha() for c in run)


def looks_random(run: str) -> bool:
    """A run of 16+ characters that reads as generated: at least two of lower case, upper case
    and digits, high entropy per character, and either frequent changes of character class
    (`a8Kf93LmQz0pR7tX`) or too few readable words (`HuggingFaceTokenizer` and
    `x86_64-linux-gnu` have both few changes and words)."""
    if len(run) < MIN_RANDOM_LENGTH:
        return False
    classes = sum(
        any(test(c) for c in run) for test in (str.islower, str.isupper, str.isdigit)
    )
    if classes < 2 or _entropy_bits(run) < MIN_ENTROPY_BITS:
        return False
    return _class_changes(run) >= MIN_RANDOM_CLASS_CHANGES or _in_words(run) < MIN_READABLE_WORDS


def _character_class(c: str) -> str | None:
    return "l" if c.islower() else "u" if c.isupper() else "d" if c.isdigit() else None


def _class_changes(run: str) -> float:
    """The share of neighbouring letters and digits whose class changes, a word's capital
    followed by its lower case letters not counted."""
    pairs = [
        (a, b)
        for a, b in zip(map(_character_class, run), map(_character_class, run[1:]))
        if a is not None and b is not None
    ]
    changes = sum(a != b and (a, b) != ("u", "l") for a, b in pairs)
    return changes / max(len(pairs), 1)


def _in_words(run: str) -> float:
    """The share of the run's letters and digits that belong to readable words."""
    words = [
        word
        for word in _WORD.findall(run)
        if any(c.lower() in _VOWELS for c in word) and any(c.lower() not in _VOWELS for c in word)
    ]
    return sum(map(len, words)) / max(sum(c.isalnum() for c in run), 1)


def _entropy_bits(text: str) -> float:
    counts = Counter(text)
    return -sum(n / len(text) * math.log2(n / len(text)) for n in counts.values())


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
