"""What the training loop runs at its sync points, as Levanter's `TrainerHooks`.

The loop (kiln.train.trainer) reads the device's results only at sync points (docs/training.md,
"Sync points"); there it runs its hooks in the order they were added, each handed the step and
the state after it: the trainer's own (validation, lm-eval, checkpoints, the control endpoint),
then any added from outside with `trainer.hooks.add_hook(fn, every=N)`. A hook added with
`every=N` runs at the steps that are multiples of N and at the run's last step, and makes those
steps sync points; a hook added without `every` runs at every sync point. `StopSignals` turns
SIGINT/SIGTERM into the flag the loop stops on after the hooks.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepInfo:
    """One step queued on the device, as the loop's step generator yields it."""

    step: int
    state: Any  # kiln.train.step.TrainState after the step (its arrays may still be computing)
    metrics: Any  # the step's metrics, on the device
    began: float  # time.monotonic() when the step asked for its batch
    data_wait: float  # seconds it waited for the batch
    signum: int | None  # a stop signal this process received by now
    stopping_early: bool  # the invocation ends here before the run does (--max-steps)


@dataclass
class SyncPoint:
    """A step at which the loop has read the device's results and runs its hooks. The
    checkpoint hook agrees with the other processes on `signum` before the hooks after it."""

    step: int
    state: Any  # kiln.train.step.TrainState after the step
    final: bool  # the run's last step
    ending: bool  # this invocation's last step: the run's, or --max-steps'
    save: str | None  # the save this process finds due: "permanent", "temporary" or None
    signum: int | None


HookFn = Callable[[SyncPoint], None]


@dataclass(frozen=True)
class Hook:
    fn: HookFn
    every: int | None  # None: at every sync point

    def due(self, point: SyncPoint) -> bool:
        return self.every is None or point.final or point.step % self.every == 0


class TrainerHooks:
    def __init__(self) -> None:
        self.hooks: list[Hook] = []

    def add_hook(self, fn: HookFn, *, every: int | None = None) -> None:
        self.hooks.append(Hook(fn, every))

    def schedule(self, step: int, *, final: bool) -> bool:
        """Whether a hook's cadence makes `step` a sync point."""
        return any(h.every is not None and (final or step % h.every == 0) for h in self.hooks)

    def run_hooks(self, point: SyncPoint) -> None:
        for hook in self.hooks:
            if hook.due(point):
                hook.fn(point)


class StopSignals:
    """Turns the first SIGINT/SIGTERM/SIGHUP (a closed terminal) into a flag the loop reads
    after each step (a SIGTERM replacing a SIGINT); a second one of the same kind gets the
    default behaviour (kill now).
    A signal noted before (`noted_before`) counts as received: the loop stops at its first
    sync point."""

    # A stop that came before the loop's handlers, noted by the process's own handler
    # (kiln.runner), whose exception Python drops when it lands in a garbage-collection callback.
    noted_before: int | None = None

    def __init__(self) -> None:
        self.received: int | None = StopSignals.noted_before
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        # SIGTERM says why whenever it comes: Pants follows it with a SIGINT of its own, and
        # two signals that arrive together are handled in signal-number order, SIGINT first.
        if self.received is None or signum == signal.SIGTERM:
            self.received = signum
        signal.signal(
            signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
        )

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
