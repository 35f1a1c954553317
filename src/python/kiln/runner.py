"""`python -m kiln.runner STEP.json ...`: build one lm_checkpoint artifact, Marin's StepRunner for
one step, run by `pants run` (interactive) and `pants package` (a cached process).

The Pants backend has already built the input caches (cached processes) and placed them under
`--inputs`. This runner parses the step spec once (kiln_contract.step), then:
  1. decides: already built with this fingerprint -> report and stop; built with another
     fingerprint -> refuse, naming the fields that differ (bump the version, or --force);
     otherwise:
  2. takes the artifact's lease (kiln.artifacts.lease) and holds it until the end. While another
     run holds it, this one waits, saying who builds it and how far it is, then serves its
     result ("already built"); --no-wait refuses at once, naming the holder. With --force the
     built artifact is set aside (kiln.artifacts.replacement) and deleted only once the
     rebuild succeeds;
  3. places each input cache in the artifact store at `{prefix}/{name}/{version}` (a copy,
     verified file by file against the cache's digests, renamed into place; an existing copy
     must have the same fingerprint and its files their recorded sizes), so records point at
     stable paths;
  4. writes STATUS RUNNING and the record with provenance, trains, resuming from the newest
     checkpoint, and writes STATUS last: SUCCESS, or FAILED when anything fails.
A code-only change does not retrain a finished artifact: the record keeps the code digest it was
built with, and a differing one is reported ("built by other code"), never silently discarded.

Exit status: 0 built or served; 1 an expected error (one paragraph: bad input, a damaged input
cache, a lease held by another run with --no-wait or --force, a run waited for that failed); 2
the loss diverged; 3 stopped early by --max-steps (rerun to continue); 4 a storage error, as one
line `kiln: error: PATH: CAUSE` (no space, no permission, an I/O error: fix it and rerun, the run
resumes); 128 + N stopped by signal N.

Containment: before anything is written, the output, the checkpoint folders and each input it
places are resolved and checked to lie in the prefix (or the explicit --output folder), and a
dev rerun deletes only its own artifact's checkpoints (kiln.containment). SIGTERM stops a run as
Ctrl-C does, and the runner stops when the Pants process that started it dies (kiln.lifetime).

Multi-host (`--coordinator ...`, the same command on every host, docs/training.md): every process
serves or refuses alike and derives the same train spec; process 0 alone places the inputs, holds
the lease and writes STATUS and the record; then all train and compute the report (both
collectives), and process 0 writes it.

Cluster (`--cluster ray://HOST:PORT|HOST:PORT|auto`, or `[kiln] cluster`; docs/clusters.md):
this runner serves or refuses as above, places the inputs in the store, then submits the
multi-host run as a job on a Ray cluster (kiln.cluster.jobs) and follows its output (Ctrl-C
detaches; `--detach` returns the job's id at once).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import getpass
import json
import os
import platform
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kiln import artifacts, lifetime  # lifetime before the slow imports: it notes the parent
from kiln.artifacts import replacement
from kiln.artifacts.lease import Lease, LeaseHeld, LeaseRecord, lease_key
from kiln.artifacts.storage_errors import EXIT_STORAGE, StorageError, as_storage_error
from kiln.artifacts.store import (
    ObjectStore,
    UnsupportedStore,
    copy_folder_into,
    open_store,
    read_text,
)
from kiln.cluster import dispatch, jobs
from kiln.cluster.placement import PlacementError, describe
from kiln.containment import OutsideRoot, within
from kiln.data.errors import KilnDataError
from kiln.data.verify import mark_verified, verify_once
from kiln.train import multihost
from kiln_contract.parsing import SpecError
from kiln_contract.record import ArtifactRecord, fingerprint_drift, served_message
from kiln_contract.step import StepInput, StepSpec
from kiln_contract.train import TrainSpec
from kiln_contract.vocabulary import ATTENTION_IMPLS, REMAT_POLICIES, is_mutable_version


class StepError(RuntimeError):
    """An expected failure: printed as one paragraph, no traceback."""


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def check_drift(directory: Path, record: ArtifactRecord) -> dict[str, Any] | None:
    """The stored record if `directory` holds this artifact; StepError if it holds another."""
    return _same_artifact(_read_json(directory / artifacts.RECORD_FILE), record, str(directory))


def _same_artifact(
    stored: dict[str, Any] | None, record: ArtifactRecord, where: str
) -> dict[str, Any] | None:
    """`stored` (a record read at `where`, or None) if it is this artifact's; StepError if it
    is another's."""
    if stored is None:
        return None
    drift = fingerprint_drift(stored, record)
    if drift is not None:
        raise StepError(
            f"{record.ref} already exists at {where} with {drift}. Bump `version` in the "
            "BUILD file to build a new artifact (the old one is kept), or rebuild this version "
            "with `-- --force` (the old one is deleted once the new one is built)."
        )
    return stored


