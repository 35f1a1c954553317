"""Reading a Kiln target as Kiln's goals do: through the artifact graph, which raises what is
wrong with it (kiln_pants.field_problems); Pants alone builds it without complaint."""

from __future__ import annotations

from pants.engine.addresses import Address, Addresses
from pants.engine.target import Target
from pants.testutil.rule_runner import RuleRunner

from kiln_pants.artifact_graph import ArtifactGraph, ArtifactGraphRequest


def read_target(rule_runner: RuleRunner, address: Address) -> Target:
    """The target at `address`, once Kiln's artifact graph has read it and its inputs."""
    rule_runner.request(ArtifactGraph, [ArtifactGraphRequest(Addresses([address]))])
    return rule_runner.get_target(address)
