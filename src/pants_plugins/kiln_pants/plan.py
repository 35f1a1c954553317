"""`pants plan <targets>`: Marin's dry run.

Lists every artifact in the transitive closure, inputs first, with its fingerprint, its output
path `{prefix}/{name}/{version}`, what `pants run` would do with it and, for an unbuilt cache,
what building it takes (kiln_pants.cache_estimate) and its shard plan (kiln_pants.shard_plan);
then, for each checkpoint, the tokens its run reads from each mixture component against what that
cache holds (kiln_pants.mixture_budget), and what its training costs: parameters, tokens, FLOPs,
device-hours from measured throughput and wall time (kiln_pants.training_cost), with a total over
the runs; with `--fit`, whether each training's step fits its TPU slice, compiled for it here
(kiln_pants.fit_check).
Reads the artifact store (kiln_pants.artifact_store: a bucket by one process); builds nothing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Optional

from pants.base.build_root import BuildRoot
from pants.engine.addresses import Addresses
from pants.engine.console import Console
from pants.engine.fs import Workspace
from pants.engine.goal import Goal, GoalSubsystem
from pants.engine.rules import Get, MultiGet, collect_rules, goal_rule
from pants.engine.target import Target, WrappedTarget, WrappedTargetRequest
from pants.option.global_options import GlobalOptions
from pants.option.option_types import BoolOption, IntOption, StrOption

from kiln_contract.hf_llama import NotPlainLlama, config_fields, kiln_run_advice
from kiln_contract.layout import RECORD_FILE
from kiln_contract.llama import weights_differences
from kiln_contract.train import HfModelSource
from kiln_pants.artifact_graph import (
    Artifact,
    ArtifactGraph,
    ArtifactGraphRequest,
    engine_message,
)
from kiln_pants.artifact_store import (
    StoredState,
    artifact_path,
    stored_states_or_report,
)
from kiln_pants.cache_estimate import CacheEstimate, estimate_cache
from kiln_pants.fit_check import FitCheck, FitCheckRequest, fit_target
from kiln_pants.mixture_budget import local_budgets
from kiln_pants.shard_plan import ShardPlan, ShardPlans, ShardPlansRequest
from kiln_pants.subsystem import KilnSubsystem
from kiln_pants.target_types import InitFromField, ModelField, ResourcesField
from kiln_pants.training_cost import (
    FLOPS_FORMULA,
    RunCost,
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
    json = BoolOption(
        default=False,
        help="Print the plan as one JSON object for scripts and CI: the store, per artifact "
        "(inputs first) its address, kind, name@version, fingerprint, path, state and why (and "
        "an unbuilt cache's estimate), and each training's data and cost; the exit code is the "
        "text plan's.",
    )
    fit = BoolOption(
        default=False,
        help="Also compile each training's step for its TPU slice, ahead of time and without "
        "a TPU (libtpu's mock devices), and print per chip its parameters and optimizer state, "
        "temporaries, peak, the chip's HBM, whether it fits and the compile time; when it does "
        "not fit, the cheapest remedy that does (more microbatches, remat, mesh splits) with "
        "the BUILD fields to change. Cached per step and slice. Exit code 1 when one does not "
        "fit (docs/fitting.md).",
    )
    fit_target = StrOption(
        default=None,
        help="With --fit: compile every training for this TPU slice (`v4-128`, `v5litepod-16`, "
        "`v5e-16`) or libtpu topology (`v5e:2x2`) instead of its own `resources`; the way to "
        "check a gpu(...) training on a slice.",
    )
    fit_variants = IntOption(
        default=6,
        help="With --fit: when a step does not fit, compile up to this many remedies, cheapest "
        "first, until one fits (0: none).",
    )


class Plan(Goal):
    subsystem_cls = PlanSubsystem
    environment_behavior = Goal.EnvironmentBehavior.LOCAL_ONLY


async def _init_from_problems(graph: ArtifactGraph) -> list[str]:
    checkpoints = [a for a in graph if a.kind == "lm_checkpoint"]
    targets = await MultiGet(
        Get(WrappedTarget, WrappedTargetRequest(c.address, description_of_origin="<kiln plan>"))
        for c in checkpoints
    )
    return [p for t in targets if (p := init_from_problem(t.target)) is not None]


async def _training_costs(graph: ArtifactGraph, prefix: str) -> list[RunCost]:
    """Each checkpoint's parameters, tokens, FLOPs and device-hours."""
    checkpoints = [a for a in graph if a.kind == "lm_checkpoint"]
    caches = [graph.get(c.inputs[0]) for c in checkpoints]  # the vocabulary of the mixture
    targets = await MultiGet(
        Get(WrappedTarget, WrappedTargetRequest(c.address, description_of_origin="<kiln plan>"))
        for c in checkpoints
    )
    vocabularies = await MultiGet(
        Get(Vocabulary, VocabularyRequest(cache.address)) for cache in caches
    )
    return [
        run_cost(checkpoint, target.target[ResourcesField].value,
                 stored_vocabulary(prefix, cache) or vocabulary.size)
        for checkpoint, cache, target, vocabulary in zip(checkpoints, caches, targets, vocabularies)
    ]  # fmt: skip


