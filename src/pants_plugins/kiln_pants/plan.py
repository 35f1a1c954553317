"""`pants plan <targets>`: Marin's dry run.

Lists every artifact in the transitive closure, inputs first, with its fingerprint, its output
path `{prefix}/{name}/{version}`, what `pants run` would do with it and, for an unbuilt cache,
what building it takes (kiln_pants.build_estimate) and its shard plan (kiln_pants.shard_plan);
then, for each checkpoint, the tokens its run reads from each mixture component against what that
cache holds (kiln_pants.mixture_budget), and what its training costs: parameters, tokens, FLOPs,
device-hours from measured throughput (kiln_pants.training_cost), with a total over the runs.
Reads the artifact store; builds nothing. A local store is read directly; a bucket through the
runtime's own store client (`python -m kiln.artifacts.peek`), run as a process that is never
cached beyond this run (PER_SESSION) and gets the bucket's credentials from the caller's
environment.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from pants.base.build_root import BuildRoot
from pants.engine.addresses import Addresses
from pants.engine.console import Console
from pants.engine.env_vars import EnvironmentVars, EnvironmentVarsRequest
from pants.engine.fs import EMPTY_DIGEST, Workspace
from pants.engine.goal import Goal, GoalSubsystem
from pants.engine.process import FallibleProcessResult, Process, ProcessCacheScope
from pants.engine.rules import Get, MultiGet, collect_rules, goal_rule, rule
from pants.engine.target import WrappedTarget, WrappedTargetRequest
from pants.option.option_types import BoolOption
from pants.util.frozendict import FrozenDict

from kiln_contract.layout import RECORD_FILE, STATUS_FILE
from kiln_pants.artifact_graph import Artifact, ArtifactGraph, ArtifactGraphRequest
from kiln_pants.artifact_store import (
    DEV,
    STORE_ENVIRONMENT,
    StoredState,
    artifact_path,
    recorded_state,
    stored_state,
)
from kiln_pants.build_estimate import estimate_build
from kiln_pants.mixture_budget import local_budgets
from kiln_pants.runtime import PEEK, Runtime, RuntimeProcess, RuntimeRequest
from kiln_pants.shard_plan import ShardPlan, ShardPlanRequest
from kiln_pants.subsystem import KilnSubsystem
from kiln_pants.target_types import ResourcesField
from kiln_pants.training_cost import (
    FLOPS_FORMULA,
    Vocabulary,
    VocabularyRequest,
    run_cost,
    stored_vocabulary,
    total_lines,
)


class PlanSubsystem(GoalSubsystem):
    name = "plan"
    help = "Show the artifacts a target needs, their fingerprints, paths, and what would run."

    shards = BoolOption(
        default=False,
        help="List every shard of each unbuilt cache with the files it reads and their bytes "
        "(by default: a summary line and the first shards).",
    )


class Plan(Goal):
    subsystem_cls = PlanSubsystem
    environment_behavior = Goal.EnvironmentBehavior.LOCAL_ONLY


class BucketUnreadable(Exception):
    pass


@dataclass(frozen=True)
class BucketRecordsRequest:
    prefix: str  # s3://... or gs://...
    folders: tuple[str, ...]  # name/version


@dataclass(frozen=True)
class BucketRecords:
    texts: FrozenDict[str, FrozenDict[str, Optional[str]]]  # folder -> file -> text or None


@rule(desc="Reading artifact records from a bucket")
async def read_bucket_records(request: BucketRecordsRequest) -> BucketRecords:
    runtime, environment = await Get(Runtime, RuntimeRequest(*PEEK)), await Get(
        EnvironmentVars, EnvironmentVarsRequest(STORE_ENVIRONMENT)
    )
    process = await Get(
        Process,
        RuntimeProcess(
            runtime,
            argv=(request.prefix, *request.folders),
            description=f"Reading {len(request.folders)} artifact records from {request.prefix}",
            input_digest=EMPTY_DIGEST,
            output_directories=(),
            cache_scope=ProcessCacheScope.PER_SESSION,  # the bucket changes behind Pants' back
            env=FrozenDict(environment),
        ),
    )
    result = await Get(FallibleProcessResult, Process, process)
    if result.exit_code != 0:
        lines = result.stderr.decode(errors="replace").strip().splitlines()
        why = lines[-1].removeprefix("error: ") if lines else f"exit {result.exit_code}"
        raise BucketUnreadable(f"cannot read the artifact store: {why}")  # why names the URL
    texts = json.loads(result.stdout)
    return BucketRecords(FrozenDict({k: FrozenDict(v) for k, v in texts.items()}))


def bucket_folders(graph: ArtifactGraph) -> tuple[str, ...]:
    """The folders to read from a bucket: those of the graph's immutable artifacts."""
    return tuple(f"{a.name}/{a.version}" for a in graph if not a.mutable)


