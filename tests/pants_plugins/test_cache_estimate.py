"""Estimates of an unbuilt cache's tokens, bytes, CPU-hours and wall time."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from pants.engine.addresses import Address

from kiln_pants.artifact_graph import Artifact
from kiln_pants.cache_estimate import TOKENS_PER_CORE_SECOND, duration, estimate_cache


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
        f"500k tokens/s per core; wall ~ {duration(hours)} tokenizing, 1 shard process(es) at once"
    )
    assert estimate_cache(cache(source=hub), "/repo").tokens is None
    # The ids are stored as the cache will store them: uint16 for a vocabulary of 65,536 or less.
    assert "59.00 GB as uint16" in replace(estimate, vocabulary=50257).describe()
    assert "118.00 GB as uint32" in replace(estimate, vocabulary=128256).describe()


def test_the_wall_time_divides_the_cpu_hours_by_the_shards_at_once() -> None:
    """--plan-json carries what the row says."""
    estimate = replace(estimate_cache(cache(source={"kind": "hf", "id": "org/data"},
                                            max_tokens=3_600_000_000), "/repo"),
                       vocabulary=50257, processes=8)  # fmt: skip
    cpu_hours = 3_600_000_000 / TOKENS_PER_CORE_SECOND / 3600  # 2 h
    assert estimate.describe().endswith(
        f"{cpu_hours:.1f} CPU-hours at 500k tokens/s per core; wall ~ 15 min tokenizing, 8 shard "
        "process(es) at once"
    )
    assert estimate.to_json() == {
        "tokens": 3_600_000_000, "basis": "max_tokens", "dtype": "uint16",
        "bytes": 7_200_000_000, "cpu_hours": cpu_hours, "wall_hours": cpu_hours / 8,
        "processes_at_once": 8,
    }  # fmt: skip
    unknown = estimate_cache(cache(source={"kind": "hf", "id": "org/data"}), "/repo")
    assert unknown.to_json()["wall_hours"] is None
    assert duration(60 / 3600) == "1 min" and duration(0.35 / 3600) == "0.35 s"
    assert duration(5.8e-5 / 3600) == "under 0.01 s"  # a one-document cache: not 5.8e-05 s


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
