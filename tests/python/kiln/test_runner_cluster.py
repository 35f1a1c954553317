"""`python -m kiln.runner ... --cluster ray://...` against a real two-node Ray cluster on
loopback (kiln_testing.ray_cluster): a job followed, detached by Ctrl-C, controlled and stopped
from elsewhere; requests the cluster can never hold, TPU slices, addresses that are wrong; a
store-mode cache tokenized on the nodes. Two hosts training one run through a lost host, in a
bucket, from nodes that have only Ray: tests/e2e/test_cluster_run.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kiln_testing.buckets import fresh_url, s3_server  # noqa: F401 - a fixture
from kiln_testing.data import STDLIB_TOKENIZER, make_spec, write_corpus
from kiln_testing.multihost import free_port, run_each
from kiln_testing.ray_cluster import ray_cluster
from kiln_testing.steps import write_step
from kiln_testing.training import write_runner_step

from kiln import artifacts
from kiln.artifacts.store import open_store
from kiln.cluster import fanout
from kiln.cluster.dispatch import ClusterJob, bundle_order, connect, reserve_slice
from kiln.cluster.placement import PlacementError, bundle, check_capacity
from kiln.data.spec import parse_cache_spec
from kiln.data.tokenize import build_cache, tokenize_shard
from kiln_contract.tokenize import shard_dir_name
from kiln_contract.train import Resources

DEVICES_PER_HOST = 2  # the step's mesh is data=2, fsdp=2: four devices over two hosts

# One host (mesh data=2 on its two devices), the control endpoint on, and no save but the ones
# asked for: the run trains until `stop`.
ENDLESS_ONE_HOST_RUN = {
    "config.num_train_steps": 100_000,
    "runtime.mesh": {"data": 2, "fsdp": 1, "tensor": 1},
    "runtime.validation_every": 100_000,
    "runtime.checkpointer.every": None,
    "runtime.checkpointer.save_interval_minutes": 10_000,
    "runtime.control.enabled": True,
}


# Each node stands in for an H100 GPU host and for a host of a 2-host v4-16 TPU slice (as Ray
# registers a TPU VM: its chips, the slice's name, and the head resource, here on both nodes).
SLICE = "kiln-test-slice"
STAND_INS = {"accelerator_type:H100": 1.0, "TPU": 4.0, "TPU-v4-16-head": 1.0, SLICE: 1.0}


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    with ray_cluster(STAND_INS, num_gpus=1, devices=DEVICES_PER_HOST,
                     node_env={"TPU_NAME": SLICE}) as address:  # fmt: skip
        yield address


def runner(step: Path, prefix: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "kiln.runner", str(step), "--inputs", str(step.parent),
            "--prefix", str(prefix), *flags]  # fmt: skip


def submitted_job(stdout: str) -> str:
    found = re.search(r"^kiln: submitted job (\S+)$", stdout, re.MULTILINE)
    assert found, stdout[-3000:]
    return found.group(1)


def kiln_cluster(address: str, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "kiln.cluster", "--cluster", address, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_a_detached_job_is_followed_controlled_and_stopped_from_elsewhere(
    cluster: str, tmp_path: Path
) -> None:
    step = write_runner_step(tmp_path, **ENDLESS_ONE_HOST_RUN)  # only `stop` ends it
    job, detached = submit_then_interrupt(runner(step, tmp_path / "store", "--cluster", cluster))
    assert detached.returncode == 130, detached.stdout[-3000:] + detached.stderr[-3000:]
    assert f"kiln: detached; job {job} goes on." in detached.stdout
    assert f"logs -f {job}" in detached.stdout  # how to follow it, and to stop it beside that
    assert f"./pants --concurrent run :kiln-cluster -- --cluster {cluster} stop {job}" in \
        detached.stdout  # fmt: skip
    run_dir = tmp_path / "store" / "checkpoints/tiny/2026.11.29"
    try:
        status = kiln_cluster(cluster, "status", job)
        assert status.returncode == 0, status.stderr
        assert f"job: {job}\nartifact: checkpoints/tiny@2026.11.29\nstate: " in status.stdout
        token = request_a_checkpoint_through_the_job(cluster, job, run_dir)
    finally:
        stopped = kiln_cluster(cluster, "stop", job)  # the trainer saves a checkpoint and stops
    assert stopped.returncode == 0, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    exit_code = re.search(rf"^kiln: job {job} is STOPPED \(exit code (\d+)\)$", stopped.stdout, re.M)
    assert exit_code, stopped.stdout

    followed = kiln_cluster(cluster, "logs", "-f", job)  # to the end: the job's exit code
    assert followed.returncode == int(exit_code.group(1)) != 0, followed.stderr[-3000:]
    assert "(host 0) training control: http://127.0.0.1:" in followed.stdout
    assert "/c/[hidden]/" in followed.stdout and token not in followed.stdout
    assert not re.search(r"/c/[A-Za-z0-9_-]{54}", followed.stdout)  # no token in the log
    listed = kiln_cluster(cluster, "list")
    assert re.search(rf"^{job}  STOPPED    checkpoints/tiny@2026.11.29 ", listed.stdout, re.M)
    ended = kiln_cluster(cluster, "endpoints", job)
    assert ended.returncode == 1
    assert ended.stderr == f"kiln: error: job {job} has ended (STOPPED): its control endpoint " \
                           "is gone\n"  # fmt: skip

    missing = kiln_cluster(cluster, "mint", "no-such-job")
    assert missing.returncode == 1
    assert missing.stderr.strip().startswith(
        f"kiln: error: no job 'no-such-job' on the Ray cluster at {cluster} "
    ), missing.stderr


def submit_then_interrupt(command: list[str]) -> tuple[str, subprocess.CompletedProcess]:
    """Submits a job, follows it, and sends the follower SIGINT (Ctrl-C) once the job is
    submitted: the job's id, and the follower's end."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
           "JAX_PLATFORMS": "cpu"}  # fmt: skip
    follower = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)  # fmt: skip
    assert follower.stdout is not None
    seen = []
    for line in follower.stdout:
        seen.append(line)
        if line.startswith("kiln: submitted job "):
            break
    follower.send_signal(signal.SIGINT)
    stdout, stderr = follower.communicate(timeout=120)
    job = submitted_job("".join(seen))
    return job, subprocess.CompletedProcess(command, follower.returncode, "".join(seen) + stdout,
                                            stderr)  # fmt: skip


