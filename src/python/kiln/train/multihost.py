"""Multi-host runs: one jax runtime over the processes of several hosts.

Joining: every host runs the same command with `--coordinator HOST:PORT --num-processes N
--process-id I` (process 0's address and a free port), or `--coordinator auto` where jax detects
the cluster itself (TPU pods, SLURM, ...); `joined` starts jax.distributed and leaves it.

Leaving on an error: jax's shutdown waits at a barrier (up to its shutdown timeout, 300 s) for
every process, then aborts the ones still waiting. Processes that fail together (an error they
agreed on) meet there at once; a process that fails alone would wait for peers held in a
collective it has left, and be aborted before its error is printed. So a process leaving on an
error waits LEAVE_ON_ERROR_S for the others, and if they do not come `exiting` ends it once its
error is said; its peers' coordination clients then see it gone and end them.

Agreeing: every process runs the same program, and every collective (a train step, an orbax
save) must be entered by all of them. Decisions that read per-process state (a clock, a signal, a
control request, the file system) are therefore agreed on before they start a collective. With
one process these are no-ops.

jax is imported on use: the flags are parsed, and a built artifact served, before it loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager


class JoinError(RuntimeError):
    """This process could not join the multi-host run (one paragraph, names the flags)."""


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """How this process joins a run; no coordinator: it runs alone."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    @property
    def is_multihost(self) -> bool:
        return self.coordinator is not None


ALONE = ProcessGroup()
LEAVE_ON_ERROR_S = 10.0
_left_alone = False  # this process left a multi-host run on an error, without its peers


def add_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("multi-host runs (the same command on every host)")
    group.add_argument(
        "--coordinator",
        metavar="HOST:PORT|auto",
        help="process 0's address (every process gives the same), or auto",
    )
    group.add_argument("--num-processes", type=int, help="how many processes")
    group.add_argument("--process-id", type=int, help="this process, 0-based")


def process_group_from_flags(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> ProcessGroup:
    """The ProcessGroup the flags of `add_flags` describe; a parser error when they are
    incomplete."""
    explicit = (args.num_processes, args.process_id)
    if args.coordinator not in (None, "auto") and None in explicit:
        parser.error("--coordinator HOST:PORT needs --num-processes and --process-id")
    if args.coordinator in (None, "auto") and explicit != (None, None):
        parser.error("--num-processes and --process-id go with --coordinator HOST:PORT")
    return ProcessGroup(args.coordinator, args.num_processes, args.process_id)


@contextmanager
def joined(group: ProcessGroup) -> Iterator[int]:
    """Joins the run (nothing to do alone) and yields this process's index; on the way out,
    every process leaves together, so none tears down a collective another is still in."""
    if not group.is_multihost:
        yield 0
        return
    import jax

    # CPU hosts need a collectives backend across processes; GPUs and TPUs bring their own.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # jax's preemption service takes SIGTERM for itself from here on, and a stop that came
    # before the trainer's own handlers would be kept from it: SIGTERM stays the runner's.
    jax.config.update("jax_enable_preemption_service", False)
    try:
        if group.coordinator == "auto":
            jax.distributed.initialize()
        else:
            jax.distributed.initialize(group.coordinator, group.num_processes, group.process_id)
    except (ValueError, RuntimeError) as e:  # no cluster found, coordinator unreachable, ...
        raise JoinError(
            f"cannot join the multi-host run ({str(e).splitlines()[0]}); give --coordinator "
            "HOST:PORT --num-processes N --process-id I, or run --coordinator auto where jax can "
            "detect the cluster (TPU pods, SLURM)"
        ) from None
    try:
        yield jax.process_index()
    except BaseException:
        if not _shut_down_within(LEAVE_ON_ERROR_S):
            global _left_alone
            _left_alone = True  # `exiting` ends the process once the error is said
        raise
    jax.distributed.shutdown()


def _shut_down_within(seconds: float) -> bool:
    """jax's shutdown, waited for up to `seconds`: whether every process reached it. Else it
    is left waiting, in a thread that ends with the process."""
    import jax

    done = threading.Event()

    def shut_down() -> None:
        jax.distributed.shutdown()
        done.set()

    threading.Thread(target=shut_down, name="kiln-shutdown", daemon=True).start()
    return done.wait(seconds)


@contextmanager
def exiting() -> Iterator[None]:
    """Around a command's whole run (its `sys.exit(main())`): a process that left a multi-host
    run on an error alone exits as soon as the error is said, with its exit status (1 for an
    exception no one caught, its traceback printed)."""
    try:
        yield
    except SystemExit as e:
        if _left_alone:
            _exit_now(0 if e.code is None else e.code if isinstance(e.code, int) else 1)
        raise
    except BaseException:
        if _left_alone:
            traceback.print_exc()
            _exit_now(1)
        raise


def _exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def barrier(name: str) -> None:
    """Returns once every process has reached the barrier `name`."""
    import jax
    from jax.experimental import multihost_utils

    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def agree_max(values: list[int]) -> list[int]:
    """Element-wise maximum over all processes of each process's `values` (flags: any process)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return list(values)
    gathered = multihost_utils.process_allgather(np.asarray(values, np.int64))
    return [int(v) for v in np.asarray(gathered).reshape(-1, len(values)).max(axis=0)]
