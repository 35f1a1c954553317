"""Levanter's document framing, exactly: a cache's `framing` "levanter" or "marin".

Levanter's BatchTokenizer (levanter/data/text/_batch_tokenizer.py) over its HfMarinTokenizer
(levanter/tokenizers.py) turns a document into ids so:

  1. text + " " + eos_token, when the tokenizer names an eos_token (append_eos);
  2. "marin" only (Marin's tokenize step turns on `long_string_workaround`): a text longer than
     10,000 characters is cut at the first whitespace at or after each 10,000th character of
     its piece, and the pieces are encoded separately;
  3. each text (or piece) is cut before and after every run of 25,000 or more whitespace or
     non-whitespace characters, those runs into pieces of 25,000 (`_safe_split_for_tokenizer`);
  4. every part is encoded by the Rust tokenizer without a post-processor
     (add_special_tokens=False), special tokens' text matched as special tokens: the appended
     eos_token becomes EOS, and so does "<|endoftext|>" inside a document;
  5. the ids of the parts are concatenated, BOS first when the tokenizer has a bos_token
     (enforce_bos), even one equal to EOS.

"levanter" is what Levanter's `build_or_load_cache` writes; "marin" what Marin's `tokenize`
step writes; they differ only on documents longer than 10,000 characters.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from kiln.data.errors import TokenizerError

LONG_STRING_CHARS = 10_000  # _batch_tokenizer.LONG_STRING_WORKAROUND
MAX_RUN_CHARS = 25_000  # tokenizers._MAX_HOMOGENEOUS_RUN_CHARS
_OVERLONG_RUN = re.compile(rf"\s{{{MAX_RUN_CHARS},}}|\S{{{MAX_RUN_CHARS},}}")
_WHITESPACE = re.compile(r"\s")


class LevanterFraming:
    """Frames documents as Levanter does over `backend`, a Rust `tokenizers.Tokenizer` that
    matches special tokens in text; `long_strings`: Marin's long-string workaround."""

    def __init__(
        self, backend: Any, eos_token: str | None, bos_id: int | None, long_strings: bool
    ) -> None:
        if eos_token is None:
            raise TokenizerError(
                "Levanter's framing appends the tokenizer's eos_token, and this tokenizer names "
                "none: add `eos_token` to its tokenizer_config.json, or use framing='kiln'."
            )
        self._backend = backend
        self._eos_token = eos_token
        self._bos_id = bos_id
        self._long_strings = long_strings

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Each document's ids, BOS and EOS included."""
        pieces: list[str] = []
        owners: list[int] = []
        for document, text in enumerate(texts):
            framed = f"{text} {self._eos_token}"
            for piece in self._pieces(framed):
                for part in _safe_split(piece):
                    pieces.append(part)
                    owners.append(document)
        encodings = self._backend.encode_batch_fast(pieces, add_special_tokens=False)
        ids: list[list[int]] = [[] if self._bos_id is None else [self._bos_id] for _ in texts]
        for owner, encoding in zip(owners, encodings):
            ids[owner].extend(encoding.ids)
        return ids

    def _pieces(self, text: str) -> list[str]:
        """Marin's long-string workaround (_BatchTokenizer._encode_long_string's cuts)."""
        if not self._long_strings or len(text) <= LONG_STRING_CHARS:
            return [text]
        pieces, position = [], 0
        while position < len(text):
            split = len(text)
            if len(text) - position > LONG_STRING_CHARS:
                match = _WHITESPACE.search(text, position + LONG_STRING_CHARS)
                split = match.start() if match is not None else len(text)
            pieces.append(text[position:split])
            position = split
        return pieces


def _safe_split(text: str) -> list[str]:
    """levanter.tokenizers._safe_split_for_tokenizer: no part holds a run of more than
    MAX_RUN_CHARS whitespace or non-whitespace characters."""
    if len(text) <= MAX_RUN_CHARS:
        return [text]
    parts, last = [], 0
    for match in _OVERLONG_RUN.finditer(text):
        if match.start() > last:
            parts.append(text[last : match.start()])
        run = match.group()
        parts.extend(run[i : i + MAX_RUN_CHARS] for i in range(0, len(run), MAX_RUN_CHARS))
        last = match.end()
    if last < len(text):
        parts.append(text[last:])
    return parts or [text]
