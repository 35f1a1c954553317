"""`pants build <targets>`: many artifacts and their inputs into the artifact store, Marin's
`StepRunner().run([...])`.

Each artifact in the closure is a step, run in dependency order. Caches build as cached Pants
processes and exports as per-session processes, as many at once as Pants' process parallelism
allows; checkpoints train with the same runner as `pants run` (`kiln.runner`), as a process whose
output goes to a log file, `[build] trainings_at_once` of them at a time (default 1: a training
step takes the whole machine). An artifact already built (STATUS SUCCESS, same fingerprint) is
served, and nothing below it is built. A step that fails does not stop the others: its
dependents are reported DEP_FAILED (and so marked in their folder's STATUS in a local store),
independent steps go on, and the goal ends with "N step(s) failed" and exit 1 (as `pants test`
reports each test and fails at the end).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from typing import Optional

from pants.base.build_root import BuildRoot
from pants.core.goals.package import BuiltPackage
from pants.core.util_rules.distdir import DistDir
from pants.engine.addresses import Address, Addresses
from pants.engine.console import Console
from pants.engine.env_vars import EnvironmentVars, EnvironmentVarsRequest
from pants.engine.fs import Workspace
from pants.engine.goal import Goal, GoalSubsystem
from pants.engine.process import FallibleProcessResult, Process, ProcessCacheScope
from pants.engine.rules import Get, MultiGet, collect_rules, goal_rule, rule
from pants.engine.target import WrappedTarget, WrappedTargetRequest
from pants.option.option_types import IntOption
from pants.util.frozendict import FrozenDict

from kiln_contract.layout import DEP_FAILED
from kiln_pants.artifact_graph import Artifact, ArtifactGraph, ArtifactGraphRequest
from kiln_pants.artifact_store import (
    STORE_ENVIRONMENT,
    BucketRecords,
    BucketRecordsRequest,
    StoredState,
    artifact_path,
    bucket_folders,
    clear_dep_failed,
    mark_dep_failed,
    stored_states,
)
from kiln_pants.hf_model_rules import HfModelPackageFieldSet
from kiln_pants.runtime import RuntimeProcess
from kiln_pants.subsystem import KilnSubsystem
from kiln_pants.target_types import LmCheckpointTarget, ResourcesField, TokenizedCacheTarget
from kiln_pants.tokenize_rules import BuildCacheRequest, BuiltCache
from kiln_pants.train_rules import (
    STEP_FILE,
    AcceleratorsPresent,
    CheckAcceleratorsRequest,
    PreparedStep,
    PrepareStepRequest,
)

logger = logging.getLogger(__name__)

# What a training step gets from the caller's environment besides the store's credentials: the
# tracker's settings and key, the Hub's token. Per-session processes only: never in a cache key.
TRAINING_ENVIRONMENT = (
    *STORE_ENVIRONMENT,
    "WANDB_API_KEY", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_MODE", "WANDB_BASE_URL",
    "HF_TOKEN", "HF_HOME", "RAY_ADDRESS",
)  # fmt: skip

# Runs the runner with its output in the step's log file (Pants processes get no PATH: builtins).
_TO_LOG = 'log="$1"; shift; exec "$@" >"$log" 2>&1'

SUCCESS, SERVED, FAILED = "SUCCESS", "SERVED", "FAILED"


class BuildSubsystem(GoalSubsystem):
    name = "build"
    help = (
        "Build artifacts and everything they need into the artifact store, independent steps "
        "at once; a failed step's dependents are DEP_FAILED and the others go on."
    )

    trainings_at_once = IntOption(
        default=1,
        help=(
            "How many checkpoints train at the same time. A training step uses every core (XLA) "
            "or every accelerator of the machine, so the default is one; caches and exports "
            "run alongside, bounded by `[GLOBAL] process_execution_local_parallelism`."
        ),
    )


class Build(Goal):
    subsystem_cls = BuildSubsystem
    environment_behavior = Goal.EnvironmentBehavior.LOCAL_ONLY


@dataclass(frozen=True)
class StepOutcome:
    status: str  # SUCCESS | SERVED | FAILED | DEP_FAILED
    detail: str = ""  # one line, for the console
    seconds: float = 0.0
    error: str = ""  # a failure's whole text, for the step's log (the goal writes it)

    @property
    def failed(self) -> bool:
        return self.status in (FAILED, DEP_FAILED)


@dataclass(frozen=True)
class StepRequest:
    address: Address
    kind: str  # the target alias
    log: str  # the step's log file


@dataclass(frozen=True)
class CacheStep:
    address: Address


@dataclass(frozen=True)
class TrainingStep:
    address: Address
    log: str


@dataclass(frozen=True)
class ExportStep:
    address: Address


@rule(desc="Building a step")
async def build_step(request: StepRequest) -> StepOutcome:
    address, log = request.address, request.log
    if request.kind == TokenizedCacheTarget.alias:
        return await Get(StepOutcome, CacheStep(address))
    if request.kind == LmCheckpointTarget.alias:
        return await Get(StepOutcome, TrainingStep(address, log))
    return await Get(StepOutcome, ExportStep(address))


def _failure(text: str, started: float) -> StepOutcome:
    """FAILED, with `text` for the step's log and its last error line for the console."""
    return StepOutcome(FAILED, _last_error(text), time.monotonic() - started, text)


