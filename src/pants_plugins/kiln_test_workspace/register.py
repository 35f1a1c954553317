"""This repo's own test support: a Python test with `workspace=True` finds the repo's files in its
sandbox (the launcher, Pants' config, the lockfiles, the sources, `experiments/` and `scripts/`),
to run real `./pants` on a copy of them or to read them as they are.

The files come from a pytest set-up plugin (Pants' `PytestPluginSetupRequest`), not from a
`files` target: a glob over `experiments/**` in a `files` target would put a generated target per
file into `pants list experiments:`, beside the artifacts a user looks for there. The files are
part of the test's inputs all the same: a change to any of them reruns the test.
"""

from __future__ import annotations

from pants.backend.python.goals.pytest_runner import PytestPluginSetup, PytestPluginSetupRequest
from pants.backend.python.target_types import PythonTestsGeneratorTarget, PythonTestTarget
from pants.engine.fs import Digest, PathGlobs
from pants.engine.rules import Get, collect_rules, rule
from pants.engine.target import BoolField, Target
from pants.engine.unions import UnionRule

WORKSPACE_GLOBS = (
    "BUILD", "pants", "pants.toml", "ruff.toml", "mypy.ini", "3rdparty/python/*", "src/**/*",
    "experiments/**/*", "scripts/*", "!**/__pycache__/**",
)  # fmt: skip


class WorkspaceField(BoolField):
    alias = "workspace"
    default = False
    help = (
        "Put this repo's files (BUILD, pants, pants.toml, ruff.toml, mypy.ini, 3rdparty/python/, "
        "src/, experiments/, scripts/) into the test's sandbox."
    )


class WorkspaceSetupRequest(PytestPluginSetupRequest):
    @classmethod
    def is_applicable(cls, target: Target) -> bool:
        return bool(target.get(WorkspaceField).value)


@rule(desc="Putting the workspace's files in the test's sandbox")
async def workspace_files(_: WorkspaceSetupRequest) -> PytestPluginSetup:
    return PytestPluginSetup(await Get(Digest, PathGlobs(WORKSPACE_GLOBS)))


def rules():
    return [
        *collect_rules(),
        UnionRule(PytestPluginSetupRequest, WorkspaceSetupRequest),
        PythonTestTarget.register_plugin_field(WorkspaceField),
        PythonTestsGeneratorTarget.register_plugin_field(WorkspaceField),
    ]
