"""Running one step's trainer on a Ray cluster: one `python -m kiln.runner` process per host.

The submitting runner has already served, refused or placed the inputs in the artifact store
(a bucket every host reaches, or a directory every host mounts). It connects to the cluster
(kiln.cluster.connection), checks that the cluster can ever hold the request (Ray itself would
wait forever: kiln.cluster.placement) and ships Kiln's runtime to the cluster through Ray
(kiln.cluster.node_runtime: its sources, and the runtime PEX Pants built); the job's driver
(kiln.cluster.driver, started by kiln.cluster.jobs) then calls `run_hosts`, which reserves one
bundle per host (STRICT_SPREAD: one host each; a TPU slice by its head first) and starts a
`host.TrainerHost` actor on each; the hosts run the multi-host runner with the coordinator on
host 0 (`--coordinator IP:PORT --num-processes N --process-id I`), so process 0 holds the lease
and writes the record as in any multi-host run. A host that is lost (its node, its actor or its
trainer) ends the attempt; the next one, after a pause that doubles each time, checks the
cluster's capacity again and resumes from the newest checkpoint.

A TPU slice's hosts join with `--coordinator auto`: on TPU VMs jax reads the coordinator (host
0) and each process's id from the VM's metadata, so process ids are the TPU worker ids, and the
host actor on the slice head's node is host 0.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kiln.cluster import host, node_runtime
from kiln.cluster.errors import ClusterError
from kiln.cluster.placement import (
    CAPACITY_WAIT_S,
    Stopped,
    Waiting,
    bundle,
    bundle_order,
    host_count,
    reserve,
    reserve_slice,
    wait_for_capacity,
)
from kiln_contract.location import in_bucket
from kiln_contract.step import STEP_FILE
from kiln_contract.train import Resources

STAGING_DIR = "staging"  # in a host's inputs folder: where a run in a bucket stages its files
STOP_TIMEOUT_S = 120.0  # after `stop`, how long the trainers get to save a checkpoint
STOP_POLL_S = 1.0  # how often the driver looks for a `stop` while the hosts train
RETRY_PAUSE_S = 10.0  # before the first retry after a lost host; doubled for each one after
RETRY_PAUSE_MAX_S = 120.0
ABANDON_TIMEOUT_S = 10.0  # how long a lost attempt's hosts get to end and remove their folders


# What every host's trainer gets from the submitting machine's environment: the tracker's and the
# Hub's keys and settings and the buckets' credentials (kiln_pants.build.TRAINING_ENVIRONMENT),
# less the variables that name this machine's files and folders (HOME, HF_HOME, AWS_CONFIG_FILE,
# AWS_SHARED_CREDENTIALS_FILE, GOOGLE_APPLICATION_CREDENTIALS, CLOUDSDK_CONFIG): each host
# keeps its own.
HOST_ENVIRONMENT = (
    "WANDB_API_KEY", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_MODE", "WANDB_BASE_URL", "HF_TOKEN",
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
    "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_EC2_METADATA_DISABLED",
    "STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL",
)  # fmt: skip


@dataclass(frozen=True)
class ClusterJob:
    job_id: str  # the name of the job's driver (kiln.cluster.jobs.new_job_id)
    artifact: str  # NAME@VERSION, for people
    address: str  # ray://HOST:PORT (Ray Client) or HOST:PORT (the cluster's GCS)
    resources: Resources
    files: Mapping[str, bytes]  # the step (STEP_FILE) and its eval task files, by relative path
    prefix: str  # the artifact store: a bucket URL, or a directory every host mounts
    max_retries: int = 3  # attempts after a lost host, each from the newest checkpoint
    force: bool = False  # process 0 rebuilds a built artifact (kiln.runner --force)
    runtime: dict[str, Any] = field(default_factory=dict)  # node_runtime.NodeRuntime, as JSON

    @property
    def in_bucket(self) -> bool:
        return in_bucket(self.prefix)

    def run_dir(self, inputs: str) -> str:
        """Where a host's runner builds the artifact (process 0's holds its control endpoint):
        its folder in a mounted store, or the host's staging folder of a run in a bucket."""
        if self.in_bucket:
            return f"{inputs}/{STAGING_DIR}/run"
        step = json.loads(self.files[STEP_FILE])
        return f"{self.prefix.rstrip('/')}/{step['name']}/{step['version']}"

    def runner_argv(self, coordinator: str, process_id: int) -> list[str]:
        """Host `process_id`'s `python -m kiln.runner` arguments (on a TPU slice, jax finds the
        coordinator and process ids itself)."""
        argv = [
            f"{host.INPUTS}/{STEP_FILE}", "--inputs", host.INPUTS, "--prefix", self.prefix,
            "--job", self.job_id, "--max-retries", str(self.max_retries),
        ]  # fmt: skip
        if self.force:
            argv.append("--force")
        if self.in_bucket:
            argv += ["--staging", f"{host.INPUTS}/{STAGING_DIR}"]
        if self.resources.kind == "tpu":
            return [*argv, "--coordinator", "auto"]
        hosts = str(host_count(self.resources))
        return [*argv, "--coordinator", coordinator, "--num-processes", hosts,
                "--process-id", str(process_id)]  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        """Plain values (and the files' bytes): the driver unpickles it before it can import
        Kiln."""
        return {
            "job_id": self.job_id, "artifact": self.artifact, "address": self.address,
            "resources": self.resources.to_json(), "files": dict(self.files),
            "prefix": self.prefix, "max_retries": self.max_retries, "force": self.force,
            "runtime": self.runtime,
        }  # fmt: skip

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ClusterJob:
        return cls(**{**obj, "resources": Resources.from_json(obj["resources"])})


