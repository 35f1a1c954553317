"""`pants store`'s decisions: what a removal selects, what it keeps and why, the table, and the
targets it reads."""

from __future__ import annotations

import pytest
from pants.engine.addresses import Address
from pants.testutil.rule_runner import RuleRunner

from kiln_contract.inventory import Inventory, StoredArtifact
from kiln_pants.housekeeping import Removal, inventory_lines, parse_date, select
from kiln_pants.store_inventory import StoredTargets, StoredTargetsRequest

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


TARGETS = """
tokenized_cache(name="web", sources=["web.jsonl"], tokenizer="//exp/tok:tok", version="2026.12.01")
lm_checkpoint(
    name="zero",
    version="2026.12.01",
    model=llama(max_seq_len=64, hidden_dim=32, intermediate_dim=64, num_heads=2, num_kv_heads=1,
                num_layers=1),
    optimizer=adam(learning_rate=1e-3, warmup=1),
    datasets={":web": 0.0},
    validation=[":web"],
    batch_size=2, seq_len=64, num_train_steps=4, z_loss_weight=None, evals=None, resources=cpu(),
)
tokenized_cache(name="unbuilt", sources=["web.jsonl"], tokenizer="//exp/tok:tok",
                version="2026.12.01", num_shards=0)
tokenized_cache(name="undated", sources=["web.jsonl"], tokenizer="//exp/tok:tok", version="soon")
tokenized_cache(name="twin", artifact_name="tokenized/web", sources=["web.jsonl"],
                tokenizer="//exp/tok:tok", version="2026.12.02")
tokenized_cache(name="twin2", artifact_name="tokenized/web", sources=["web.jsonl"],
                tokenizer="//exp/tok:tok", version="2026.12.02")
"""


def test_targets_wrong_elsewhere_are_skipped_with_a_line_each(rule_runner: RuleRunner) -> None:
    """A mixture weight 0.0 in a stored run's target, a version that is none and two targets of
    one stored artifact stop nothing: each is one line naming the target and why; their folders
    stay named (never `unnamed`), and a wrong target whose artifact the store does not hold is
    not read at all."""
    rule_runner.write_files({
        "exp/BUILD": TARGETS,
        "exp/web.jsonl": '{"text": "hello"}\n',
        "exp/tok/BUILD": 'files(name="tok", sources=["kiln-tok/*"])',
        "exp/tok/kiln-tok/tokenizer.json": '{"model": "fake"}',
    })  # fmt: skip
    stored = ("tokenized/web/2026.12.01", "checkpoints/zero/2026.12.01", "tokenized/gone/v1",
              "tokenized/web/2026.12.02")  # fmt: skip
    targets = rule_runner.request(StoredTargets, [StoredTargetsRequest(stored)])
    assert targets.unread is None
    assert dict(targets.named) == {
        "tokenized/web/2026.12.01": Address("exp", target_name="web"),
        "checkpoints/zero/2026.12.01": Address("exp", target_name="zero"),
        "tokenized/unbuilt/2026.12.01": Address("exp", target_name="unbuilt"),
        "tokenized/web/2026.12.02": Address("exp", target_name="twin"),
    }
    assert list(targets.fingerprints) == ["tokenized/web/2026.12.01"]
    undated, zero, *twins = targets.skipped
    assert undated.startswith("Skipped exp:undated (it names no artifact until fixed): ")
    assert "`version`" in undated and "'soon'" in undated
    assert zero.startswith("Skipped exp:zero (its artifact stays named; its fingerprint is not "
                           "compared with the record's): exp/BUILD:3: ")  # fmt: skip
    assert "`datasets`" in zero and "\n" not in zero
    shared = "Targets exp:twin and exp:twin2 are both the artifact tokenized/web@2026.12.02"
    assert [t.split(": ")[0] for t in twins] == [
        f"Skipped exp:{name} (its artifact stays named; its fingerprint is not compared with "
        "the record's)" for name in ("twin", "twin2")
    ]  # fmt: skip
    assert all(shared in t for t in twins)