def request_a_checkpoint_through_the_job(cluster: str, job: str, run_dir: Path) -> str:
    """`endpoints` lists process 0's endpoint, `mint` gives a URL for it, and a POST with the
    control header makes the trainer save a temporary checkpoint into the store. Returns the
    URL's token."""
    wait_for(lambda: (run_dir / "control/endpoint.json").exists(), "process 0's endpoint")
    listed = kiln_cluster(cluster, "endpoints", job)
    assert listed.returncode == 0, listed.stderr
    routes = "GET / \\(control page\\), GET healthz, POST checkpoint"
    line = rf"^{job}/training-control  127\.0\.0\.1:\d+  node [0-9.]+  {routes}$"
    assert re.search(line, listed.stdout, re.M), listed.stdout
    minted = kiln_cluster(cluster, "mint", f"{job}/training-control")
    assert minted.returncode == 0, minted.stderr
    url = re.search(r"^url (http://127\.0\.0\.1:\d+/c/([A-Za-z0-9_-]+)/)$", minted.stdout, re.M)
    assert url, minted.stdout
    request = urllib.request.Request(url.group(1) + "checkpoint", method="POST",
                                     headers={"X-Levanter-Training-Control": "request-checkpoint"})
    with urllib.request.urlopen(request, timeout=60) as answer:  # fmt: skip
        assert answer.status == 202
    saved = wait_for(lambda: list(run_dir.glob("checkpoints/step-*/metadata.json")), "the save")
    assert json.loads(saved[0].read_text())["is_temporary"] is True
    return url.group(2)


def wait_for(condition: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + 300  # a bound for a loaded 2-core machine, not a timing check
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.1)
    pytest.fail(f"gave up waiting for {what}")


def test_a_request_the_cluster_can_never_hold_fails_at_once(cluster: str, tmp_path: Path) -> None:
    step = write_step(tmp_path, resources={"kind": "gpu", "type": "H100", "count": 8})
    [result] = run_each([runner(step, tmp_path / "store", "--cluster", cluster)], devices=1)
    assert result.returncode == 1, result.stderr[-3000:]
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("kiln: error: resources=gpu('H100', count=8) asks for 1 host(s) with "
                            "CPU 1, GPU 8, accelerator_type:H100 each"), error  # fmt: skip
    node = rf"[0-9.]+: CPU 1, GPU 1, TPU 4, TPU-v4-16-head 1, accelerator_type:H100, {SLICE} 1"
    assert re.search(rf"0 of its 2 node\(s\) fit \({node}; {node}\)", error), error
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "store").exists()  # nothing placed, nothing started


def test_a_tpu_slice_is_reserved_by_its_head_then_placed_on_its_hosts(cluster: str) -> None:
    """What a tpu() run reserves (kiln.cluster.dispatch), on stand-in TPU nodes: the trainers
    themselves need real TPUs."""
    ray = connect(cluster)
    groups: list[Any] = []
    try:
        nodes = ray.nodes()
        check_capacity(Resources("tpu", "v4-16"), nodes, cluster)
        with pytest.raises(PlacementError, match=r"asks for a v4-32 slice: 4 host\(s\) with CPU 1"):
            check_capacity(Resources("tpu", "v4-32"), nodes, cluster)

        job = ClusterJob("slice-1", "x@1", cluster, Resources("tpu", "v4-16"), {}, "/s")
        name, head_node = reserve_slice(ray, job, groups)
        assert name == SLICE
        wanted = {**bundle(job.resources), name: 1.0}
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
        ray.shutdown()


