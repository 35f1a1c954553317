"""What a source yields: a document's text (or its fields) and where it came from."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Which part of a record is the document: its text field (a text cache's `text_key`), or the
# fields of a structured document (a chat's messages; a prompt and its answer), kept as read.
DocumentKeys = str | tuple[str, ...]


@dataclass(frozen=True)
class Document:
    text: str
    # Where it came from, for error messages: "path:line", "org/name[row 17]". A stdlib
    # document's origin is also its id, which decides its split.
    origin: str
    # A structured document's fields (its text is then ""): key -> the record's JSON value.
    fields: Mapping[str, Any] = field(default_factory=dict)

    @property
    def chars(self) -> int:
        """Its length, as max_document_chars counts it: its text's, or the characters of the
        strings in its fields (a chat's messages, a prompt and its answer)."""
        return len(self.text) + sum(map(_string_chars, self.fields.values()))


def _string_chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        return sum(map(_string_chars, value.values()))
    if isinstance(value, list):
        return sum(map(_string_chars, value))
    return 0
