"""End to end, what a user does with a cluster besides one run (docs/clusters.md), through real
./pants on the end-to-end tests' Ray cluster and S3 bucket (conftest.py):

- a store-mode cache tokenized on the nodes into the bucket, byte for byte the cache built
  here, served once built without reaching the cluster; a shard that fails is one line naming
  the cache, the shard and its error, and nothing reads as complete;
- a run followed, detached by Ctrl-C, its control endpoint listed and used through the job, a
  checkpoint asked for, stopped from a second command, its log followed to the end (no
  capability token in it) and listed; a run stopped wherever the stop lands (waiting for busy
  nodes, training, as it starts, in the pause before a retry) is STOPPED, never a success;
- a run the cluster can never hold, addresses that are wrong and a head whose GCS its Ray
  Client server cannot reach: one line each, in seconds.

Last, Kiln's TPU-slice reservation on the nodes' stand-in TPU resources (its trainers need
real TPUs).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kiln_testing.buckets import BUCKET
from kiln_testing.data import write_corpus
from kiln_testing.multihost import free_port
from kiln_testing.processes import command_lines

from kiln.artifacts.locations import open_store
from kiln.artifacts.store import ObjectStore
from kiln.cluster import driver, host
from kiln.cluster import jobs as cluster_jobs
from kiln.cluster.connection import connect
from kiln.cluster.placement import (
    PLACEMENT_TIMEOUT_S,
    PlacementError,
    Waiting,
    bundle,
    bundle_order,
    check_capacity,
    reserve_slice,
)
from kiln_contract.train import Resources
from tests.e2e.ray_nodes import SLICE, Cluster
from tests.e2e.workspace import run_pants

CACHE = "tokenized/fan/2026.12.03"
RUN = "checkpoints/endless/2026.12.03"
# A store-mode cache of two shards from the workspace's files, one whose shards fail, a run
# that trains until it is stopped (no save but the ones asked for), one on both nodes (which
# waits while the first holds one) and one on more hosts than the cluster has.
BUILD = """
tokenized_cache(
    name="fan",
    artifact_name="tokenized/fan",
    sources=["fan/*.jsonl"],
    tokenizer="//experiments/tokenizers:kiln-stdlib-8k",
    version="2026.12.03",
    num_shards=2,
    storage="store",
)

tokenized_cache(
    name="fan_bad",
    artifact_name="tokenized/fan_bad",
    sources=["fan/*.jsonl"],
    tokenizer="//experiments/tokenizers:kiln-stdlib-8k",
    text_key="x",
    version="2026.12.03",
    num_shards=2,
    storage="store",
)

TINY = dict(
    model=llama(max_seq_len=64, hidden_dim=32, intermediate_dim=64, num_heads=2,
                num_kv_heads=1, num_layers=1),
    optimizer=adam(learning_rate=1e-2, warmup=2),
    datasets={":fan": 1.0},
    validation=[],
    batch_size=4,
    seq_len=64,
    z_loss_weight=None,
    evals=None,
    compute_dtype="float32",
)

lm_checkpoint(
    name="endless",
    artifact_name="checkpoints/endless",
    version="2026.12.03",
    num_train_steps=100_000,
    checkpoint_interval_minutes=10_000,
    resources=cpu(),
    **TINY,
)

lm_checkpoint(
    name="two_hosts",
    artifact_name="checkpoints/two_hosts",
    version="2026.12.03",
    num_train_steps=10,
    resources=cpu(hosts=2),
    **TINY,
)

