"""The multi-host tests' step: a tiny lm_checkpoint step for 2 x 2 devices, with its input caches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln_testing.training import write_runner_step

NUM_STEPS = 6


def write_step(root: Path, **runtime: Any) -> Path:
    """A step JSON as the Pants backend writes it (docs/step-spec.md), its inputs under root;
    `runtime` replaces fields of its runtime section."""
    return write_runner_step(
        root,
        **{"config.num_train_steps": NUM_STEPS, "runtime.mesh": {"data": 2, "fsdp": 2, "tensor": 1},
           "runtime.checkpointer.every": 3,
           **{f"runtime.{key}": value for key, value in runtime.items()}},
    )  # fmt: skip
