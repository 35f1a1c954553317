"""kiln.runner's decisions: serve, refuse drift, refuse a concurrent run, place inputs atomically."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kiln import artifacts
from kiln.runner import (
    StepError,
    _parser,
    apply_overrides,
    check_drift,
    place_input,
    run_step,
    train_spec,
)

IDENTITY = {"kind": "lm_checkpoint", "batch_size": 8, "model": {"hidden_dim": 64}}


def record(fingerprint: str = "f" * 16, **identity: Any) -> dict[str, Any]:
    return {
        "name": "checkpoints/x",
        "version": "2026.11.29",
        "fingerprint": fingerprint,
        "identity": {**IDENTITY, **identity},
    }


def step(code_digest: str = "a" * 64, **identity: Any) -> dict[str, Any]:
    return {"record": record(**identity), "provenance": {"code_digest": code_digest}, "inputs": []}


def built(directory: Path, rec: dict[str, Any], code_digest: str = "a" * 64) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    artifacts.atomic_write_json(
        directory / artifacts.RECORD_FILE, {**rec, "provenance": {"code_digest": code_digest}}
    )
    artifacts.atomic_write_text(directory / artifacts.SUMMARY_TEXT_FILE, "the summary\n")
    artifacts.write_status(directory, artifacts.SUCCESS)
    return directory


def test_a_built_artifact_is_served(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    output = built(tmp_path / "out", record())
    assert run_step(step(), tmp_path, output, prefix=None) == 0
    printed = capsys.readouterr().out
    assert "is already built" in printed and "the summary" in printed
    assert "built by other code" not in printed


def test_a_code_only_change_is_reported_not_retrained(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = built(tmp_path / "out", record(), code_digest="b" * 64)
    assert run_step(step(code_digest="c" * 64), tmp_path, output, prefix=None) == 0
    assert "built by other code (runtime digest bbbbbbbbbbbb, now cccccccccccc)" in (
        capsys.readouterr().out
    )


def test_a_reused_version_with_another_config_is_refused(tmp_path: Path) -> None:
    output = built(tmp_path / "out", record(fingerprint="0" * 16, batch_size=16))
    with pytest.raises(StepError) as error:
        run_step(step(), tmp_path, output, prefix=None)
    message = str(error.value)
    assert "differs in: batch_size" in message and "Bump `version`" in message
    assert artifacts.read_status(output) == artifacts.SUCCESS  # the old artifact is untouched


def test_a_second_concurrent_run_is_refused(tmp_path: Path) -> None:
    output = tmp_path / "out"
    with artifacts.lease(output, wait=False):
        with pytest.raises(StepError, match="A second run of checkpoints/x@2026.11.29 is refused"):
            run_step(step(), tmp_path, output, prefix=None)
    assert artifacts.read_status(output) is None


def test_inputs_are_placed_once_and_checked(tmp_path: Path) -> None:
    cache = record(fingerprint="c" * 16)
    source = built(tmp_path / "built", cache)
    (source / "data.bin").write_bytes(b"tokens")
    destination = tmp_path / "store/tokenized/x/2026.11.29"

    assert place_input(source, destination, cache) == destination
    assert (destination / "data.bin").read_bytes() == b"tokens"
    assert not [p for p in destination.parent.iterdir() if p.name.startswith(".")]  # no temp left
    (source / "data.bin").write_bytes(b"changed")
    place_input(source, destination, cache)  # already there with this fingerprint: kept
    assert (destination / "data.bin").read_bytes() == b"tokens"

    with pytest.raises(StepError, match="differs in"):
        place_input(source, destination, record(fingerprint="d" * 16, batch_size=1))


def test_an_incomplete_input_is_refused(tmp_path: Path) -> None:
    source = tmp_path / "built"
    source.mkdir()
    with pytest.raises(StepError, match="not complete"):
        place_input(source, tmp_path / "store/x", record())


def test_check_drift_without_a_record(tmp_path: Path) -> None:
    assert check_drift(tmp_path, record()) is None


def test_the_train_spec_gets_absolute_input_and_task_paths(tmp_path: Path) -> None:
    entry = {"name": "tokenized/a", "version": "2026.11.29", "fingerprint": "a" * 16}
    step = {
        "name": "checkpoints/x",
        "version": "2026.11.29",
        "fingerprint": "f" * 16,
        "config": {
            "datasets": [{**entry, "weight": 1.0}],
            "validation": [entry],
            "evals": {"tasks": [], "every": 5, "max_examples": None, "task_paths": ["exp/tasks"]},
        },
        "runtime": {},
    }
    cache = tmp_path / "store/tokenized/a/2026.11.29"
    spec = train_spec(step, tmp_path / "out", {"tokenized/a@2026.11.29": cache}, tmp_path)
    assert spec["config"]["datasets"][0]["path"] == str(cache)
    assert spec["config"]["validation"][0]["path"] == str(cache)
    assert spec["config"]["evals"]["task_paths"] == [str(tmp_path / "exp/tasks")]
    assert spec["output_path"] == str(tmp_path / "out")


def test_run_time_overrides_leave_the_identity_alone() -> None:
    base = {
        "runtime": {"attention": "auto", "per_device_parallelism": None},
        "config": {"batch_size": 8},
    }
    args = _parser().parse_args(
        ["step.json", "--inputs", ".", "--per-device-parallelism", "2", "--attention", "xla"]
        + ["--mesh", "data=2, fsdp=-1"]
    )
    overridden = apply_overrides(base, args)
    assert overridden["runtime"] == {
        "attention": "xla",
        "per_device_parallelism": 2,
        "mesh": {"data": 2, "fsdp": -1},
    }
    with pytest.raises(SystemExit):
        _parser().parse_args(["s", "--inputs", ".", "--mesh", "fsdp"])
    assert overridden["config"] == base["config"]
    with pytest.raises(StepError, match="--batch-size changes the artifact's identity"):
        apply_overrides(base, _parser().parse_args(["s", "--inputs", ".", "--batch-size", "4"]))