def place_input(source: Path, destination: Path, record: ArtifactRecord) -> Path:
    """Copies a built cache into the artifact store unless the same one is already there.

    A copy is made under the cache's lease, into a temp sibling, checked against every file's
    digest, then renamed into place; temp copies of killed placements are deleted first. A
    cache already in place is checked cheaply (its files present with their sizes)."""
    if _placed(destination, record):
        return destination
    if not artifacts.is_built(source):
        raise StepError(f"input cache {source} is not complete (no STATUS SUCCESS)")
    with Lease.beside(destination, what=f"place {record.ref}").acquire(wait=True):
        if _placed(destination, record):  # another run placed it while this one waited
            return destination
        for leftover in destination.parent.glob(f".{destination.name}.placing-*"):
            shutil.rmtree(leftover)
        staging = destination.parent / f".{destination.name}.placing-{os.getpid()}"
        try:
            shutil.copytree(source, staging)
            _check_cache(staging, record)
            _rename_into_place(staging, destination, record)
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # gone already after the rename
    return destination


def _rename_into_place(staging: Path, destination: Path, record: ArtifactRecord) -> None:
    try:
        os.rename(staging, destination)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise StepError(
                f"{destination} exists but is not a complete copy of {record.ref}; "
                "move it away and rerun"
            ) from None
        raise


def _placed(destination: Path, record: ArtifactRecord) -> bool:
    """Whether `destination` holds this cache (checked: files present, sizes as recorded)."""
    if not (artifacts.is_built(destination) and check_drift(destination, record)):
        return False
    _check_cache(destination, record)
    return True


def _check_cache(folder: Path | str, record: ArtifactRecord, *, mark: bool = True) -> None:
    """kiln.data.verify's full check of an input cache, unless it passed it when placed and is
    unchanged since: StepError if it is damaged. `mark`: record that it passed, in its folder."""
    try:
        verification = verify_once(folder, record=mark)
    except KilnDataError as e:
        raise StepError(f"input {record.ref}: {e}") from None
    if not verification.cache.verified:
        print(f"kiln: note: input {verification.describe()}", file=sys.stderr)