def _last_error(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["no output"])[-1][:300]


@rule(desc="Building a cache step")
async def build_cache_step(step: CacheStep) -> StepOutcome:
    started = time.monotonic()
    try:
        await Get(BuiltCache, BuildCacheRequest(step.address))
    except Exception as e:  # noqa: BLE001 - reported as this step's failure; others go on
        return _failure(str(e), started)
    return StepOutcome(SUCCESS, seconds=time.monotonic() - started)


@rule(desc="Building an export step")
async def build_export_step(step: ExportStep) -> StepOutcome:
    started = time.monotonic()
    try:
        wrapped = await Get(
            WrappedTarget, WrappedTargetRequest(step.address, description_of_origin="<kiln build>")
        )
        await Get(BuiltPackage, HfModelPackageFieldSet, HfModelPackageFieldSet.create(wrapped.target))
    except Exception as e:  # noqa: BLE001 - reported as this step's failure; others go on
        return _failure(str(e), started)
    return StepOutcome(SUCCESS, seconds=time.monotonic() - started)


@rule(desc="Building a training step")
async def build_training_step(
    step: TrainingStep, kiln: KilnSubsystem, build_root: BuildRoot
) -> StepOutcome:
    """The runner as `pants run` starts it, but as a per-session process logging to a file."""
    started = time.monotonic()
    try:
        wrapped = await Get(
            WrappedTarget, WrappedTargetRequest(step.address, description_of_origin="<kiln build>")
        )
        if not kiln.cluster:  # a cluster run's accelerators are on the cluster's hosts
            await Get(
                AcceleratorsPresent,
                CheckAcceleratorsRequest(step.address, wrapped.target[ResourcesField].value),
            )
        prepared = await Get(PreparedStep, PrepareStepRequest(step.address))
    except Exception as e:  # noqa: BLE001 - reported as this step's failure; others go on
        return _failure(str(e), started)
    environment = await Get(EnvironmentVars, EnvironmentVarsRequest(TRAINING_ENVIRONMENT))
    process = await Get(
        Process,
        RuntimeProcess(
            prepared.runtime,
            argv=(
                STEP_FILE,
                "--inputs",
                ".",
                "--prefix",
                kiln.prefix_location(build_root.path),
                *(("--cluster", kiln.cluster) if kiln.cluster else ()),
            ),
            description=f"Training {prepared.artifact.ref} (log: {step.log})",
            input_digest=prepared.digest,
            output_directories=(),
            # The store is the cache: the runner serves a built artifact itself.
            cache_scope=ProcessCacheScope.PER_SESSION,
            env=FrozenDict(environment),
        ),
    )
    result = await Get(
        FallibleProcessResult,
        Process,
        replace(process, argv=("/bin/sh", "-c", _TO_LOG, "kiln-build", step.log, *process.argv)),
    )
    seconds = time.monotonic() - started
    if result.exit_code != 0:
        with open(step.log) as f:
            detail = _last_error(f.read())
        return StepOutcome(FAILED, f"exit {result.exit_code}: {detail}", seconds)
    return StepOutcome(SUCCESS, seconds=seconds)


def steps_to_build(
    roots: list[Artifact], graph: ArtifactGraph, states: dict[Address, StoredState]
) -> list[list[Artifact]]:
    """The steps the roots need, in levels: each step after every input it needs. An artifact
    already built is served and its inputs are not needed for it (caches always build: they
    are Pants' cache hits, and the steps above them take their files)."""
    needed: set[Address] = set()
    pending = list(roots)
    while pending:
        artifact = pending.pop()
        if artifact.address in needed:
            continue
        needed.add(artifact.address)
        if not _served(artifact, states):
            pending.extend(graph.get(address) for address in artifact.inputs)
    level: dict[Address, int] = {}
    for artifact in graph:  # inputs first
        if artifact.address in needed:
            waits_for = () if _served(artifact, states) else artifact.inputs
            level[artifact.address] = 1 + max((level[a] for a in waits_for), default=-1)
    levels: list[list[Artifact]] = [[] for _ in range(1 + max(level.values(), default=-1))]
    for artifact in graph:
        if artifact.address in level:
            levels[level[artifact.address]].append(artifact)
    return levels


def _served(artifact: Artifact, states: dict[Address, StoredState]) -> bool:
    return artifact.kind != TokenizedCacheTarget.alias and states[artifact.address].status == "built"


def _log_path(dist: str, artifact: Artifact) -> str:
    return os.path.join(dist, "logs", artifact.name, f"{artifact.version}.log")


