"""`python -m kiln.runner --prefix s3://…` and `gs://…`, each test on both (S3 on moto's server,
GCS on fake-gcs-server, on loopback): a step trains with its artifact store in the bucket and
its input caches read from there; a rerun is served from the bucket; `plan` reads built and
would run from it; a second run while one trains is refused, naming the holder; a run
SIGKILLed while it uploads a checkpoint resumes from the newest complete one and ends equal to
an uninterrupted run; "saved" is said once the bucket holds the checkpoint; denied writes fail in
seconds, naming the URL."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from kiln_testing.buckets import ENDPOINT_VARIABLES, BucketGate, fresh_url
from kiln_testing.processes import python_env
from kiln_testing.training import write_runner_step

from kiln.artifacts import peek
from kiln.artifacts.folder import ArtifactFolder
from kiln.artifacts.locations import open_store
from kiln.artifacts.storage_errors import StorageError
from kiln.artifacts.store import ObjectStore
from kiln.runner.checkpoint_step import run_step
from kiln.runner.command_line import read_step
from kiln.runner.errors import StepError
from kiln.runner.inputs import place_inputs
from kiln.runner.step_run import Destination
from kiln_contract.step import StepSpec

REF = "checkpoints/tiny@2026.11.29"
RUN = "checkpoints/tiny/2026.11.29"
STEPS = {"config.num_train_steps": 6, "runtime.checkpointer.every": 3}


@pytest.fixture(scope="module")
def step(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_runner_step(tmp_path_factory.mktemp("bucket-runs"), **STEPS)


def runner(step: Path, prefix: str) -> list[str]:
    return [sys.executable, "-m", "kiln.runner", str(step), "--inputs", str(step.parent),
            "--prefix", prefix]  # fmt: skip


def environment(**extra: str) -> dict[str, str]:
    return python_env(JAX_PLATFORMS="cpu", **extra)


def run(command: list[str], **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, env=environment(**extra), capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def run_in_bucket(step: StepSpec, inputs: Path, store: ObjectStore, *, wait: bool = True) -> int:
    """The runner's one path, with its artifact store in the bucket."""
    return run_step(step, inputs, Destination(ArtifactFolder(store, RUN)), wait=wait)


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


@pytest.fixture(scope="module", params=["s3", "gs"])
def scheme(request: pytest.FixtureRequest) -> str:
    """The bucket flavour under test, its server started."""
    request.getfixturevalue({"s3": "s3_server", "gs": "gcs_server"}[request.param])
    return str(request.param)


@pytest.fixture
def server(scheme: str) -> str:
    """The test server's endpoint, as the environment points clients at it."""
    return os.environ[ENDPOINT_VARIABLES[scheme]]


@pytest.fixture(scope="module")
def uninterrupted(scheme: str, step: Path) -> str:
    """The prefix of an uninterrupted run in the bucket (in this process: the killed run
    below runs `python -m kiln.runner`)."""
    prefix = fresh_url(scheme)
    assert run_in_bucket(read_step(step), step.parent, open_store(prefix)) == 0
    return prefix


def test_a_run_puts_everything_in_the_bucket_and_is_served_from_it(
    uninterrupted: str, step: Path, capsys
) -> None:
    store = open_store(uninterrupted)
    assert text(store, f"{RUN}/STATUS") == "SUCCESS\n"
    names = store.keys(RUN)
    for name in ("artifact.json", "train_spec.json", "metrics.jsonl", "summary.txt",
                 "summary.json", "plots/training.png", "checkpoints/step-3/metadata.json",
                 "checkpoints/step-6/metadata.json"):  # fmt: skip
        assert name in names
    assert f"  artifact    {uninterrupted}/{RUN}\n" in text(store, f"{RUN}/summary.txt")
    # Records name the artifact in the bucket, never a host's staging folder.
    summary = json.loads(text(store, f"{RUN}/summary.json"))
    assert summary["checkpoint"] == f"{uninterrupted}/{RUN}/checkpoints/step-6"
    assert summary["output_path"] == f"{uninterrupted}/{RUN}"
    record = json.loads(text(store, f"{RUN}/artifact.json"))
    assert record["name"] == "checkpoints/tiny" and record["provenance"]["argv"]
    caches = ("tokenized/a/2026.11.29", "tokenized/val/2026.11.29")
    for cache in caches:  # inputs placed
        assert text(store, f"{cache}/STATUS") == "SUCCESS\n"
    datasets = json.loads(text(store, f"{RUN}/train_spec.json"))["config"]
    read = [d["path"] for d in datasets["datasets"] + datasets["validation"]]
    assert read == [f"{uninterrupted}/{cache}" for cache in caches]  # streamed from the bucket
    assert not [k for k in store.keys("checkpoints/tiny") if k.endswith(".lease")]
    assert not [name for name in names if name.startswith("control/")]  # its key stays here

    assert run_in_bucket(read_step(step), step.parent, store) == 0  # needs no jax: in-process
    served = capsys.readouterr().out
    assert f"{REF} is already built at {uninterrupted}/{RUN}" in served
    assert text(store, f"{RUN}/summary.txt") in served