def host_environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The HOST_ENVIRONMENT variables set here: an argument of the job's start and of each
    host's run, never a command line, runtime_env, record or log line."""
    return {name: environ[name] for name in HOST_ENVIRONMENT if environ.get(name)}


def run_hosts(
    job_json: dict[str, Any],
    environment: dict[str, str],
    driver_actor: Any,
    sayers: tuple[Callable[[str], None], Callable[[str], None]],
    stopping: threading.Event,
    process_0: Callable[[Any], None],
) -> int:
    """In the job's driver (kiln.cluster.driver): runs the hosts, their output going to
    `driver_actor.write` and `environment` in their trainers' environment. A lost host (its
    actor or node died, or its trainer was killed by a signal) ends the attempt; after a pause
    the next one waits up to CAPACITY_WAIT_S for the cluster to hold the run again (a node may
    have to come back first) and resumes from the newest checkpoint, up to `max_retries` times.
    Waiting for busy nodes is not a lost host: it says what it waits for, and ends the job
    (PlacementError) when the nodes stay busy. `stopping` asks the trainers to save a checkpoint
    and stop, and ends any wait at once (host.STOPPED_EXIT); `process_0` is told each attempt's
    host 0 actor (None once it ends), which finds the control endpoint. Returns the runners' exit
    code."""
    import ray

    say, say_retry = sayers  # a line of the job's output; one announcing a retry (counted)
    job = ClusterJob.from_json(job_json)
    for module in (host, node_runtime):  # the hosts need no Kiln to start the actor
        ray.cloudpickle.register_pickle_by_value(module)
    waiting = Waiting(stopping, say)
    lost = ""
    for attempt in range(job.max_retries + 1):
        try:
            if attempt:
                pause = min(RETRY_PAUSE_S * 2 ** (attempt - 1), RETRY_PAUSE_MAX_S)
                say_retry(f"kiln: a host of the run was lost ({lost}); retry {attempt} of "
                    f"{job.max_retries} in {pause:.0f} s, from the newest checkpoint")  # fmt: skip
                if stopping.wait(pause):
                    raise Stopped()
            # A retry waits for a lost node's place to be taken, apart from max_retries; a
            # cluster that cannot hold the run ends the job, naming what it lacks.
            wait_for_capacity(job.resources, ray.nodes, job.address, waiting=waiting,
                              seconds=CAPACITY_WAIT_S if attempt else 0.0)  # fmt: skip
            if stopping.is_set():  # asked for before placement: nothing is reserved or started
                raise Stopped()
            outcome = _attempt(ray, job, environment, driver_actor, waiting, process_0)
        except Stopped:
            say(f"kiln: stopped before the trainers ran (exit code {host.STOPPED_EXIT})")
            return host.STOPPED_EXIT
        if isinstance(outcome, int):
            return outcome
        lost = outcome
    raise ClusterError(
        f"a host of the cluster run was lost {job.max_retries + 1} times (last: {lost}); "
        "rerun to resume from the newest checkpoint"
    )


