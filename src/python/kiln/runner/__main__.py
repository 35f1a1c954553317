"""`python -m kiln.runner`: the command line, to the room that does the work, and every expected
failure as one paragraph with its exit status (kiln.runner)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from kiln import lifetime  # before the slow imports: it notes the parent
from kiln.artifacts.folder import ArtifactFolder
from kiln.artifacts.local import LocalStore
from kiln.artifacts.locations import UnsupportedStore, open_store
from kiln.artifacts.storage_errors import (
    EXIT_STORAGE,
    StorageError,
    as_storage_error,
    refused_store_write,
)
from kiln.artifacts.store import ObjectStore
from kiln.cluster import connection
from kiln.cluster.errors import ClusterError
from kiln.cluster.placement import PlacementError
from kiln.data.errors import KilnDataError
from kiln.runner.bundle import write_bundle
from kiln.runner.checkpoint_step import run_step
from kiln.runner.cluster import submit
from kiln.runner.command_line import apply_overrides, argument_parser, read_step
from kiln.runner.errors import StepError
from kiln.runner.step_run import Destination
from kiln.train import multihost
from kiln.train.hooks import StopSignals
from kiln.train.progress import quiet_libraries
from kiln_contract.location import is_bucket_url
from kiln_contract.step import StepSpec

# How long a runner whose Pants process died has to save a checkpoint before it is killed.
ORPHAN_GRACE_SECONDS = 30.0


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised wherever the run is, as Ctrl-C raises KeyboardInterrupt."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _terminate(signum: int, frame: object) -> None:
    StopSignals.noted_before = signum  # training stops at once if the exception is dropped
    raise Terminated(signum)


def main(argv: list[str] | None = None) -> int:
    # transformers (tokenizers for evals and samples) warns that PyTorch is absent: irrelevant.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    parser = argument_parser()
    args = parser.parse_args(argv)
    if not args.library_output:
        quiet_libraries()
    # SIGTERM (timeout, SLURM, Kubernetes, a cluster job's `stop`) and SIGHUP (a closed
    # terminal) stop a run as Ctrl-C does: the training loop saves a checkpoint first; elsewhere
    # the run unwinds, releasing its lease. Output that finds no reader is dropped, never fatal.
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _terminate)
    lifetime.stop_when_orphaned(ORPHAN_GRACE_SECONDS)
    lifetime.discard_output_once_closed()
    try:
        step = read_step(args.step)
    except StepError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 1
    if args.output is None and args.prefix is None and args.bundle is None:
        parser.error("give --prefix (artifact store) or --output")
    group = multihost.process_group_from_flags(parser, args)
    try:
        return _run(parser, args, apply_overrides(step, args), group)
    except (StepError, KilnDataError, multihost.JoinError, ClusterError,
            PlacementError) as e:  # fmt: skip
        print(f"kiln: error: {e}", file=sys.stderr)
        return 1
    except (StorageError, OSError) as e:
        failure = _storage_failure(e, args)
        if failure is None:
            raise
        print(f"kiln: error: {failure}", file=sys.stderr)
        return EXIT_STORAGE
    except KeyboardInterrupt as e:
        print(f"kiln: {step.ref} interrupted; rerun to go on", file=sys.stderr)
        return 128 + (e.signum if isinstance(e, Terminated) else signal.SIGINT)


def _run(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    step: StepSpec,
    group: multihost.ProcessGroup,
) -> int:
    if args.bundle is not None:
        print(_bundled(args, step))
        return 0
    address = None if args.output else connection.resolve_address(args.cluster)
    if address is not None:
        _check_cluster_flags(parser, args, group)
        store = artifact_store(args.prefix)
        return submit(step, args.inputs.absolute(), store, address, args.max_retries,
                      detach=args.detach, force=args.force)  # fmt: skip
    if args.detach:
        parser.error("--detach submits a cluster job: give --cluster (or [kiln] cluster)")
    if args.force and args.output is not None:
        parser.error("--force replaces an artifact in the store: give --prefix, not --output")
    job = {"id": args.job, "max_retries": args.max_retries} if args.job else None
    return run_step(step, args.inputs, _destination(args, step), group, job,
                    force=args.force, wait=not args.no_wait)  # fmt: skip


def _storage_failure(error: Exception, args: argparse.Namespace) -> StorageError | None:
    """A storage failure that escaped the run's own handling (the artifact's lease, the first
    write into the store) as one line; a local store that refuses writes is named with what to
    do. None for an error that is no storage failure: its traceback is the report."""
    if isinstance(error, BrokenPipeError):
        return None  # the terminal went away: no storage failure, and no one to tell
    where = args.output or args.prefix or args.step
    if args.prefix is not None and not is_bucket_url(args.prefix):
        refused = refused_store_write(error, args.prefix)
        if refused is not None:
            return refused
    return as_storage_error(error, where)


def _bundled(args: argparse.Namespace, step: StepSpec) -> str:
    """Writes the bundle; says how to train from it and how the artifact comes back."""
    here = args.prefix if args.prefix is not None else "the artifact store"
    if args.prefix is not None and is_bucket_url(args.prefix):
        prefix, back = args.prefix, f"it lands in {args.prefix}, which this machine reads too"
    else:
        prefix = "FOLDER"
        back = (f"then copy FOLDER/{step.name}/{step.version} to {here}/{step.name}/{step.version} "
                "here (or give a bucket both machines read)")
    command = write_bundle(args.step, step, args.inputs, args.bundle.absolute(), prefix)
    return (
        f"kiln: {step.ref}'s step, its inputs and Kiln's sources are in {args.bundle}. Copy the "
        "folder to the machine that trains it and run there, with its jax and the runtime's "
        f"packages (docs/training.md, \"Training on another machine\"):\n  {command}\n"
        f"kiln: {back}."
    )


def _destination(args: argparse.Namespace, step: StepSpec) -> Destination:
    if args.output is not None:  # a scratch folder: a hermetic run's sandbox
        output = args.output.absolute()
        return Destination(ArtifactFolder(LocalStore(output.parent), output.name), artifact_store=False)
    folder = ArtifactFolder(artifact_store(args.prefix), f"{step.name}/{step.version}")
    return Destination(folder, staging=args.staging)


def artifact_store(prefix: str) -> ObjectStore:
    """The artifact store at `--prefix`: a bucket, or a directory (made absolute)."""
    try:
        store = open_store(prefix)
    except (UnsupportedStore, ValueError) as e:
        raise StepError(f"--prefix {e}") from None
    return store if store.root_location.in_bucket else LocalStore(Path(prefix).absolute())


def _check_cluster_flags(
    parser: argparse.ArgumentParser, args: argparse.Namespace, group: multihost.ProcessGroup
) -> None:
    if group.is_multihost:
        parser.error(
            "--cluster starts every host itself: drop --coordinator (or give --cluster local)"
        )
    if args.output is not None:
        parser.error("--cluster builds into the artifact store: give --prefix, not --output")


if __name__ == "__main__":
    with multihost.exiting():
        sys.exit(main())
