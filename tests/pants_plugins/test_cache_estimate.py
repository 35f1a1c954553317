"""Estimates of an unbuilt cache's tokens, bytes and CPU-hours."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pants.engine.addresses import Address

from kiln_pants.artifact_graph import Artifact
from kiln_pants.cache_estimate import TOKENS_PER_CORE_SECOND, estimate_cache


def cache(**identity: Any) -> Artifact:
    return Artifact(
        address=Address("exp", target_name="c"),
        kind="tokenized_cache",
        name="tokenized/c",
        version="2026.06.28",
        identity_json=json.dumps(identity),
        fingerprint="0" * 16,
        inputs=(),
    )


def test_a_bounded_cache_is_estimated_from_max_tokens() -> None:
    hub = {"kind": "hf", "id": "org/data"}
    estimate = estimate_cache(cache(source=hub, max_tokens=29_500_000_000), "/repo")
    hours = 29_500_000_000 / TOKENS_PER_CORE_SECOND / 3600
    assert estimate.describe() == (
        f"estimate: 29.50B tokens (max_tokens), 118.00 GB as uint32, {hours:.1f} CPU-hours at "
        "500k tokens/s per core"
    )
    assert estimate_cache(cache(source=hub), "/repo").tokens is None
    # The ids are stored as the cache will store them: uint16 for a vocabulary of 65,536 or less.
    assert "59.00 GB as uint16" in estimate.describe(vocabulary=50257)
    assert "118.00 GB as uint32" in estimate.describe(vocabulary=128256)


def test_local_text_is_estimated_from_its_size(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data/a.jsonl").write_bytes(b"x" * 3300)
    (tmp_path / "data/b.jsonl").write_bytes(b"x" * 6600)
    in_repo = {"kind": "files", "files": ["data/a.jsonl", "data/b.jsonl"]}
    assert estimate_cache(cache(source=in_repo), str(tmp_path)).tokens == 3000
    outside = {"kind": "files", "paths": [str(tmp_path / "data/*.jsonl")]}
    assert estimate_cache(cache(source=outside), "/elsewhere").tokens == 3000
    (tmp_path / "data/c.jsonl.zst").write_bytes(b"x")
    compressed = estimate_cache(cache(source=outside | {"paths": [str(tmp_path / "data/*")]}), "/")
    assert compressed.tokens is None and "compressed" in compressed.describe()
