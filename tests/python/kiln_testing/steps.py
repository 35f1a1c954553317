"""A tiny lm_checkpoint step spec, as the Pants backend writes it, with its input caches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kiln_testing.training import build_tiny_cache, make_spec

NUM_STEPS = 6


def write_step(root: Path, **runtime: Any) -> Path:
    """A step JSON as the Pants backend writes it (docs/step-spec.md), its inputs under root;
    `runtime` replaces fields of its runtime section."""
    caches = {
        "tokenized/a": build_tiny_cache(root, "tokenized/a", 120, seed=0),
        "tokenized/val": build_tiny_cache(root, "tokenized/val", 30, seed=2),
    }
    spec = make_spec(
        root / "unused", {"tokenized/a": caches["tokenized/a"]},
        {"tokenized/val": caches["tokenized/val"]},
        **{"config.num_train_steps": NUM_STEPS, "runtime.mesh": {"data": 2, "fsdp": 2, "tensor": 1},
           "runtime.checkpointer.every": 3},
    )  # fmt: skip
    entries = spec["config"]["datasets"] + spec["config"]["validation"]
    for entry in entries:
        del entry["path"]  # a step names its caches; the runner finds them under --inputs
    inputs: list[dict[str, Any]] = [
        {"ref": f"{e['name']}@{e['version']}", "name": e["name"], "version": e["version"],
         "record": record(e["name"], e["fingerprint"], "tokenized_cache", {}),
         "location": caches[e["name"]].name}
        for e in entries
    ]  # fmt: skip
    for entry in inputs:  # each cache's record, as the tokenize step writes it
        (caches[entry["name"]] / "artifact.json").write_text(json.dumps(entry["record"]))
    spec["runtime"].update(runtime)
    identity = {"kind": "lm_checkpoint", "config": spec["config"]}
    step = {
        "step_version": 1, "kind": "lm_checkpoint", "name": spec["name"],
        "version": spec["version"], "fingerprint": spec["fingerprint"],
        "record": record(spec["name"], spec["fingerprint"], "lm_checkpoint", identity),
        "config": spec["config"], "runtime": spec["runtime"], "inputs": inputs,
        "provenance": {"code_digest": "a" * 64, "lockfile_digest": "b" * 64},
    }  # fmt: skip
    path = root / "step.json"
    path.write_text(json.dumps(step))
    return path


def record(name: str, fingerprint: str, kind: str, identity: dict[str, Any]) -> dict[str, Any]:
    return {"record_version": 1, "kind": kind, "name": name, "version": "2026.11.29",
            "fingerprint": fingerprint, "identity": identity, "inputs": []}  # fmt: skip