def _attempt(
    ray: Any,
    job: ClusterJob,
    environment: dict[str, str],
    driver_actor: Any,
    waiting: Waiting,
    process_0: Callable[[Any], None],
) -> int | str:
    """One run of every host: the exit code, or why a host was lost. Stopped when a stop is
    asked for before the hosts start."""
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    groups: list[Any] = []  # every placement group reserved, released at the end
    hosts: list[Any] = []
    runs: list[Any] = []
    try:
        wanted, first_node = bundle(job.resources), None
        if job.resources.kind == "tpu":
            slice_name, first_node = reserve_slice(
                ray, job.resources, job.address, groups, waiting
            )
            wanted[slice_name] = 1.0
        bundles = [wanted] * host_count(job.resources)
        group = reserve(ray, job.address, bundles, "STRICT_SPREAD", groups, waiting)
        trainer_host = ray.remote(host.TrainerHost)
        hosts = [
            trainer_host.options(
                num_cpus=wanted["CPU"],
                num_gpus=wanted.get("GPU", 0),
                resources={k: v for k, v in wanted.items() if k not in ("CPU", "GPU")},
                max_concurrency=4,  # `stop` and `endpoint` answer while `run` waits
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, index),
            ).remote(job.run_dir(host.INPUTS))
            for index in bundle_order(group, first_node)
        ]
        nodes = ray.get([h.node.remote() for h in hosts])
        process_0(hosts[0])
        tpu = job.resources.kind == "tpu"
        coordinator = "auto" if tpu else ray.get(hosts[0].coordinator_address.remote())
        trainer_environment = {**job.resources.process_env(), **environment}
        runs = [
            h.run.remote(dict(job.files), job.runner_argv(coordinator, i), job.runtime,
                         trainer_environment, driver_actor, i)  # fmt: skip
            for i, h in enumerate(hosts)
        ]
        return _wait(ray, hosts, runs, nodes, waiting.stopping)
    finally:
        process_0(None)
        _end_hosts(ray, hosts, runs)
        for reserved in groups:
            remove_placement_group(reserved)


def _end_hosts(ray: Any, hosts: list[Any], runs: list[Any]) -> None:
    """Ends an attempt's hosts. One whose trainer still runs (a host was lost elsewhere) ends it
    and removes its folder before Ray kills its actor: a killed actor leaves its folder on its
    node, and a trainer dies with its actor."""
    for h in hosts:
        h.abandon.remote()
    if runs:
        ray.wait(runs, num_returns=len(runs), timeout=ABANDON_TIMEOUT_S)
    for h in hosts:
        ray.kill(h)


def _wait(
    ray: Any, hosts: list[Any], runs: list[Any], nodes: list[str], stopping: threading.Event
) -> int | str:
    """The first non-zero exit code of the hosts' runners (0 when all succeed), or why a host
    was lost (naming its node), as soon as one is. Once `stopping` is set, every trainer saves a
    checkpoint and stops."""
    codes = []
    pending = list(runs)
    while pending:
        if stopping.is_set():
            for h in hosts:
                h.stop.remote()
            try:
                stopped = ray.get(runs, timeout=STOP_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise ClusterError(
                    f"the trainers did not stop within {STOP_TIMEOUT_S:.0f} s of `stop`: they "
                    "were killed, and a rerun resumes from the newest checkpoint"
                ) from None
            # A trainer stopped before it handles SIGTERM dies of it: 128 + 15, as a shell says.
            return next((128 - c if c < 0 else c for c in stopped if c != 0), 0)
        done, pending = ray.wait(pending, num_returns=1, timeout=STOP_POLL_S)
        if not done:
            continue
        index = runs.index(done[0])
        try:
            code = ray.get(done[0])
        except ray.exceptions.RayError as e:
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            return f"process {index}'s host on node {nodes[index]} is gone: {reason}"
        if code < 0:
            return f"process {index}'s trainer on node {nodes[index]} was killed by signal {-code}"
        codes.append(code)
    return next((code for code in codes if code != 0), 0)