def _provenance(step: StepSpec, cluster_job: dict[str, Any] | None) -> dict[str, Any]:
    return {
        **dataclasses.asdict(step.provenance),
        **({"cluster_job": cluster_job} if cluster_job else {}),
        "user": getpass.getuser(),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "argv": sys.argv,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def input_path(entry: StepInput, inputs_root: Path, prefix: Path | None) -> Path:
    """Where the trainer reads an input cache: in the artifact store, or in place (hermetic
    runs, which have no store)."""
    if entry.store_path is not None:  # built in place in the artifact store (storage="store")
        return Path(entry.store_path)
    assert entry.location is not None  # a StepInput has one of the two
    if prefix is None:
        return (inputs_root / entry.location).resolve()
    return prefix / entry.name / entry.version


def place_inputs(step: StepSpec, inputs_root: Path, prefix: Path | None) -> None:
    """Copies each built input cache to its `input_path` unless it is there already, and
    checks those already in the store."""
    for entry in step.inputs:
        destination = input_path(entry, inputs_root, prefix)
        if prefix is not None:
            _contained(destination, prefix, f"input cache {entry.ref} at")
        if entry.store_path is not None:
            place_input(destination, destination, entry.record)
        elif prefix is not None:
            assert entry.location is not None
            place_input(inputs_root / entry.location, destination, entry.record)
        else:  # read where Pants built it (hermetic runs): checked, not marked
            _check_cache(destination, entry.record, mark=False)


def train_spec(step: StepSpec, inputs_root: Path, output: Path, prefix: Path | None) -> TrainSpec:
    """The trainer's spec: the step's config with every input at its `input_path`."""
    paths = {entry.ref: input_path(entry, inputs_root, prefix) for entry in step.inputs}
    return step.train_spec(output, paths, inputs_root)


def run_step(
    step: StepSpec,
    inputs_root: Path,
    output: Path,
    prefix: Path | None,
    cluster: multihost.Cluster = multihost.ALONE,
    cluster_job: dict[str, Any] | None = None,
    *,
    force: bool = False,
    wait: bool = True,
) -> int:
    """Serves, refuses or builds the step at `output`. In a multi-host run every process calls
    this; process 0 alone places the inputs, holds the lease and writes STATUS and the record
    (with `cluster_job`, the Ray job's id and retries, when it is one).

    `force`: rebuild even when built (local stores: the old artifact is set aside until the new
    one succeeds). `wait`: a single-host run that finds another run building the artifact
    waits for it and serves its result; otherwise (and always with `force` or multi-host) it
    is refused at once."""
    if not force and _served(step, output, prefix):
        return 0
    spec = train_spec(step, inputs_root, output, prefix)
    check_write_paths(spec, prefix or output)
    wait = wait and not force and not cluster.is_multihost
    with multihost.joined(cluster) as process_index, contextlib.ExitStack() as held:
        failure: Exception | None = None
        lease: Lease | None = None
        if process_index == 0:
            try:
                lease = _lease_output(step, output, held, wait=wait)
                if lease is not None:
                    _start_run(step, spec, inputs_root, prefix, cluster_job, force=force)
            except Exception as e:  # noqa: BLE001 - raised below, once the others know
                failure = e
        if cluster.is_multihost and multihost.agree_max([failure is not None])[0]:
            failure = failure or StepError(
                f"process 0 could not start {step.ref}; its output says why"
            )
        if failure is not None:
            raise failure
        if process_index == 0 and lease is None:
            return 0  # the run it waited for built it (single-host only: no one else trains)
        # A run into an explicit --output folder (hermetic `pants package`) has no cache of its own.
        compile_cache = _compile_cache(prefix) if prefix is not None else None
        exit_code = _train(step, spec, lease, compile_cache=compile_cache)
        if exit_code == 0 and lease is not None and prefix is not None:
            _finish_replacement(step, output, prefix)
        return exit_code


def _served(step: StepSpec, output: Path, prefix: Path | None) -> bool:
    """Serves the artifact when `output` holds it built (a finished replacement's leftover is
    deleted then); refuses another artifact there (StepError); False when it is to be built."""
    stored = None if is_mutable_version(step.version) else check_drift(output, step.record)
    if stored is None or not artifacts.is_built(output):
        return False
    _serve(step, stored, str(output), _read_text(output / artifacts.SUMMARY_TEXT_FILE))
    if prefix is not None and replacement.is_replacing(output):
        # A forced run stopped after the new artifact's STATUS SUCCESS: finish it, unless a
        # run holds the lease (that one finishes it).
        lease = Lease.beside(output, what=f"finish replacing {step.ref}")
        with contextlib.suppress(LeaseHeld), lease.acquire(wait=False):
            _finish_replacement(step, output, prefix)
    return True


def check_write_paths(spec: TrainSpec, root: Path) -> None:
    """Before anything is written: the output lies in `root` (the prefix, or the explicit
    --output folder) and the checkpoint folders in the output (temporaries, when they have a
    base of their own, in that base), symlinks and `..` resolved."""
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


def _restart_dev_run(step: StepSpec, output: Path) -> None:
    """A built dev artifact trains again from scratch: its own checkpoints are deleted, and
    nothing else (the folder's record must name this artifact, the folder must be the
    artifact's own)."""
    stored = _read_json(output / artifacts.RECORD_FILE) or {}
    if (stored.get("name"), stored.get("version")) != (step.name, step.version):
        raise StepError(
            f"{output} is marked built but its {artifacts.RECORD_FILE} does not name "
            f"{step.ref}; it is not this artifact's folder, so nothing in it is deleted. Move "
            "it away and rerun."
        )
    checkpoints = _contained(output / "checkpoints", output, "the checkpoint folder")
    if checkpoints.exists():
        shutil.rmtree(checkpoints)


def run_on_cluster(
    step: StepSpec,
    inputs_root: Path,
    prefix: Path,
    address: str,
    max_retries: int,
    detach: bool = False,
) -> int:
    """Serves or refuses here like `run_step`; otherwise places the inputs in the store and
    submits the training as a job on the cluster's hosts, following it unless `detach`."""
    output = prefix / step.name / step.version
    stored = None if is_mutable_version(step.version) else check_drift(output, step.record)
    if stored is not None and artifacts.is_built(output):
        _serve(step, stored, str(output), _read_text(output / artifacts.SUMMARY_TEXT_FILE))
        return 0
    resources = step.runtime.resources

    def prepare() -> None:  # once the cluster is reached and can hold the request
        place_inputs(step, inputs_root, prefix)
        where = f"the Ray cluster at {address}: {describe(resources)}"
        print(f"kiln: training {step.ref} on {where}", flush=True)

    files = {
        dispatch.STEP_FILE: json.dumps(step.to_json()).encode(),
        **_task_files(step, inputs_root),
    }
    job_id = jobs.new_job_id(step.name)
    job = dispatch.ClusterJob(job_id, step.ref, address, resources, files, prefix, max_retries)
    return jobs.run(job, prepare, detach=detach)


def _task_files(step: StepSpec, inputs_root: Path) -> dict[str, bytes]:
    """The local eval task files the step names, by path under `inputs_root`: they travel to
    the hosts with the step."""
    task_paths = step.config.evals.task_paths if step.config.evals else ()
    return {
        str(path.relative_to(inputs_root)): path.read_bytes()
        for folder in task_paths
        for path in sorted((inputs_root / folder).rglob("*"))
        if path.is_file()
    }


def _start_run(
    step: StepSpec,
    spec: TrainSpec,
    inputs_root: Path,
    prefix: Path | None,
    cluster_job: dict[str, Any] | None,
    *,
    force: bool,
) -> None:
    """Under the artifact's lease: goes on with (or, forced, begins) the replacement of a built
    artifact, places the inputs and writes STATUS RUNNING, the record and, for people, the
    train spec."""
    output = spec.output_path
    if prefix is not None:
        _continue_replacement(step, output, force=force)
    with _failure_recorded(output, writer=True):
        place_inputs(step, inputs_root, prefix)
        _begin(step, spec, cluster_job)


def _take_lease(step: StepSpec, lease: Lease, held: contextlib.ExitStack) -> Lease:
    try:
        held.enter_context(lease.acquire(wait=False))
    except LeaseHeld as e:
        raise StepError(
            f"{step.ref} is being built by another run: {e}. A second run of {step.ref} is "
            "refused; nothing was changed."
        ) from None
    return lease


# How often a run waiting for another run's lease says again who holds it and how far it is.
WAIT_REPORT_SECONDS = 30.0


def _lease_output(
    step: StepSpec, output: Path, held: contextlib.ExitStack, *, wait: bool
) -> Lease | None:
    """Takes the lease of `output` into `held`. Without `wait` a live holder is refused at once
    (StepError). With it, this run waits, saying who holds the lease, and then decides again:
    the run it waited for built the artifact -> served (None); it failed -> StepError; it ended
    without finishing (killed, its lease taken over when stale, or stopped by --max-steps) ->
    this run goes on with the build (the lease)."""
    lease = Lease.beside(output, what=f"train {step.ref}")
    if not wait:
        return _take_lease(step, lease, held)
    watch = _HolderWatch(step, output)
    held.enter_context(lease.acquire(wait=True, on_wait=watch))
    if watch.holder is None:
        return lease
    return _after_waiting(step, output, watch.holder, lease)


def _after_waiting(step: StepSpec, output: Path, holder: LeaseRecord, lease: Lease) -> Lease | None:
    status = artifacts.read_status(output)
    if is_mutable_version(step.version):
        print(f"kiln: {holder.describe()} ended; a dev version is rebuilt by every run", flush=True)
        return lease
    stored = check_drift(output, step.record)
    if status == artifacts.SUCCESS and stored is not None:
        lease.release()
        _serve(step, stored, str(output), _read_text(output / artifacts.SUMMARY_TEXT_FILE))
        return None
    if status == artifacts.FAILED:
        why = artifacts.read_stop_reason(open_store(output), "") or "its output says why"
        raise StepError(
            f"{step.ref}: the run this one waited for, {holder.describe()}, failed (STATUS "
            f"FAILED in {output}: {why}). Rerun to resume the build from its newest checkpoint."
        )
    print(
        f"kiln: {holder.describe()} ended without finishing {step.ref} (STATUS "
        f"{status or 'none'}): this run goes on with it, from its newest checkpoint",
        flush=True,
    )
    return lease


class _HolderWatch:
    """`Lease.acquire`'s `on_wait`: prints who holds the lease, at once and then at most every
    WAIT_REPORT_SECONDS, with the holder's step and ETA from its metrics.jsonl."""

    def __init__(self, step: StepSpec, output: Path) -> None:
        self.step = step
        self.output = output
        self.holder: LeaseRecord | None = None
        self._said_at: float | None = None

    def __call__(self, holder: LeaseRecord) -> None:
        self.holder = holder
        now = time.monotonic()
        if self._said_at is not None and now - self._said_at < WAIT_REPORT_SECONDS:
            return
        self._said_at = now
        print(
            f"kiln: waiting for {self.step.ref}: {holder.describe()} holds its lease; "
            f"{self._progress()} (--no-wait refuses instead of waiting)",
            flush=True,
        )

    def _progress(self) -> str:
        from kiln.report.metrics_log import STEP_TIME, latest_train_step
        from kiln.train.metrics import METRICS_FILE

        latest = latest_train_step(self.output / METRICS_FILE)
        if latest is None:
            return "no step logged yet"
        step, total = latest["step"], self.step.config.num_train_steps
        eta = float(latest[STEP_TIME]) * max(0, total - step)
        return f"step {step} of {total}, ETA {_duration(eta)}"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def _continue_replacement(step: StepSpec, output: Path, *, force: bool) -> None:
    """Forced: sets the built artifact aside (or goes on with a stopped forced rebuild). Not
    forced, with a forced rebuild under way: says that this run goes on with it."""
    try:
        if force:
            done = replacement.set_aside(output, step.name, step.version, step.fingerprint)
            print(f"kiln: --force: {done}", flush=True)
        elif replacement.is_replacing(output) and not artifacts.is_built(output):
            aside = replacement.replaced_folder(output)
            print(
                f"kiln: going on with the forced rebuild of {step.ref}; the replaced artifact "
                f"stays at {aside} until it succeeds",
                flush=True,
            )
    except replacement.NotThisArtifact as e:
        raise StepError(str(e)) from None
    except OSError as e:
        raise as_storage_error(e, output) or e from None


def _finish_replacement(step: StepSpec, output: Path, prefix: Path) -> None:
    """Once the rebuild has STATUS SUCCESS: deletes the artifact it replaced and names the built
    artifacts in the store that were built from it (they now point at an older input)."""
    try:
        finished = replacement.finish(output)
    except OSError as e:
        raise as_storage_error(e, replacement.replaced_folder(output)) or e from None
    if finished is None:
        return
    print(f"kiln: deleted the replaced {step.ref} ({finished.replaced})", flush=True)
    dependents = replacement.built_dependents(prefix, step.ref)
    if dependents:
        print(_dependents_note(step, dependents), flush=True)


def _dependents_note(step: StepSpec, dependents: list[replacement.Dependent]) -> str:
    lines = [
        f"kiln: note: {len(dependents)} built artifact(s) in the store were built from the "
        f"replaced {step.ref} and now point at an older input:"
    ]
    for dependent in dependents:
        if dependent.kind == "lm_checkpoint":
            how = "rebuild it: `pants run` its target with `-- --force`"
        else:
            how = f"delete {dependent.folder} and build its target again"
        lines.append(f"  {dependent.ref} ({dependent.kind}) at {dependent.folder}: {how}")
    lines.append("  (or bump their `version` to keep them as they are beside the new ones)")
    return "\n".join(lines)


def _begin(step: StepSpec, spec: TrainSpec, cluster_job: dict[str, Any] | None = None) -> None:
    """Writes STATUS RUNNING, the record (with `cluster_job`, the Ray job's id and retries, when
    it is one) and, for people, the train spec into the output (a built dev artifact's
    checkpoints deleted first)."""
    output = spec.output_path
    output.mkdir(parents=True, exist_ok=True)
    if is_mutable_version(step.version) and artifacts.is_built(output):
        _restart_dev_run(step, output)
    artifacts.write_status(output, artifacts.RUNNING)
    artifacts.clear_stop_reason(open_store(output), "")
    artifacts.atomic_write_json(
        output / artifacts.RECORD_FILE,
        {**step.record.to_json(), "provenance": _provenance(step, cluster_job)},
    )
    artifacts.atomic_write_json(output / artifacts.TRAIN_SPEC_FILE, spec.to_json())


def run_in_bucket(step: StepSpec, inputs_root: Path, store: ObjectStore) -> int:
    """Serves, refuses or builds the step in a bucket (docs/artifacts.md, "Runs in a bucket"):
    the store is read for the decision and holds the lease; the inputs are copied into it and
    read from there; the run trains into a local staging folder, pulled from the bucket first
    (the newest complete checkpoint) and uploaded while it trains, STATUS last."""
    store.check()  # a missing bucket or an unreachable endpoint fails here, in seconds
    key = f"{step.name}/{step.version}"
    mutable = is_mutable_version(step.version)
    stored = None if mutable else _same_artifact(
        _read_object_json(store, f"{key}/{artifacts.RECORD_FILE}"), step.record,
        store.location(key))  # fmt: skip
    built = _status(store, key) == artifacts.SUCCESS
    if stored is not None and built:
        summary = read_text(store, f"{key}/{artifacts.SUMMARY_TEXT_FILE}")
        _serve(step, stored, store.location(key), summary)
        return 0
    from kiln.train.run_mirror import RunMirror  # jax and orbax: only to train

    with tempfile.TemporaryDirectory(prefix="kiln-staging-") as staging, \
            contextlib.ExitStack() as held:  # fmt: skip
        output = Path(staging) / "run"
        spec = step.train_spec(output, _bucket_inputs(step, store), inputs_root)
        lease = _take_lease(step, Lease(store, lease_key(key), what=f"train {step.ref}"), held)
        mirror = RunMirror(store, key, output)
        try:
            with _failure_recorded(output, writer=True):
                upload_inputs(step, inputs_root, store)
                mirror.pull(checkpoints=not (built and mutable))  # a built dev run starts over
                _begin(step, spec)
                mirror.push(status=True)
            with mirror.uploading():
                exit_code = _train(step, spec, lease, shown_at=store.location(key),
                                   compile_cache=_compile_cache(local_prefix=None))  # fmt: skip
        except BaseException:
            if lease.lost is None:  # else the run that took the lease owns the folder now
                with contextlib.suppress(OSError, StorageError):  # the store may have failed
                    mirror.push(status=True)
            raise
        mirror.push(status=True)  # STATUS last
        return exit_code


def _bucket_inputs(step: StepSpec, store: ObjectStore) -> dict[str, str]:
    """Where a run in a bucket reads each input cache: its copy in the bucket, streamed through
    TensorStore, so that every host of a run reads the same bytes."""
    return {entry.ref: store.location(f"{entry.name}/{entry.version}") for entry in step.inputs}


def upload_inputs(step: StepSpec, inputs_root: Path, store: ObjectStore) -> None:
    """Copies each input cache into the bucket at `{name}/{version}` (digests checked first,
    STATUS last, under the cache's lease) unless the same cache is there already."""
    for entry in step.inputs:
        key = f"{entry.name}/{entry.version}"
        if entry.location is None:
            _check_built_in_bucket(entry, store, key)
            _check_cache(store.location(key), entry.record)
            continue
        if _uploaded(store, key, entry.record):
            _check_cache(store.location(key), entry.record)
            continue
        source = inputs_root / entry.location
        if not artifacts.is_built(source):
            raise StepError(f"input cache {source} is not complete (no STATUS SUCCESS)")
        with Lease(store, lease_key(key), what=f"place {entry.ref}").acquire(wait=True):
            if not _uploaded(store, key, entry.record):  # or another run uploaded it meanwhile
                _check_cache(source, entry.record, mark=False)
                copy_folder_into(store, key, source)
                mark_verified(store.location(key))  # the bytes just checked


def _check_built_in_bucket(entry: StepInput, store: ObjectStore, key: str) -> None:
    """A store cache is built in place: with a bucket prefix, finished at its key there."""
    if entry.store_path == store.location(key) and _uploaded(store, key, entry.record):
        return
    raise StepError(
        f"input {entry.ref} has storage=\"store\" (built in place at {entry.store_path}), and "
        f"{store.location(key)} holds no finished copy of it: build it under this prefix first "
        "(`pants package` of its tokenized_cache target with the same [kiln] prefix)"
    )


def _uploaded(store: ObjectStore, key: str, record: ArtifactRecord) -> bool:
    stored = _read_object_json(store, f"{key}/{artifacts.RECORD_FILE}")
    same = _same_artifact(stored, record, store.location(key)) is not None
    return same and _status(store, key) == artifacts.SUCCESS


def _status(store: ObjectStore, key: str) -> str | None:
    text = read_text(store, f"{key}/{artifacts.STATUS_FILE}")
    return None if text is None else text.strip()



def _read_object_json(store: ObjectStore, key: str) -> Any:
    text = read_text(store, key)
    return None if text is None else json.loads(text)


def _compile_cache(local_prefix: Path | None) -> Path:
    """Where a run keeps jax's compiled programs (kiln.train.compilation_cache): in its local
    store, shared by the store's runs; for a bucket's runs (None), on this machine."""
    from kiln.train.compilation_cache import cache_folder

    return cache_folder(local_prefix)


def _train(
    step: StepSpec,
    spec: TrainSpec,
    lease: Lease | None,
    *,
    shown_at: str | None = None,
    compile_cache: Path | None = None,
) -> int:
    """Trains and reports on every process; the lease holder (process 0) writes STATUS.
    `shown_at`: where the artifact is, for people (default: the output folder).
    `compile_cache`: jax's persistent compilation cache folder ($JAX_COMPILATION_CACHE_DIR wins)."""
    from kiln.report.plots import plot_run
    from kiln.report.run_summary import write_run_summary
    from kiln.train import compilation_cache
    from kiln.train.__main__ import run_training

    compilation_cache.use(compile_cache)
    output = spec.output_path
    with _failure_recorded(output, writer=lease is not None):
        stops: list[str] = []
        exit_code = run_training(spec, quiet=True, metrics_observer=plot_run,
                                 initial_params=_published_weights, on_stop=stops.append)  # fmt: skip
        if exit_code == 0:
            # On every process: sampling is a collective.
            summary = write_run_summary(spec, shown_at=shown_at)
            if lease is not None:
                _check_still_held(lease, step)
                artifacts.write_status(output, artifacts.SUCCESS)
                print(f"kiln: built {step.ref} at {shown_at or output}\n{summary}")
        elif lease is not None:  # failed (1, 2): FAILED; stopped: RUNNING, resumable
            reason = stops[-1] if stops else f"the trainer exited with status {exit_code}"
            if exit_code in (1, 2):
                artifacts.mark_failed(output, reason)
            else:
                _record_stop(output, reason)
        return exit_code


def _published_weights(source: Any, model_config: Any, tokenizer: Any) -> Any:
    """`init_from`'s weights for the trainer (kiln.interop.hub), a failure as one line."""
    from kiln.interop.errors import InteropError
    from kiln.interop.hub import initial_params
    from kiln.train.trainer import TrainingError

    try:
        return initial_params(source, model_config, tokenizer)
    except InteropError as e:
        raise TrainingError(str(e)) from None


class LeaseLost(StepError):
    """This run's lease was taken over: another run owns the artifact now."""


def _check_still_held(lease: Lease, step: StepSpec) -> None:
    if lease.lost is not None:
        raise LeaseLost(
            f"{step.ref}: this run lost its lease ({lease.lost}), so another run owns the "
            "artifact now; this run's result is not recorded."
        )


@contextlib.contextmanager
def _failure_recorded(output: Path, *, writer: bool) -> Iterator[None]:
    """Ends a failing build with STATUS FAILED (written by the lease holder) and turns a
    storage failure (no space, no permission, an I/O error) into a StorageError naming the
    path and the cause. A run that lost its lease leaves STATUS to the run that took it."""
    try:
        yield
    except LeaseLost:
        raise
    except Exception as e:
        failure = as_storage_error(e, output)
        if writer:
            artifacts.mark_failed(output, artifacts.failure_reason(failure or e))
        if failure is not None:
            raise failure from None
        raise
    except KeyboardInterrupt as e:
        if writer:
            _record_stop(output, artifacts.failure_reason(e))
        raise


def _record_stop(output: Path, reason: str) -> None:
    with contextlib.suppress(OSError):
        artifacts.record_stop(open_store(output), "", reason)


def _serve(step: StepSpec, stored: dict[str, Any], where: str, summary: str | None) -> None:
    """Says that the artifact at `where` is built, and prints its `summary` (written when it
    was built: losses vs a unigram baseline, where things are, samples; no jax needed)."""
    code_digest = step.provenance.code_digest
    print(served_message(step.ref, where, step.fingerprint, stored, code_digest, summary))


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


# Command-line options (argparse dests) -> the step's `runtime` keys they override.
RUNTIME_OVERRIDES = {
    "max_steps": "max_steps_this_run",
    "attention": "attention",
    "gradient_checkpointing": "gradient_checkpointing",
    "validation_every": "validation_every",
    "max_eval_batches": "max_eval_batches",
    "per_device_parallelism": "per_device_parallelism",
    "mesh": "mesh",
}


def apply_overrides(step: StepSpec, args: argparse.Namespace) -> StepSpec:
    """Run-time choices from the command line (`pants run X -- --max-steps 300`)."""
    runtime = {
        key: getattr(args, option)
        for option, key in RUNTIME_OVERRIDES.items()
        if getattr(args, option) is not None
    }
    if args.control_host is not None:
        runtime["control"] = _replace(step.runtime.control, "runtime.control", host=args.control_host)
    config = step.config
    if args.batch_size is not None:
        # Identity changes: only for scratch runs (throughput checks), never into the store.
        if args.output is None:
            raise StepError(
                "--batch-size changes the artifact's identity: give --output DIR as well, so the "
                "run goes to a scratch folder and not to the artifact store"
            )
        config = _replace(config, "config", batch_size=args.batch_size)
    return dataclasses.replace(
        step, runtime=_replace(step.runtime, "runtime", **runtime), config=config
    )


def _replace(value: Any, where: str, **changes: Any) -> Any:
    """`dataclasses.replace`, an invalid value named by its field in the spec."""
    try:
        return dataclasses.replace(value, **changes)
    except SpecError as e:
        raise StepError(f"{e.within(where)} (from the command line)") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kiln.runner", description=__doc__.split("\n")[0]
    )
    parser.add_argument("step", type=Path, help="the step JSON written by the Pants backend")
    parser.add_argument("--inputs", type=Path, required=True, help="where the built inputs are")
    parser.add_argument(
        "--prefix", help="the artifact store: a directory, s3://BUCKET/PATH or gs://BUCKET/PATH"
    )
    parser.add_argument("--output", type=Path, help="build here instead of the artifact store")
    parser.add_argument(
        "--force",
        action="store_true",
        help="rebuild this version even when built (a local store: the old artifact is kept "
        "aside until the new one succeeds)",
    )
    parser.add_argument(
        "--no-wait",
        action="store_true",
        help="refuse at once, instead of waiting, when another run is building the artifact",
    )
    overrides = parser.add_argument_group(
        "run-time overrides (not part of the artifact's identity)"
    )
    overrides.add_argument("--max-steps", type=int, help="stop after N steps this run (resumable)")
    overrides.add_argument("--attention", choices=ATTENTION_IMPLS)
    overrides.add_argument("--gradient-checkpointing", choices=REMAT_POLICIES)
    overrides.add_argument("--validation-every", type=int)
    overrides.add_argument(
        "--max-eval-batches", type=int, help="validate on at most N batches of each set"
    )
    overrides.add_argument(
        "--mesh",
        type=_mesh_sizes,
        help="device mesh as AXIS=SIZE,... over data, fsdp, tensor (one may be -1), e.g. data=-1",
    )
    overrides.add_argument(
        "--per-device-parallelism",
        type=int,
        help="sequences per device per forward/backward; fewer accumulates gradients",
    )
    overrides.add_argument(
        "--batch-size", type=int, help="scratch runs only (needs --output): throughput checks"
    )
    overrides.add_argument(
        "--control-host",
        metavar="ADDRESS",
        help="where the control endpoint listens (default 127.0.0.1; 0.0.0.0: every interface, "
        "same tokens, no TLS)",
    )
    multihost.add_flags(parser)
    parser.add_argument(
        "--cluster",
        metavar="ray://HOST:PORT|HOST:PORT|auto|local",
        help="train on this Ray cluster (auto: RAY_ADDRESS; local: here); docs/clusters.md",
    )
    parser.add_argument(
        "--max-retries",
        type=int,
        default=3,
        help="cluster runs: attempts after a lost host, each from the newest checkpoint",
    )
    parser.add_argument(
        "--detach",
        action="store_true",
        help="cluster runs: print the job's id and return; the job trains on",
    )
    parser.add_argument(
        "--job", help="set by kiln.cluster on its hosts: the cluster job's id, for the record"
    )
    return parser


