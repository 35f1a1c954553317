"""Small caches tokenize in batches cut by their addresses' hashes: one new or removed cache
changes its own batch only, so the other batches' processes stay Pants cache hits
(kiln_pants.tokenize_rules.in_batches)."""

from __future__ import annotations

from pants.engine.addresses import Address

from kiln_pants.tokenize_rules import MAX_CACHES_PER_BATCH, in_batches


def caches(names: list[str]) -> list[Address]:
    return [Address("experiments/many", target_name=name) for name in names]


THOUSAND = [f"c{i:04d}" for i in range(1000)]


def test_batches_hold_every_cache_once_in_order_at_about_the_batch_size() -> None:
    batches = in_batches(caches(THOUSAND))
    flat = [address for batch in batches for address in batch.addresses]
    assert flat == sorted(caches(THOUSAND))
    assert 10 <= len(batches) <= 40  # 1000 / 50 on average
    assert max(len(batch.addresses) for batch in batches) <= MAX_CACHES_PER_BATCH


def test_a_cache_added_or_removed_changes_one_batch() -> None:
    before = set(in_batches(caches(THOUSAND)))
    for changed in (["a_first", *THOUSAND], [*THOUSAND, "z_last"], THOUSAND[1:],
                    [*THOUSAND[:500], "c0499x", *THOUSAND[500:]]):  # fmt: skip
        after = set(in_batches(caches(changed)))
        assert len(after - before) <= 2, changed[:2]  # its batch (split in two at most)
        assert len(before - after) == 1

