"""`pants plan <targets>`: Marin's dry run.

Lists every artifact in the transitive closure, inputs first, with its fingerprint, its output
path `{prefix}/{name}/{version}` and what `pants run` would do with it. Reads the artifact store;
builds nothing.
"""

from __future__ import annotations

from pants.base.build_root import BuildRoot
from pants.engine.addresses import Addresses
from pants.engine.console import Console
from pants.engine.fs import Workspace
from pants.engine.goal import Goal, GoalSubsystem
from pants.engine.rules import Get, collect_rules, goal_rule

from kiln_pants.artifact_graph import ArtifactGraph, ArtifactGraphRequest
from kiln_pants.artifact_store import artifact_path, stored_state
from kiln_pants.subsystem import KilnSubsystem


class PlanSubsystem(GoalSubsystem):
    name = "plan"
    help = "Show the artifacts a target needs, their fingerprints, paths, and what would run."


class Plan(Goal):
    subsystem_cls = PlanSubsystem
    environment_behavior = Goal.EnvironmentBehavior.LOCAL_ONLY


@goal_rule
async def plan(
    console: Console,
    addresses: Addresses,
    kiln: KilnSubsystem,
    build_root: BuildRoot,
    workspace: Workspace,  # marks the goal as side-effecting: it reads the artifact store
) -> Plan:
    graph = await Get(ArtifactGraph, ArtifactGraphRequest(addresses))
    prefix = kiln.prefix_path(build_root.path)
    console.print_stdout(f"Artifact store: {prefix}")
    counts: dict[str, int] = {}
    for artifact in graph:
        state = stored_state(prefix, artifact)
        counts[state.status] = counts.get(state.status, 0) + 1
        console.print_stdout(
            f"  {state.status:<11} {artifact.fingerprint}  {artifact.kind:<15} "
            f"{artifact.ref:<48} {artifact.address}"
        )
        console.print_stdout(f"  {'':<11} {'':<16}  -> {artifact_path(prefix, artifact)}")
        if state.detail:
            console.print_stdout(f"  {'':<11} {'':<16}  !! {state.detail}")
    summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    console.print_stdout(f"{len(graph)} artifacts: {summary}")
    return Plan(exit_code=1 if counts.get("drift") else 0)


def rules():
    return collect_rules()
