"""Estimates of an unbuilt cache's tokens, bytes, CPU-hours and wall time."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from pants.engine.addresses import Address

from kiln_pants.artifact_graph import Artifact
from kiln_pants.artifact_store import StoredState
from kiln_pants.cache_estimate import TOKENS_PER_CORE_SECOND, duration, estimate_cache
from kiln_pants.plan import INLINE, planned_estimate, shown_path
from kiln_pants.shard_plan import _parsed


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
        "tokens": 3_600_000_000, "basis": "max_tokens", "imported_from": None, "dtype": "uint16",
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


def test_an_import_is_priced_as_an_import_not_a_tokenization() -> None:
    """A Levanter cache whose ledger claims 2T tokens: read in place in its own dtype, nothing
    tokenized or written but records, before and after it is built."""
    location = "s3://b/tokenized/dclm/train"
    imported = cache(source={"kind": "levanter_cache", "location": location})
    ledger = {"location": location, "layout": "sharded", "parts": 512, "documents": 3_000_000,
              "tokens": 2_000_000_000_000, "tokenizer": None, "vocab_size": None,
              "dtype": "int32"}  # fmt: skip
    estimate = planned_estimate(imported, _parsed([{"imported": ledger}]), 128256, "/repo", 2)
    assert estimate.describe() == (
        f"import: reads 2.00T tokens in place at {location} (int32 ids, as that cache stores "
        "them); tokenizes nothing: checks its ledger and the ids at its parts' starts, writes "
        "only Kiln's records (seconds)"
    )
    assert estimate.cpu_hours == 0.0 and estimate.wall_hours == 0.0
    as_json = estimate.to_json()
    assert (as_json["imported_from"], as_json["dtype"], as_json["bytes"]) == (location, "int32", 0)
    # Before it is built: an import, not "its processes build it"; once built, where it reads.
    unbuilt = shown_path("/store", imported, INLINE)
    assert unbuilt.startswith("Pants' cache: its import process writes Kiln's records, its "
                              f"tokens stay at {location}; ")  # fmt: skip
    built = shown_path("/store", imported, StoredState("built"))
    assert built == f"/store/tokenized/c/2026.06.28 (its tokens read in place at {location})"
    # Any other cache's rows stay as they were.
    local = cache(source={"kind": "files", "paths": ["/data/*.jsonl"]})
    assert shown_path("/store", local, StoredState("built")) == "/store/tokenized/c/2026.06.28"
