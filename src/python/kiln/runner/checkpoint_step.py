"""One lm_checkpoint step in one store: served, refused or built, the same way in a directory
and in a bucket, on one host or on every host of a multi-host run."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

from kiln import artifacts
from kiln.artifacts.atomic import atomic_write_json
from kiln.artifacts.folder import ArtifactFolder
from kiln.artifacts.lease import Lease
from kiln.cluster.host import INPUTS
from kiln.containment import OutsideRoot, within
from kiln.runner import leasing, replacing
from kiln.runner.decision import serve_if_built
from kiln.runner.errors import StepError
from kiln.runner.inputs import check_in_place, hold_inputs, input_locations, place_inputs
from kiln.runner.step_run import Destination, StepRun
from kiln.runner.training import failure_recorded, train
from kiln.runner.workspace import Workspace, opened
from kiln.train import multihost
from kiln_contract.layout import RECORD_FILE, RUNNING, TRAIN_SPEC_FILE
from kiln_contract.location import location_argument
from kiln_contract.step import StepSpec
from kiln_contract.train import TrainSpec
from kiln_contract.vocabulary import is_mutable_version


def run_step(
    step: StepSpec,
    inputs_root: Path,
    destination: Destination,
    group: multihost.ProcessGroup = multihost.ALONE,
    cluster_job: dict[str, Any] | None = None,
    *,
    force: bool = False,
    wait: bool = True,
) -> int:
    """Serves, refuses or builds the step. In a multi-host run every process calls this;
    process 0 alone places the inputs, holds the lease and writes STATUS and the record (with
    `cluster_job`, the Ray job's id and retries, when it is one).

    `force`: rebuild even when built (the old artifact is set aside until the new one
    succeeds). `wait`: a single-host run that finds another run building the artifact waits for
    it and serves its result; otherwise (and always with `force` or multi-host) it is refused
    at once."""
    destination.store.check()  # a missing bucket or an unreachable endpoint fails here, in seconds
    if not force and serve_if_built(step, destination.folder):
        return 0
    wait = wait and not force and not group.is_multihost
    with multihost.joined(group) as process_index, contextlib.ExitStack() as held:
        workspace = held.enter_context(
            opened(destination.folder, process_index=process_index,
                   process_count=_processes(group), staging=destination.staging)
        )  # fmt: skip
        spec = train_spec(step, inputs_root, workspace, destination)
        check_write_paths(spec, _write_root(destination, workspace))
        run = StepRun(step, spec, inputs_root, destination, workspace, group, process_index,
                      cluster_job, force)  # fmt: skip
        lease = _start_on_process_0(run, held, wait=wait)
        if process_index == 0 and lease is None:
            return 0  # the run it waited for built it (single-host only: no one else trains)
        if process_index != 0:
            workspace.pull(checkpoints=True)  # process 0 has cleaned up the bucket's leftovers
        return _train_and_publish(run, lease)


def _write_root(destination: Destination, workspace: Workspace) -> Path:
    """What every write of the run stays in: the local artifact store, else the workspace (a
    staging folder, or the scratch folder of a hermetic run)."""
    root = destination.store.root_location.folder
    return root if destination.artifact_store and root is not None else workspace.local


def _processes(group: multihost.ProcessGroup) -> int:
    if not group.is_multihost:
        return 1
    import jax

    return jax.process_count()


def _start_on_process_0(run: StepRun, held: contextlib.ExitStack, *, wait: bool) -> Lease | None:
    """Process 0 takes the lease and starts the run; every process learns whether it could
    (a collective in a multi-host run), and all raise its failure."""
    failure: Exception | None = None
    lease = None
    if run.process_index == 0:
        try:
            job = run.cluster_job["id"] if run.cluster_job else None
            lease = leasing.hold(run.step, run.destination.folder, held, wait=wait, job=job)
            if lease is not None:
                _start(run, held)
        except Exception as e:  # noqa: BLE001 - raised below, once the others know
            failure = e
    if run.process_group.is_multihost and multihost.agree_max([failure is not None])[0]:
        failure = failure or StepError(
            f"process 0 could not start {run.step.ref}; its output says why"
        )
    if failure is not None:
        raise failure
    return lease


def _start(run: StepRun, held: contextlib.ExitStack) -> None:
    """Under the artifact's lease: goes on with (or, forced, begins) the replacement of a built
    artifact, places the inputs and holds them until `held` closes, brings the run's newest
    checkpoint here and writes STATUS RUNNING, the record and, for people, the train spec."""
    step, destination, workspace = run.step, run.destination, run.workspace
    if destination.artifact_store:
        replacing.begin(step, destination.folder, force=run.force)
    written = ArtifactFolder.at(workspace.local)  # the folder the trainer writes
    with failure_recorded(written, writer=True):
        if destination.artifact_store:
            place_inputs(step, run.inputs_root, destination.store)
            hold_inputs(step, destination.store, held)
        else:
            check_in_place(step, run.inputs_root)
        if is_mutable_version(step.version) and destination.folder.is_built():
            _restart_dev_run(step, destination)
        workspace.pull(checkpoints=True)
        destination.folder.clear_stop_reason()
        _begin(run, written)
        workspace.publish(status=True, final=False)


def _train_and_publish(run: StepRun, lease: Lease | None) -> int:
    """Trains with the workspace mirrored into the store; STATUS last. A forced rebuild that
    succeeded deletes the artifact it replaced."""
    destination, workspace = run.destination, run.workspace
    compile_cache = _compile_cache(destination)
    try:
        with workspace.uploading():
            parents = destination.store if destination.artifact_store else None
            exit_code = train(run, lease, compile_cache=compile_cache, parents=parents)
    except BaseException:
        if lease is not None and lease.lost is None:  # else the run that took it owns the folder
            with contextlib.suppress(Exception):  # the store itself may be what failed
                workspace.publish(status=True, final=False)
        raise
    if lease is not None:
        workspace.publish(status=True, final=False)  # STATUS last
        if exit_code == 0 and destination.artifact_store:
            replacing.finish(run.step, destination.folder)
    return exit_code


def _compile_cache(destination: Destination) -> Path | None:
    """Where a run keeps jax's compiled programs (kiln.train.compilation_cache): in a local
    artifact store, shared by its runs; for a bucket's runs, on this machine; none for a
    scratch run (`--output`: a hermetic `pants package`)."""
    from kiln.train.compilation_cache import cache_folder

    if not destination.artifact_store:
        return None
    return cache_folder(destination.store.root_location.folder)


def train_spec(step: StepSpec, inputs_root: Path, workspace: Workspace, destination: Destination) -> TrainSpec:
    """The trainer's spec: the step's config with every input where the trainer reads it, the
    output in the workspace."""
    store = destination.store if destination.artifact_store else None
    paths = {ref: location_argument(where) for ref, where in input_locations(step, inputs_root, store).items()}
    spec = step.train_spec(workspace.local, paths, inputs_root)
    if workspace.mirror is not None:  # records and messages name the bucket, not the staging
        spec = dataclasses.replace(spec, location=destination.folder.location())
    if not workspace.per_host_folders:
        return spec
    checkpointer = dataclasses.replace(spec.runtime.checkpointer, per_host_folders=True)
    runtime = dataclasses.replace(spec.runtime, checkpointer=checkpointer)
    return dataclasses.replace(spec, runtime=runtime)


def check_write_paths(spec: TrainSpec, root: Path) -> None:
    """Before anything is written: the output lies in `root` (the prefix, the staging folder or
    the explicit --output folder) and the checkpoint folders in the output (temporaries, when
    they have a base of their own, in that base), symlinks and `..` resolved."""
    from kiln.train.checkpoints import checkpoint_roots

    output = spec.output_path
    _contained(output, root, f"the output of {spec.name}@{spec.version},")
    checkpointer = spec.runtime.checkpointer
    permanent, temporary = checkpoint_roots(output, checkpointer, spec.name, spec.version)
    _contained(permanent, output, "the checkpoint folder")
    _contained(temporary, checkpointer.temporary_base_path or output, "the temporary checkpoints")


def _contained(path: Path, root: Path, what: str) -> Path:
    try:
        return within(path, root, what)
    except OutsideRoot as e:
        raise StepError(str(e)) from None


def _restart_dev_run(step: StepSpec, destination: Destination) -> None:
    """A built dev artifact trains again from scratch: its own checkpoints are deleted, and
    nothing else (the folder's record must name this artifact, the folder must be the
    artifact's own)."""
    folder = destination.folder
    stored = folder.record() or {}
    if (stored.get("name"), stored.get("version")) != (step.name, step.version):
        raise StepError(
            f"{folder.location()} is marked built but its {RECORD_FILE} does not name "
            f"{step.ref}; it is not this artifact's folder, so nothing in it is deleted. Move "
            "it away and rerun."
        )
    checkpoints = folder.child("checkpoints")
    if not destination.store.root_location.in_bucket:
        output = Path(folder.location())
        _contained(output / "checkpoints", output, "the checkpoint folder")
    destination.store.remove_folder(checkpoints)


def _begin(run: StepRun, written: ArtifactFolder) -> None:
    """Writes STATUS RUNNING, the record (with the cluster job's id and retries, when it is one)
    and, for people, the train spec into the workspace's folder (`written`)."""
    step, cluster_job = run.step, run.cluster_job
    output = run.workspace.local
    output.mkdir(parents=True, exist_ok=True)
    written.write_status(RUNNING)
    written.clear_stop_reason()  # a reason of an earlier run
    job = {"cluster_job": cluster_job} if cluster_job else {}
    provenance = {**dataclasses.asdict(step.provenance), **job, **artifacts.built_here()}
    if cluster_job:  # the command as the job gave it: the host's folder as {inputs}
        provenance["argv"] = job_argv(provenance["argv"], run.inputs_root)
    record = {**step.record.to_json(), "provenance": provenance}
    atomic_write_json(output / RECORD_FILE, record)
    atomic_write_json(output / TRAIN_SPEC_FILE, run.spec.record_json())


def job_argv(argv: list[str], host_folder: Path) -> list[str]:
    """A cluster host's command line as the job gave it (`-m kiln.runner`, the host's folder on
    the node written back as `{inputs}`): records name no node's path."""
    folder = str(host_folder.absolute())
    return ["-m", "kiln.runner"] + [  # argv[0]: the code bundle's copy on the node
        INPUTS + arg[len(folder):] if arg == folder or arg.startswith(folder + "/") else arg
        for arg in argv[1:]
    ]
