"""What a source yields: a document's text and where it came from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Document:
    text: str
    # Where it came from, for error messages: "path:line", "org/name[row 17]". A stdlib
    # document's origin is also its id, which decides its split.
    origin: str
