from __future__ import annotations

import pytest
from pants.backend.python.util_rules import pex_from_targets
from pants.base.specs import RawSpecs
from pants.core.goals.run import RunRequest
from pants.core.target_types import FilesGeneratorTarget, FileTarget, GenericTarget
from pants.core.util_rules import distdir, source_files
from pants.engine.addresses import Addresses
from pants.engine.target import DependenciesRequest, Targets
from pants.testutil.rule_runner import QueryRule, RuleRunner

from kiln_pants import build, compare, housekeeping, plan, register
from kiln_pants.artifact_graph import ArtifactGraph, ArtifactGraphRequest
from kiln_pants.hf_model_rules import StoredCheckpoint, StoredCheckpointRequest
from kiln_pants.mixture_budget import MixtureBudgetRequest, MixtureFits
from kiln_pants.store_inventory import StoredTargets, StoredTargetsRequest
from kiln_pants.subsystem import KilnSubsystem
from kiln_pants.train_rules import LmCheckpointFieldSet, StepJson, StepJsonRequest


@pytest.fixture
def rule_runner() -> RuleRunner:
    """The backend's rules without its goals (see plan_rule_runner)."""
    goals = {*plan.rules(), *build.rules(), *compare.rules(), *housekeeping.rules()}
    without_goals = [rule for rule in register.rules() if rule not in goals]
    return _rule_runner([*without_goals, *KilnSubsystem.rules()])


@pytest.fixture
def plan_rule_runner() -> RuleRunner:
    """With the `plan` and `build` goals, `run`'s request and the checkpoint a `package`
    exports (StoredCheckpoint), which read a bucket through a runtime PEX process and so need the
    Python backend's PEX rules: a bigger rule graph, seconds more to set up per test."""
    return _rule_runner(
        [
            *register.rules(),
            *pex_from_targets.rules(),
            *distdir.rules(),
            QueryRule(StoredCheckpoint, [StoredCheckpointRequest]),
            QueryRule(RunRequest, [LmCheckpointFieldSet]),
        ]
    )


def _rule_runner(rules: list) -> RuleRunner:
    return RuleRunner(
        rules=[
            *rules,
            *source_files.rules(),
            QueryRule(ArtifactGraph, [ArtifactGraphRequest]),
            QueryRule(Addresses, [DependenciesRequest]),
            QueryRule(Targets, [RawSpecs]),
            QueryRule(StepJson, [StepJsonRequest]),
            QueryRule(StoredTargets, [StoredTargetsRequest]),
            QueryRule(MixtureFits, [MixtureBudgetRequest]),
        ],
        target_types=[*register.target_types(), FilesGeneratorTarget, FileTarget, GenericTarget],
        aliases=[register.build_file_aliases()],
    )
