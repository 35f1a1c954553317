"""`pants build <targets>`: many artifacts and their inputs into the artifact store, Marin's
`StepRunner().run([...])`.

Each artifact in the closure is a step, and the steps run as a pipeline: each starts as soon as
its own inputs are done, bounded by Pants' process limits, never by a level of the graph. Caches
build as cached Pants processes and exports as per-session processes; checkpoints train with the
same runner as `pants run` (`kiln.runner`, kiln_pants.build_steps), `[build] trainings_at_once`
at a time on this machine (default 1: a training step takes the whole machine), or all at once
as jobs of a configured cluster. An artifact already built (STATUS SUCCESS, same fingerprint) is
served, and nothing below it is built. A step that fails does not stop the others: its
dependents are reported DEP_FAILED (and so marked in their folder's STATUS in a local store),
independent steps go on, and the goal ends with "N step(s) failed" and exit 1 (as `pants test`
reports each test and fails at the end).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

from pants.base.build_root import BuildRoot
from pants.core.util_rules.distdir import DistDir
from pants.engine.addresses import Address, Addresses
from pants.engine.console import Console
from pants.engine.fs import Workspace
from pants.engine.goal import Goal, GoalSubsystem
from pants.engine.rules import Get, MultiGet, collect_rules, goal_rule, rule
from pants.engine.target import Dependencies, DependenciesRequest, Targets
from pants.option.option_types import IntOption

from kiln_contract.layout import DEP_FAILED
from kiln_pants import build_steps
from kiln_pants.artifact_graph import Artifact, ArtifactGraph, ArtifactGraphRequest
from kiln_pants.artifact_store import StoredState, artifact_path, stored_states_or_report
from kiln_pants.build_steps import (
    FAILED,
    SERVED,
    StepOutcome,
    StepRequest,
    TrainingSlots,
    dep_failed,
    log_path,
)
from kiln_pants.dep_failed_marks import DepFailedMarked, DepFailedMarks
from kiln_pants.eval_targets import LmEvalRunTarget
from kiln_pants.hf_model_targets import HfModelTarget
from kiln_pants.subsystem import KilnSubsystem
from kiln_pants.target_types import LmCheckpointTarget, TokenizedCacheTarget
from kiln_pants.tokenize_rules import CacheBatch, CacheBatches, SmallCachesRequest

logger = logging.getLogger(__name__)


class BuildSubsystem(GoalSubsystem):
    name = "build"
    help = (
        "Build artifacts and everything they need into the artifact store, each step as soon "
        "as its inputs are done; a failed step's dependents are DEP_FAILED and the others go on."
    )

    trainings_at_once = IntOption(
        default=None,
        help=(
            "How many checkpoints train at the same time. On this machine a training step uses "
            "every core (XLA) or every accelerator, so the default is one; caches and exports "
            "run alongside, bounded by `[GLOBAL] process_execution_local_parallelism`. With "
            "`[kiln] cluster` set each training is a job of its own, and the default is all of "
            "them at once (each follows its job in a local process, so the local process limit "
            "bounds them too)."
        ),
    )

    def training_slots(self, cluster: str, folder: str) -> Optional[TrainingSlots]:
        """The cap on trainings at once; None: no cap but Pants' own (a cluster's jobs)."""
        count = self.trainings_at_once
        if count is None:
            return None if cluster else TrainingSlots(folder, 1)
        return TrainingSlots(folder, count)


class Build(Goal):
    subsystem_cls = BuildSubsystem
    environment_behavior = Goal.EnvironmentBehavior.LOCAL_ONLY


@dataclass(frozen=True)
class PlannedStep:
    address: Address
    kind: str
    ref: str
    log: str
    decided: Optional[StepOutcome]  # served or drifted: no process runs
    batch: Optional[CacheBatch] = None  # a small cache: tokenized with these in one process
    in_store: bool = True  # False: an inline cache, which Pants' cache may serve

    @property
    def starts_quietly(self) -> bool:
        """A cache that Pants' cache may serve (inline), or one of a batch (one process, which
        Pants' progress shows): no line when it starts; one when it ends, if it ran."""
        return self.kind == TokenizedCacheTarget.alias and (not self.in_store or bool(self.batch))


def _served_cache(kind: str, outcome: StepOutcome) -> bool:
    """A cache served whole (from the store, or Pants' cache): counted in the summary, no line
    of its own (a no-op build of a thousand caches prints one line, not two thousand)."""
    return kind == TokenizedCacheTarget.alias and outcome.status == SERVED