lm_checkpoint(
    name="three_hosts",
    artifact_name="checkpoints/three_hosts",
    version="2026.12.03",
    num_train_steps=10,
    resources=cpu(hosts=3),
    **TINY,
)
"""


@pytest.fixture(scope="module")
def jobs(workspace: Path) -> Path:
    """The workspace with this module's BUILD file and the cache's documents."""
    (workspace / "experiments/jobs").mkdir()
    (workspace / "experiments/jobs/BUILD").write_text(BUILD)
    write_corpus(workspace / "experiments/jobs/fan")
    return workspace


@pytest.fixture(scope="module")
def ray(cluster: Cluster) -> Iterator[Any]:
    """A Ray Client session of the test's own, to wait on a job without a command per look (the
    commands a user types are asserted once each)."""
    session = connect(cluster.address)
    try:
        yield session
    finally:
        session.shutdown()


@pytest.fixture(scope="module")
def bucket(cluster: Cluster) -> tuple[str, ObjectStore]:
    prefix = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    return prefix, open_store(prefix)


def test_a_store_cache_fans_out_into_the_bucket(
    jobs: Path, cluster: Cluster, bucket: tuple[str, ObjectStore], tmp_path: Path
) -> None:
    prefix, store = bucket
    repo, env = jobs, dict(os.environ)
    on_the_cluster = [f"--kiln-prefix={prefix}", f"--kiln-cluster={cluster.address}"]
    built = run_pants(repo, *on_the_cluster, "package", "experiments/jobs:fan", env=env)
    on_nodes = f"Tokenizing tokenized/fan@2026.12.03: 2 shard(s) on the Ray cluster {cluster.address}"
    assert on_nodes in built.stderr, built.stderr[-4000:]
    assert store.read(f"{CACHE}/STATUS").data.decode().strip() == "SUCCESS"

    # The same cache built here, into a folder: every file is the bucket's object, byte for byte.
    here = tmp_path / "here"
    run_pants(repo, f"--kiln-prefix={here}", "--kiln-cluster=local", "package",
              "experiments/jobs:fan", env=env)  # fmt: skip
    local = here / CACHE
    files = {str(p.relative_to(local)): p.read_bytes() for p in local.rglob("*") if p.is_file()}
    assert {key: store.read(f"{CACHE}/{key}").data for key in store.keys(CACHE)} == files

    # Built: served from the bucket without reaching the cluster.
    unreachable = f"ray://127.0.0.1:{free_port()}"
    served = run_pants(repo, f"--kiln-prefix={prefix}", f"--kiln-cluster={unreachable}",
                       "package", "experiments/jobs:fan", env=env)  # fmt: skip
    assert "Tokenizing" not in served.stderr, served.stderr[-3000:]

    failed = run_pants(repo, *on_the_cluster, "package", "experiments/jobs:fan_bad", env=env,
                       check=False)  # fmt: skip
    assert failed.returncode != 0
    assert re.search(rf"tokenized/fan_bad@2026.12.03: shard \d of 2 failed on the Ray cluster at "
                     rf"{cluster.address} \(exit 2\): experiments/jobs/fan/\w.jsonl:1: no field "
                     r"'x'", failed.stderr), failed.stderr[-4000:]  # fmt: skip
    assert "tokenized/fan_bad/2026.12.03/STATUS" not in store.keys("tokenized/fan_bad")


def test_a_job_is_detached_controlled_and_stopped_from_another_command(
    jobs: Path, cluster: Cluster, bucket: tuple[str, ObjectStore], ray: Any
) -> None:
    prefix, store = bucket
    repo, env = jobs, dict(os.environ)
    options = [f"--kiln-prefix={prefix}", f"--kiln-cluster={cluster.address}"]
    job, detached = submit_then_interrupt(repo, [*options, "run", "experiments/jobs:endless"], env)
    # The runner detaches (exit 130); Pants reports the interruption as its own (exit 1).
    assert detached.returncode == 1, detached.stdout[-3000:] + detached.stderr[-3000:]
    assert "Interrupted by user." in detached.stderr
    assert f"kiln: detached; job {job} goes on." in detached.stdout
    assert f"logs -f {job}" in detached.stdout  # how to follow it, and to stop it beside that
    assert f"./pants --concurrent run :kiln-cluster -- --cluster {cluster.address} stop {job}" \
        in detached.stdout  # fmt: skip

    def kiln_cluster(*args: str) -> subprocess.CompletedProcess[str]:
        return run_pants(repo, "run", ":kiln-cluster", "--", "--cluster", cluster.address,
                         *args, env=env, check=False)  # fmt: skip

    try:
        status = kiln_cluster("status", job)
        assert status.returncode == 0, status.stderr[-3000:]
        assert f"job: {job}\nartifact: checkpoints/endless@2026.12.03\nstate: " in status.stdout
        token = request_a_checkpoint_through_the_job(kiln_cluster, ray, job, store)
        a_job_waiting_for_busy_nodes_stops_at_once(repo, options, env, kiln_cluster, ray)
    finally:
        stopped = kiln_cluster("stop", job)  # the trainer saves a checkpoint and stops
    assert stopped.returncode == 0, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    exit_code = re.search(rf"^kiln: job {job} is STOPPED \(exit code (\d+)\)$", stopped.stdout, re.M)
    assert exit_code, stopped.stdout

    followed = kiln_cluster("logs", "-f", job)  # to the end: the job's exit code
    assert followed.returncode == int(exit_code.group(1)) != 0, followed.stderr[-3000:]
    assert "(host 0) training control: http://127.0.0.1:" in followed.stdout
    assert "/c/[hidden]/" in followed.stdout and token not in followed.stdout
    assert not re.search(r"/c/[A-Za-z0-9_-]{54}", followed.stdout)  # no token in the log
    listed = kiln_cluster("list")
    assert re.search(rf"^{job}  STOPPED    checkpoints/endless@2026.12.03 ", listed.stdout, re.M)
    ended = kiln_cluster("endpoints", job)
    assert ended.returncode == 1
    assert ended.stderr.endswith(f"kiln: error: job {job} has ended (STOPPED): its control "
                                 "endpoint is gone\n"), ended.stderr  # fmt: skip
    missing = kiln_cluster("mint", "no-such-job")
    assert missing.returncode == 1
    assert f"kiln: error: no job 'no-such-job' on the Ray cluster at {cluster.address} " in \
        missing.stderr  # fmt: skip
    a_rerun_stopped_as_it_starts_and_in_a_retry_pause(repo, options, env, kiln_cluster, ray)


def a_rerun_stopped_as_it_starts_and_in_a_retry_pause(
    repo: Path,
    options: list[str],
    env: dict[str, str],
    kiln_cluster: Callable[..., subprocess.CompletedProcess[str]],
    ray: Any,
) -> None:
    """The stopped run submitted again (it resumes) and stopped as soon as it is submitted, then
    once more with its trainer SIGKILLed and stopped in the pause before the retry: each time
    STOPPED with a non-zero exit, `stop` answering in seconds, and nothing reads as success."""
    job, _ = submit_then_interrupt(repo, [*options, "run", "experiments/jobs:endless"], env)
    stopped_at_once(kiln_cluster, ray, job)

    job, _ = submit_then_interrupt(repo, [*options, "run", "experiments/jobs:endless"], env)
    trainer = wait_for(lambda: [pid for pid, line in command_lines() if f" --job {job} " in line],
                       "the trainer's process")  # its runner, on a node, as soon as it starts
    for pid in trainer:
        os.kill(pid, signal.SIGKILL)
    # Asked for at once, the stop reaches the driver in the 10 s pause before the retry (the
    # loss is seen within a second; the command takes longer than that to start).
    followed = stopped_at_once(kiln_cluster, ray, job)
    retry = r"kiln: a host of the run was lost \(.*killed by signal 9\); retry 1 of \d+ in 10 s"
    assert re.search(retry, followed), followed
    last = followed.rstrip().splitlines()[-1]
    assert last == "kiln: stopped before the trainers ran (exit code 143)", followed


def stopped_at_once(
    kiln_cluster: Callable[..., subprocess.CompletedProcess[str]], ray: Any, job: str
) -> str:
    """`stop` of `job`: STOPPED with exit code 143 within seconds (well before a wait for
    placement would give up, PLACEMENT_TIMEOUT_S). The job's whole output."""
    asked = time.monotonic()
    stopped = kiln_cluster("stop", job)
    answered_in = time.monotonic() - asked
    output, status = job_output(ray, job)
    report = stopped.stdout[-3000:] + stopped.stderr[-3000:] + output[-6000:]
    assert stopped.returncode == 0, report
    assert f"kiln: job {job} is STOPPED (exit code 143)" in stopped.stdout, report
    assert answered_in < PLACEMENT_TIMEOUT_S / 2, report  # not after a placement wait or a retry
    assert (status["state"], status["exit_code"]) == ("STOPPED", 143), report
    assert "SUCCEEDED" not in output
    return output


