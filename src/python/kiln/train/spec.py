"""The train spec as the trainer reads it: the contract's types (kiln_contract.train), which
kiln.runner builds from a step and `python -m kiln.train SPEC.json` reads from a file.

Every error is a SpecError naming the JSON field (`config.optimizer.warmup`, `runtime.mesh.data`)
and what is expected. docs/step-spec.md describes the format.
"""

from __future__ import annotations

import json
from pathlib import Path

from kiln_contract.parsing import SpecError, is_bucket_url
from kiln_contract.train import (
    CheckpointerSpec,
    ControlSpec,
    DatasetInput,
    Resources,
    RuntimeSpec,
    TrainConfig,
    TrainSpec,
    WandbSpec,
)

__all__ = [
    "CheckpointerSpec",
    "ControlSpec",
    "DatasetInput",
    "Resources",
    "RuntimeSpec",
    "SpecError",
    "TrainConfig",
    "TrainSpec",
    "WandbSpec",
    "load_spec",
    "parse_spec",
]


def load_spec(path: str | Path) -> TrainSpec:
    """The train spec in the JSON file at `path`. An artifact's train_spec.json of a run in a
    bucket names the bucket as its `output_path`; read from a local view of that artifact, the
    view's folder is the output and the bucket its `location`."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise SpecError("", f"cannot read the train spec {path}: {e.strerror}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecError("", f"{path} is not valid JSON: {e}") from None
    if isinstance(obj, dict) and is_bucket_url(obj.get("output_path")):
        obj = {**obj, "location": obj["output_path"], "output_path": str(Path(path).parent.absolute())}
    return parse_spec(obj)


def parse_spec(obj: object) -> TrainSpec:
    """The train spec in a parsed JSON object."""
    return TrainSpec.from_json(obj)
