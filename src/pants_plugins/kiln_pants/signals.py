"""SIGTERM stops a Pants run the way Ctrl-C does, with or without pantsd.

Pants 2.17 handles SIGINT in its engine: the session is cancelled and every process the run
started is interrupted (SIGINT to its process group, SIGKILL after `[GLOBAL]
process_execution_graceful_shutdown_timeout`). SIGTERM, what `timeout`, SLURM and Kubernetes
send, has only a Python handler, and CPython runs Python handlers on the main thread when it is
back in Python. Without pantsd the main thread waits inside the engine until the goal ends, so
SIGTERM did nothing while `pants run` trained: the run went on.

`forward_sigterm_as_interrupt` lets CPython's C-level handler wake a thread of ours
(`signal.set_wakeup_fd`) that passes the SIGTERM on to the processes Pants started (so the
trainer records that SIGTERM stopped it) and then interrupts the process with SIGINT: the engine
stops the run as for Ctrl-C (the trainer saves a checkpoint and exits; `[GLOBAL]
process_execution_graceful_shutdown_timeout` is how long it may take before Pants kills it), and
Pants' own SIGTERM handler still ends the process when the main thread returns. pantsd's client
is unaffected (it loads no plugins), and in pantsd itself a SIGTERM only interrupts the sessions
it was going to end anyway. A SIGTERM to the client (which handles SIGINT only) ends it, and
pantsd, which sees only its connection drop, interrupts the run with SIGINT: that is the signal
the trainer records (docs/artifacts.md, "Processes end with their run").

Pants itself reports the cancelled goal as a failure (exit 1, an `[ERROR]` line with no text).
A process that SIGTERM stopped exits 143 (128 + 15) instead, as a shell reports a command the
signal ended, after one line saying so: `_exit_as_terminated`, registered with `atexit` when the
forwarding is installed (the plugin is loaded early, so it runs after Pants' own exit handlers).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import sys
import threading

_forwarding: list[socket.socket] = []  # the wakeup socket pair, once installed
_terminated = threading.Event()  # a SIGTERM was received
EXIT_TERMINATED = 128 + signal.SIGTERM


def forward_sigterm_as_interrupt() -> bool:
    """Installs the forwarding (once per process); True if it is in place. It needs the main
    thread, a Python-level SIGTERM handler (one that would otherwise be deferred) and no other
    user of the wakeup fd."""
    if _forwarding:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    if not callable(signal.getsignal(signal.SIGTERM)):
        return False  # default or ignored: the kernel acts at once, nothing is deferred
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    if previous != -1:  # someone else relies on the wakeup fd: leave it to them
        signal.set_wakeup_fd(previous)
        reader.close()
        writer.close()
        return False
    _forwarding.extend((reader, writer))
    atexit.register(_exit_as_terminated)
    threading.Thread(
        target=_interrupt_on_sigterm, args=(reader,), name="kiln-sigterm", daemon=True
    ).start()
    return True


def _interrupt_on_sigterm(reader: socket.socket) -> None:
    """Each byte is the number of a signal that reached a Python handler."""
    while True:
        received = reader.recv(64)
        if not received:
            return
        if signal.SIGTERM in received:
            _terminated.set()
            for child in _children(os.getpid()):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)


def _children(parent: int) -> list[int]:
    """The processes whose parent is `parent` (from /proc: Linux), ended ones left out."""
    children = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                # pid (comm) state ppid ...: comm may hold spaces and parentheses.
                state, ppid = f.read().rpartition(")")[2].split()[:2]
        except (OSError, ValueError):
            continue  # not a process, or it ended meanwhile
        if int(ppid) == parent and state not in "ZX":
            children.append(int(entry))
    return children


def _exit_as_terminated() -> None:
    """At exit, after a SIGTERM: says so, and ends the process with status 143 whatever status
    Pants chose for the cancelled goal."""
    if not _terminated.is_set():
        return
    print(
        "kiln: stopped by SIGTERM (a training run saves a checkpoint first: rerun to resume)",
        file=sys.stderr,
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_TERMINATED)
