"""The training loop: `train(spec)` turns a TrainSpec into a checkpoint directory.

As Levanter's trainer: the set-up (kiln.train.setup: data, mesh, trackers, step functions) is
apart from the loop; `open_trainer` restores the newest complete checkpoint or initialises, and
opens the run's outputs (RunOutputs) before it makes the Trainer, whole; the loop is
`training_steps`, a generator handed the state and the batches that yields each step once it is
queued on the device; hooks (kiln.train.hooks) run at its sync
points, handed the step and the state: [validation] -> [evals] -> checkpoint -> control endpoint
-> any added with `trainer.hooks.add_hook(fn, every=N)`; then a signal stops the run. Fails with
a TrainingError (kiln.train.errors: a clear message, no traceback) on a non-finite loss and on
bad run-time settings, and stops with TrainingStopped on SIGINT/SIGTERM (after saving a temporary
checkpoint); caches that cannot be read raise kiln.data's errors. `train_to_end` says how a run
ended in these two exceptions alone, for the callers that report it. See docs/training.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from kiln.artifacts.atomic import atomic_write_json, atomic_write_text
from kiln.artifacts.folder import ArtifactFolder
from kiln.data.cache import TokenCache
from kiln.data.errors import KilnDataError
from kiln.data.mixture import MixtureError
from kiln.eval.validation import validation_metrics
from kiln.model.config import LlamaConfig
from kiln.train import compilation_cache
from kiln.train.checkpoints import CheckpointInfo
from kiln.train.compilation_cache import Compilations
from kiln.train.control_hook import ControlHook
from kiln.train.errors import (
    EXIT_STOPPED_EARLY,
    TrainingDiverged,
    TrainingError,
    TrainingInterrupted,
    TrainingStopped,
)
from kiln.train.hooks import StepInfo, StopSignals, SyncPoint, TrainerHooks
from kiln.train.metrics import TRACKER_FILE, MetricsLogger
from kiln.train.multihost import barrier
from kiln.train.progress import Progress, SilentProgress, make_progress
from kiln.train.saves import Saves
from kiln.train.setup import RunStart, TrainerSetup, TrainStart
from kiln.train.spec import TrainSpec
from kiln.train.step_log import StepLog
from kiln_contract.layout import RUN_CONFIG_FILE, RUN_SUMMARY_FILE

log = logging.getLogger(__name__)

# The loop reads the device's results (loss, grad norm) at these steps only, so the host queues
# the next steps while the device computes: every SYNC_EVERY_STEPS steps, and wherever the state
# is read or a decision is taken (the first and last step of an invocation, validation, evals,
# checkpoint saves; on a single process also a signal, a control request or the save clock).
SYNC_EVERY_STEPS = 10

MetricsObserver = Callable[[Path], None]
"""Called on process 0 with the run's metrics file after a validation, at most every
OBSERVE_EVERY_SECONDS, and when the run ends (kiln.runner draws the training plot with it: ~0.3 s
a drawing on a CPU, too much to repeat at every validation of a short run). Its failures are
logged: they never stop a run."""
OBSERVE_EVERY_SECONDS = 30.0


@dataclass(frozen=True)
class FinishedRun:
    """What an invocation ends with, for what runs after the trainer on every process (the
    end-of-run report samples from `params`, a collective on a multi-host run)."""

    spec: TrainSpec
    summary: dict[str, Any]  # as written to summary.json
    caches: tuple[TokenCache, ...]  # config.datasets', then config.validation's, opened
    model_config: LlamaConfig
    params: Any  # nnx.State: the parameters after the last step, on the trainer's mesh
    checkpoint: CheckpointInfo | None  # the newest committed one


def training_steps(
    train_step: Callable[[Any, Any], tuple[Any, Any]],
    state: Any,
    batches: Iterator[Any],
    steps: range,
    *,
    signals: StopSignals,
    total: int,
) -> Generator[StepInfo, None, None]:
    """Trains `steps` from `state`, one batch each, yielding each step once it is queued on the
    device, with the state after it (its metrics are read at the next sync point)."""
    for step in steps:
        began = time.monotonic()  # step time includes waiting for data, not evaluation
        batch = next(batches)
        data_wait = time.monotonic() - began
        state, metrics = train_step(state, batch)
        stopping_early = step == steps[-1] < total
        yield StepInfo(step, state, metrics, began, data_wait, signals.received, stopping_early)


@dataclass(frozen=True)
class RunOutputs:
    """What the loop writes to, opened before the trainer exists and closed after it: the
    metrics log, the progress display, the step log, the checkpoint saves and the control
    endpoint."""

    metrics: MetricsLogger
    progress: Progress
    steps: StepLog
    saves: Saves
    control: ControlHook | None

    @classmethod
    def open(
        cls,
        setup: TrainerSetup,
        start: TrainStart,
        cleanup: contextlib.ExitStack,
        checkpoint_in_store: Callable[[Path], bool] | None,
    ) -> RunOutputs:
        """Opens them, each closed by `cleanup` (the checkpointer last)."""
        spec, is_main = setup.spec, jax.process_index() == 0
        cleanup.callback(setup.checkpointer.close)
        metrics = MetricsLogger(
            spec.output_path,
            # A fresh run also drops step-0 lines: an earlier attempt's validation at the start.
            resume_step=start.step if start.step else -1,
            wandb=setup.wandb,
            run_config=setup.resolved_config() if is_main else None,
            write=is_main,
        )
        cleanup.callback(metrics.close)
        # One progress stream for a multi-host run, process 0's (as Levanter logs): the other
        # processes' output is what only they say (warnings, errors).
        progress: Progress = SilentProgress()
        if is_main:
            progress = make_progress(
                spec.runtime.progress, total_steps=spec.config.num_train_steps,
                start_step=start.step,
            )  # fmt: skip
        cleanup.callback(progress.close)
        steps = StepLog(setup.throughput, metrics, progress)
        saves = Saves(setup.checkpointer, start.checkpoint, metrics, progress, spec.shown,
                      checkpoint_in_store)  # fmt: skip
        if start.step and start.checkpoint is not None:
            progress.message(f"resumed from {spec.shown(start.checkpoint.path)}")
        elif spec.config.init_from is not None:
            progress.message(f"started from {spec.config.init_from.label}")
        control = ControlHook.start(setup, progress, metrics, steps, saves)
        if control is not None:
            cleanup.callback(control.stop)
        return cls(metrics, progress, steps, saves, control)


@contextlib.contextmanager
def open_trainer(
    spec: TrainSpec,
    metrics_observer: MetricsObserver | None = None,
    start: RunStart | None = None,
    *,
    checkpoint_in_store: Callable[[Path], bool] | None = None,
) -> Iterator[Trainer]:
    """A run's trainer, whole: its set-up made from the spec, its state restored or initialised,
    its config written and its outputs open (closed when the block ends). Hooks added to
    `trainer.hooks` before `trainer.run()` run after the trainer's own. `checkpoint_in_store`:
    whether the store holds a committed checkpoint for good (a bucket's run uploads them in the
    background; by default a checkpoint is held once committed)."""
    started = time.monotonic()
    setup = TrainerSetup(spec, start)
    state = setup.initial_state()
    spec.output_path.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        atomic_write_json(spec.output_path / RUN_CONFIG_FILE, setup.resolved_config())
    with contextlib.ExitStack() as cleanup:
        outputs = RunOutputs.open(setup, state, cleanup, checkpoint_in_store)
        yield Trainer(setup, state, outputs, metrics_observer, started=started)


class Trainer:
    """A run's trainer (made by `open_trainer`): `run()` trains from its start to the run's end
    (or runtime.max_steps_this_run)."""

    def __init__(
        self,
        setup: TrainerSetup,
        start: TrainStart,
        outputs: RunOutputs,
        metrics_observer: MetricsObserver | None = None,
        *,
        started: float,
    ):
        self.setup, self.start, self.started = setup, start, started
        self.spec, self.cfg, self.runtime = setup.spec, setup.spec.config, setup.spec.runtime
        self.output = self.spec.output_path
        self.is_main = jax.process_index() == 0
        self.metrics, self.progress, self.steps = outputs.metrics, outputs.progress, outputs.steps
        self.saves, self.control = outputs.saves, outputs.control
        self.metrics_observer = metrics_observer
        self.hooks = self._own_hooks()
        self.first_step: dict[str, Any] = {}  # seconds, program source, compilation cache
        self._observed_step: int | None = None
        self._observed_at = time.monotonic()  # the first drawing comes after a while, or at the end

    def _own_hooks(self) -> TrainerHooks:
        """What runs at the loop's sync points, in this order (docs/training.md, "One step")."""
        hooks = TrainerHooks()
        hooks.add_hook(self._validation_hook, every=self.runtime.validation_every)
        if self.setup.evals is not None and self.cfg.evals is not None:
            hooks.add_hook(self._evals_hook, every=self.cfg.evals.every)
        hooks.add_hook(self.saves)
        if self.control is not None:
            hooks.add_hook(self.control)
        return hooks

    # --- the loop ---------------------------------------------------------------------------

    def run(self) -> FinishedRun:
        start = self.start
        end_step = self.cfg.num_train_steps
        if self.runtime.max_steps_this_run is not None:
            end_step = min(end_step, start.step + self.runtime.max_steps_this_run)
        if start.step == 0 and self.runtime.validate_at_start:
            self._validate(0, start.state)
        with contextlib.ExitStack() as cleanup:
            batches = self.setup.batches(range(start.step, end_step))
            cleanup.enter_context(contextlib.closing(batches))
            signals = cleanup.enter_context(StopSignals())
            compilations = cleanup.enter_context(compilation_cache.watching())
            steps = training_steps(
                self.setup.train_step, start.state, batches, range(start.step + 1, end_step + 1),
                signals=signals, total=self.cfg.num_train_steps,
            )  # fmt: skip
            state = start.state
            for info in cleanup.enter_context(contextlib.closing(steps)):
                state = info.state
                self.steps.queued(info)
                if info.step == start.step + 1:
                    self._time_first_step(info.step, compilations)
                self._after_step(info)
            summary = self._finish(end_step, state)
        setup = self.setup
        return FinishedRun(
            self.spec, summary, setup.data.caches, setup.model_config, state.params, self.saves.last
        )

    def _time_first_step(self, step: int, compilations: Compilations) -> None:
        """The invocation's first step, timed to its metrics on the host: it includes compiling
        the step, or reading it from the persistent cache (kiln.train.compilation_cache)."""
        self._read_metrics()
        self.first_step = self.steps.first_step(step, compilations.source)

    def _read_metrics(self) -> None:
        """Brings the unread steps' metrics to the host; stops on a non-finite loss."""
        diverged = self.steps.read()
        if diverged is None:
            return
        step, values = diverged
        self.saves.commit()  # a save begun at an earlier step holds a good state
        last = self.spec.shown(self.saves.last.path) if self.saves.last else "none yet"
        raise TrainingDiverged(
            f"non-finite training loss at step {step} (loss {values['loss']}, grad_norm "
            f"{values['grad_norm']}); stopped without saving this state. Last good checkpoint: "
            f"{last}. Lower the learning rate, raise warmup or enable z-loss, with a new version."
        )

    def _after_step(self, info: StepInfo) -> None:
        """At sync points (SYNC_EVERY_STEPS, and the hooks' own steps): reads the steps' metrics,
        runs the hooks, and stops on a signal."""
        point = self._sync_point(info)
        if point is None:
            return
        self._read_metrics()
        self.hooks.run_hooks(point)
        if point.signum is not None:
            self._stop(point)

    def _sync_point(self, info: StepInfo) -> SyncPoint | None:
        """The step as a sync point, or None when the loop goes on without waiting for the
        device."""
        step, final = info.step, info.step == self.cfg.num_train_steps
        ending = final or info.stopping_early
        checkpointer = self.setup.checkpointer
        scheduled = (
            step % SYNC_EVERY_STEPS == 0 or ending or self.hooks.schedule(step, final=final)
            or checkpointer.due(step, final=final) == "permanent"
        )  # fmt: skip
        # A control request (process 0's endpoint), a signal and the save clock are one
        # process's: acted on at once by a lone process; on several, at the next scheduled point
        # (each process agrees on them there, or one would enter a save, a collective, alone).
        alone = jax.process_count() == 1
        requested = (scheduled or alone) and self.control is not None and \
            self.control.take_checkpoint_request()  # fmt: skip
        if requested:
            self.saves.requested_step = step
        save = checkpointer.due(
            step, final=final, requested=requested or info.signum is not None or ending
        )
        if not (scheduled or (alone and save is not None)):
            return None
        return SyncPoint(step, info.state, final, ending, save, info.signum)

    def _stop(self, point: SyncPoint) -> None:
        assert point.signum is not None  # saved by its hook, if the store took it in time
        last = self.saves.last
        saved = f"saved {self.spec.shown(last.path)}" if last else "no checkpoint is in the store"
        message = (
            f"interrupted by {signal.Signals(point.signum).name} after step {point.step}; "
            f"{saved}. Rerun to resume."
        )
        if self.is_main:  # beside STATUS before the way out (W&B, orbax), which may be cut short
            with contextlib.suppress(OSError):
                ArtifactFolder.at(self.output).record_stop(message)
        raise TrainingInterrupted(message, point.signum)

    # --- the trainer's own hooks ------------------------------------------------------------

    def _validation_hook(self, point: SyncPoint) -> None:
        self._validate(point.step, point.state)

    def _validate(self, step: int, state: Any) -> None:
        from kiln.train.step import shard_batch

        if not self.setup.data.validation:
            return

        def eval_batch(batch: dict[str, Any]) -> dict[str, Any]:
            sharded = shard_batch(batch, self.setup.mesh)
            return jax.device_get(self.setup.eval_step(state, sharded))

        began = time.monotonic()
        metrics = validation_metrics(eval_batch, self.setup.data.validation)
        self.metrics.log(step, {**metrics, "eval/total_time": time.monotonic() - began})
        self._observe_metrics(step)

    def _evals_hook(self, point: SyncPoint) -> None:
        assert self.setup.evals is not None  # added only with evals
        self.metrics.log(point.step, self.setup.evals(point.state, point.step))

    def _observe_metrics(self, step: int, *, final: bool = False) -> None:
        if self.metrics_observer is None or not self.is_main or self._observed_step == step:
            return
        if not final and time.monotonic() - self._observed_at < OBSERVE_EVERY_SECONDS:
            return
        self._observed_step, self._observed_at = step, time.monotonic()
        try:
            self.metrics_observer(self.metrics.path)
        except Exception as e:  # an observer (a plot) is a convenience: never stop training
            log.warning("the metrics observer failed at step %d: %s", step, e)

    # --- the end ----------------------------------------------------------------------------

    def _finish(self, end_step: int, state: Any) -> dict[str, Any]:
        complete = end_step == self.cfg.num_train_steps
        self._read_metrics()
        self.saves.commit()
        if complete:  # a no-op when the last step already saved it (the usual case)
            self.saves.save_final(end_step, state)
        self._observe_metrics(end_step, final=True)
        summary = self._summary(end_step, complete)
        if self.is_main:
            atomic_write_json(self.output / RUN_SUMMARY_FILE, summary)
            if complete:
                record = {"config": self.setup.resolved_config(), "summary": summary}
                atomic_write_text(self.output / TRACKER_FILE, _json_line(record))
        barrier("run files written")  # what follows on any process (the report) may read them
        return summary

    def _summary(self, end_step: int, complete: bool) -> dict[str, Any]:
        latest = {k: v for k, v in self.metrics.latest.items() if not k.startswith("throughput/")}
        latest.pop("timestamp", None)
        last = self.saves.last
        return {
            **latest,
            "complete": complete,
            "step": end_step,
            "num_train_steps": self.cfg.num_train_steps,
            **self.steps.speed(),
            "first_step_seconds": self.first_step.get("seconds"),
            "first_step_program": self.first_step.get("program"),  # cache | compiled | ...
            # A folder of this machine: a run staged for a bucket names none in its records.
            "compilation_cache": None if self.spec.location else self.first_step.get("cache"),
            "wall_time_seconds": time.monotonic() - self.started,
            "output_path": self.spec.shown(self.output),
            "checkpoint": self.spec.shown(last.path) if last else None,
            "metrics_file": self.spec.shown(self.metrics.path),
        }