@dataclass(frozen=True)
class PipelineStep:
    """A step, started once the steps it waits for (`inputs`) are done. It holds those steps
    rather than the whole plan, so that a request is as large as its own part of the graph:
    pantsd compares each request with the last session's, and requests that each held all
    5,000 steps of a graph made a no-op build quadratic (benchmarks/RESULTS.md)."""

    step: PlannedStep
    inputs: tuple[PipelineStep, ...]
    slots: Optional[TrainingSlots]


@rule(desc="Waiting for a step's inputs")
async def pipeline_step(request: PipelineStep) -> StepOutcome:
    step = request.step
    if step.decided is not None:
        return step.decided
    outcomes = await MultiGet(Get(StepOutcome, PipelineStep, p) for p in request.inputs)
    failed = [p.step.ref for p, outcome in zip(request.inputs, outcomes) if outcome.failed]
    if failed:
        return dep_failed(", ".join(failed))
    if not step.starts_quietly:
        logger.info(_start_line(step, request.slots))
    outcome = await Get(
        StepOutcome, StepRequest(step.address, step.kind, step.log, request.slots, step.batch)
    )
    if not _served_cache(step.kind, outcome):
        logger.info(_outcome_line(step.ref, outcome, step.log))
    return outcome


def _start_line(step: PlannedStep, slots: Optional[TrainingSlots]) -> str:
    """A step whose inputs are done: it starts, or (a training here) waits for a slot."""
    if step.kind != LmCheckpointTarget.alias:
        return f"kiln: start      {step.ref} ({step.address})"
    if slots is None:
        return f"kiln: start      {step.ref} ({step.address}); log: {step.log}"
    return (
        f"kiln: ready      {step.ref} ({step.address}): trains in one of {slots.count} "
        f"slot(s) (--build-trainings-at-once); log: {step.log}"
    )


def steps_to_build(
    roots: list[Artifact], graph: ArtifactGraph, states: dict[Address, StoredState]
) -> dict[Address, tuple[Address, ...]]:
    """The steps the roots need, in build order (inputs first), each with the steps it waits
    for. An artifact already built in the store is served and waits for nothing, and its inputs
    are not needed for it (inline caches always build: they are Pants' cache hits, and the
    steps above them take their files)."""
    needed: set[Address] = set()
    pending = list(roots)
    while pending:
        artifact = pending.pop()
        if artifact.address in needed:
            continue
        needed.add(artifact.address)
        if not _served(artifact, states):
            pending.extend(graph.get(address) for address in artifact.inputs)
    return {
        artifact.address: () if _served(artifact, states) else artifact.inputs
        for artifact in graph  # inputs first
        if artifact.address in needed
    }


def _served(artifact: Artifact, states: dict[Address, StoredState]) -> bool:
    return artifact.in_store and states[artifact.address].status == "built"


def _decided(artifact: Artifact, state: StoredState) -> Optional[StepOutcome]:
    """The outcome of a step that runs no process, known before anything runs: served or
    drifted. None: it runs once its inputs are done."""
    if _served(artifact, {artifact.address: state}):
        return StepOutcome(SERVED, "already built")
    if state.status == "drift":
        return StepOutcome(FAILED, f"{state.detail}; bump `version` to build a new artifact")
    return None


@dataclass(frozen=True)
class BuildRootsRequest:
    addresses: Addresses


@dataclass(frozen=True)
class BuildRoots:
    """The artifacts asked for: each artifact target given, and the artifacts that any other
    target given depends on directly (a sweep's `target`, or any group of runs)."""

    addresses: Addresses


@rule(desc="Finding the artifacts asked for")
async def build_roots(request: BuildRootsRequest) -> BuildRoots:
    targets = await Get(Targets, Addresses, request.addresses)
    artifacts = [t.address for t in targets if t.alias in ARTIFACT_ALIASES]
    groups = [t for t in targets if t.alias not in ARTIFACT_ALIASES and t.has_field(Dependencies)]
    members = await MultiGet(Get(Addresses, DependenciesRequest(t[Dependencies])) for t in groups)
    grouped = await MultiGet(Get(Targets, Addresses, addresses) for addresses in members)
    for group in grouped:
        artifacts.extend(t.address for t in group if t.alias in ARTIFACT_ALIASES)
    return BuildRoots(Addresses(sorted(set(artifacts))))


