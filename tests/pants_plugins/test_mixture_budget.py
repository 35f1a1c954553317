"""What a mixture reads from each cache, in whole sequences (kiln_pants.mixture_budget)."""

from __future__ import annotations

from kiln_pants.mixture_budget import apportion


def test_a_thousand_small_shares_add_up_to_what_the_run_reads() -> None:
    """80 sequences over 1,000 equal weights: 80 caches give one, not all 1,000."""
    counts = apportion({f"c{i:04d}": 1.0 for i in range(1000)}, 80)
    assert sum(counts.values()) == 80 and set(counts.values()) == {0, 1}


def test_shares_round_by_their_remainders() -> None:
    assert apportion({"a": 3.8, "b": 0.25, "c": 0.055}, 1000) == {"a": 926, "b": 61, "c": 13}
    assert apportion({"a": 1.0, "b": 1.0, "c": 1.0}, 10) == {"a": 4, "b": 3, "c": 3}
    assert apportion({"a": 1.0, "b": 0.0}, 7) == {"a": 7, "b": 0}