def job_output(ray: Any, job: str) -> tuple[str, dict[str, Any]]:
    """The job's output so far, as `logs` prints it, and its status."""
    handle, lines = cluster_jobs.job(ray, job, "the test's cluster"), []
    while True:
        more, status = ray.get(handle.read.remote(len(lines)))
        lines += more
        if len(more) < driver.READ_LINES:
            return "".join(f"{line}\n" for line in lines), status


def a_job_waiting_for_busy_nodes_stops_at_once(
    repo: Path,
    options: list[str],
    env: dict[str, str],
    kiln_cluster: Callable[..., subprocess.CompletedProcess[str]],
    ray: Any,
) -> None:
    """With the endless run holding one node, a run on both nodes waits for them, saying what it
    waits for; stopped there it ends STOPPED with a non-zero exit, and `stop` returns at once
    (the wait for placement would last PLACEMENT_TIMEOUT_S)."""
    job, _ = submit_then_interrupt(repo, [*options, "run", "experiments/jobs:two_hosts"], env)
    try:
        wait_for(lambda: "kiln: waiting for the Ray cluster" in job_output(ray, job)[0],
                 "the busy line")  # fmt: skip
        waiting = kiln_cluster("logs", job)
        assert waiting.returncode == 0, waiting.stderr[-3000:]
        busy = r"kiln: waiting for the Ray cluster at \S+ to place 2 host\(s\) of CPU 1 \(STRICT"
        assert re.search(busy, waiting.stdout), waiting.stdout
        assert " busy (CPU 0 of 1 free)" in waiting.stdout, waiting.stdout
        assert " free (CPU 1 of 1 free)" in waiting.stdout, waiting.stdout
    except BaseException:
        kiln_cluster("stop", job)  # not left waiting for the nodes, whatever failed
        raise
    followed = stopped_at_once(kiln_cluster, ray, job)
    assert "kiln: stopped before the trainers ran (exit code 143)" in followed
    assert "was lost" not in followed


