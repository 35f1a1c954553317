"""Processes end with their run: a runtime process whose parent has died stops.

Pants starts each runtime process (the runner, tokenize shards and merges) as a child of the
Pants process (pantsd, or the client itself with `--no-pantsd`), in a session of its own. When a
run is cancelled (Ctrl-C, SIGTERM, a client that goes away under pantsd) Pants interrupts them:
SIGINT to their process group, SIGKILL a few seconds later. When the Pants process itself is
killed (SIGKILL of `./pants --no-pantsd run`, of pantsd, an OOM kill), nothing would: the
process is adopted by init and goes on writing, holding its artifact's lease.

`stop_when_orphaned` watches for exactly that: a daemon thread polls the parent pid, which
changes when the parent dies (the kernel re-parents the process to init or a subreaper). The
process then gets SIGTERM (the trainer saves a checkpoint and exits; other processes end at
once), and the kernel ends it if it is still running after a grace period.

The bound: a process whose parent dies is gone within POLL_SECONDS + its grace period, plus the
time a loaded machine takes to run the watcher thread once (its CPU share and the GIL). The
kill after the grace is a real-time timer's SIGALRM, whose default action ends the process with
no Python code running: neither a save that overruns, nor a C call holding the GIL, nor an
interpreter shutdown (which never runs daemon threads again) can outlast it. So nothing in the
runtime may handle or block SIGALRM.

The parent is read when this module is imported, which the runtime's command lines do before
their heavy imports (jax, transformers take seconds): a parent that dies during those imports is
noticed as well. Only one that dies in the ~0.1 s of interpreter start-up goes unseen.

Why not `prctl(PR_SET_PDEATHSIG)`: Linux sends that signal when the *thread* that forked the
child exits, not the parent process; Pants forks from its engine's worker threads, so a run
could be stopped while Pants lives on. The parent pid changes only when the process dies.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

POLL_SECONDS = 0.5

_watching: list[threading.Thread] = []
_PARENT_AT_IMPORT = os.getppid()


def stop_when_orphaned(grace_seconds: float) -> bool:
    """From now on, when this process's parent dies: SIGTERM to this process, then SIGALRM
    (unhandled: the kernel ends the process) `grace_seconds` later if it still runs. Once per
    process; False when there is no parent to watch (init's children: their parent never
    dies)."""
    if not grace_seconds > 0:  # a zero timer is no timer
        raise ValueError(f"grace_seconds must be positive, got {grace_seconds}")
    if _watching:
        return True
    parent = _PARENT_AT_IMPORT
    if parent == 1:
        return False
    watcher = threading.Thread(
        target=_watch, args=(parent, grace_seconds), name="kiln-parent-watch", daemon=True
    )
    watcher.start()
    _watching.append(watcher)
    return True


def _watch(parent: int, grace_seconds: float) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_SECONDS)
    _note(
        f"kiln: the process that started this one (pid {parent}) has ended; stopping "
        f"(ended in {grace_seconds:g} s if still running)"
    )
    signal.setitimer(signal.ITIMER_REAL, grace_seconds)  # SIGALRM: see the module docstring
    os.kill(os.getpid(), signal.SIGTERM)


def _note(message: str) -> None:
    """Best effort: whoever read our output may be gone with the parent."""
    try:
        print(message, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def discard_output_once_closed() -> None:
    """From now on, a write to stdout or stderr that finds its reader gone (EPIPE: a closed
    terminal, a `pants run` client killed under pantsd, `| head`) sends that and all later
    output to /dev/null instead of raising: output never fails a run. What stops the run is a
    signal (pantsd's SIGINT when its client goes, SIGHUP, SIGTERM, a dead parent)."""
    sys.stdout = _Discarding(sys.stdout)
    sys.stderr = _Discarding(sys.stderr)


class _Discarding:
    """A text stream that discards its output once its reader is gone (discard_output_once_closed)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            _to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            _to_devnull()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _to_devnull() -> None:
    """Points this process's stdout and stderr (the descriptors: Python's and C's writes alike)
    at /dev/null."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
