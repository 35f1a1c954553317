"""`pants store`'s decisions: what a removal selects, what it keeps and why, and the table."""

from __future__ import annotations

import pytest
from pants.engine.addresses import Address

from kiln_contract.inventory import Inventory, StoredArtifact
from kiln_pants.housekeeping import Removal, inventory_lines, parse_date, select

DAY = 86400.0
NOW = parse_date("2026-12-02") + 12 * 3600


def _artifact(
    folder: str, status: str | None = "SUCCESS", *, inputs: tuple[str, ...] = (),
    days_old: float = 1, lease: str | None = None, fingerprint: str = "f1",
) -> StoredArtifact:  # fmt: skip
    return StoredArtifact(folder, status, "lm_checkpoint", fingerprint, inputs, 3, 2_500_000,
                          NOW - days_old * DAY, lease)  # fmt: skip


STORE = Inventory(
    (
        _artifact("checkpoints/run/v2", inputs=("tokenized/web@v1",)),
        _artifact("checkpoints/run/v1", inputs=("tokenized/old@v1",), days_old=40),
        _artifact("checkpoints/sweep-lr3/v1", "FAILED", inputs=("tokenized/web@v1",)),
        _artifact("checkpoints/busy/v1", "RUNNING", lease="train checkpoints/busy@v1 (host h)"),
        _artifact("tokenized/old/v1", days_old=50),
        _artifact("tokenized/web/v1", days_old=50),
    ),
    other_objects=2,
    other_size=70,
)
NAMED = {
    "checkpoints/run/v2": Address("experiments", target_name="run"),
    "tokenized/web/v1": Address("experiments", target_name="web"),
}


def _removed(selection) -> list[str]:
    return sorted(a.ref for a in selection.remove)


def test_unnamed_selects_what_no_target_names_less_leased_ones() -> None:
    selection = select(STORE, NAMED, Removal.unnamed, None)
    assert _removed(selection) == [
        "checkpoints/run@v1", "checkpoints/sweep-lr3@v1", "tokenized/old@v1",
    ]  # fmt: skip
    assert selection.kept == {
        "checkpoints/busy/v1": "a run holds its lease: train checkpoints/busy@v1 (host h)"
    }


def test_an_input_of_an_artifact_that_stays_stays() -> None:
    """The old cache goes with the old run that read it; kept while that run stays."""
    named = {**NAMED, "checkpoints/run/v1": Address("experiments", target_name="run_v1")}
    selection = select(STORE, named, Removal.unnamed, None)
    assert _removed(selection) == ["checkpoints/sweep-lr3@v1"]
    assert selection.kept["tokenized/old/v1"] == "checkpoints/run@v1 was built from it"


def test_inputs_are_kept_through_chains() -> None:
    chain = Inventory(
        (
            _artifact("a/x/v1"),
            _artifact("b/x/v1", inputs=("a/x@v1",)),
            _artifact("c/x/v1", inputs=("b/x@v1",)),
        ),
        0,
        0,
    )
    selection = select(chain, {"c/x/v1": Address("x", target_name="c")}, Removal.unnamed, None)
    assert _removed(selection) == []
    assert selection.kept == {
        "b/x/v1": "c/x@v1 was built from it", "a/x/v1": "b/x@v1 was built from it"
    }  # fmt: skip


def test_failed_and_older_than_narrow_the_selection() -> None:
    assert _removed(select(STORE, NAMED, Removal.failed, None)) == ["checkpoints/sweep-lr3@v1"]
    before = parse_date("2026-11-01")
    old = select(STORE, NAMED, None, before)  # alone: everything older
    assert _removed(old) == ["checkpoints/run@v1", "tokenized/old@v1"]
    assert old.kept == {"tokenized/web/v1": "checkpoints/run@v2 was built from it"}
    assert _removed(select(STORE, NAMED, Removal.unnamed, before)) == [
        "checkpoints/run@v1", "tokenized/old@v1",
    ]  # fmt: skip
    assert _removed(select(STORE, NAMED, Removal.failed, before)) == []


def test_the_table_names_targets_states_sizes_and_ages() -> None:
    fingerprints = {"checkpoints/run/v2": "f1", "tokenized/web/v1": "f9"}
    lines = list(inventory_lines(STORE, NAMED, fingerprints, NOW))
    assert lines[0].split() == ["STATUS", "SIZE", "AGE", "ARTIFACT", "TARGET"]
    assert lines[1].split() == ["SUCCESS", "2.50", "MB", "1", "d", "checkpoints/run@v2",
                                "experiments:run"]  # fmt: skip
    assert lines[3].split()[:6] == ["FAILED", "2.50", "MB", "1", "d", "checkpoints/sweep-lr3@v1"]
    assert lines[3].endswith("(no target)")
    assert lines[5].split() == ["leased:", "train", "checkpoints/busy@v1", "(host", "h)"]
    assert lines[7].endswith("experiments:web (built with another fingerprint)")
    assert lines[-1] == (
        "6 artifacts, 15.00 MB; no target names 4 of them (10.00 MB); 2 other objects (70 B: "
        ".kiln/ and files of no artifact, never removed)"
    )


def test_a_date_that_is_not_one_is_refused_naming_the_option() -> None:
    assert parse_date("2026-06-01") == 1780272000.0
    with pytest.raises(ValueError, match=r"^--store-older-than='last week' is not a date: give"):
        parse_date("last week")