def _print_training_costs(console: Console, costs: list[RunCost], prices: dict[str, float]) -> None:
    """Each checkpoint's cost, then their total."""
    if not costs:
        return
    console.print_stdout(f"Training cost ({FLOPS_FORMULA}):")
    for cost in costs:
        for line in cost.describe(prices):
            console.print_stdout(f"  {line}")
    if len(costs) > 1:
        for line in total_lines(costs, prices):
            console.print_stdout(line)


@dataclass(frozen=True)
class FitOutcome:
    """A training's fit check: its report, or why it was not (or could not be) checked."""

    cost: RunCost
    target: Optional[str]
    check: Optional[FitCheck]
    skipped: str = ""

    @property
    def refused(self) -> bool:
        """A step that does not fit its slice, or could not be checked for it."""
        return self.check is not None and (bool(self.check.error) or not self.check.fits)

    def to_json(self) -> dict[str, Any]:
        """kiln.fit's report (docs/fitting.md), or why there is none."""
        if self.check is None:
            return {"skipped": self.skipped}
        if self.check.error:
            return {"target": {"slice": self.target}, "error": self.check.error}
        return self.check.data() or {}

    def lines(self) -> list[str]:
        ref = self.cost.checkpoint.ref
        if self.check is None:
            return [f"{ref}: not checked: {self.skipped}"]
        if self.check.error:
            return [f"{ref} on {self.target}: could not check: {self.check.error}"]
        return self.check.table.splitlines()


async def _fit_checks(costs: list[RunCost], plan_subsystem: PlanSubsystem) -> list[FitOutcome]:
    """Each training's step compiled for its slice (kiln_pants.fit_check), at once."""
    outcomes = []
    for cost in costs:
        target, why = fit_target(cost.resources, plan_subsystem.fit_target)
        if target is not None and cost.vocab_size is None:
            target, why = None, "its tokenizer's vocabulary is not known until its caches are built"
        outcomes.append(FitOutcome(cost, target, None, why))
    wanted = [o for o in outcomes if o.target is not None]
    checks = await MultiGet(
        Get(
            FitCheck,
            FitCheckRequest(
                o.cost.checkpoint.address, o.target or "", o.cost.vocab_size or 0,
                plan_subsystem.fit_variants,
            ),
        )
        for o in wanted
    )  # fmt: skip
    answers = iter(checks)
    return [replace(o, check=next(answers)) if o.target is not None else o for o in outcomes]


def _print_fit_checks(console: Console, outcomes: list[FitOutcome]) -> None:
    if not outcomes:
        return
    console.print_stdout(
        "Fit on the slice (each step compiled ahead of time for its TPU slice's mock devices; "
        "GiB a chip):"
    )
    for outcome in outcomes:
        for line in outcome.lines():
            console.print_stdout(f"  {line}")