def _mesh_sizes(text: str) -> dict[str, int]:
    """'data=2,fsdp=-1' -> {"data": 2, "fsdp": -1}; the spec checks axes and sizes."""
    try:
        return {axis.strip(): int(size) for axis, size in (p.split("=") for p in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected AXIS=SIZE pairs separated by commas, e.g. data=2,fsdp=-1"
        ) from None


# How long a runner whose Pants process died has to save a checkpoint before it is killed.
ORPHAN_GRACE_SECONDS = 30.0


def main(argv: list[str] | None = None) -> int:
    # transformers (tokenizers for evals and samples) warns that PyTorch is absent: irrelevant.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    parser = _parser()
    args = parser.parse_args(argv)
    # SIGTERM (timeout, SLURM, Kubernetes) stops a run as Ctrl-C does: the training loop saves a
    # checkpoint first; elsewhere the run unwinds, releasing its lease.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    lifetime.stop_when_orphaned(ORPHAN_GRACE_SECONDS)
    try:
        step = read_step(args.step)
    except StepError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 1
    if args.output is None and args.prefix is None:
        parser.error("give --prefix (artifact store) or --output")
    cluster = multihost.cluster_from_flags(parser, args)
    try:
        step = apply_overrides(step, args)
        bucket = None if args.output else _bucket(args.prefix)
        if bucket is not None:
            _check_bucket_flags(parser, args, cluster)
            _refuse_force(args, f"the bucket prefix {args.prefix}")
            return run_in_bucket(step, args.inputs.absolute(), bucket)
        output = (args.output or Path(args.prefix) / step.name / step.version).absolute()
        address = dispatch.resolve_address(args.cluster)
        if address is not None:
            _check_cluster_flags(parser, args, cluster)
            _refuse_force(args, f"a cluster run (--cluster {args.cluster})")
            inputs, store = args.inputs.absolute(), Path(args.prefix).absolute()
            return run_on_cluster(step, inputs, store, address, args.max_retries, args.detach)
        if args.detach:
            parser.error("--detach submits a cluster job: give --cluster (or [kiln] cluster)")
        prefix = None if args.output else Path(args.prefix).absolute()
        cluster_job = {"id": args.job, "max_retries": args.max_retries} if args.job else None
        if args.force and prefix is None:
            parser.error("--force replaces an artifact in the store: give --prefix, not --output")
        return run_step(
            step, args.inputs, output, prefix, cluster, cluster_job,
            force=args.force, wait=not args.no_wait,
        )  # fmt: skip
    except (StepError, KilnDataError, multihost.JoinError, dispatch.ClusterError,
            PlacementError) as e:  # fmt: skip
        print(f"kiln: error: {e}", file=sys.stderr)
        return 1
    except StorageError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return EXIT_STORAGE
    except KeyboardInterrupt:
        print(f"kiln: {step.ref} interrupted; rerun to go on", file=sys.stderr)
        return 130


def _bucket(prefix: str) -> ObjectStore | None:
    """The store at `prefix` if it is a bucket; None for a local directory."""
    try:
        store = open_store(prefix)
    except (UnsupportedStore, ValueError) as e:
        raise StepError(f"--prefix {e}") from None
    return None if store.local_root is not None else store


def _check_bucket_flags(
    parser: argparse.ArgumentParser, args: argparse.Namespace, cluster: multihost.Cluster
) -> None:
    if cluster.is_multihost or args.cluster not in (None, "local"):
        parser.error(
            f"--prefix {args.prefix}: a run in a bucket trains on this machine; drop "
            "--coordinator and --cluster"
        )


def _refuse_force(args: argparse.Namespace, where: str) -> None:
    if args.force:
        raise StepError(
            f"--force replaces artifacts in a local store only, not with {where}; nothing was "
            "changed. Bump `version` in the BUILD file to build a new artifact, or delete the "
            "artifact's folder (in a bucket: its objects) and rerun without --force."
        )


def _check_cluster_flags(
    parser: argparse.ArgumentParser, args: argparse.Namespace, cluster: multihost.Cluster
) -> None:
    if cluster.is_multihost:
        parser.error(
            "--cluster starts every host itself: drop --coordinator (or give --cluster local)"
        )
    if args.output is not None:
        parser.error("--cluster builds into the artifact store: give --prefix, not --output")


def read_step(path: Path) -> StepSpec:
    """The step spec in the file at `path`, parsed once: the runner's boundary."""
    try:
        return StepSpec.from_json(json.loads(path.read_text()))
    except OSError as e:
        raise StepError(f"cannot read the step spec {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise StepError(f"{path} is not valid JSON: {e}") from None
    except SpecError as e:
        raise StepError(f"{path}: {e}") from None

if __name__ == "__main__":
    sys.exit(main())
