"""The loop's checkpoint hook: which save is due, agreed on by every process, begun while training
goes on, committed, and counted (said "saved", recorded as the run's last) once the store holds it
(docs/training.md, "Checkpoints")."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.train.checkpoints import Checkpointer, CheckpointInfo
from kiln.train.hooks import SyncPoint
from kiln.train.metrics import MetricsLogger
from kiln.train.multihost import agree_max
from kiln.train.progress import Progress

# How long the last save of an invocation (its end, a signal) waits for the store to hold it.
IN_STORE_WAIT_SECONDS = 600.0
_IN_STORE_POLL_SECONDS = 0.5


class Saves:
    def __init__(
        self,
        checkpointer: Checkpointer,
        last: CheckpointInfo | None,
        metrics: MetricsLogger,
        progress: Progress,
        shown: Callable[[Path], str],
        in_store: Callable[[Path], bool] | None = None,
    ):
        self.checkpointer = checkpointer
        self.last = last  # the newest checkpoint the store holds for good
        # Whether the store holds a committed checkpoint: by default at once (a directory); a
        # bucket's run uploads its checkpoints in the background (kiln.train.run_mirror).
        self.in_store = in_store or (lambda path: True)
        self._unstored: list[tuple[CheckpointInfo, str]] = []  # committed, and what to say
        self.metrics = metrics
        self.progress = progress
        self.shown = shown  # a path as people and records name it
        self.blocked_seconds = 0.0  # how long the latest save held training up
        self.requested_step: int | None = None  # a save asked for at the control endpoint

    def __call__(self, point: SyncPoint) -> None:
        """Agrees with the other processes on a temporary save, a signal and the save in
        progress; completes that save once every process has written it; saves if due (the
        last save of an invocation, at its end or a signal, is waited for)."""
        wants_temporary, any_signal, any_writing = agree_max(
            [point.save == "temporary", point.signum or 0, self.checkpointer.writing()]
        )
        point.signum = any_signal or None
        kind = point.save
        if kind != "permanent":  # permanent saves follow the step number: all agree already
            kind = "temporary" if wants_temporary else None
        if not any_writing:
            self.commit()  # a save begun earlier has written its files on every process
        if kind is not None:
            ending = point.ending or point.signum is not None
            self.save(point.step, point.state, temporary=kind == "temporary", wait=ending)
        self._count_stored()

    def save(self, step: int, state: Any, *, temporary: bool, wait: bool) -> None:
        """Saves `state`, after `step`. Training is held up only while orbax copies the state
        off the devices (logged as throughput/checkpoint_blocked_seconds), unless `wait`; the
        checkpoint counts once committed."""
        self.commit()  # the previous save first: one in progress at a time
        began = time.monotonic()
        done = self.checkpointer.begin_save(step, state, temporary=temporary)
        if wait:
            done = self.checkpointer.commit() or done
        self.blocked_seconds = time.monotonic() - began
        self.metrics.log(step, {"throughput/checkpoint_blocked_seconds": self.blocked_seconds})
        if done is not None:
            self._saved(done)
        if wait:
            self._count_stored(wait=True)

    def save_final(self, step: int, state: Any) -> None:
        """The complete run's permanent checkpoint: a no-op when the last step saved it."""
        final = self.checkpointer.save(step, state, temporary=False)
        self._count_stored(wait=True)
        if self._wait_for_store(final):
            self.last = final

    def commit(self) -> None:
        """Completes the save in progress (waiting for its files, if it must)."""
        committed = self.checkpointer.commit()
        if committed is not None:
            self._saved(committed)

    def _saved(self, checkpoint: CheckpointInfo) -> None:
        """Committed on every process: said and counted once the store holds it."""
        kind = "temporary" if checkpoint.is_temporary else "permanent"  # it may have been promoted
        held_up = f"training held up {self.blocked_seconds:.2f}s"
        if checkpoint.step == self.requested_step:
            held_up = f"asked for at the control endpoint; {held_up}"
        line = f"saved {kind} checkpoint {self.shown(checkpoint.path)} ({held_up})"
        self._unstored.append((checkpoint, line))
        self._count_stored()

    def _count_stored(self, *, wait: bool = False) -> None:
        """Says and counts, in order, the committed checkpoints the store now holds; with
        `wait`, waits for them (up to IN_STORE_WAIT_SECONDS: a store that never shows one leaves
        the run's last checkpoint the one before, and nothing said)."""
        while self._unstored:
            checkpoint, line = self._unstored[0]
            stored = self._wait_for_store(checkpoint) if wait else self.in_store(checkpoint.path)
            if not stored and checkpoint.path.exists():
                return  # not in the store yet (or, waited for, not in time)
            self._unstored.pop(0)
            if stored:
                self.last = checkpoint
                self.progress.message(line)
            # else pruned here before it reached the store: a newer checkpoint supersedes it

    def _wait_for_store(self, checkpoint: CheckpointInfo) -> bool:
        """Whether the store holds it, once it does; False after IN_STORE_WAIT_SECONDS, or at
        once when the trainer has pruned it (it never will)."""
        deadline = time.monotonic() + IN_STORE_WAIT_SECONDS
        while not self.in_store(checkpoint.path):
            if time.monotonic() >= deadline or not checkpoint.path.exists():
                return False
            time.sleep(_IN_STORE_POLL_SECONDS)
        return True