def init_from_problem(target: Target) -> Optional[str]:
    """Why a checkpoint cannot start from the local folder its `init_from` names (unreadable,
    not a plain Llama, or another architecture than `model`), as one line; None when it fits
    or is not a local folder (a hub model is checked when the run downloads it; a run of the
    graph, when the graph is built)."""
    source = target[InitFromField].value
    if not isinstance(source, HfModelSource) or not source.is_local:
        return None
    where = f"The `init_from` field in target {target.address}"
    advice = _kiln_run_advice(source.model)
    if advice is not None:
        return f"{where}: {advice}"
    path = os.path.join(source.model, "config.json")
    try:
        with open(path) as f:
            fields = config_fields(json.load(f), source=path)
    except OSError as e:
        return f"{where}: cannot read {path} ({e.strerror}): give a transformers Llama folder"
    except (ValueError, NotPlainLlama) as e:
        return f"{where}: {e}"
    differing = weights_differences(target[ModelField].value.to_json(), fields)
    if differing:
        return (
            f"{where}: {source.model} is not the architecture `model` declares "
            f"({'; '.join(differing)}): make `model=llama(...)` match the weights"
        )
    return None


INLINE = StoredState("inline")


def shown_state(artifact: Artifact, state: StoredState) -> StoredState:
    """An inline cache that no run has placed in the store lives in Pants' cache, where `plan`
    cannot look without running its processes: `inline`, not `would run`."""
    if not artifact.in_store and state.status == "would run" and not state.detail:
        return INLINE
    return state


def shown_path(prefix: str, artifact: Artifact, state: StoredState) -> str:
    path = artifact_path(prefix, artifact)
    imported_from = imported_location(artifact)
    if state is INLINE and imported_from is not None:
        return (
            f"Pants' cache: its import process writes Kiln's records, its tokens stay at "
            f"{imported_from}; a run that reads it places the records at {path}"
        )
    if state is INLINE:
        return (
            "Pants' cache: its processes build it when a step needs it (cache hits once they "
            f"have run); a run that reads it places it at {path}"
        )
    if imported_from is not None:
        return f"{path} (its tokens read in place at {imported_from})"
    return path


def imported_location(artifact: Artifact) -> Optional[str]:
    """Where an imported cache's tokens live (a `levanter_cache` source); None for others."""
    source = artifact.identity.get("source") if artifact.kind == "tokenized_cache" else None
    return source["location"] if source and source.get("kind") == "levanter_cache" else None


def planned_estimate(
    artifact: Artifact, shards: ShardPlan, vocabulary: Optional[int], build_root: str,
    parallelism: int,
) -> CacheEstimate:
    """What building an unbuilt cache takes, its shards run up to `parallelism` at once (Pants'
    local process limit); a cache whose shards are not known yet may use them all."""
    if shards.imported_from is not None:
        return CacheEstimate(
            shards.imported_tokens,
            "its shard_ledger.json",
            vocabulary,
            imported_from=shards.imported_from,
            imported_dtype=shards.imported_dtype,
        )
    at_once = min(len(shards.shards) or parallelism, parallelism)
    return replace(estimate_cache(artifact, build_root), vocabulary=vocabulary, processes=at_once)


def plan_json(
    prefix: str,
    states: Mapping[Artifact, StoredState],
    problems: list[str],
    estimates: Mapping[Artifact, CacheEstimate],
) -> dict[str, Any]:
    """The plan for scripts: what `plan` prints about each artifact, as data."""
    return {
        "store": prefix,
        "artifacts": [
            {
                "address": str(artifact.address),
                "kind": artifact.kind,
                "ref": artifact.ref,
                "fingerprint": artifact.fingerprint,
                "path": artifact_path(prefix, artifact),
                "state": state.status,
                "detail": state.detail or None,
                "inputs": [str(a) for a in artifact.inputs],
                "estimate": estimates[artifact].to_json() if artifact in estimates else None,
            }
            for artifact, state in states.items()
        ],
        "problems": problems,
    }