def test_an_unreachable_cluster_is_one_line(tmp_path: Path) -> None:
    step = write_step(tmp_path)
    address = f"ray://127.0.0.1:{free_port()}"
    result = subprocess.run(runner(step, tmp_path / "store", "--cluster", address),
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 1
    assert not (tmp_path / "store").exists()
    assert result.stderr.strip() == (
        f"kiln: error: cannot reach the Ray cluster at {address} (Connection refused); check the "
        "address ([kiln] cluster in pants.toml, or --cluster) and that the cluster is up"
    )



def test_the_other_kind_of_port_is_one_line(cluster: str, tmp_path: Path) -> None:
    """A Ray Client port given as a GCS address (HOST:PORT) would make Ray wait for a minute and
    more; the runner's probe says what it is instead."""
    step = write_step(tmp_path)
    host_port = cluster.removeprefix("ray://")
    result = subprocess.run(runner(step, tmp_path / "store", "--cluster", host_port),
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.strip() == (
        f"kiln: error: {host_port} is a Ray Client port, not the cluster's GCS port: give "
        f"ray://{host_port}"
    )
    assert not (tmp_path / "store").exists()


@pytest.mark.usefixtures("s3_server")
def test_a_store_cache_tokenized_on_the_cluster_is_the_local_build(
    cluster: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """In a directory and in a bucket: there the tasks get the bucket's credentials as
    arguments (not the nodes' environment) and write every object at its final key
    (kiln_pants.cache_layout), STATUS last."""
    # Relative data files and tokenizer, as in a Pants sandbox: the tasks get them shipped.
    write_corpus(tmp_path / "data")
    shutil.copytree(STDLIB_TOKENIZER["path"], tmp_path / "tok")
    raw = make_spec({"kind": "files", "paths": ["data/*.jsonl"]}, num_shards=2)
    raw["config"]["tokenizer"] = {"kind": "local", "path": "tok"}
    monkeypatch.chdir(tmp_path)
    local = build_cache(raw, tmp_path / "local/tokenized/test/2026.11.29")

    prefix = tmp_path / "store"
    built = fan_out(raw, prefix, cluster)
    # Shard 1 of an interrupted build is finished already: its task finds and keeps it.
    tokenize_shard(built.spec, 1, Path(built.shards[1]))
    bad = {**raw, "version": "2026.12.01", "config": {**raw["config"], "text_key": "x"}}
    failing = fan_out(bad, prefix, cluster)
    in_bucket = fan_out_into_bucket(raw, fresh_url("s3"), cluster)
    ray = connect(cluster)  # one Ray Client session: seconds each on a busy head
    try:
        fanout.build(ray, built, fanout.task_files(built.spec, json.dumps(raw).encode(), None))
        with pytest.raises(fanout.TaskFailed) as failed:
            fanout.build(ray, failing, fanout.task_files(failing.spec, json.dumps(bad).encode(), None))
        fanout.build(ray, in_bucket, fanout.task_files(in_bucket.spec, json.dumps(raw).encode(), None))
    finally:
        ray.shutdown()
    output = capsys.readouterr().err
    assert "(shard 1 of 2) tokenized/test: shard 1 is already at " in output
    assert "(shard 0 of 2) tokenized/test: shard 0/2: " in output  # tokenized on a node
    assert files_of(Path(built.out)) == files_of(local)  # every file, byte for byte
    bucket = open_store(in_bucket.out)
    assert {key: bucket.read(key).data for key in bucket.keys("")} == files_of(local)
    assert not Path(built.shards[0]).parent.exists()

    # A shard that fails names the cache and the shard; nothing reads as complete.
    assert failed.value.exit_code == 2
    assert re.match(rf"tokenized/test@2026.12.01: shard \d of 2 failed on the Ray cluster at "
                    rf"{cluster} \(exit 2\): data/\w.jsonl:1: no field 'x'", str(failed.value))
    assert not (Path(failing.out) / artifacts.STATUS_FILE).exists()

    # The command serves a built cache with no cluster contact.
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(raw))
    unreachable = f"ray://127.0.0.1:{free_port()}"
    argv = [str(spec), "--cluster", unreachable, "--prefix", str(prefix),
            "--shards", *map(str, built.shards), "--out", str(built.out)]  # fmt: skip
    assert fanout.main(argv) == 0
    assert f"tokenized/test@2026.11.29: already built at {built.out}" in capsys.readouterr().err


def fan_out_into_bucket(raw: dict, prefix: str, address: str) -> fanout.FanOut:
    """A bucket's layout: the shards uploaded at their places in the cache."""
    spec = parse_cache_spec(raw)
    cache = f"{prefix}/{spec.name}/{spec.version}"
    shards = tuple(f"{cache}/shards/{shard_dir_name(i)}" for i in range(spec.num_shards))
    return fanout.FanOut(spec, shards, cache, prefix, address, record=False)


def fan_out(raw: dict, prefix: Path, address: str) -> fanout.FanOut:
    """The folders a store-mode build uses (kiln_pants.tokenize_rules)."""
    spec = parse_cache_spec(raw)
    cache = prefix / spec.name / spec.version
    shards = [cache.parent / f".{spec.version}.shards/shard-{i}" for i in range(spec.num_shards)]
    return fanout.FanOut(spec, tuple(map(str, shards)), str(cache), str(prefix), address,
                         record=False)  # fmt: skip


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