ARTIFACT_ALIASES = (
    TokenizedCacheTarget.alias, LmCheckpointTarget.alias, HfModelTarget.alias,
    LmEvalRunTarget.alias,
)  # fmt: skip


async def _marked_dep_failed(
    dependents: list[PlannedStep],
    outcomes: dict[Address, StepOutcome],
    graph: ArtifactGraph,
    prefix: str,
) -> dict[Address, StepOutcome]:
    """Writes DEP_FAILED, with the failed input beside it, into the dependents' folders (one
    runtime process, any store); the outcomes of those it marked say where."""
    artifacts = [graph.get(step.address) for step in dependents]
    marks = tuple(
        (a.folder, f"{outcomes[a.address].detail} in the last `pants build`") for a in artifacts
    )
    marked = set((await Get(DepFailedMarked, DepFailedMarks(prefix, marks=marks))).folders)
    return {
        a.address: StepOutcome(
            DEP_FAILED,
            f"{outcomes[a.address].detail}; STATUS {DEP_FAILED} in {artifact_path(prefix, a)}",
        )
        for a in artifacts
        if a.folder in marked
    }


# The goal's helpers come before it: Pants finds a helper's Gets when it reads the rule.
async def _planned_pipeline(
    graph: ArtifactGraph,
    roots: list[Artifact],
    states: dict[Address, StoredState],
    dist: str,
    slots: Optional[TrainingSlots],
) -> dict[Address, PipelineStep]:
    """The steps the roots need, each decided now where the store decides it (served, or
    refused), the small caches among the others in their batches."""
    to_build = steps_to_build(roots, graph, states)
    decided = {a: _decided(graph.get(a), states[a]) for a in to_build}
    caches = Addresses(
        a for a in to_build
        if graph.get(a).kind == TokenizedCacheTarget.alias and decided[a] is None
    )  # fmt: skip
    batches = await Get(CacheBatches, SmallCachesRequest(caches))
    batch_of = {address: batch for batch in batches.batches for address in batch.addresses}
    return _pipeline(graph, to_build, decided, dist, slots, batch_of)


async def _clear_earlier_marks(
    pipeline: dict[Address, PipelineStep],
    graph: ArtifactGraph,
    states: dict[Address, StoredState],
    prefix: str,
) -> None:
    """Clears the DEP_FAILED marks an earlier build left on the steps this one decides again."""
    marked_before = [
        graph.get(address).folder for address, p in pipeline.items()
        if p.step.decided is None and states[address].status == "dep failed"
    ]  # fmt: skip
    if marked_before:
        await Get(DepFailedMarked, DepFailedMarks(prefix, clears=tuple(marked_before)))


async def _run_pipeline(
    console: Console, pipeline: dict[Address, PipelineStep], graph: ArtifactGraph, prefix: str
) -> dict[Address, StepOutcome]:
    """Every step's outcome: those decided up front printed first; a failed step's error in its
    log; the dependents of a failure marked DEP_FAILED in the store."""
    steps = [p.step for p in pipeline.values()]
    console.print_stderr(f"Building {len(steps)} step(s) into {prefix}")
    for step in steps:
        if step.decided is not None and not _served_cache(step.kind, step.decided):
            console.print_stderr(_outcome_line(step.ref, step.decided, None))
    results = await MultiGet(Get(StepOutcome, PipelineStep, p) for p in pipeline.values())
    outcomes = dict(zip(pipeline, results))
    for step, outcome in zip(steps, results):
        if outcome.error:
            with open(step.log, "w") as f:
                f.write(outcome.error.rstrip() + "\n")
    dependents = [s for s in steps if outcomes[s.address].status == DEP_FAILED]
    if dependents:
        outcomes.update(await _marked_dep_failed(dependents, outcomes, graph, prefix))
        for step in dependents:
            console.print_stderr(_outcome_line(step.ref, outcomes[step.address], step.log))
    return outcomes