def test_plan_reads_built_and_would_run_from_the_bucket(
    uninterrupted: str, scheme: str, capsys
) -> None:
    """What `pants plan` runs for a bucket prefix (kiln_pants.plan): the records it decides on."""
    assert peek.main([uninterrupted, RUN, "checkpoints/other/2026.11.29"]) == 0
    read = json.loads(capsys.readouterr().out)
    assert read[RUN]["STATUS"] == "SUCCESS\n"
    assert json.loads(read[RUN]["artifact.json"])["name"] == "checkpoints/tiny"
    absent = {"STATUS": None, "artifact.json": None, "failure.txt": None}
    assert read["checkpoints/other/2026.11.29"] == absent
    assert read[RUN]["failure.txt"] is None

    store = open_store(fresh_url(scheme))  # failure.txt is read beside an unfinished STATUS
    for folder, status in (("a/1", b"FAILED\n"), ("b/1", b"SUCCESS\n")):
        store.write(f"{folder}/STATUS", status)
        store.write(f"{folder}/failure.txt", f"{folder} ran out of memory".encode())
    store.write("c/1/artifact.json", b"{}")  # a run that stopped before its STATUS
    store.write("c/1/failure.txt", b"c/1 was stopped")
    assert peek.main([store.location(""), "a/1", "b/1", "c/1"]) == 0
    read = json.loads(capsys.readouterr().out)
    failures = {folder: files["failure.txt"] for folder, files in read.items()}
    assert failures == {"a/1": "a/1 ran out of memory", "b/1": None, "c/1": "c/1 was stopped"}
    missing = f"{scheme}://kiln-no-such-bucket/x"
    assert peek.main([missing, RUN]) == 4
    assert f"{missing}: the bucket kiln-no-such-bucket does not exist" in capsys.readouterr().err


def test_store_caches_are_read_where_they_were_built_in_the_bucket(
    uninterrupted: str, scheme: str, step: Path, tmp_path: Path
) -> None:
    """A storage="store" input names its URL in the bucket (kiln_pants.train_rules): the run
    reads it there, finished with the same record, and copies nothing; elsewhere it is refused."""
    raw = json.loads(step.read_text())
    for entry in raw["inputs"]:
        del entry["location"]
        entry["store_path"] = f"{uninterrupted}/{entry['name']}/{entry['version']}"
    (tmp_path / "step.json").write_text(json.dumps(raw))
    store_step = read_step(tmp_path / "step.json")
    place_inputs(store_step, tmp_path, open_store(uninterrupted))  # nothing under tmp_path
    elsewhere = fresh_url(scheme)
    with pytest.raises(StepError, match=rf"{elsewhere}/tokenized/a/2026.11.29 holds no finished"):
        place_inputs(store_step, tmp_path, open_store(elsewhere))


