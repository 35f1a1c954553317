"""`python -m kiln.runner --prefix s3://…` and `gs://…`: a step trains with its artifact store
in a bucket on a real server on loopback; a rerun is served from the bucket; a run SIGKILLed
while it uploads a checkpoint resumes from the newest complete one and ends equal to an
uninterrupted run; denied writes fail in seconds, naming the URL."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from kiln_testing.buckets import S3Gate, fresh_url
from kiln_testing.training import write_runner_step

from kiln.artifacts import peek
from kiln.artifacts.storage_errors import StorageError
from kiln.artifacts.store import ObjectStore, open_store
from kiln.runner import read_step, run_in_bucket

RUN = "checkpoints/tiny/2026.11.29"
STEPS = {"config.num_train_steps": 6, "runtime.checkpointer.every": 3}


@pytest.fixture(scope="module")
def step(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_runner_step(tmp_path_factory.mktemp("bucket-runs"), **STEPS)


def runner(step: Path, prefix: str) -> list[str]:
    return [sys.executable, "-m", "kiln.runner", str(step), "--inputs", str(step.parent),
            "--prefix", prefix]  # fmt: skip


def environment(**extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        "JAX_PLATFORMS": "cpu",
        **extra,
    }


def run(command: list[str], **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, env=environment(**extra), capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def text(store: ObjectStore, key: str) -> str:
    return store.read(key).data.decode()


def losses(store: ObjectStore) -> list[tuple[int, float]]:
    lines = text(store, f"{RUN}/metrics.jsonl").splitlines()
    return [(r["step"], r["train/loss"]) for r in map(json.loads, lines) if "train/loss" in r]


def final_state(store: ObjectStore, into: Path) -> list[np.ndarray]:
    import jax
    import orbax.checkpoint as ocp

    folder = f"{RUN}/checkpoints/step-6"
    for name in store.keys(folder):
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        (into / name).write_bytes(store.read(f"{folder}/{name}").data)
    state = ocp.StandardCheckpointer().restore(into / "state")
    return [np.asarray(leaf) for leaf in jax.tree.leaves(state)]


@pytest.fixture(scope="module")
def s3_run(s3_server: str, step: Path) -> str:
    """The prefix of an uninterrupted run in the S3 bucket (in this process: the killed run
    below runs `python -m kiln.runner`)."""
    prefix = fresh_url("s3")
    assert run_in_bucket(read_step(step), step.parent, open_store(prefix)) == 0
    return prefix


def test_a_run_in_s3_puts_everything_in_the_bucket_and_is_served_from_it(
    s3_run: str, step: Path, capsys
) -> None:
    store = open_store(s3_run)
    assert text(store, f"{RUN}/STATUS") == "SUCCESS\n"
    names = store.keys(RUN)
    for name in ("artifact.json", "train_spec.json", "metrics.jsonl", "summary.txt",
                 "summary.json", "plots/training.png", "checkpoints/step-3/metadata.json",
                 "checkpoints/step-6/metadata.json"):  # fmt: skip
        assert name in names
    assert f"  artifact    {s3_run}/{RUN}\n" in text(store, f"{RUN}/summary.txt")
    record = json.loads(text(store, f"{RUN}/artifact.json"))
    assert record["name"] == "checkpoints/tiny" and record["provenance"]["argv"]
    for cache in ("tokenized/a/2026.11.29", "tokenized/val/2026.11.29"):  # inputs placed
        assert text(store, f"{cache}/STATUS") == "SUCCESS\n"
    assert not [k for k in store.keys("checkpoints/tiny") if k.endswith(".lease")]
    assert not [name for name in names if name.startswith("control/")]  # its key stays here

    assert run_in_bucket(read_step(step), step.parent, store) == 0  # needs no jax: in-process
    served = capsys.readouterr().out
    assert f"checkpoints/tiny@2026.11.29 is already built at {s3_run}/{RUN}" in served
    assert text(store, f"{RUN}/summary.txt") in served


def test_plan_reads_built_and_would_run_from_the_bucket(s3_run: str, capsys) -> None:
    """What `pants plan` runs for a bucket prefix (kiln_pants.plan): the records it decides on."""
    assert peek.main([s3_run, RUN, "checkpoints/other/2026.11.29"]) == 0
    read = json.loads(capsys.readouterr().out)
    assert read[RUN]["STATUS"] == "SUCCESS\n"
    assert json.loads(read[RUN]["artifact.json"])["name"] == "checkpoints/tiny"
    assert read["checkpoints/other/2026.11.29"] == {"STATUS": None, "artifact.json": None}
    assert peek.main(["s3://kiln-no-such-bucket/x", RUN]) == 4
    assert "s3://kiln-no-such-bucket/x: the bucket kiln-no-such-bucket does not exist" in (
        capsys.readouterr().err
    )


def test_a_run_killed_while_uploading_a_checkpoint_resumes_equal(
    s3_run: str, s3_server: str, step: Path, tmp_path: Path, caplog
) -> None:
    prefix = fresh_url("s3")
    gate = S3Gate(s3_server, hold=f"{RUN}/checkpoints/step-6/")
    try:
        killed = subprocess.Popen(runner(step, prefix), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL,
                                  env=environment(AWS_ENDPOINT_URL=gate.endpoint,
                                                  TMPDIR=str(tmp_path)))  # fmt: skip
        assert gate.held.wait(240), "the run never uploaded step 6"
        killed.send_signal(signal.SIGKILL)
        killed.wait()
    finally:
        gate.close()
    assert len(list(tmp_path.glob("kiln-staging-*"))) == 1  # left behind, unused by the rerun
    store = open_store(prefix)
    names = store.keys(RUN)
    assert "checkpoints/step-3/metadata.json" in names
    assert "checkpoints/step-6/metadata.json" not in names  # cut off: not complete
    assert text(store, f"{RUN}/STATUS") == "RUNNING\n"

    with caplog.at_level(logging.INFO, logger="kiln"):
        assert run_in_bucket(read_step(step), step.parent, store) == 0
    assert f"its holder, pid {killed.pid} on this host, has ended" in caplog.text
    assert text(store, f"{RUN}/STATUS") == "SUCCESS\n"
    reference = open_store(s3_run)
    assert losses(store) == losses(reference)
    got, expected = tmp_path / "got", tmp_path / "expected"
    for a, b in zip(final_state(store, got), final_state(reference, expected), strict=True):
        np.testing.assert_array_equal(a, b)


def test_denied_writes_fail_in_seconds_naming_the_url(
    s3_server: str, step: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = fresh_url("s3")
    gate = S3Gate(s3_server, deny_writes=True)
    monkeypatch.setenv("AWS_ENDPOINT_URL", gate.endpoint)
    try:
        with pytest.raises(StorageError) as denied:
            run_in_bucket(read_step(step), step.parent, open_store(prefix))
    finally:
        gate.close()
    message = str(denied.value)
    assert message.startswith(f"{prefix}/checkpoints/tiny/.2026.11.29.lease: access denied: ")
    assert "check that these credentials" in message
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    assert open_store(prefix).keys("") == []  # nothing was written


def test_a_run_in_gcs_trains_and_is_served(gcs_server: str, step: Path, capsys) -> None:
    prefix = fresh_url("gs")
    assert run_in_bucket(read_step(step), step.parent, open_store(prefix)) == 0
    assert f"kiln: built checkpoints/tiny@2026.11.29 at {prefix}/{RUN}" in capsys.readouterr().out
    store = open_store(prefix)
    assert text(store, f"{RUN}/STATUS") == "SUCCESS\n"
    assert "checkpoints/step-6/metadata.json" in store.keys(RUN)
    assert run_in_bucket(read_step(step), step.parent, open_store(prefix)) == 0
    assert f"is already built at {prefix}/{RUN}" in capsys.readouterr().out
