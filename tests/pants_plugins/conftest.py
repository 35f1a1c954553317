from __future__ import annotations

import pytest
from pants.core.target_types import FilesGeneratorTarget, FileTarget
from pants.core.util_rules import source_files
from pants.engine.addresses import Addresses
from pants.engine.target import DependenciesRequest
from pants.testutil.rule_runner import QueryRule, RuleRunner

from kiln_pants import register
from kiln_pants.artifact_graph import ArtifactGraph, ArtifactGraphRequest
from kiln_pants.hf_model_rules import StoredCheckpoint, StoredCheckpointRequest
from kiln_pants.train_rules import StepJson, StepJsonRequest


@pytest.fixture
def rule_runner() -> RuleRunner:
    return RuleRunner(
        rules=[
            *register.rules(),
            *source_files.rules(),
            QueryRule(ArtifactGraph, [ArtifactGraphRequest]),
            QueryRule(Addresses, [DependenciesRequest]),
            QueryRule(StepJson, [StepJsonRequest]),
            QueryRule(StoredCheckpoint, [StoredCheckpointRequest]),
        ],
        target_types=[*register.target_types(), FilesGeneratorTarget, FileTarget],
        objects=register.build_file_aliases().objects,
    )