def submit_then_interrupt(
    repo: Path, args: list[str], env: dict[str, str]
) -> tuple[str, subprocess.CompletedProcess[str]]:
    """`./pants ARGS` follows the job it submits; once submitted, Ctrl-C (SIGINT to Pants).
    The job's id, and the command's end."""
    follower = subprocess.Popen(["./pants", *args], cwd=repo, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert follower.stdout is not None
    seen = []
    for line in follower.stdout:
        seen.append(line)
        if line.startswith("kiln: submitted job "):
            break
    follower.send_signal(signal.SIGINT)
    stdout, stderr = follower.communicate(timeout=300)
    submitted = re.search(r"^kiln: submitted job (\S+)$", "".join(seen), re.M)
    assert submitted, "".join(seen)[-3000:] + stderr[-3000:]
    result = subprocess.CompletedProcess(args, follower.returncode, "".join(seen) + stdout, stderr)
    return submitted.group(1), result


def request_a_checkpoint_through_the_job(
    kiln_cluster: Callable[..., subprocess.CompletedProcess[str]],
    ray: Any,
    job: str,
    store: ObjectStore,
) -> str:
    """`endpoints` lists process 0's endpoint, `mint` gives a URL for it, and a POST with the
    control header makes the trainer save a temporary checkpoint into the bucket. Returns the
    URL's token."""
    # Until the trainer serves it, `endpoints` says "no control endpoint yet ...".
    handle = cluster_jobs.job(ray, job, "the test's cluster")
    wait_for(lambda: ray.get(handle.endpoint.remote(None)), "process 0's endpoint")
    listed = kiln_cluster("endpoints", job)
    assert listed.returncode == 0, listed.stderr[-3000:]
    routes = "GET / \\(control page\\), GET healthz, POST checkpoint"
    line = rf"^{job}/training-control  127\.0\.0\.1:\d+  node [0-9.]+  {routes}$"
    assert re.search(line, listed.stdout, re.M), listed.stdout
    minted = kiln_cluster("mint", f"{job}/training-control")
    assert minted.returncode == 0, minted.stderr[-3000:]
    url = re.search(r"^url (http://127\.0\.0\.1:\d+/c/([A-Za-z0-9_-]+)/)$", minted.stdout, re.M)
    assert url, minted.stdout
    request = urllib.request.Request(url.group(1) + "checkpoint", method="POST",
                                     headers={"X-Levanter-Training-Control": "request-checkpoint"})
    with urllib.request.urlopen(request, timeout=60) as answer:  # fmt: skip
        assert answer.status == 202
    saved = wait_for(lambda: [k for k in store.keys(f"{RUN}/checkpoints")
                              if k.endswith("/metadata.json")], "the save")  # fmt: skip
    metadata = json.loads(store.read(f"{RUN}/checkpoints/{saved[0]}").data)
    assert metadata["is_temporary"] is True
    return url.group(2)


def wait_for(condition: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + 300  # a bound for a loaded 2-core machine, not a timing check
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.5)
    pytest.fail(f"gave up waiting for {what}")


def test_what_cannot_run_is_one_line_at_once(
    jobs: Path, cluster: Cluster, bucket: tuple[str, ObjectStore]
) -> None:
    prefix, _ = bucket
    repo, env = jobs, dict(os.environ)
    target = "experiments/jobs:three_hosts"

    def run_on(address: str) -> str:
        result = run_pants(repo, f"--kiln-prefix={prefix}", f"--kiln-cluster={address}", "run",
                           target, env=env, check=False)  # fmt: skip
        assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
        assert "Traceback" not in result.stderr
        return result.stderr.strip().splitlines()[-1]

    error = run_on(cluster.address)
    assert error.startswith("kiln: error: resources=cpu(hosts=3) asks for 3 host(s) with CPU 1 "
                            f"each, and the Ray cluster at {cluster.address} can never give it: "
                            "2 of its 2 node(s) fit ("), error  # fmt: skip
    node = r"[0-9.]+: CPU 1, TPU 4, TPU-v4-16-head 1, kiln-test-slice 1"
    assert re.search(rf"fit \({node}; {node}\)\. Change `resources` or use a bigger", error), error

    host_port = cluster.address.removeprefix("ray://")  # a Ray Client port given as a GCS one
    assert run_on(host_port) == (f"kiln: error: {host_port} is a Ray Client port, not the "
                                 f"cluster's GCS port: give ray://{host_port}")  # fmt: skip
    # An artifact store whose bucket is missing: one line from `plan` and `build` alike.
    missing = "s3://kiln-no-such-bucket/store"
    for goal in ("plan", "build"):
        result = run_pants(repo, f"--kiln-prefix={missing}", goal, target, env=env, check=False)
        assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
        assert "Exception encountered" not in result.stderr, result.stderr[-3000:]
        assert result.stderr.strip().splitlines()[-1] == (
            f"kiln: error: cannot read the artifact store: {missing}: the bucket "
            "kiln-no-such-bucket does not exist (or is not visible to these credentials): "
            "check the bucket name in the prefix"
        ), result.stderr[-3000:]
    # A head whose Ray Client server cannot reach the GCS: one line naming it, in seconds (Ray's
    # own GCS timeouts take about 40 s to say so; docs/clusters.md, "Failure behaviour").
    with cluster.gcs_paused():
        began = time.monotonic()
        error = run_on(cluster.address)
        waited = time.monotonic() - began
    assert error.startswith(f"kiln: error: the Ray cluster at {cluster.address} answers, but its "
                            "Ray Client server cannot reach the cluster's GCS at "), error  # fmt: skip
    assert waited < 30, f"the error came after {waited:.0f} s"
    address = f"ray://127.0.0.1:{free_port()}"
    assert run_on(address) == (
        f"kiln: error: cannot reach the Ray cluster at {address} (Connection refused); check the "
        "address ([kiln] cluster in pants.toml, or --cluster) and that the cluster is up"
    )


def test_a_tpu_slice_is_reserved_by_its_head_then_placed_on_its_hosts(
    cluster: Cluster, ray: Any
) -> None:
    """What a tpu() run reserves (kiln.cluster.dispatch), from here, on the stand-in TPU nodes."""
    ray.cloudpickle.register_pickle_by_value(host)  # the probe runs on a node without Kiln
    groups: list[Any] = []
    try:
        nodes = ray.nodes()
        check_capacity(Resources("tpu", "v4-16"), nodes, cluster.address)
        with pytest.raises(PlacementError, match=r"asks for a v4-32 slice: 4 host\(s\) with CPU 1"):
            check_capacity(Resources("tpu", "v4-32"), nodes, cluster.address)

        v4_16 = Resources("tpu", "v4-16")
        waiting = Waiting(threading.Event(), print)
        name, head_node = reserve_slice(ray, v4_16, cluster.address, groups, waiting)
        assert name == SLICE
        wanted = {**bundle(v4_16), name: 1.0}
        assert wanted == {"CPU": 1.0, "TPU": 4.0, SLICE: 1.0}
        group = ray.util.placement_group([wanted] * 2, strategy="STRICT_SPREAD")
        groups.append(group)
        ray.get(group.ready(), timeout=120)
        order = bundle_order(group, head_node)
        placed = ray.util.placement_group_table(group)["bundles_to_node_id"]
        assert sorted(order) == [0, 1] and placed[order[0]] == head_node != placed[order[1]]
    finally:
        for group in groups:
            ray.util.remove_placement_group(group)