def _batches(steps: list[Artifact], trainings_at_once: int) -> list[list[Artifact]]:
    """Caches and exports all in the first batch; trainings `trainings_at_once` per batch."""
    trainings = [a for a in steps if a.kind == LmCheckpointTarget.alias]
    others = [a for a in steps if a.kind != LmCheckpointTarget.alias]
    size = max(1, trainings_at_once)
    batches = [trainings[i : i + size] for i in range(0, len(trainings), size)] or [[]]
    batches[0] = others + batches[0]
    return [batch for batch in batches if batch]


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
    graph = await Get(ArtifactGraph, ArtifactGraphRequest(addresses))
    requested = set(addresses)
    roots = [a for a in graph if a.address in requested]
    if not roots:
        console.print_stderr("No artifact targets (tokenized_cache, lm_checkpoint, hf_model) given.")
        return Build(exit_code=0)
    prefix = kiln.prefix_location(build_root.path)
    records = (
        await Get(BucketRecords, BucketRecordsRequest(prefix, bucket_folders(graph)))
        if "://" in prefix
        else None
    )
    states = {a.address: state for a, state in stored_states(graph, prefix, records).items()}
    levels = steps_to_build(roots, graph, states)
    total = sum(len(level) for level in levels)
    console.print_stderr(f"Building {total} step(s) into {prefix}")
    dist = os.path.join(build_root.path, distdir.relpath)
    outcomes: dict[Address, StepOutcome] = {}
    for level in levels:
        runnable = []
        for artifact in level:
            decided = _decide(artifact, states[artifact.address], outcomes, graph, prefix)
            if decided is None:
                runnable.append(artifact)
            else:
                outcomes[artifact.address] = decided
                _report(console, artifact, decided, None)
        for batch in _batches(runnable, subsystem.trainings_at_once):
            for artifact in batch:
                _start(console, artifact, prefix, _log_path(dist, artifact))
            results = await MultiGet(
                Get(StepOutcome, StepRequest(a.address, a.kind, _log_path(dist, a))) for a in batch
            )
            for artifact, outcome in zip(batch, results):
                outcomes[artifact.address] = outcome
                if outcome.error:
                    with open(_log_path(dist, artifact), "w") as f:
                        f.write(outcome.error.rstrip() + "\n")
                _report(console, artifact, outcome, _log_path(dist, artifact))
    return Build(exit_code=_summary(console, graph, outcomes))


def _decide(
    artifact: Artifact,
    state: StoredState,
    outcomes: dict[Address, StepOutcome],
    graph: ArtifactGraph,
    prefix: str,
) -> Optional[StepOutcome]:
    """The outcome of a step that does not run: served, drifted, or an input failed (then
    marked DEP_FAILED in a local store). None: it runs."""
    if _served(artifact, {artifact.address: state}):
        return StepOutcome(SERVED, "already built")
    if state.status == "drift":
        return StepOutcome(FAILED, f"{state.detail}; bump `version` to build a new artifact")
    failed = [address for address in artifact.inputs if outcomes[address].failed]
    if failed:
        names = ", ".join(graph.get(address).ref for address in failed)
        why = f"input {names} failed in the last `pants build`"
        recorded = "://" not in prefix and mark_dep_failed(prefix, artifact, why)
        where = f"; STATUS {DEP_FAILED} in {artifact_path(prefix, artifact)}" if recorded else ""
        return StepOutcome(DEP_FAILED, f"input {names} failed{where}")
    return None


def _start(console: Console, artifact: Artifact, prefix: str, log: str) -> None:
    if "://" not in prefix:
        clear_dep_failed(prefix, artifact)  # this run decides again
    os.makedirs(os.path.dirname(log), exist_ok=True)
    with open(log, "w"):
        pass  # a training step's output as it runs; another step's error if it fails
    # Caches and exports are Pants processes: Pants shows them as they run.
    live = f"; log: {log}" if artifact.kind == LmCheckpointTarget.alias else ""
    console.print_stderr(f"kiln: start      {artifact.ref} ({artifact.address}){live}")


def _report(
    console: Console, artifact: Artifact, outcome: StepOutcome, log: Optional[str]
) -> None:
    took = f" in {outcome.seconds:.1f}s" if outcome.seconds else ""
    detail = f": {outcome.detail}" if outcome.detail else ""
    where = f" (log: {log})" if log and outcome.status == FAILED else ""
    console.print_stderr(
        f"kiln: {outcome.status.lower():<10} {artifact.ref}{took}{detail}{where}"
    )


def _summary(console: Console, graph: ArtifactGraph, outcomes: dict[Address, StepOutcome]) -> int:
    """A line per step, as `pants test` ends, then the count of failed steps: the exit code."""
    console.print_stderr("")
    for artifact in graph:
        if artifact.address in outcomes:
            outcome = outcomes[artifact.address]
            console.print_stderr(f"{outcome.status:<11} {artifact.ref:<48} {artifact.address}")
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


def rules():
    return collect_rules()
