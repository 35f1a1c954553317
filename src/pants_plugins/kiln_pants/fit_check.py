"""`pants plan --fit`: each training's step compiled for its TPU slice, ahead of time, here.

One cached process per training and slice (`python -m kiln.fit`, kiln.fit) from the runtime PEX
with the `tpu` resolve's libtpu layered on, as a `tpu(...)` training gets it: its inputs are the
step spec the runner would train from, the slice, the vocabulary and Kiln's code, so a second
`plan --fit` of an unchanged run is served from Pants' cache. The compiler never runs in Pants'
own interpreter, and never needs a TPU.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from pants.backend.python.subsystems.setup import PythonSetup
from pants.engine.addresses import Address
from pants.engine.fs import CreateDigest, Digest, DigestContents, FileContent, PathGlobs
from pants.engine.process import FallibleProcessResult, Process
from pants.engine.rules import Get, MultiGet, collect_rules, rule

from kiln_contract.step import STEP_FILE
from kiln_contract.tpu import UnknownTpu, tpu_topology
from kiln_contract.train import Resources
from kiln_pants.artifact_store import runtime_provenance
from kiln_pants.runtime import (
    ACCELERATOR_PLUGINS,
    FIT,
    KilnProcess,
    Runtime,
    RuntimeProcess,
    RuntimeRequest,
)
from kiln_pants.train_rules import StepJson, StepJsonRequest

REPORT_DIR = "fit"
REPORT_FILE = f"{REPORT_DIR}/fit.json"


def fit_target(resources: Resources, override: Optional[str]) -> tuple[Optional[str], str]:
    """The slice a training's step is compiled for (`--plan-fit-target`, else its `tpu(...)`),
    or None and why it is not checked."""
    target = override or (resources.type if resources.kind == "tpu" else None)
    if target is None:
        written = f"{resources.kind}({repr(resources.type) if resources.type else ''})"
        return None, (
            f"trains on {written}: only TPU slices are compiled for here; "
            "`--plan-fit-target=v4-128` checks it on one"
        )
    try:
        tpu_topology(target)
    except UnknownTpu as e:
        return None, str(e)
    return target, ""


@dataclass(frozen=True)
class FitCheckRequest:
    address: Address  # an lm_checkpoint
    target: str  # a TPU slice (v4-128) or libtpu topology (v5e:2x2)
    vocab_size: int
    variants: int  # remedies to compile at most when it does not fit


@dataclass(frozen=True)
class FitCheck:
    """kiln.fit's table (its stdout) and report (JSON text); `error`: why it could not check."""

    table: str
    report: str
    error: str = ""

    def data(self) -> Optional[dict[str, Any]]:
        return json.loads(self.report) if self.report else None

    @property
    def fits(self) -> bool:
        data = self.data()
        return bool(data and data["fits"])


@rule(desc="Compiling a training's step for its TPU slice")
async def fit_check(request: FitCheckRequest, python_setup: PythonSetup) -> FitCheck:
    runtime, lockfiles = await MultiGet(
        Get(Runtime, RuntimeRequest(FIT, accelerator="tpu")),
        Get(
            Digest,
            PathGlobs(
                [python_setup.resolves[name]
                 for name in (python_setup.default_resolve, ACCELERATOR_PLUGINS["tpu"].resolve)]
            ),
        ),
    )  # fmt: skip
    step = await Get(
        StepJson, StepJsonRequest(request.address, runtime_provenance(runtime, lockfiles))
    )
    step_digest = await Get(Digest, CreateDigest([FileContent(STEP_FILE, step.content)]))
    process = (await Get(
        KilnProcess,
        RuntimeProcess(
            runtime,
            argv=(
                STEP_FILE, "--target", request.target, "--vocab-size", str(request.vocab_size),
                "--variants", str(request.variants), "--json", REPORT_FILE,
            ),
            description=f"Compiling {request.address}'s step for {request.target}",
            input_digest=step_digest,
            output_directories=(REPORT_DIR,),
        ),
    )).process  # fmt: skip
    result = await Get(FallibleProcessResult, Process, process)
    table = result.stdout.decode(errors="replace").rstrip()
    if result.exit_code != 0:
        lines = result.stderr.decode(errors="replace").strip().splitlines()
        errors = [line for line in lines if line.startswith("kiln.fit: error:")]
        why = errors[-1] if errors else (lines[-1] if lines else f"exit {result.exit_code}")
        return FitCheck(table, "", why.removeprefix("kiln.fit: error: "))
    contents = await Get(DigestContents, Digest, result.output_digest)
    report = next((c.content.decode() for c in contents if c.path == REPORT_FILE), "")
    return FitCheck(table, report, "" if report else "kiln.fit wrote no report")


def rules():
    return collect_rules()
