"""End to end, the reference's cluster run as docs/clusters.md's "A cluster on one machine" writes
it: `./pants run experiments:ci_tiny_2hosts`, a quickstart-shaped `cpu(hosts=2)` target with its
local eval task and its artifact store in an S3 bucket, submitted from this machine to two Ray
nodes that share nothing but the bucket (the cluster and the bucket: tests/e2e/ray_nodes.py).

Once a checkpoint is in the bucket, the second node's raylet is SIGKILLed and a node started in
its place (`scripts/one_machine_cluster.sh add`): the job retries, naming the lost node, and ends
with the losses of an uninterrupted run. Then the rerun is served from the bucket, `plan` says
built, the hf_model export lands in the bucket, and no planted secret is in any object, log or
record. Last, a sweep built on the same cluster submits its two trainings as jobs at once.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pytest
from kiln_testing.buckets import BUCKET
from kiln_testing.processes import command_lines, environment

from kiln.artifacts.locations import open_store
from kiln.artifacts.store import ObjectStore
from kiln.cluster.connection import connect
from kiln.cluster.jobs import list_jobs
from tests.e2e.ray_nodes import Cluster
from tests.e2e.workspace import run_pants, store_rows

# The one-machine recipe's run (docs/clusters.md): ci_tiny on `cpu(hosts=2)`, with its local eval
# task and a permanent checkpoint every 10 steps, and its export.
TARGET = "experiments:ci_tiny_2hosts"
RUN = "checkpoints/ci_tiny_2hosts/2026.12.06"
BUILD = """
hf_model(
    name="tiny2_hf",
    artifact_name="hf/tiny2",
    version="2026.12.01",
    checkpoint="//experiments:ci_tiny_2hosts",
    dtype="float32",
)
"""
# Two runs of one sweep, each a job of the cluster.
SWEEP = """
lm_sweep(
    name="pair",
    version="2026.12.02",
    base=dict(
        model=llama(max_seq_len=64, hidden_dim=32, intermediate_dim=64, num_heads=2,
                    num_kv_heads=1, num_layers=1),
        optimizer=adam(learning_rate=1e-2, warmup=2),
        datasets={"//experiments:stdlib_validation": 1.0},
        validation=[],
        batch_size=4,
        seq_len=64,
        num_train_steps=20,
        z_loss_weight=None,
        evals=None,
        resources=cpu(),
        compute_dtype="float32",
    ),
    grid={"seed": [1, 2]},
)
"""
PLANTED = {"WANDB_API_KEY": "kilnplanted" + "7e" * 20, "HF_TOKEN": "hf_kilnPlantedNodeToken9"}


def train_losses(text: str) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [(r["step"], r["train/loss"]) for r in records if "train/loss" in r]


def test_a_cluster_run_from_this_machine_shares_nothing_but_the_bucket(
    cluster: Cluster, workspace: Path, tmp_path: Path
) -> None:
    repo = workspace
    (repo / "experiments/cluster").mkdir()
    (repo / "experiments/cluster/BUILD").write_text(BUILD)
    prefix = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    store = open_store(prefix)
    env = {**os.environ, **PLANTED, "WANDB_MODE": "offline"}
    options = [f"--kiln-prefix={prefix}", f"--kiln-cluster={cluster.address}"]
    earlier_folders = _host_folders(cluster)
    run = subprocess.Popen(["./pants", *options, "run", TARGET], cwd=repo, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    trainers = _kill_node_b_after_a_checkpoint(store, cluster, run)
    # The secrets only the submitting machine has reached both hosts' trainers.
    assert len(trainers) == 2 and all(PLANTED.items() <= env.items() for env in trainers)
    output, _ = run.communicate(timeout=1500)
    (tmp_path / "run.log").write_text(output)  # for a person, when this test fails
    assert run.returncode == 0, output[-6000:]
    lost_lines = [line for line in output.splitlines() if "a host of the run was lost" in line]
    assert len(lost_lines) == 1, output[-8000:]  # a second loss: its cause is printed before it
    [lost] = lost_lines
    # The node's host part that noticed first: its actor (gone with its raylet) or its trainer.
    assert re.search(r"\(process [01]'s (host|trainer) on node \S+ \([0-9a-f]{8}\) ", lost), lost
    assert "); retry 1 of 3 in 10 s, from the newest checkpoint" in lost, lost
    assert f"(host 0) kiln: built checkpoints/ci_tiny_2hosts@2026.12.06 at {prefix}/{RUN}" in output
    assert (store.read(f"{RUN}/STATUS").data.decode().strip()) == "SUCCESS"
    noise = [line for line in output.splitlines() if "AWS_ERROR" in line]
    assert not noise, noise  # no SDK noise from the bucket clients

    losses = train_losses(store.read(f"{RUN}/metrics.jsonl").data.decode())
    assert [step for step, _ in losses] == list(range(1, 41))  # one line per step
    # The same run uninterrupted, here in one process over two devices: the hosts' data
    # parallelism, reduced in the same order.
    reference = tmp_path / "reference"
    two_devices = {**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    run_pants(repo, *options, "run", TARGET, "--", "--cluster", "local", "--output",
          str(reference), env=two_devices)  # fmt: skip
    expected = train_losses((reference / "metrics.jsonl").read_text())
    np.testing.assert_allclose([v for _, v in losses], [v for _, v in expected], rtol=1e-5)

    # The job, from the documented entry (nodes without Kiln answer `list` too).
    job = re.search(r"^kiln: submitted job (\S+)$", output, re.M)
    assert job, output[-3000:]
    # One view of the two hosts: process 0's progress, and a closing line with what is built.
    assert re.search(r"^\(host 0\) step 40/40 ", output, re.M), output[-3000:]
    assert not re.search(r"^\(host 1\) (step |saved |resumed )", output, re.M), output[-3000:]
    closing = f"kiln: job {job.group(1)} SUCCEEDED; STATUS SUCCESS at {prefix}/{RUN}"
    assert output.rstrip().endswith(closing), output[-3000:]
    listed = run_pants(repo, "run", ":kiln-cluster", "--", "--cluster", cluster.address, "list",
                   env=env)  # fmt: skip
    assert re.search(rf"^{job.group(1)}  SUCCEEDED  checkpoints/ci_tiny_2hosts@2026.12.06 ",
                     listed.stdout, re.M), listed.stdout + listed.stderr[-2000:]  # fmt: skip
    status = run_pants(repo, "run", ":kiln-cluster", "--", "--cluster", cluster.address, "status",
                   job.group(1), env=env)  # fmt: skip
    assert "\nretries: 1\nmax_retries: 3\n" in status.stdout, status.stdout  # the lost node's
    # The first attempt's host on the node that survived ended its trainer and removed its
    # folder before Ray killed its actor; each host of the retry removed its own.
    assert _host_folders(cluster) == earlier_folders

    served = run_pants(repo, *options, "run", TARGET, env=env)
    assert f"is already built at {prefix}/{RUN}" in served.stdout
    planned = run_pants(repo, *options, "plan", TARGET, env=env)
    assert re.search(r"^\s+built\s+\w+\s+lm_checkpoint\s+checkpoints/ci_tiny_2hosts@2026.12.06 ",
                     planned.stdout, re.M), planned.stdout
    run_pants(repo, *options, "package", "experiments/cluster:tiny2_hf", env=env)
    assert store.read("hf/tiny2/2026.12.01/STATUS").data.decode().strip() == "SUCCESS"
    assert "hf/tiny2/2026.12.01/model.safetensors" in [
        f"hf/tiny2/2026.12.01/{name}" for name in store.keys("hf/tiny2/2026.12.01")
    ]
    listed = run_pants(repo, *options, "store", env=env)
    rows = store_rows(listed.stdout)
    assert rows["checkpoints/ci_tiny_2hosts@2026.12.06"] == ("SUCCESS", TARGET)
    assert rows["hf/tiny2@2026.12.01"] == ("SUCCESS", "experiments/cluster:tiny2_hf")
    _assert_nowhere(PLANTED.values(), store, [output, served.stdout, listed.stdout],
                    [cluster.root, cluster.ray_root])  # fmt: skip

    _a_sweep_submits_its_trainings_at_once(repo, options, cluster, store, env)


def _host_folders(cluster: Cluster) -> set[Path]:
    """The host folders on the nodes that stay up (a, and c, which replaces the killed b)."""
    return {p for node in ("a", "c") for p in (cluster.root / node / "tmp").glob("kiln-host-*")}


def _a_sweep_submits_its_trainings_at_once(
    repo: Path, options: list[str], cluster: Cluster, store: ObjectStore, env: dict[str, str]
) -> None:
    """`pants build` of a 2-run sweep with a cluster: each run a job of its own, all submitted
    at once (docs/sweeps.md): each job's driver started before the other's ended. (When their
    steps run depends on the nodes' start-up: on a loaded 2-core machine, 800-step runs submitted
    together have trained one after the other.)"""
    (repo / "experiments/pair").mkdir()
    (repo / "experiments/pair/BUILD").write_text(SWEEP)
    result = run_pants(repo, *options, "build", "experiments/pair:pair", env=env)
    assert "3 step(s) built or served." in result.stderr  # the cache and both runs
    jobs = []
    for seed in (1, 2):
        run = f"checkpoints/pair-seed{seed}/2026.12.02"
        assert store.read(f"{run}/STATUS").data.decode().strip() == "SUCCESS"
        provenance = json.loads(store.read(f"{run}/artifact.json").data)["provenance"]
        jobs.append(provenance["cluster_job"]["id"])  # trained as a job of the cluster
        assert provenance["argv"][:3] == ["-m", "kiln.runner", "{inputs}/step.json"]
        for record in ("artifact.json", "train_spec.json", "config.json", "summary.json"):
            text = store.read(f"{run}/{record}").data.decode()  # bucket locations only
            assert "kiln-host-" not in text, (record, text)
            assert str(cluster.root) not in text, (record, text)
        assert json.loads(store.read(f"{run}/summary.json").data)["metrics_file"] == (
            f"{store.location(run)}/metrics.jsonl"
        )
    assert len(set(jobs)) == 2  # each run its own job
    ray = connect(cluster.address)
    try:
        statuses = {status["job"]: status for status in list_jobs(ray)}
    finally:
        ray.shutdown()
    spans = [(statuses[job]["started_at"], statuses[job]["ended_at"]) for job in jobs]
    (started_a, ended_a), (started_b, ended_b) = spans
    assert max(started_a, started_b) < min(ended_a, ended_b), spans


def _kill_node_b_after_a_checkpoint(
    store: ObjectStore, cluster: Cluster, run: subprocess.Popen[str]
) -> list[dict[str, str]]:
    """Once step 10's checkpoint is complete in the bucket, node b's raylet is SIGKILLed (its
    host and trainer die with it) and a node takes its place, as a cluster's autoscaler would.
    Returns the environments the two trainers had."""
    deadline = time.monotonic() + 1200
    while "step-10/metadata.json" not in store.keys(f"{RUN}/checkpoints"):
        if run.poll() is not None:
            output = run.stdout.read() if run.stdout else ""
            pytest.fail(f"the run ended before its step-10 checkpoint:\n{output[-6000:]}")
        assert time.monotonic() < deadline, "no step-10 checkpoint in the bucket"
        time.sleep(0.5)
    trainers = [environment(pid) for pid, line in command_lines()
                if " --job " in line and str(cluster.root) in line]  # fmt: skip
    cluster.kill_raylet("b")
    time.sleep(2)
    cluster.script("add", "c")
    return trainers


def _assert_nowhere(
    secrets: Iterable[str], store: ObjectStore, outputs: list[str], folders: list[Path]
) -> None:
    """No planted secret in the bucket's objects, the run's output, or the nodes' files (Ray's
    logs, Kiln's caches and staging folders)."""
    values = list(secrets)
    for name in store.keys(""):
        data = store.read(name).data
        assert not [v for v in values if v.encode() in data], name
    for text in outputs:
        assert not [v for v in values if v in text]
    for path in (p for folder in folders for p in _files_written_under(folder)):
        if path.is_file() and not path.is_symlink() and path.stat().st_size < 50 << 20:
            data = path.read_bytes()
            assert not [v for v in values if v.encode() in data], path


def _files_written_under(folder: Path) -> Iterator[Path]:
    """The files under `folder`, but those pex installed from the runtime lockfile's wheels on
    a node (each wheel's sha256 checked against the lockfile's): 1.6 GB of third-party code a
    node, which nothing else writes."""
    for root, folders, files in os.walk(folder):
        if Path(root).name == "pex_root":
            folders[:] = [name for name in folders if name not in ("installed_wheels", "venvs")]
        yield from (Path(root) / name for name in files)
