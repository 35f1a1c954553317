"""Orbax's side of a checkpoint save (kiln.train.checkpoints): the checkpointer for one folder or a
folder per host, a save writing its files while training goes on, and orbax's reports of a
failed save held back while Kiln reports it once."""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from kiln.artifacts.content import FileRecords, files_under, record_files


def orbax_checkpointer(per_host_folders: bool) -> ocp.AsyncCheckpointer:
    """Orbax's checkpointer. With a folder per host, every host is orbax's primary (it writes the
    checkpoint's metadata into its own folder) and arrays are plain zarr, each host writing the
    chunks of its own shards: OCDBT merges the processes' files on the primary host, which only a
    folder every host sees allows. The union of the hosts' folders is then the checkpoint, and
    any host restores it from a folder that holds the union.

    Each host creates its save's folder before any host writes (between two barriers): orbax's
    asynchronous creation signals "created" under one key for all processes, so a host slower to
    create its own folder would start writing on another host's signal, and then fail to create
    the folder its writes had made (EEXIST)."""
    if not per_host_folders:
        return ocp.StandardCheckpointer()
    options = ocp.options.MultiprocessingOptions(primary_host=None)
    handler = ocp.StandardCheckpointHandler(use_ocdbt=False, multiprocessing_options=options)
    return ocp.AsyncCheckpointer(
        handler,
        multiprocessing_options=options,
        async_options=ocp.options.AsyncOptions(create_directories_asynchronously=False),
    )


class SaveInProgress:
    """An orbax save writing its files; a thread waits for it, then (on the process that
    records them) digests the files it wrote, so that the training loop can ask, without
    blocking, whether it is done."""

    def __init__(
        self,
        path: Path,
        state_dir: str,
        step: int,
        temporary: bool,
        quiet: OrbaxFailuresQuieted,
        writer: ocp.AsyncCheckpointer,
        *,
        record_digests: bool,
    ) -> None:
        self.path = path  # the staging folder (.step-N.saving)
        self.state_dir = path / state_dir  # where orbax writes the state's files
        self.step = step
        self.temporary = temporary
        self.files: FileRecords | None = None  # once done: sizes and digests (process 0)
        self._record_digests = record_digests
        self._quiet = quiet
        self._error: BaseException | None = None
        self.done = threading.Event()
        self._writer = writer
        threading.Thread(target=self._wait, name="kiln-checkpoint", daemon=True).start()

    def _wait(self) -> None:
        try:
            self._writer.wait_until_finished()
            if self._record_digests:  # orbax has finalized the folder: every host's files are in
                self.files = record_files(self.state_dir, files_under(self.state_dir))
        except BaseException as e:  # noqa: BLE001 - raised by finish(), on the training thread
            self._error = e
        finally:
            self.done.set()

    def finish(self) -> None:
        """Waits for the files to be written; raises the save's error, if any."""
        self.done.wait()
        self._quiet.end(succeeded=self._error is None)
        if self._error is not None:
            raise self._error


class OrbaxFailuresQuieted:
    """From a save's start to its end: orbax logs a failed background save with its traceback
    (on the `absl` logger) and raises the same error from wait_until_finished: the raised one is
    reported (a storage error as one line, kiln.artifacts.storage_errors), so the logged copies
    are held back. After a failure, TensorStore still completes the writes in flight and reports
    each to orbax's event loop, closed by then: Python would print each as an unraisable "Event
    loop is closed", which says nothing the raised error does not, so those are dropped from
    then on; so are asyncio's "Task (or _GatheringFuture) exception was never retrieved" reports
    of the sibling writes that failed with the same error after the first one ended the save."""

    def __init__(self) -> None:
        self._log = logging.getLogger("absl")
        self._level, self._hook = self._log.level, sys.unraisablehook
        self._log.setLevel(logging.CRITICAL)
        sys.unraisablehook = _without_closed_loop_reports(self._hook)
        self._unretrieved = _UnretrievedTaskErrors()
        logging.getLogger("asyncio").addFilter(self._unretrieved)

    def end(self, *, succeeded: bool) -> None:
        self._log.setLevel(self._level)
        if succeeded:  # a save that succeeded leaves no write in flight
            sys.unraisablehook = self._hook
            logging.getLogger("asyncio").removeFilter(self._unretrieved)


class _UnretrievedTaskErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        # asyncio's report is "Task exception was never retrieved" then a line per detail.
        first_line = record.getMessage().split("\n", 1)[0]
        return not first_line.endswith("exception was never retrieved")


def _without_closed_loop_reports(hook: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def report(unraisable: Any) -> None:
        error = unraisable.exc_value
        if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
            hook(unraisable)

    return report
