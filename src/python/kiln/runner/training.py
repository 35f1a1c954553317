"""Training the step on this process, then its summary and STATUS, last."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kiln import artifacts
from kiln.artifacts.folder import ArtifactFolder
from kiln.artifacts.lease import Lease
from kiln.artifacts.storage_errors import as_storage_error
from kiln.artifacts.store import ObjectStore
from kiln.runner.errors import LeaseLost
from kiln.runner.leasing import check_still_held
from kiln.runner.step_run import StepRun
from kiln.train import multihost
from kiln_contract.train import HfModelSource, ParentRun


def train(
    run: StepRun, lease: Lease | None, *, compile_cache: Path | None, parents: ObjectStore | None
) -> int:
    """Trains and reports on every process; the lease holder (process 0) writes STATUS.
    `compile_cache`: jax's persistent compilation cache folder ($JAX_COMPILATION_CACHE_DIR
    wins). `parents`: the store holding the run `init_from` names, if it names one (the artifact
    store; None for a scratch run)."""
    from kiln.report.plots import plot_run
    from kiln.report.run_summary import write_run_summary
    from kiln.train import compilation_cache, progress
    from kiln.train.errors import TrainingError, TrainingStopped
    from kiln.train.trainer import train_to_end

    compilation_cache.use(compile_cache)
    progress.configure_logging()
    spec, workspace = run.spec, run.workspace
    folder = ArtifactFolder.at(spec.output_path)
    writer = lease is not None
    with failure_recorded(folder, writer=writer):
        try:
            finished = train_to_end(spec, plot_run, _run_start(parents, spec.config.init_from),
                                    checkpoint_in_store=workspace.holds_checkpoint)  # fmt: skip
        except TrainingError as e:
            print(e.line, file=sys.stderr)
            if writer:
                folder.mark_failed(str(e))
            return e.exit_code
        except TrainingStopped as e:  # RUNNING, resumable
            print(e.line, file=sys.stderr)
            if writer:
                _record_stop(folder, str(e))
            return e.exit_code
        # The final checkpoint in the store, whole, before any host reports or writes STATUS.
        workspace.publish(status=False, final=True)
        multihost.barrier("kiln: the final checkpoint is in the store")
        workspace.complete()
        summary = write_run_summary(finished)  # a collective: every host
        if lease is not None:
            check_still_held(lease, run.step)
            folder.write_status(artifacts.SUCCESS)
            print(f"kiln: built {run.step.ref} at {run.shown_at}\n{summary}")
        return 0


def _run_start(parents: ObjectStore | None, init_from: Any) -> Any:
    """What the run starts from (kiln.train.setup.RunStart): `init_from`'s state, read when the
    run starts without a checkpoint of its own, and, when it continues its parent's data, the
    parent's data position at the step it starts from (read at every start: the run's batches
    are a pure function of it); None without `init_from`."""
    from kiln.interop.errors import InteropError
    from kiln.interop.parent_run import parent_data_position
    from kiln.train.errors import TrainingError
    from kiln.train.setup import RunStart

    if init_from is None:
        return None
    data = None
    if isinstance(init_from, ParentRun) and init_from.data_continues:
        try:
            data = parent_data_position(_parents_store(parents, init_from), init_from)
        except InteropError as e:
            raise TrainingError(str(e)) from None
    return RunStart(functools.partial(_start_from, parents), data)


def _start_from(
    parents: ObjectStore | None,
    source: HfModelSource | ParentRun,
    fresh: Any,
    model_config: Any,
    tokenizer: Any,
) -> Any:
    """The state a run starts from: the fresh one with `init_from`'s weights, published
    (kiln.interop.hub) or a run of the graph in the artifact store (kiln.interop.parent_run,
    with its optimizer state when asked); a failure as one line."""
    from kiln.interop.errors import InteropError
    from kiln.interop.hub import initial_params
    from kiln.interop.parent_run import parent_params, parent_state
    from kiln.train.errors import TrainingError
    from kiln.train.step import with_params

    try:
        if isinstance(source, HfModelSource):
            return with_params(fresh, initial_params(source, model_config, tokenizer))
        store = _parents_store(parents, source)
        if source.optimizer_state:
            return parent_state(store, source, fresh, model_config, tokenizer)
        return with_params(fresh, parent_params(store, source, model_config, tokenizer))
    except InteropError as e:
        raise TrainingError(str(e)) from None


def _parents_store(parents: ObjectStore | None, source: ParentRun) -> ObjectStore:
    from kiln.interop.errors import InteropError

    if parents is None:
        raise InteropError(
            f"init_from: {source.ref} is read from the artifact store: build this run there "
            "(`pants run` or `pants build`), not as a hermetic `pants package`"
        )
    return parents


@contextlib.contextmanager
def failure_recorded(folder: ArtifactFolder, *, writer: bool) -> Iterator[None]:
    """Ends a failing build with its reason (FAILURE_FILE) and STATUS FAILED (written by the
    lease holder) and turns a storage failure (no space, no permission, an I/O error) into a
    StorageError naming the path and the cause; an interrupted one records why and stays
    RUNNING (resumable). A run that lost its lease leaves STATUS to the run that took it."""
    try:
        yield
    except LeaseLost:
        raise
    except Exception as e:
        failure = as_storage_error(e, folder.location())
        if writer:
            folder.mark_failed(artifacts.failure_reason(failure or e))
        if failure is not None:
            raise failure from None
        raise
    except KeyboardInterrupt as e:
        if writer:
            _record_stop(folder, artifacts.failure_reason(e))
        raise


def _record_stop(folder: ArtifactFolder, reason: str) -> None:
    with contextlib.suppress(OSError):
        folder.record_stop(reason)
