"""Cluster jobs, from any machine that reaches the cluster: submit, follow, list, status, stop,
and their control endpoint.

A job is a detached Ray actor (kiln.cluster.driver.JobDriver) named by the job's id in Kiln's
namespace: it runs the hosts and outlives the terminal that submitted it, which follows its
output until it ends, or detaches (`--detach`, Ctrl-C) and leaves it running.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from kiln.cluster import driver, node_runtime
from kiln.cluster.connection import connect
from kiln.cluster.dispatch import ClusterJob, host_environment
from kiln.cluster.errors import ClusterError
from kiln.cluster.placement import check_capacity, describe, host_count
from kiln.cluster.runtime_shipping import ship_runtime

FOLLOW_POLL_S = 0.5  # how often a follower asks the driver for new output
STOP_WAIT_S = 180.0  # how long `stop` waits for the trainers' checkpoint


def new_job_id(name: str) -> str:
    """`tiny-20261201-103000-3fa2`: the artifact's name, the time, and a random tail."""
    return f"{name.rsplit('/', 1)[-1]}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def how_to_follow(job_id: str, address: str) -> str:
    """The commands that follow and stop the job. `stop` carries `--concurrent`: a checkout's
    Pants daemon runs one command at a time, and a terminal following the job holds it."""
    command = f"run :kiln-cluster -- --cluster {address}"
    return (
        f"follow it: ./pants {command} logs -f {job_id}; "
        f"stop it (from any terminal): ./pants --concurrent {command} stop {job_id}"
    )


def run(
    job: ClusterJob,
    prepare: Callable[[], None],
    *,
    detach: bool,
    outcome: Callable[[], str] | None = None,
) -> int:
    """Submits `job` once the cluster is known to hold it and `prepare` (placing the inputs in
    the store) has run; then follows its output to the end (its exit code), or returns 0 at once
    when `detach`. `outcome` says what the job left (its closing line's second half)."""
    ray = connect(job.address)
    try:
        check_capacity(job.resources, ray.nodes(), job.address)
        prepare()
        job = dataclasses.replace(job, runtime=ship_runtime(ray, job.resources).to_json())
        handle = _start(ray, job)
        with detaching() as detached:  # from the moment the job exists, Ctrl-C detaches
            print(f"kiln: submitted job {job.job_id}", flush=True)
            if detach:
                print(f"kiln: {how_to_follow(job.job_id, job.address)}", flush=True)
                return 0
            return follow(ray, handle, job.job_id, job.address, detached, outcome)
    finally:
        ray.shutdown()


def _start(ray: Any, job: ClusterJob) -> Any:
    summary = {
        "artifact": job.artifact, "address": job.address,
        "resources": describe(job.resources), "hosts": host_count(job.resources),
        "max_retries": job.max_retries, "prefix": job.prefix,
    }  # fmt: skip
    handle = (
        ray.remote(driver.JobDriver)
        .options(
            name=job.job_id,
            lifetime="detached",
            num_cpus=0,  # the hosts' bundles hold the cluster's CPUs
            resources=node_runtime.ON_HEAD,  # it lives as long as the cluster, not a worker
            max_concurrency=8,  # status, read and stop answer while the job runs
            runtime_env=node_runtime.worker_env(),
        )
        .remote(job.job_id, job.to_json(), summary)
    )
    # The hosts' secrets go as an argument of this call only: not in the driver's creation
    # task (which Ray keeps) nor in a runtime_env (which Ray shows); docs/clusters.md, "Secrets".
    ray.get(handle.start.remote(host_environment()))  # the job goes on without this process
    return handle


@contextlib.contextmanager
def detaching() -> Iterator[threading.Event]:
    """An event that Ctrl-C (or SIGTERM) sets while the block runs, in place of their usual
    effect: the signal only sets a flag, so that no Ray Client call is cut off midway."""
    detached = threading.Event()
    handlers = {sig: signal.signal(sig, lambda *_: detached.set())
                for sig in (signal.SIGINT, signal.SIGTERM)}  # fmt: skip
    try:
        yield detached
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def follow(
    ray: Any,
    handle: Any,
    job_id: str,
    address: str,
    detached: threading.Event,
    outcome: Callable[[], str] | None = None,
) -> int:
    """Prints the job's output as it comes until the job ends, then a closing line with the
    job's state (and `outcome`, when given); returns its exit code. When `detached` is set
    (`detaching`: Ctrl-C or SIGTERM), exit 130: the job goes on, and how to reattach is
    printed."""
    offset = 0
    while not detached.is_set():
        lines, status = _call(ray, handle.read.remote(offset), job_id)
        for line in lines:
            print(line, flush=True)
        offset += len(lines)
        if status["state"] in driver.FINISHED and len(lines) < driver.READ_LINES:
            closing = f"kiln: job {job_id} {status['state']}"
            print(f"{closing}; {outcome()}" if outcome else closing, flush=True)
            return int(status["exit_code"])
        if not lines:
            detached.wait(FOLLOW_POLL_S)
    print(f"\nkiln: detached; job {job_id} goes on. {how_to_follow(job_id, address)}", flush=True)
    return 130


def job(ray: Any, job_id: str, address: str) -> Any:
    """The driver of job `job_id`; ClusterError when the cluster has no such job."""
    try:
        return ray.get_actor(job_id)
    except ValueError:
        raise ClusterError(
            f"no job {job_id!r} on the Ray cluster at {address} (finished jobs are kept "
            f"{driver.KEEP_FINISHED_S // 3600} h); `./pants run :kiln-cluster -- list` shows its jobs"
        ) from None


def list_jobs(ray: Any) -> list[dict[str, Any]]:
    """Every job's status, oldest first."""
    job_names = ray.remote(driver.job_names).options(
        num_cpus=0, runtime_env=node_runtime.worker_env()
    )
    names = ray.get(job_names.remote())
    statuses = [_call(ray, ray.get_actor(name).status.remote(), name) for name in names]
    return sorted(statuses, key=lambda status: status["started_at"])


def stop(ray: Any, handle: Any, job_id: str) -> dict[str, Any] | None:
    """Asks the job to save a checkpoint and stop, waits for it, and returns its status; None
    when it had already finished."""
    if not _call(ray, handle.stop.remote(), job_id):
        return None
    print(f"kiln: stopping job {job_id} (the trainers save a checkpoint) ...", flush=True)
    deadline = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < deadline:
        status = _call(ray, handle.status.remote(), job_id)
        if status["state"] in driver.FINISHED:
            return status
        time.sleep(FOLLOW_POLL_S)
    raise ClusterError(f"job {job_id} did not stop within {STOP_WAIT_S:.0f} s; ask again")


def endpoint(
    ray: Any, handle: Any, job_id: str, ttl_minutes: float | None = None
) -> dict[str, Any]:
    """The control endpoint job `job_id` serves (kiln.cluster.endpoints; with a capability URL
    when `ttl_minutes`); ClusterError when it serves none."""
    found = _call(ray, handle.endpoint.remote(ttl_minutes), job_id)
    if found is not None:
        return dict(found)
    status = _call(ray, handle.status.remote(), job_id)
    if status["state"] in driver.FINISHED:
        raise ClusterError(f"job {job_id} has ended ({status['state']}): its control endpoint "
                           "is gone")  # fmt: skip
    raise ClusterError(
        f"job {job_id} has no control endpoint yet: its process 0 serves one once training "
        "starts (and none with runtime.control.enabled false); ask again in a moment"
    )


def _call(ray: Any, ref: Any, job_id: str) -> Any:
    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ClusterError(f"the driver of job {job_id} is gone ({reason})") from None
