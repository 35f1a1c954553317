"""What a store holds, artifact by artifact: the runtime lists it (`python -m
kiln.artifacts.inventory`), `pants store` reads the JSON and decides what may go; and what the
store processes that change it say back, one JSON object per line as they go (a removal, a
DEP_FAILED mark), so that a process stopped half way has still said what it did."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class StoredArtifact:
    folder: str  # "{name}/{version}"
    status: str | None  # STATUS's token; None: none written
    kind: str | None  # from the record; None: no readable record
    fingerprint: str | None
    inputs: tuple[str, ...]  # the refs (name@version) its record says it was built from
    objects: int  # the folder's and its siblings' (lease, aside, shards)
    size: int  # bytes
    modified: float  # its newest object's time, unix seconds
    lease: str | None  # who holds its lease, while that holder may be alive

    @property
    def ref(self) -> str:
        return ref_of(self.folder)


@dataclass(frozen=True)
class Inventory:
    artifacts: tuple[StoredArtifact, ...]  # sorted by folder
    other_objects: int  # objects of no artifact (`.kiln/`, stray files): never removed
    other_size: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Inventory:
        fields: dict[str, Any] = json.loads(text)
        artifacts = tuple(
            StoredArtifact(**{**a, "inputs": tuple(a["inputs"])}) for a in fields["artifacts"]
        )
        return cls(artifacts, int(fields["other_objects"]), int(fields["other_size"]))


def ref_of(folder: str) -> str:
    """'checkpoints/run/2026.01.01' -> 'checkpoints/run@2026.01.01'."""
    name, _, version = folder.rpartition("/")
    return f"{name}@{version}"


@dataclass(frozen=True)
class FolderOutcome:
    """What a store process did to one artifact folder: `done` (removed, or marked DEP_FAILED),
    else `kept` says why it was left as it was."""

    folder: str  # "{name}/{version}"
    done: bool
    kept: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, line: str) -> FolderOutcome:
        fields: dict[str, Any] = json.loads(line)
        return cls(str(fields["folder"]), bool(fields["done"]), fields.get("kept"))

    @classmethod
    def read_lines(cls, text: str) -> tuple[FolderOutcome, ...]:
        return tuple(cls.from_json(line) for line in text.splitlines() if line.strip())
