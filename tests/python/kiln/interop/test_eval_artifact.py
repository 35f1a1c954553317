"""An evaluation as an artifact (`lm_eval_run`, docs/evals.md): a run of the store scored by
`python -m kiln.interop eval-artifact` has the scores the run reported for the same checkpoint,
tasks and validation windows; it is served once built and refused under another fingerprint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from kiln_testing.processes import python_env
from kiln_testing.training import EVAL_TASK, write_eval_task, write_runner_step

RUN = "checkpoints/tiny/2026.11.29"


def python_command(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], env=python_env(JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                          timeout=600)  # fmt: skip


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store holding a trained run that validated and ran its lm-eval task at its last step."""
    root = tmp_path_factory.mktemp("eval-artifact")
    write_eval_task(root / "tasks")
    evals = {"tasks": [{"name": EVAL_TASK, "num_fewshot": 0}], "every": 6, "task_paths": ["tasks"]}
    step = write_runner_step(root, **{"config.num_train_steps": 6, "config.evals": evals,
                                      "runtime.checkpointer.every": 3})  # fmt: skip
    trained = python_command("-m", "kiln.runner", str(step), "--inputs", str(root),
                             "--prefix", str(root / "store"))  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    return root / "store"


def record(store: Path, folder: Path, fingerprint: str = "e1a1") -> Path:
    """The record an lm_eval_run target's build gives the command (the Pants side writes it)."""
    run = json.loads((store / RUN / "artifact.json").read_text())
    identity = {
        "kind": "lm_eval_run", "format": 1,
        "model": {"kind": "lm_checkpoint", "name": "checkpoints/tiny", "version": "2026.11.29",
                  "fingerprint": run["fingerprint"]},
        "evals": {"tasks": [{"name": EVAL_TASK, "num_fewshot": 0}], "every": 1,
                  "max_examples": None, "sequence_start": "tokenizer", "max_length": None,
                  "task_files": "digest"},
        "validation": [], "seq_len": 64, "batch_size": 4, "max_eval_batches": 2,
        "compute_dtype": "float32",
    }  # fmt: skip
    path = folder / f"record-{fingerprint}.json"
    path.write_text(json.dumps({
        "record_version": 1, "kind": "lm_eval_run", "name": "evals/tiny", "version": "2026.12.02",
        "fingerprint": fingerprint, "identity": identity,
        "inputs": [{"ref": "checkpoints/tiny@2026.11.29", "fingerprint": run["fingerprint"]}],
        "provenance": {"code_digest": "c" * 64, "lockfile_digest": "l" * 64},
    }))  # fmt: skip
    return path


def test_an_evaluation_of_a_run_scores_what_the_run_reported(store: Path, tmp_path: Path) -> None:
    out = store / "evals/tiny/2026.12.02"
    validation = store / "tokenized/val/2026.11.29"  # placed in the store by the run
    args = ["-m", "kiln.interop", "eval-artifact", str(out), "--prefix", str(store),
            "--validation", f"val={validation}", "--task-files", str(store.parent / "tasks")]  # fmt: skip
    built = python_command(*args, "--record", str(record(store, tmp_path)))
    assert built.returncode == 0, built.stderr[-3000:]
    assert f"kiln: built evals/tiny@2026.12.02 at {out}" in built.stdout
    assert (out / "STATUS").read_text().strip() == "SUCCESS"
    scores = json.loads((out / "results.json").read_text())["metrics"]
    reported = json.loads((store / RUN / "summary.json").read_text())
    for name in ("eval/val/loss", "eval/val/bpb", f"lm_eval/{EVAL_TASK}/acc"):
        assert scores[name] == pytest.approx(reported[name], rel=1e-5, abs=1e-7), name

    served = python_command(*args, "--record", str(record(store, tmp_path)))
    assert served.returncode == 0 and "is already built at" in served.stdout
    other = python_command(*args, "--record", str(record(store, tmp_path, fingerprint="0ther")))
    assert other.returncode == 1
    assert "already holds evals/tiny@2026.12.02 with fingerprint e1a1" in other.stderr
