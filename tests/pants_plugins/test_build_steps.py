"""`pants build`'s decisions without Pants: which steps wait for which, how many train at once,
DEP_FAILED in the store, and what a served `pants run` prints (tests/e2e runs the goal itself)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from pants.engine.addresses import Address
from pants.testutil.option_util import create_subsystem

from kiln_pants.artifact_graph import Artifact, ArtifactGraph
from kiln_pants.artifact_store import (
    StoredState,
    recorded_state,
    stored_state,
)
from kiln_pants.build import BuildSubsystem, steps_to_build
from kiln_pants.build_steps import TrainingSlots
from kiln_pants.train_rules import served_text


def artifact(name: str, kind: str, *inputs: Artifact, version: str = "2026.12.01") -> Artifact:
    return Artifact(
        address=Address("experiments", target_name=name),
        kind=kind,
        name=f"x/{name}",
        version=version,
        identity_json="{}",
        fingerprint=f"fp-{name}",
        inputs=tuple(i.address for i in inputs),
    )


CACHE = artifact("cache", "tokenized_cache")
OTHER_CACHE = artifact("other_cache", "tokenized_cache")
RUN = artifact("run", "lm_checkpoint", CACHE)
OTHER_RUN = artifact("other_run", "lm_checkpoint", CACHE, OTHER_CACHE)
EXPORT = artifact("export", "hf_model", RUN)
GRAPH = ArtifactGraph([CACHE, OTHER_CACHE, RUN, OTHER_RUN, EXPORT])


def states(**built: str) -> dict[Address, StoredState]:
    return {a.address: StoredState(built.get(a.address.target_name, "would run")) for a in GRAPH}


def waits(steps: dict[Address, tuple[Address, ...]]) -> dict[str, list[str]]:
    return {a.target_name: [i.target_name for i in inputs] for a, inputs in steps.items()}


def test_each_step_waits_for_its_own_inputs_only() -> None:
    steps = steps_to_build([EXPORT, OTHER_RUN], GRAPH, states())
    assert waits(steps) == {
        "cache": [], "other_cache": [], "run": ["cache"], "other_run": ["cache", "other_cache"],
        "export": ["run"],
    }  # fmt: skip
    assert list(steps) == [a.address for a in GRAPH]  # inputs first


def test_a_built_artifact_is_served_and_needs_nothing_below_it() -> None:
    # The cache is not built for a served run, and the served run waits for nothing.
    assert waits(steps_to_build([EXPORT], GRAPH, states(run="built"))) == {
        "run": [], "export": ["run"]
    }  # fmt: skip
    assert waits(steps_to_build([EXPORT], GRAPH, states(export="built"))) == {"export": []}
    # Another step still needs the cache built; the served run's export need not wait for it.
    steps = steps_to_build([EXPORT, OTHER_RUN], GRAPH, states(run="built"))
    assert waits(steps)["run"] == [] and waits(steps)["other_run"] == ["cache", "other_cache"]


def test_caches_always_build_they_are_pants_cache_hits() -> None:
    assert waits(steps_to_build([RUN], GRAPH, states(cache="built"))) == {
        "cache": [], "run": ["cache"]
    }  # fmt: skip


def test_trainings_are_capped_here_and_all_at_once_on_a_cluster() -> None:
    subsystem = create_subsystem(BuildSubsystem, trainings_at_once=None)
    assert subsystem.training_slots("", "/slots") == TrainingSlots("/slots", 1)
    assert subsystem.training_slots("ray://head:10001", "/slots") is None
    capped = create_subsystem(BuildSubsystem, trainings_at_once=3)
    assert capped.training_slots("ray://head:10001", "/slots") == TrainingSlots("/slots", 3)


def test_a_dep_failed_mark_reads_as_will_run_with_its_reason(tmp_path: Path) -> None:
    """The mark as kiln.artifacts.dep_failed writes it (tested there, in every store)."""
    folder = tmp_path / EXPORT.name / EXPORT.version
    folder.mkdir(parents=True)
    (folder / "failure.txt").write_text("input x/run@2026.12.01 failed\n")
    (folder / "STATUS").write_text("DEP_FAILED\n")
    assert stored_state(str(tmp_path), EXPORT).describe() == (
        "dep failed (input x/run@2026.12.01 failed; will run)"
    )


def test_plan_shows_why_the_last_run_failed_or_stopped() -> None:
    record = json.dumps({"fingerprint": RUN.fingerprint})
    reason = "input tokenized/a@v1: shard shard-00000, file data/c/0 is missing\n"
    assert recorded_state(RUN, "FAILED\n", record, reason).describe() == (
        "failed (input tokenized/a@v1: shard shard-00000, file data/c/0 is missing; will rerun)"
    )
    assert recorded_state(RUN, "FAILED\n", record).detail == "no reason recorded; will rerun"
    # A run that failed on its inputs ends before writing its record: the reason still shows.
    assert recorded_state(RUN, "FAILED\n", None, reason).describe() == (
        "failed (input tokenized/a@v1: shard shard-00000, file data/c/0 is missing; will rerun)"
    )
    stopped = recorded_state(RUN, "RUNNING\n", record, "interrupted by SIGTERM after step 4")
    assert (
        stopped.detail == "the last run stopped: interrupted by SIGTERM after step 4; will resume"
    )


def test_a_served_run_prints_the_runners_words() -> None:
    record = json.dumps({"fingerprint": RUN.fingerprint, "provenance": {"code_digest": "a" * 64}})
    assert recorded_state(RUN, "SUCCESS\n", record).status == "built"
    same = served_text(RUN, "/store/x/run/2026.12.01", record, "the summary\n", "a" * 64)
    assert same == (
        f"kiln: x/run@2026.12.01 is already built at /store/x/run/2026.12.01 (fingerprint "
        f"{RUN.fingerprint}).\nthe summary\n"
    )
    other = served_text(RUN, "/store/x/run/2026.12.01", record, None, "b" * 64)
    assert "built by other code (runtime digest aaaaaaaaaaaa, now bbbbbbbbbbbb)" in other


def test_drift_from_inputs_alone_says_to_bump_the_version() -> None:
    """A parent built anew under its version makes its children drift though their own fields
    did not change: the plan says so, and what to do."""
    parent_changed = json.dumps({"fingerprint": "old", "identity": {
        "init_from": {"fingerprint": "a"}, "seq_len": 64}})  # fmt: skip
    child = dataclasses.replace(RUN, identity_json=json.dumps(
        {"init_from": {"fingerprint": "b"}, "seq_len": 64}))  # fmt: skip
    drift = recorded_state(child, "SUCCESS\n", parent_changed)
    assert drift.detail == (
        "built with fingerprint old; differs in: init_from.fingerprint (only its inputs changed: "
        "bump this target's `version` to build it from them, as every artifact made from a "
        "changed one needs)")  # fmt: skip
    own_change = json.dumps({"fingerprint": "old", "identity": {
        "init_from": {"fingerprint": "b"}, "seq_len": 32}})  # fmt: skip
    assert recorded_state(child, "SUCCESS\n", own_change).detail == (
        "built with fingerprint old; differs in: seq_len")
