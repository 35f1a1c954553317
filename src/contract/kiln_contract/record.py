"""An artifact's record: the identity part of `artifact.json` (docs/artifacts.md).

The backend computes it (fingerprint and identity, inputs first); the runtime writes it beside
the artifact, adding provenance, and compares it with a stored one before building again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kiln_contract.parsing import (
    SpecError,
    build,
    check_str,
    check_tuple_of,
    field_path,
    json_fields,
    json_list,
    read_json,
    scalar_json,
)
from kiln_contract.vocabulary import check_address

RECORD_VERSION = 1
_OTHER_KILN = "the record was written by another version of Kiln"


@dataclass(frozen=True)
class InputRef:
    ref: str  # name@version
    fingerprint: str

    def __post_init__(self) -> None:
        check_str("ref", self.ref)
        check_str("fingerprint", self.fingerprint)


@dataclass(frozen=True)
class ArtifactRecord:
    kind: str  # the target alias: tokenized_cache | lm_checkpoint
    name: str
    version: str
    fingerprint: str
    identity: Mapping[str, Any]  # the canonical identity config the fingerprint hashes
    inputs: tuple[InputRef, ...] = ()

    def __post_init__(self) -> None:
        check_str("kind", self.kind)
        check_address(self)
        if not isinstance(self.identity, Mapping):
            raise SpecError("identity", f"expected a JSON object, got {self.identity!r}")
        check_tuple_of("inputs", self.inputs, InputRef)

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    @classmethod
    def from_json(cls, obj: Any, where: str = "record") -> ArtifactRecord:
        values = json_fields(cls, obj, where, {"record_version": RECORD_VERSION}, _OTHER_KILN)
        inputs = json_list(values.get("inputs", []), field_path(where, "inputs"))
        values["inputs"] = tuple(
            read_json(InputRef, item, field_path(where, f"inputs[{i}]"))
            for i, item in enumerate(inputs)
        )
        return build(cls, where, values)

    def to_json(self) -> dict[str, Any]:
        return {
            "record_version": RECORD_VERSION,
            **scalar_json(self),
            "identity": dict(self.identity),
            "inputs": [scalar_json(i) for i in self.inputs],
        }


def fingerprint_drift(stored: Mapping[str, Any], record: ArtifactRecord) -> str | None:
    """None when `stored` (an artifact.json) has `record`'s fingerprint; otherwise how they
    differ, for a message: "fingerprint X, but the target now has fingerprint Y; it differs in: F"."""
    if stored.get("fingerprint") == record.fingerprint:
        return None
    fields = differing_fields(stored.get("identity", {}), record.identity)
    return (
        f"fingerprint {stored.get('fingerprint')}, but the target now has fingerprint "
        f"{record.fingerprint}; it differs in: {', '.join(fields) or 'identity format'}"
    )


def differing_fields(old: Any, new: Any, path: str = "") -> list[str]:
    """Dotted paths of the fields that differ between two identity configs (for drift errors)."""
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        differing = []
        for key in sorted(set(old) | set(new)):
            sub = f"{path}.{key}" if path else key
            if key not in old or key not in new:
                differing.append(sub)
            else:
                differing.extend(differing_fields(old[key], new[key], sub))
        return differing
    return [] if old == new else [path or "<root>"]



def served_message(
    ref: str,
    where: str,
    fingerprint: str,
    stored: Mapping[str, Any],
    code_digest: str,
    summary: str | None,
) -> str:
    """What `pants run` prints for an artifact already built at `where` (its `stored` record):
    the runner says it when it serves one, and the backend when it serves one without starting
    the runtime. A note when other code (runtime digest) built it; then its `summary.txt`."""
    lines = [f"kiln: {ref} is already built at {where} (fingerprint {fingerprint})."]
    built_by = stored.get("provenance", {}).get("code_digest")
    if built_by and built_by != code_digest:
        lines.append(
            f"kiln: note: it was built by other code (runtime digest {built_by[:12]}, now "
            f"{code_digest[:12]}); the code is not part of its identity, so it is kept. Bump "
            "`version` to retrain with the current code."
        )
    if summary is not None:
        lines.append(summary)
    return "\n".join(lines)
