"""The kernel lab stays out of the runner's code digest.

A checkpoint's provenance.code_digest is the digest of the runner's sources: the first-party
files of kiln.runner's transitive closure, as kiln_pants.runtime.kiln_runtime gathers them
(Runtime.sources for RUN_STEP). Here that closure is computed with the same requests on this
workspace's real src/python and lab/ files: no lab file is in it, so editing one leaves the
digest as it was, while editing a product file in it changes the digest. A product module that
imports the lab brings lab files into the closure, and these tests fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pants.backend.python import target_types_rules
from pants.backend.python.dependency_inference import rules as dependency_inference_rules
from pants.backend.python.target_types import PythonSourcesGeneratorTarget, PythonSourceTarget
from pants.backend.python.typecheck.mypy import skip_field as mypy_skip_field
from pants.backend.python.util_rules import python_sources
from pants.backend.python.util_rules.python_sources import (
    PythonSourceFiles,
    PythonSourceFilesRequest,
)
from pants.engine.fs import Digest, DigestContents
from pants.engine.target import TransitiveTargets, TransitiveTargetsRequest
from pants.testutil.rule_runner import QueryRule, RuleRunner

from kiln_pants.runtime import RUN_STEP

# The workspace's files, in this test's sandbox (BUILD: `workspace=True` and lab:code).
PRODUCT, LAB = Path("src/python"), Path("lab/kiln_lab")
LAB_KERNEL = "lab/kiln_lab/flash_attention_hopper.py"
PRODUCT_KERNEL = "src/python/kiln/kernels/flash_attention.py"


@pytest.fixture(scope="module")
def rule_runner() -> RuleRunner:
    runner = RuleRunner(
        rules=[
            *target_types_rules.rules(),
            *dependency_inference_rules.rules(),
            *python_sources.rules(),
            *mypy_skip_field.rules(),  # the lab's BUILD sets skip_mypy
            QueryRule(TransitiveTargets, [TransitiveTargetsRequest]),
            QueryRule(PythonSourceFiles, [PythonSourceFilesRequest]),
            QueryRule(DigestContents, [Digest]),
        ],
        target_types=[PythonSourcesGeneratorTarget, PythonSourceTarget],
    )
    runner.set_options(
        [
            "--source-root-patterns=['/src/python', '/lab']",
            "--python-enable-resolves",
            "--python-resolves={'runtime': 'runtime.lock'}",
            "--python-default-resolve=runtime",
            "--python-infer-use-rust-parser",
            # Third-party requirements are not sources: they do not enter the digest.
            "--python-infer-unowned-dependency-behavior=ignore",
        ]
    )
    runner.write_files(workspace_files())
    return runner


def workspace_files() -> dict[str, str]:
    files = {}
    for root in (PRODUCT, LAB):
        for path in sorted(root.rglob("*")):
            if path.is_file() and (path.suffix == ".py" or path.name == "BUILD"):
                files[str(path)] = path.read_text()
    assert PRODUCT_KERNEL in files and LAB_KERNEL in files, sorted(files)[:5]
    return files


def runner_sources(rule_runner: RuleRunner) -> tuple[Digest, set[str]]:
    """Runtime.sources for RUN_STEP, and the paths of its files."""
    address = RUN_STEP.address
    closure = rule_runner.request(TransitiveTargets, [TransitiveTargetsRequest([address])])
    sources = rule_runner.request(
        PythonSourceFiles, [PythonSourceFilesRequest(closure.closure, include_files=True)]
    )
    digest = sources.source_files.snapshot.digest
    return digest, set(sources.source_files.snapshot.files)


def edited(rule_runner: RuleRunner, path: str, line: str) -> None:
    rule_runner.write_files({path: Path(path).read_text() + line})


def test_the_runner_closure_holds_the_kernels_and_no_lab_file(rule_runner: RuleRunner) -> None:
    _, files = runner_sources(rule_runner)
    assert PRODUCT_KERNEL in files  # the model's "pallas" attention: the kernels are in it
    lab_files = sorted(path for path in files if path.startswith("lab/"))
    assert not lab_files, f"the runner's code closure holds lab files: {lab_files}"


def test_editing_a_lab_file_leaves_the_runner_digest_alone(rule_runner: RuleRunner) -> None:
    before, _ = runner_sources(rule_runner)
    edited(rule_runner, LAB_KERNEL, "# an edit in the lab\n")
    assert runner_sources(rule_runner)[0] == before
    edited(rule_runner, PRODUCT_KERNEL, "# an edit in the product\n")
    assert runner_sources(rule_runner)[0] != before
    rule_runner.write_files(workspace_files())
    assert runner_sources(rule_runner)[0] == before


def test_a_product_import_of_the_lab_would_bring_it_into_the_digest(
    rule_runner: RuleRunner,
) -> None:
    """What the tests above guard against, shown once: they would see these files."""
    edited(rule_runner, PRODUCT_KERNEL, "import kiln_lab.flash_attention_hopper  # noqa\n")
    try:
        _, files = runner_sources(rule_runner)
    finally:
        rule_runner.write_files(workspace_files())
    assert LAB_KERNEL in files