@goal_rule
async def build(
    console: Console,
    addresses: Addresses,
    subsystem: BuildSubsystem,
    kiln: KilnSubsystem,
    build_root: BuildRoot,
    distdir: DistDir,
    workspace: Workspace,  # marks the goal as side-effecting: it writes the artifact store
) -> Build:
    prefix = kiln.prefix_or_report(console, build_root.path)
    if prefix is None:
        return Build(exit_code=1)
    roots_asked = await Get(BuildRoots, BuildRootsRequest(addresses))
    graph = await Get(ArtifactGraph, ArtifactGraphRequest(roots_asked.addresses))
    requested = set(roots_asked.addresses)
    roots = [a for a in graph if a.address in requested]
    if not roots:
        console.print_stderr(
            "No artifact targets (tokenized_cache, lm_checkpoint, hf_model, lm_eval_run) given."
        )
        return Build(exit_code=0)
    if subsystem.trainings_at_once is not None and subsystem.trainings_at_once < 1:
        console.print_stderr(
            f"--build-trainings-at-once={subsystem.trainings_at_once}: give 1 or more."
        )
        return Build(exit_code=1)
    stored = await stored_states_or_report(console, prefix, graph)
    if stored is None:
        return Build(exit_code=1)
    states = {a.address: state for a, state in stored.items()}
    dist = os.path.join(build_root.path, distdir.relpath)
    slots = subsystem.training_slots(kiln.cluster, os.path.join(dist, "kiln-build", "slots"))
    pipeline = await _planned_pipeline(graph, roots, states, dist, slots)
    await _clear_earlier_marks(pipeline, graph, states, prefix)
    outcomes = await _run_pipeline(console, pipeline, graph, prefix)
    return Build(exit_code=_summary(console, graph, outcomes))


def _pipeline(
    graph: ArtifactGraph,
    steps: dict[Address, tuple[Address, ...]],
    decided: dict[Address, Optional[StepOutcome]],
    dist: str,
    slots: Optional[TrainingSlots],
    batch_of: dict[Address, CacheBatch],
) -> dict[Address, PipelineStep]:
    """Every step (in build order, inputs first) with the steps it waits for and its outcome
    if known now (`decided`); the folders of the steps' logs made."""
    pipeline: dict[Address, PipelineStep] = {}
    for address, waits_for in steps.items():
        artifact = graph.get(address)
        log = log_path(dist, artifact)
        if decided[address] is None:
            os.makedirs(os.path.dirname(log), exist_ok=True)
            with open(log, "w"):
                pass  # a training's output as it runs; another step's error if it fails
        step = PlannedStep(
            address, artifact.kind, artifact.ref, log, decided[address], batch_of.get(address),
            artifact.in_store,
        )
        inputs = tuple(pipeline[a] for a in waits_for)
        pipeline[address] = PipelineStep(step, inputs, slots)
    return pipeline


def _outcome_line(ref: str, outcome: StepOutcome, log: Optional[str]) -> str:
    took = f" in {outcome.seconds:.1f}s" if outcome.seconds else ""
    detail = f": {outcome.detail}" if outcome.detail else ""
    where = f" (log: {log})" if log and outcome.status == FAILED else ""
    return f"kiln: {outcome.status.lower():<10} {ref}{took}{detail}{where}"


def _summary(console: Console, graph: ArtifactGraph, outcomes: dict[Address, StepOutcome]) -> int:
    """A line per step, as `pants test` ends (the caches served whole counted in one), then the
    count of failed steps: the exit code."""
    console.print_stderr("")
    for line in summary_lines(graph, outcomes):
        console.print_stderr(line)
    failed = [o for o in outcomes.values() if o.failed]
    if not failed:
        console.print_stderr(f"{len(outcomes)} step(s) built or served.")
        return 0
    dependents = sum(1 for o in failed if o.status == DEP_FAILED)
    console.print_stderr(
        f"{len(failed)} step(s) failed ({len(failed) - dependents} {FAILED}, "
        f"{dependents} {DEP_FAILED}); the others were built or served."
    )
    return 1


def summary_lines(graph: ArtifactGraph, outcomes: dict[Address, StepOutcome]) -> list[str]:
    """A line per step that ran, failed or is served but a cache; one for the served caches."""
    lines = []
    served_caches = 0
    for artifact in graph:
        outcome = outcomes.get(artifact.address)
        if outcome is None:
            continue
        if _served_cache(artifact.kind, outcome):
            served_caches += 1
        else:
            lines.append(f"{outcome.status:<11} {artifact.ref:<48} {artifact.address}")
    if served_caches:
        lines.append(
            f"{SERVED:<11} {served_caches} cache(s), built before (the store, or Pants' cache)"
        )
    return lines


def rules():
    return [*collect_rules(), *build_steps.rules()]