def stored_states(
    graph: ArtifactGraph, prefix: str, records: Optional[BucketRecords]
) -> dict[Artifact, StoredState]:
    """What the store holds for each artifact: a bucket's `records` (read through the runtime's
    store client), else the local store, read directly. Called from goal rules, which run every
    time: a rule's result would be kept by pantsd while the store changes behind it."""
    if records is not None:
        return {a: _bucket_state(a, records) for a in graph}
    return {a: stored_state(prefix, a) for a in graph}


def _bucket_state(artifact: Artifact, records: BucketRecords) -> StoredState:
    if artifact.mutable:
        return DEV
    texts = records.texts[f"{artifact.name}/{artifact.version}"]
    return recorded_state(artifact, texts[STATUS_FILE], texts[RECORD_FILE])


async def _print_training_costs(
    console: Console, graph: ArtifactGraph, prefix: str, prices: dict[str, float]
) -> None:
    """Each checkpoint's parameters, tokens, FLOPs and device-hours, then their total."""
    checkpoints = [a for a in graph if a.kind == "lm_checkpoint"]
    if not checkpoints:
        return
    caches = [graph.get(c.inputs[0]) for c in checkpoints]  # the vocabulary of the mixture
    targets = await MultiGet(
        Get(WrappedTarget, WrappedTargetRequest(c.address, description_of_origin="<kiln plan>"))
        for c in checkpoints
    )
    vocabularies = await MultiGet(
        Get(Vocabulary, VocabularyRequest(cache.address)) for cache in caches
    )
    console.print_stdout(f"Training cost ({FLOPS_FORMULA}):")
    costs = []
    for checkpoint, cache, target, vocabulary in zip(checkpoints, caches, targets, vocabularies):
        size = stored_vocabulary(prefix, cache) or vocabulary.size
        costs.append(run_cost(checkpoint, target.target[ResourcesField].value, size))
        for line in costs[-1].describe(prices):
            console.print_stdout(f"  {line}")
    if len(costs) > 1:
        for line in total_lines(costs, prices):
            console.print_stdout(line)


@goal_rule
async def plan(
    console: Console,
    addresses: Addresses,
    kiln: KilnSubsystem,
    plan_subsystem: PlanSubsystem,
    build_root: BuildRoot,
    workspace: Workspace,  # marks the goal as side-effecting: it reads the artifact store
) -> Plan:
    graph = await Get(ArtifactGraph, ArtifactGraphRequest(addresses))
    prefix = kiln.prefix_location(build_root.path)
    console.print_stdout(f"Artifact store: {prefix}")
    counts: dict[str, int] = {}
    records = (
        await Get(BucketRecords, BucketRecordsRequest(prefix, bucket_folders(graph)))
        if "://" in prefix
        else None
    )
    states = stored_states(graph, prefix, records)
    unbuilt = [a for a, s in states.items() if a.kind == "tokenized_cache" and s.status != "built"]
    shard_plans = await MultiGet(Get(ShardPlan, ShardPlanRequest(a.address)) for a in unbuilt)
    shard_plan = dict(zip(unbuilt, shard_plans))
    for artifact, state in states.items():
        counts[state.status] = counts.get(state.status, 0) + 1
        console.print_stdout(
            f"  {state.status:<11} {artifact.fingerprint}  {artifact.kind:<15} "
            f"{artifact.ref:<48} {artifact.address}"
        )
        console.print_stdout(f"  {'':<11} {'':<16}  -> {artifact_path(prefix, artifact)}")
        if state.detail:
            console.print_stdout(f"  {'':<11} {'':<16}  !! {state.detail}")
        if artifact.kind == "tokenized_cache" and state.status != "built":
            estimate = estimate_build(artifact, build_root.path)
            console.print_stdout(f"  {'':<11} {'':<16}  {estimate.describe()}")
            for line in shard_plan[artifact].describe(plan_subsystem.shards):
                console.print_stdout(f"  {'':<11} {'':<16}  {line}")
    summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    console.print_stdout(f"{len(graph)} artifacts: {summary}")
    too_small = False
    for budget in local_budgets(prefix, graph):  # a bucket's caches count as not built
        console.print_stdout(budget.header())
        for component in budget.components:
            console.print_stdout(f"  {component.describe()}")
        too_small = too_small or budget.refusal() is not None
    await _print_training_costs(console, graph, prefix, kiln.price_per_device_hour)
    return Plan(exit_code=1 if counts.get("drift") or too_small else 0)


def rules():
    return collect_rules()