def _json_line(record: dict[str, Any]) -> str:
    return json.dumps(record, sort_keys=True) + "\n"


def train(
    spec: TrainSpec,
    metrics_observer: MetricsObserver | None = None,
    start: RunStart | None = None,
) -> dict[str, Any]:
    """Trains (or resumes) the run described by `spec`; returns the summary dict."""
    with open_trainer(spec, metrics_observer, start) as trainer:
        return trainer.run().summary


def train_to_end(
    spec: TrainSpec,
    metrics_observer: MetricsObserver | None = None,
    start: RunStart | None = None,
    *,
    checkpoint_in_store: Callable[[Path], bool] | None = None,
) -> FinishedRun:
    """`train`, for the callers that report how a run ended (`python -m kiln.train`, kiln.runner):
    a complete run; else TrainingError (failed: bad input, unreadable data, a
    diverged loss) or TrainingStopped (resumable: a signal, runtime.max_steps_this_run), each
    with its process exit code."""
    try:
        with open_trainer(
            spec, metrics_observer, start, checkpoint_in_store=checkpoint_in_store
        ) as trainer:
            finished = trainer.run()
    except (KilnDataError, MixtureError) as e:
        raise TrainingError(str(e)) from None
    except KeyboardInterrupt:
        raise TrainingStopped("interrupted before a checkpoint could be saved", 130) from None
    summary = finished.summary
    if not summary["complete"]:
        raise TrainingStopped(
            f"stopped early at step {summary['step']} of {summary['num_train_steps']} "
            "(runtime.max_steps_this_run); rerun without it to finish",
            EXIT_STOPPED_EARLY,
        )
    return finished

