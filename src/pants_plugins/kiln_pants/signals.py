"""SIGTERM stops a Pants run the way Ctrl-C does, with or without pantsd.

Pants 2.17 handles SIGINT in its engine: the session is cancelled and every process the run
started is interrupted (SIGINT to its process group, SIGKILL after `[GLOBAL]
process_execution_graceful_shutdown_timeout`). SIGTERM, what `timeout`, SLURM and Kubernetes
send, has only a Python handler, and CPython runs Python handlers on the main thread when it is
back in Python. Without pantsd the main thread waits inside the engine until the goal ends, so
SIGTERM did nothing while `pants run` trained: the run went on.

`forward_sigterm_as_interrupt` lets CPython's C-level handler wake a thread of ours
(`signal.set_wakeup_fd`) that interrupts the process with SIGINT: the engine stops the run as for
Ctrl-C (the trainer saves a checkpoint and exits), and Pants' own SIGTERM handler still ends the
process when the main thread returns. pantsd's client is unaffected (it loads no plugins), and in
pantsd itself a SIGTERM only interrupts the sessions it was going to end anyway.
"""

from __future__ import annotations

import os
import signal
import socket
import threading

_forwarding: list[socket.socket] = []  # the wakeup socket pair, once installed


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
            os.kill(os.getpid(), signal.SIGINT)