def test_a_second_run_is_refused_and_a_killed_upload_resumes_equal(
    uninterrupted: str, scheme: str, server: str, step: Path, tmp_path: Path, caplog
) -> None:
    prefix = fresh_url(scheme)
    gate = BucketGate(server, hold=f"{RUN}/checkpoints/step-6/")
    try:
        killed = subprocess.Popen(runner(step, prefix), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL,
                                  env=environment(**{ENDPOINT_VARIABLES[scheme]: gate.endpoint},
                                                  TMPDIR=str(tmp_path)))  # fmt: skip
        assert gate.held.wait(240), "the run never uploaded step 6"
        # Two runs at once: the one training holds the lease; the second (--no-wait) names it
        # and stops.
        with pytest.raises(StepError) as refused:
            run_in_bucket(read_step(step), step.parent, open_store(prefix), wait=False)
        holder = f"held by train {REF} (host {socket.gethostname()}, pid {killed.pid}, since "
        assert holder in str(refused.value) and "nothing was changed" in str(refused.value)
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
    reference = open_store(uninterrupted)
    assert losses(store) == losses(reference)
    got, expected = tmp_path / "got", tmp_path / "expected"
    for a, b in zip(final_state(store, got), final_state(reference, expected), strict=True):
        np.testing.assert_array_equal(a, b)


def test_denied_writes_fail_in_seconds_naming_the_url(
    scheme: str, server: str, step: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = fresh_url(scheme)
    gate = BucketGate(server, deny_writes=True)
    monkeypatch.setenv(ENDPOINT_VARIABLES[scheme], gate.endpoint)
    try:
        with pytest.raises(StorageError) as denied:
            run_in_bucket(read_step(step), step.parent, open_store(prefix))
    finally:
        gate.close()
    message = str(denied.value)
    assert message.startswith(f"{prefix}/checkpoints/tiny/.2026.11.29.lease: access denied")
    assert "check that these credentials" in message
    monkeypatch.setenv(ENDPOINT_VARIABLES[scheme], server)
    assert open_store(prefix).keys("") == []  # nothing was written


def test_force_rebuilds_in_the_bucket_then_deletes_the_replaced_artifact(
    uninterrupted: str, step: Path, capsys
) -> None:
    """Last in this file: it rebuilds the artifact the tests above read (to the same values)."""
    store = open_store(uninterrupted)
    before = losses(store)
    target = Destination(ArtifactFolder(store, RUN))
    assert run_step(read_step(step), step.parent, target, force=True) == 0
    said = capsys.readouterr().out
    aside = f"{uninterrupted}/checkpoints/tiny/.2026.11.29.replaced"
    assert f"kiln: --force: moved {uninterrupted}/{RUN} aside to {aside}" in said
    assert f"kiln: deleted the replaced {REF} ({aside})" in said
    assert store.keys("checkpoints/tiny/.2026.11.29.replaced") == []
    assert text(store, f"{RUN}/STATUS") == "SUCCESS\n" and losses(store) == before


def test_saved_is_said_once_the_bucket_holds_the_checkpoint(
    s3_server: None, step: Path, tmp_path: Path
) -> None:
    """While the bucket has not taken step 3's upload (held by a proxy), the run says nothing
    of step 3; once it has, the run says it saved step 3, and a kill right after that line
    leaves a bucket the rerun resumes from step 3 or later."""
    prefix = fresh_url("s3")
    gate = BucketGate(os.environ[ENDPOINT_VARIABLES["s3"]], hold=f"{RUN}/checkpoints/step-3/")
    log = tmp_path / "run.out"
    with log.open("w") as out:
        killed = subprocess.Popen(runner(step, prefix), stdout=out, stderr=subprocess.DEVNULL,
                                  env=environment(**{ENDPOINT_VARIABLES["s3"]: gate.endpoint}))  # fmt: skip
    try:
        assert gate.held.wait(240), "the run never uploaded step 3"
        time.sleep(3)  # training goes on meanwhile, and reaches its last save
        saved = f"saved permanent checkpoint {prefix}/{RUN}/checkpoints/step-3 "
        assert "saved permanent checkpoint" not in log.read_text(), log.read_text()
        gate.release()
        deadline = time.monotonic() + 240
        while saved not in log.read_text():
            assert killed.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.01)
        killed.send_signal(signal.SIGKILL)
        killed.wait()
    finally:
        gate.close()
    assert "checkpoints/step-3/metadata.json" in open_store(prefix).keys(RUN)
    rerun = run(runner(step, prefix))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    resumed = re.search(r"resumed from \S+/checkpoints/step-(\d+)", rerun.stdout + rerun.stderr)
    assert resumed and int(resumed[1]) >= 3, rerun.stdout
