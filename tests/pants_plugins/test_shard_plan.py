"""How `plan` prints a shard plan: readable at 512 shards, complete with `--plan-shards`.
(Plans made by the runtime process are checked end to end in tests/e2e.)"""

from __future__ import annotations

from kiln_pants.shard_plan import ShardPlan, _files_plan, _parsed, _sizes_on_disk


def dclm_shaped(num_shards: int = 512) -> ShardPlan:
    """Shard i reads 2 files, or 3 for every tenth shard; each file 1.5 MB plus i bytes."""
    files = [2 + (i % 10 == 0) for i in range(num_shards)]
    return _parsed(
        [
            {"files": {f"part-{i:03d}-{k}.jsonl.zst": 1_500_000 + i for k in range(n)}}
            for i, n in enumerate(files)
        ]
    )


def test_a_summary_line_and_the_first_shards_by_default() -> None:
    assert dclm_shaped().describe(every_shard=False) == [
        "shard plan: 512 shards, 1,076 files, 1.61 GB; per shard (min/median/max) 2/2/3 files, "
        "3.00 MB/3.00 MB/4.50 MB",
        "  shard 0: 3 files, 4.50 MB: part-000-0.jsonl.zst, part-000-1.jsonl.zst and 1 more",
        "  shard 1: 2 files, 3.00 MB: part-001-0.jsonl.zst, part-001-1.jsonl.zst",
        "  shard 2: 2 files, 3.00 MB: part-002-0.jsonl.zst, part-002-1.jsonl.zst",
        "  ... 509 more shards: `--plan-shards` lists every shard and file",
    ]


def test_every_shard_and_file_with_plan_shards() -> None:
    lines = dclm_shaped().describe(every_shard=True)
    assert len(lines) == 1 + 512 + 1_076
    assert lines[-3:] == [
        "  shard 511: 2 files, 3.00 MB",
        "    part-511-0.jsonl.zst (1,500,511 bytes)",
        "    part-511-1.jsonl.zst (1,500,511 bytes)",
    ]


def test_one_shard_needs_no_spread() -> None:
    assert _parsed([{"files": {"a.jsonl": 900, "b.jsonl": 2_100}}]).describe(every_shard=False) == [
        "shard plan: 1 shard, 2 files, 3.00 kB",
        "  shard 0: 2 files, 3.00 kB: a.jsonl, b.jsonl",
    ]


def test_a_streamed_source_and_an_unavailable_plan_take_one_line() -> None:
    how = "split_dataset_by_node(rank={}, world_size=2)"
    streamed = _parsed([{"streamed": how.format(rank)} for rank in (0, 1)])
    assert streamed.describe(every_shard=True) == [
        "shard plan: 2 shards, each its rank's part of the stream (split_dataset_by_node); "
        "a streamed source's parts are known only when it is read"
    ]
    offline = ShardPlan(unavailable="shard plan needs the hub: offline (HF_HUB_OFFLINE=1)")
    assert offline.describe(every_shard=False) == [offline.unavailable]
    assert ShardPlan().describe(every_shard=False) == []


def test_an_import_is_planned_from_its_ledger_and_a_bad_one_refused() -> None:
    imported = {"location": "s3://b/tokenized/dclm/train", "layout": "sharded", "parts": 512,
                "documents": 3_000_000, "tokens": 2_950_000_000, "tokenizer": None,
                "vocab_size": None}  # fmt: skip
    assert _parsed([{"imported": imported}]).describe(every_shard=False) == [
        "imports the Levanter cache at s3://b/tokenized/dclm/train: sharded layout, 512 parts, "
        "3,000,000 documents, 2,950,000,000 tokens (its shard_ledger.json)"
    ]
    # What `plan` estimates and budgets with, so that it says one thing of the import.
    assert _parsed([{"imported": imported}]).imported_tokens == 2_950_000_000
    assert _parsed([{"imported": {**imported, "dtype": "int32"}}]).imported_dtype == "int32"
    assert _parsed([{"imported": imported}]).imported_from == "s3://b/tokenized/dclm/train"
    refused = ShardPlan(refused="tokenized/x: ... shard_ledger.json field `layout` is 'zoned'")
    assert refused.describe(every_shard=True) == [f"!! import refused: {refused.refused}"]


def test_local_files_are_planned_from_their_sizes_without_the_runtime(tmp_path) -> None:
    """The backend plans files by the runtime's own rules (kiln_contract.sharding): here two
    files on disk outside the repository, found by their glob as the runtime expands it."""
    for name, size in (("a.jsonl", 900), ("b.jsonl", 2_100)):
        (tmp_path / name).write_bytes(b"x" * size)
    sizes = _sizes_on_disk(f"{tmp_path}/*.jsonl")
    assert sizes == {f"{tmp_path}/a.jsonl": 900, f"{tmp_path}/b.jsonl": 2_100}
    plan = _files_plan(sizes, 2)
    assert plan is not None and plan.describe(every_shard=True) == [
        "shard plan: 2 shards, 2 files, 3.00 kB; per shard (min/median/max) 1/1/1 files, "
        "900 B/900 B/2.10 kB",
        "  shard 0: 1 file, 2.10 kB",
        f"    {tmp_path}/b.jsonl (2,100 bytes)",
        "  shard 1: 1 file, 900 B",
        f"    {tmp_path}/a.jsonl (900 bytes)",
    ]
    # What the runtime must say in its own words: no match, an empty file, a format it reads.
    assert _sizes_on_disk(f"{tmp_path}/*.parquet") is None
    (tmp_path / "c.jsonl").write_bytes(b"")
    assert _sizes_on_disk(f"{tmp_path}/*.jsonl") is None
    assert _files_plan({"big.parquet": 300 * 2**20}, 4) is None
