"""Artifact identity: a hash of canonical JSON.

The fingerprint covers only literals that define the artifact (its identity config) and the
fingerprints of its inputs: never the prefix, absolute paths of this machine, resources, or code.
So it is the same on every clone and machine (tests pin a value), and a code-only edit does not
change it. Code is recorded as provenance beside the artifact instead (see docs/artifacts.md).
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

FINGERPRINT_LENGTH = 16


def canonical_json(value: Any) -> str:
    _refuse_unstable(value, "config")
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def fingerprint(identity: Any) -> str:
    return hashlib.sha256(canonical_json(identity).encode("ascii")).hexdigest()[:FINGERPRINT_LENGTH]


def _refuse_unstable(value: Any, where: str) -> None:
    """Only JSON literals bear identity; anything else has no stable representation."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where}: key {key!r} is not a string")
            _refuse_unstable(item, f"{where}.{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _refuse_unstable(item, f"{where}[{index}]")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: {value} is not a finite number")
    elif not (value is None or isinstance(value, (str, int, bool))):
        raise TypeError(f"{where}: {value!r} ({type(value).__name__}) has no stable identity")

