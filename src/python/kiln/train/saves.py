"""The loop's checkpoint hook: which save is due, agreed on by every process, begun while training
goes on and counted once committed (docs/training.md, "Checkpoints")."""

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


class Saves:
    def __init__(
        self,
        checkpointer: Checkpointer,
        last: CheckpointInfo | None,
        metrics: MetricsLogger,
        progress: Progress,
        shown: Callable[[Path], str],
    ):
        self.checkpointer = checkpointer
        self.last = last  # the newest committed checkpoint
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

    def save_final(self, step: int, state: Any) -> None:
        """The complete run's permanent checkpoint: a no-op when the last step saved it."""
        self.last = self.checkpointer.save(step, state, temporary=False)

    def commit(self) -> None:
        """Completes the save in progress (waiting for its files, if it must)."""
        committed = self.checkpointer.commit()
        if committed is not None:
            self._saved(committed)

    def _saved(self, checkpoint: CheckpointInfo) -> None:
        self.last = checkpoint
        kind = "temporary" if checkpoint.is_temporary else "permanent"  # it may have been promoted
        held_up = f"training held up {self.blocked_seconds:.2f}s"
        if checkpoint.step == self.requested_step:
            held_up = f"asked for at the control endpoint; {held_up}"
        self.progress.message(f"saved {kind} checkpoint {self.shown(checkpoint.path)} ({held_up})")
