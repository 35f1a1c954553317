"""`pants build`'s decisions without Pants: which steps wait for which, how many train at once,
DEP_FAILED in the store, what a served `pants run` prints, and what a cache step reports when
Pants' cache serves it or a batch builds it (tests/e2e runs the goal itself)."""

from __future__ import annotations

import dataclasses
import json
import uuid
from pathlib import Path

from pants.engine.addresses import Address
from pants.engine.internals.native_engine import ProcessExecutionEnvironment
from pants.engine.internals.session import RunId
from pants.engine.process import FallibleProcessResult, Process, ProcessResultMetadata
from pants.testutil.option_util import create_subsystem
from pants.testutil.rule_runner import QueryRule, RuleRunner

from kiln_pants.artifact_graph import Artifact, ArtifactGraph
from kiln_pants.artifact_store import (
    StoredState,
    recorded_state,
    stored_state,
)
from kiln_pants.build import BuildSubsystem, PlannedStep, steps_to_build, summary_lines
from kiln_pants.build_steps import (
    FROM_PANTS_CACHE,
    SERVED,
    SUCCESS,
    StepOutcome,
    TrainingSlots,
    cache_outcome,
)
from kiln_pants.tokenize_rules import CacheBatch
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


def process(source: str, run: int, milliseconds: int | None = 12_345) -> ProcessResultMetadata:
    """A process result's metadata as Pants gives it: how it was had, in which run."""
    here = ProcessExecutionEnvironment(
        environment_name=None, platform="linux_x86_64", docker_image=None,
        remote_execution=False, remote_execution_extra_platform_properties=[],
    )  # fmt: skip
    return ProcessResultMetadata(milliseconds, here, source, run)


BATCH = CacheBatch(tuple(Address("scale/caches", target_name=f"c{i}") for i in range(50)))


def test_a_cache_whose_process_did_not_run_now_is_served() -> None:
    now = RunId(7)
    for made in (process("hit_locally", 7), process("hit_remotely", 7), process("ran", 6)):
        # Pants' cache, a remote cache, or pantsd's memory of an earlier run: nothing ran.
        assert cache_outcome(made, BATCH, now, 1.5) == StepOutcome(SERVED, FROM_PANTS_CACHE)
        assert cache_outcome(made, None, now, 1.5).status == SERVED


def processes_rule_runner() -> RuleRunner:
    return RuleRunner(rules=[QueryRule(FallibleProcessResult, [Process]), QueryRule(RunId, [])])


def test_pants_says_a_process_ran_in_its_first_run_and_not_after() -> None:
    """What build_cache_step reads, from Pants itself: a batch's process that runs, then the same
    process in the daemon's next command (its memory) and in a new daemon (Pants' local cache)."""
    batch = Process(("/bin/sh", "-c", f"echo {uuid.uuid4()} > out"), description="a batch",
                    output_files=("out",))  # fmt: skip

    def outcome(rule_runner: RuleRunner) -> StepOutcome:
        result = rule_runner.request(FallibleProcessResult, [batch])
        return cache_outcome(result.metadata, BATCH, rule_runner.request(RunId, []), 0.0)

    daemon = processes_rule_runner()
    assert outcome(daemon).status == SUCCESS
    daemon.set_options([])  # a new session: the next command
    assert outcome(daemon) == StepOutcome(SERVED, FROM_PANTS_CACHE)
    assert outcome(processes_rule_runner()) == StepOutcome(SERVED, FROM_PANTS_CACHE)


def test_a_cache_built_in_a_batch_reports_the_batch_not_its_time_as_its_own() -> None:
    built = cache_outcome(process("ran", 7), BATCH, RunId(7), 12.9)
    assert built == StepOutcome(SUCCESS, "built in a batch of 50, 12.3s")
    assert built.seconds == 0.0  # the step's wait was the batch's
    untimed = cache_outcome(process("ran", 7, milliseconds=None), BATCH, RunId(7), 12.9)
    assert untimed.detail == "built in a batch of 50"
    # A cache of its own (shards and merge, or alone in its batch) takes its step's time.
    assert cache_outcome(process("ran", 7), None, RunId(7), 25.3) == StepOutcome(SUCCESS, "", 25.3)
    alone = CacheBatch(BATCH.addresses[:1])
    assert cache_outcome(process("ran", 7), alone, RunId(7), 2.5) == StepOutcome(SUCCESS, "", 2.5)
    assert cache_outcome(None, None, RunId(7), 25.3) == StepOutcome(SUCCESS, "", 25.3)  # no process


def test_caches_served_whole_are_one_summary_line() -> None:
    """A no-op build of a thousand caches: one line for them, not a thousand."""
    outcomes = {
        CACHE.address: StepOutcome(SERVED, FROM_PANTS_CACHE),
        OTHER_CACHE.address: StepOutcome(SERVED, "already built"),
        RUN.address: StepOutcome(SERVED, "already built"),
        OTHER_RUN.address: StepOutcome(SUCCESS, seconds=3.0),
    }
    assert summary_lines(GRAPH, outcomes) == [
        f"SERVED      {RUN.ref:<48} {RUN.address}",
        f"SUCCESS     {OTHER_RUN.ref:<48} {OTHER_RUN.address}",
        "SERVED      2 cache(s), built before (the store, or Pants' cache)",
    ]
    built = {**outcomes, CACHE.address: StepOutcome(SUCCESS, "built in a batch of 50, 12.3s")}
    assert f"SUCCESS     {CACHE.ref:<48} {CACHE.address}" in summary_lines(GRAPH, built)


def test_a_cache_pants_may_serve_or_a_batch_builds_starts_without_a_line() -> None:
    def step(kind: str, in_store: bool, batch: CacheBatch | None = None) -> PlannedStep:
        return PlannedStep(CACHE.address, kind, CACHE.ref, "log", None, batch, in_store)

    assert step("tokenized_cache", in_store=False).starts_quietly  # inline: maybe a cache hit
    assert step("tokenized_cache", in_store=True, batch=BATCH).starts_quietly  # one process
    assert not step("tokenized_cache", in_store=True).starts_quietly  # its own store processes
    assert not step("lm_checkpoint", in_store=True).starts_quietly
