"""The step spec: one `lm_checkpoint` for `python -m kiln.runner STEP.json`.

The backend writes it (kiln_pants.train_rules) with the step's record, its identity config, the
run-time defaults and where each input cache is; the runner parses it once, places the inputs,
decides (serve / refuse drift / train) and hands `StepSpec.train_spec(...)` to the trainer.
docs/step-spec.md describes every field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln_contract.location import is_bucket_url
from kiln_contract.parsing import (
    SpecError,
    build,
    check_absolute_path,
    check_relative_path,
    check_str,
    field_path,
    json_fields,
    json_list,
    read_json,
    scalar_json,
)
from kiln_contract.record import ArtifactRecord
from kiln_contract.train import (
    SPEC_KIND,
    DatasetRef,
    RuntimeSpec,
    TrainConfig,
    TrainSpec,
)
from kiln_contract.vocabulary import check_address, check_artifact_name, check_version

STEP_VERSION = 1
STEP_FILE = "step.json"  # where the runner reads a step: in its sandbox, a host's folder, a bundle


@dataclass(frozen=True)
class StepInput:
    """An input cache and where its built files are: `location`, relative to the runner's
    `--inputs` (an inline cache, carried with the step), or `store_path`, already in the
    artifact store (a store cache: an absolute path, or a URL in a bucket store)."""

    ref: str  # name@version
    name: str
    version: str
    record: ArtifactRecord
    location: str | None = None
    store_path: str | None = None

    def __post_init__(self) -> None:
        check_artifact_name("name", self.name)
        check_version("version", self.version)
        if self.ref != f"{self.name}@{self.version}":
            raise SpecError("ref", f"expected {self.name}@{self.version}, got {self.ref!r}")
        if (self.location is None) == (self.store_path is None):
            raise SpecError("", "expected exactly one of location and store_path")
        if self.location is not None:
            check_relative_path("location", self.location)
        if self.store_path is not None and not is_bucket_url(self.store_path):
            check_absolute_path("store_path", Path(self.store_path))

    @classmethod
    def from_json(cls, obj: Any, where: str) -> StepInput:
        values = json_fields(cls, obj, where)
        values["record"] = ArtifactRecord.from_json(values["record"], field_path(where, "record"))
        return build(cls, where, values)

    def to_json(self) -> dict[str, Any]:
        return {**scalar_json(self, omit_none=True), "record": self.record.to_json()}


@dataclass(frozen=True)
class Provenance:
    """What built the step, recorded beside the artifact; never part of its identity."""

    code_digest: str  # the runtime's sources
    lockfile_digest: str  # the runtime's third-party lockfile(s)

    def __post_init__(self) -> None:
        check_str("code_digest", self.code_digest)
        check_str("lockfile_digest", self.lockfile_digest)


@dataclass(frozen=True)
class StepSpec:
    name: str
    version: str
    fingerprint: str
    record: ArtifactRecord  # artifact.json's identity part
    config: TrainConfig[DatasetRef]
    runtime: RuntimeSpec
    inputs: tuple[StepInput, ...]
    provenance: Provenance

    def __post_init__(self) -> None:
        check_address(self)
        if (self.record.name, self.record.version, self.record.fingerprint) != (
            self.name,
            self.version,
            self.fingerprint,
        ):
            raise SpecError("record", f"describes {self.record.ref}, not {self.ref}")
        refs = {i.ref for i in self.inputs}
        for key in ("datasets", "validation"):
            for index, dataset in enumerate(getattr(self.config, key)):
                if dataset.ref not in refs:
                    raise SpecError(
                        f"config.{key}[{index}]", f"{dataset.ref} is not among the step's inputs"
                    )
        try:
            self.runtime.eval_names(self.config.validation)
        except SpecError as e:
            raise e.within("runtime") from None

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    @classmethod
    def from_json(cls, obj: Any) -> StepSpec:
        header = {"step_version": STEP_VERSION, "kind": SPEC_KIND}
        advice = "build the step with a matching Kiln (rerun it through Pants)"
        values = json_fields(cls, obj, "", header, advice)
        values["record"] = ArtifactRecord.from_json(values["record"])
        values["config"] = TrainConfig.from_json(values["config"], "config", DatasetRef)
        values["runtime"] = RuntimeSpec.from_json(values["runtime"])
        values["inputs"] = tuple(
            StepInput.from_json(item, f"inputs[{i}]")
            for i, item in enumerate(json_list(values["inputs"], "inputs"))
        )
        values["provenance"] = read_json(Provenance, values["provenance"], "provenance")
        return build(cls, "", values)

    def to_json(self) -> dict[str, Any]:
        return {
            "step_version": STEP_VERSION,
            "kind": SPEC_KIND,
            **scalar_json(self),
            "record": self.record.to_json(),
            "config": self.config.to_json(),
            "runtime": self.runtime.to_json(),
            "inputs": [i.to_json() for i in self.inputs],
            "provenance": scalar_json(self.provenance),
        }

    def train_spec(
        self, output_path: Path, paths: Mapping[str, Path | str], inputs_root: Path
    ) -> TrainSpec:
        """What the trainer gets: this step's config with every input cache at its path
        (`paths` by `name@version`), writing to `output_path`."""
        return TrainSpec(
            name=self.name,
            version=self.version,
            fingerprint=self.fingerprint,
            output_path=output_path,
            config=self.config.located(paths, inputs_root),
            runtime=self.runtime,
        )
