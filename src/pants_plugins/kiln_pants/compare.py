"""`pants compare <targets>`: the runs of checkpoints side by side, e.g. a sweep's, and
evaluations (`lm_eval_run`) beside them.

Runs `python -m kiln.report compare` (kiln.report.compare) on the checkpoints' folders in the
local artifact store, as a process that is never cached beyond this run (the store changes
behind Pants' back), given each run's name and identity so that a run not built yet keeps its
row. Prints the table and writes `dist/compare/NAME/compare.csv`, `compare.png` and the runs'
loss curves, `curves.png`.
"""

from __future__ import annotations

import json
import os

from pants.base.build_root import BuildRoot
from pants.core.util_rules.distdir import DistDir
from pants.engine.addresses import Addresses
from pants.engine.console import Console
from pants.engine.env_vars import EnvironmentVars, EnvironmentVarsRequest
from pants.engine.fs import AddPrefix, CreateDigest, Digest, FileContent, RemovePrefix, Workspace
from pants.engine.goal import Goal, GoalSubsystem
from pants.engine.process import FallibleProcessResult, Process, ProcessCacheScope
from pants.engine.rules import Get, collect_rules, goal_rule
from pants.option.option_types import StrOption
from pants.util.frozendict import FrozenDict

from kiln_pants.artifact_graph import ArtifactGraph, ArtifactGraphRequest
from kiln_pants.artifact_store import artifact_path
from kiln_pants.build import BuildRoots, BuildRootsRequest
from kiln_pants.eval_targets import LmEvalRunTarget
from kiln_pants.runtime import REPORT, KilnProcess, Runtime, RuntimeProcess, RuntimeRequest
from kiln_pants.store_process import STORE_ENVIRONMENT
from kiln_pants.subsystem import KilnSubsystem
from kiln_pants.target_types import LmCheckpointTarget

RUNS_FILE = "runs.json"
OUT_DIR = "out"


class CompareSubsystem(GoalSubsystem):
    name = "compare"
    help = (
        "Compare checkpoints' runs (a sweep): a table of the fields they vary and their losses, "
        "evals, tokens, FLOPs and wall time (evaluations beside them), written to "
        "dist/compare/NAME/compare.csv with a plot of validation loss against training FLOPs "
        "(compare.png) and the runs' train and validation loss against step and tokens "
        "(curves.png)."
    )

    metric = StrOption(
        default=None,
        help="The loss the plot shows, e.g. `eval/paloma/macro_loss` (default: the first "
        "validation set's `eval/NAME/loss`).",
    )


class Compare(Goal):
    subsystem_cls = CompareSubsystem
    environment_behavior = Goal.EnvironmentBehavior.LOCAL_ONLY


@goal_rule
async def compare(
    console: Console,
    addresses: Addresses,
    subsystem: CompareSubsystem,
    kiln: KilnSubsystem,
    build_root: BuildRoot,
    distdir: DistDir,
    workspace: Workspace,
) -> Compare:
    prefix = kiln.prefix_or_report(console, build_root.path)  # a folder or a bucket
    if prefix is None:
        return Compare(exit_code=1)
    roots = await Get(BuildRoots, BuildRootsRequest(addresses))
    graph = await Get(ArtifactGraph, ArtifactGraphRequest(roots.addresses))
    asked = set(roots.addresses)
    kinds = (LmCheckpointTarget.alias, LmEvalRunTarget.alias)
    runs = [a for a in graph if a.address in asked and a.kind in kinds]
    if not runs:
        console.print_stderr(
            "No lm_checkpoint or lm_eval_run targets given (a sweep, checkpoints, evaluations)."
        )
        return Compare(exit_code=1)
    listed = [{"name": a.ref, "folder": artifact_path(prefix, a), "identity": a.identity}
              for a in runs]  # fmt: skip
    runtime = await Get(Runtime, RuntimeRequest(REPORT))
    environment = await Get(EnvironmentVars, EnvironmentVarsRequest(STORE_ENVIRONMENT))
    runs_file = await Get(Digest, CreateDigest([FileContent(RUNS_FILE, json.dumps(listed).encode())]))
    metric = ("--metric", subsystem.metric) if subsystem.metric else ()
    process = (await Get(
        KilnProcess,
        RuntimeProcess(
            runtime,
            argv=("compare", "--runs", RUNS_FILE, "--out", OUT_DIR, *metric),
            description=f"Comparing {len(runs)} run(s)",
            input_digest=runs_file,
            output_directories=(OUT_DIR,),
            cache_scope=ProcessCacheScope.PER_SESSION,  # the runs' folders change as they train
            env=FrozenDict(environment),  # a bucket's credentials
        ),
    )).process
    result = await Get(FallibleProcessResult, Process, process)
    if result.exit_code != 0:
        console.print_stderr(result.stderr.decode(errors="replace").strip())
        return Compare(exit_code=1)
    where = os.path.join(distdir.relpath, "compare", _name(addresses))
    written = await Get(Digest, RemovePrefix(result.output_digest, OUT_DIR))
    workspace.write_digest(await Get(Digest, AddPrefix(written, where)))
    console.print_stdout(result.stdout.decode().replace(f"{OUT_DIR}/", f"{where}/"))
    return Compare(exit_code=0)


def _name(addresses: Addresses) -> str:
    """The output folder: the target's name for one target (a sweep), else `runs`."""
    return addresses[0].target_name if len(addresses) == 1 else "runs"


def rules():
    return collect_rules()