def _kiln_run_advice(folder: str) -> Optional[str]:
    try:
        with open(os.path.join(folder, RECORD_FILE)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return kiln_run_advice(folder, record) if isinstance(record, dict) else None


@goal_rule
async def plan(
    console: Console,
    addresses: Addresses,
    kiln: KilnSubsystem,
    plan_subsystem: PlanSubsystem,
    build_root: BuildRoot,
    global_options: GlobalOptions,
    workspace: Workspace,  # marks the goal as side-effecting: it reads the artifact store
) -> Plan:
    try:  # a bad `[kiln] prefix` fails before the graph is computed or the store read
        prefix = kiln.prefix_location(build_root.path)
    except ValueError as e:
        if plan_subsystem.json:
            console.print_stdout(json.dumps({"error": str(e)}, indent=2))
        else:
            console.print_stderr(f"kiln: error: {e}")
        return Plan(exit_code=1)
    try:
        graph = await Get(ArtifactGraph, ArtifactGraphRequest(addresses))
    except Exception as e:  # noqa: BLE001 - a graph that cannot be read: for scripts, as JSON
        if not plan_subsystem.json:
            raise
        console.print_stdout(json.dumps({"error": engine_message(e)}, indent=2))
        return Plan(exit_code=1)
    counts: dict[str, int] = {}
    stored = await stored_states_or_report(console, prefix, graph)
    if stored is None:
        return Plan(exit_code=1)
    states = {artifact: shown_state(artifact, state) for artifact, state in stored.items()}
    unbuilt = [a for a, s in states.items() if a.kind == "tokenized_cache" and s.status != "built"]
    planned = await Get(ShardPlans, ShardPlansRequest(tuple(a.address for a in unbuilt)))
    shard_plan = dict(zip(unbuilt, planned.plans))
    vocabularies = await MultiGet(Get(Vocabulary, VocabularyRequest(a.address)) for a in unbuilt)
    parallelism = global_options.process_execution_local_parallelism
    estimates = {
        a: planned_estimate(a, shard_plan[a], v.size, build_root.path, parallelism)
        for a, v in zip(unbuilt, vocabularies)
    }
    if plan_subsystem.json:
        problems = await _init_from_problems(graph)
        budgets = local_budgets(prefix, graph, build_root.path)
        costs = await _training_costs(graph, prefix)
        data = plan_json(prefix, states, problems, estimates)
        data["training"] = [
            {**budget.to_json(), "cost": cost.to_json(kiln.price_per_device_hour)}
            for budget, cost in zip(budgets, costs)
        ]
        fits = await _fit_checks(costs, plan_subsystem) if plan_subsystem.fit else []
        for training, outcome in zip(data["training"], fits):
            training["fit"] = outcome.to_json()
        console.print_stdout(json.dumps(data, indent=2))
        drift = any(state.status == "drift" for state in states.values())
        refused = any(budget.refusal() for budget in budgets)
        refused = refused or any(outcome.refused for outcome in fits)
        return Plan(exit_code=1 if drift or problems or refused else 0)
    console.print_stdout(f"Artifact store: {prefix}")
    for artifact, state in states.items():
        counts[state.status] = counts.get(state.status, 0) + 1
        console.print_stdout(
            f"  {state.status:<11} {artifact.fingerprint}  {artifact.kind:<15} "
            f"{artifact.ref:<48} {artifact.address}"
        )
        console.print_stdout(f"  {'':<11} {'':<16}  -> {shown_path(prefix, artifact, state)}")
        if state.detail:
            console.print_stdout(f"  {'':<11} {'':<16}  !! {state.detail}")
        if artifact in estimates:
            console.print_stdout(f"  {'':<11} {'':<16}  {estimates[artifact].describe()}")
            for line in shard_plan[artifact].describe(plan_subsystem.shards):
                console.print_stdout(f"  {'':<11} {'':<16}  {line}")
    summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    console.print_stdout(f"{len(graph)} artifacts: {summary}")
    too_small = False
    imports = {a.ref: p.imported_tokens for a, p in shard_plan.items() if p.imported_tokens}
    for budget in local_budgets(prefix, graph, build_root.path, imports):  # a bucket's: unbuilt
        console.print_stdout(budget.header())
        for component in budget.components:
            console.print_stdout(f"  {component.describe()}")
        too_small = too_small or budget.refusal() is not None
    refused = any(p.refused is not None for p in planned.plans)  # an import that cannot be made
    for problem in await _init_from_problems(graph):
        console.print_stdout(f"!! {problem}")
        refused = True
    costs = await _training_costs(graph, prefix)
    _print_training_costs(console, costs, kiln.price_per_device_hour)
    if plan_subsystem.fit:
        fits = await _fit_checks(costs, plan_subsystem)
        _print_fit_checks(console, fits)
        refused = refused or any(outcome.refused for outcome in fits)
    return Plan(exit_code=1 if counts.get("drift") or too_small or refused else 0)


def rules():
    return collect_rules()
