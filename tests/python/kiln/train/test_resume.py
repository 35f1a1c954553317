"""Exact resumption: a run SIGKILLed mid-training, while a checkpoint is being written in the
background, and rerun ends where an uninterrupted run does, across a change of its mixture.

The uninterrupted reference runs in this process; the killed run and its resumption run as
`python -m kiln.train SPEC.json` subprocesses. On CPU the comparison is bit-for-bit: batches are
a pure function of the step, the restored state is the saved arrays exactly, and XLA:CPU is
deterministic for a given program.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from kiln_testing.processes import python_env
from kiln_testing.training import build_tiny_cache, make_spec, read_jsonl

from kiln.train.spec import parse_spec
from kiln.train.trainer import train

NUM_STEPS = 20
KILLED_SAVE = 10  # killed while saving step 10: a permanent checkpoint exists from step 5 on


def train_command(spec_path: Path) -> list[str]:
    return [sys.executable, "-m", "kiln.train", str(spec_path)]


def subprocess_env() -> dict[str, str]:
    return python_env(JAX_PLATFORMS="cpu")


def kill_mid_save(spec_path: Path, saving: Path) -> int:
    """Runs the trainer until the save into `saving` (a checkpoint's staging folder) has begun,
    then SIGKILLs it."""
    process = subprocess.Popen(
        train_command(spec_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=subprocess_env(),
    )  # fmt: skip
    while process.poll() is None and not saving.exists():
        time.sleep(0.002)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=120)
    return process.returncode


def final_params(output: Path) -> list[np.ndarray]:
    state = ocp.StandardCheckpointer().restore(output / f"checkpoints/step-{NUM_STEPS}/state")
    return [np.asarray(leaf) for leaf in jax.tree.leaves(state)]


def losses(output: Path) -> list[tuple[int, float]]:
    return [
        (r["step"], r["train/loss"])
        for r in read_jsonl(output / "metrics.jsonl")
        if "train/loss" in r
    ]


@pytest.mark.skipif(
    jax.device_count() != 1, reason="the reference run must use the subprocess's 1 device"
)
def test_killed_run_resumes_bit_for_bit(tmp_path: Path) -> None:
    caches = {name: build_tiny_cache(tmp_path, name, 120, seed=i)
              for i, name in enumerate(("tokenized/a", "tokenized/b"))}  # fmt: skip
    validation = {"tokenized/val": build_tiny_cache(tmp_path, "tokenized/val", 20, seed=1)}
    # The mixture changes at step 12, which the resumed run crosses (Levanter's varying mixture).
    stages = [{"start_step": 12, "weights": [0.2, 1.0]}]
    overrides = {"config.num_train_steps": NUM_STEPS, "runtime.validation_every": 10,
                 "config.stages": stages}  # fmt: skip
    reference_output, resumed_output = tmp_path / "reference", tmp_path / "resumed"
    train(parse_spec(make_spec(reference_output, caches, validation, **overrides)))

    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(make_spec(resumed_output, caches, validation, **overrides)))
    killed_save = resumed_output / f"checkpoints/.step-{KILLED_SAVE}.saving"
    assert kill_mid_save(spec_path, killed_save) == -signal.SIGKILL
    # Killed while the save was writing: its step folder is absent, never half-written.
    assert not (resumed_output / f"checkpoints/step-{KILLED_SAVE}").exists()
    assert max(step for step, _ in losses(resumed_output)) >= KILLED_SAVE

    finished = subprocess.run(
        train_command(spec_path), capture_output=True, text=True, env=subprocess_env()
    )
    assert finished.returncode == 0, finished.stderr
    summary = json.loads(finished.stdout[finished.stdout.index("\n{") :])
    assert summary["complete"] and summary["steps_this_run"] == NUM_STEPS - 5  # from step 5
    # The reference run compiled the same step into the tests' compilation cache.
    assert summary["first_step_program"] == "cache", summary

    assert losses(resumed_output) == losses(reference_output)
    for resumed, reference in zip(final_params(resumed_output), final_params(reference_output)):
        np.testing.assert_array_equal(resumed, reference)
    evals = [read_jsonl(o / "tracker_metrics.jsonl")[0]["summary"]["eval/loss"]
             for o in (resumed_output, reference_output)]  # fmt: skip
    assert evals[0] == evals[1]
