"""The training loop: `train(spec)` turns a TrainSpec into a checkpoint directory.

The loop is a generator of steps (`Trainer.training_steps`: batch, a pure function of the step
-> train_step, queued on the device) and hooks run at its sync points (kiln.train.hooks):
[validation] -> [evals] -> [checkpoint] -> control endpoint -> stop on a signal. Resumes from
the newest complete checkpoint. Fails with a
TrainingError (a clear message, no traceback) on a non-finite loss and on bad run-time settings,
and stops with TrainingStopped on SIGINT/SIGTERM (after saving a temporary checkpoint); caches
that cannot be read raise kiln.data's errors. `train_to_end` says how a run ended in these two
exceptions alone, for the callers that report it. See docs/training.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import signal
import time
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from kiln.artifacts.atomic import atomic_write_json, atomic_write_text
from kiln.artifacts.folder import ArtifactFolder
from kiln.data.cache import open_caches, shared_tokenizer
from kiln.data.errors import KilnDataError
from kiln.data.mixture import (
    MixtureDataset,
    MixtureError,
    fixed_batches,
    mixture_block_size,
    staged_block_size,
)
from kiln.data.tokenizer import TokenizerInfo
from kiln.eval.validation import ValidationSet, validation_metrics
from kiln.model.config import LlamaConfig
from kiln.train import compilation_cache
from kiln.train.checkpoints import CheckpointDamaged, Checkpointer, CheckpointInfo
from kiln.train.hooks import StepInfo, StopSignals, SyncPoint, TrainerHooks
from kiln.train.metrics import (
    TRACKER_FILE,
    MetricsLogger,
    Throughput,
    WandbSettings,
    peak_flops_per_device,
)
from kiln.train.multihost import agree_max, barrier
from kiln.train.progress import Progress, SilentProgress, make_progress
from kiln.train.spec import Resources, RuntimeSpec, TrainConfig, TrainSpec
from kiln_contract.layout import RUN_CONFIG_FILE, RUN_SUMMARY_FILE

log = logging.getLogger(__name__)

PREFETCH_BATCHES = 2
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
# The state a run starts from when `config.init_from` names weights: given by the runner (which
# reads published weights or a parent run), called with init_from and the freshly initialised
# state, only when a run starts without a checkpoint of its own.
StartFrom = Callable[[Any, Any, LlamaConfig, TokenizerInfo], Any]


class TrainingError(RuntimeError):
    """An expected failure: the message says what happened and what to do."""

    exit_code = 1


class TrainingDiverged(TrainingError):
    exit_code = 2


class TrainingStopped(RuntimeError):
    """A run that stopped before its last step, resumable from its last checkpoint: STATUS stays
    RUNNING. The message says where it stopped and how to go on."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class TrainingInterrupted(TrainingStopped):
    def __init__(self, message: str, signum: int):
        super().__init__(message, 128 + signum)


# runtime.max_steps_this_run reached: a checkpoint was saved.
EXIT_STOPPED_EARLY = 3


@dataclass(frozen=True)
class RunData:
    """The opened inputs: training mixture, validation sets and their shared tokenizer."""

    mixture: MixtureDataset
    validation: tuple[ValidationSet, ...]
    tokenizer: TokenizerInfo
    tokenizer_spec: Any  # what kiln.data.tokenizer.load_tokenizer takes (for evals)


def open_data(spec: TrainSpec) -> RunData:
    cfg, runtime = spec.config, spec.runtime
    inputs = [*cfg.datasets, *cfg.validation]
    caches = open_caches(inputs)
    tokenizer = shared_tokenizer(inputs, caches)
    train_caches = caches[: len(cfg.datasets)]
    stage_starts = [stage.start_step * cfg.batch_size for stage in cfg.stages]
    block_size = mixture_block_size(cfg.batch_size, cfg.num_train_steps)
    mixture = MixtureDataset(
        [(c, d.weight) for c, d in zip(train_caches, cfg.datasets)],
        cfg.seq_len,
        cfg.seed,
        block_size=staged_block_size(block_size, stage_starts),
        loss_positions=cfg.loss_positions,
        stages=[(start, stage.weights) for start, stage in zip(stage_starts, cfg.stages)],
    )
    validation = tuple(
        ValidationSet.build(
            name,
            fixed_batches(
                c, cfg.seq_len, cfg.batch_size, eval_batches(runtime, c, cfg), cfg.loss_positions
            ),
            tokenizer.token_byte_lengths,
        )
        for name, c in zip(runtime.eval_names(cfg.validation), caches[len(cfg.datasets) :])
    )
    return RunData(mixture, validation, tokenizer, caches[0].info["tokenizer"].get("spec"))


def eval_batches(runtime: RuntimeSpec, cache: Any, cfg: TrainConfig) -> int:
    """Validation batches of one set: runtime.max_eval_batches, or all of the set's windows."""
    whole_set = -(-cache.num_windows(cfg.seq_len) // cfg.batch_size)
    return min(whole_set, runtime.max_eval_batches or whole_set)


def microbatch_count(batch_size: int, per_device_parallelism: int | None, ways: int) -> int:
    """Gradient-accumulation steps per optimizer step (Levanter's per_device_parallelism): each
    microbatch holds per_device_parallelism sequences on each of the `ways` batch shards."""
    if per_device_parallelism is None:
        return 1
    microbatch = per_device_parallelism * ways
    if batch_size % microbatch:
        raise TrainingError(
            f"runtime.per_device_parallelism={per_device_parallelism} on {ways} data-parallel "
            f"device(s) makes microbatches of {microbatch} sequences, which do not divide "
            f"batch_size={batch_size}; pick a per_device_parallelism that does"
        )
    return batch_size // microbatch


def check_devices(resources: Resources) -> None:
    """The devices jax sees must be of the kind the spec asks for: a GPU run silently falling back
    to the CPU (jax without CUDA) would take months, not hours."""
    backend = jax.default_backend()
    if resources.kind != "cpu" and backend != resources.kind:
        raise TrainingError(
            f"runtime.resources asks for {resources.kind} but jax found only {backend} devices "
            f"(its log above says why: no driver or device here, or no jax {resources.kind} "
            "plugin installed); run it where one is, or with resources cpu()"
        )
    if resources.count is not None and resources.count != jax.device_count():
        log.warning(
            "runtime.resources asks for %d %s devices; jax sees %d: the mesh uses what it sees",
            resources.count, resources.kind, jax.device_count(),
        )  # fmt: skip


def prefetched(make: Callable[[int], Any], steps: range, depth: int) -> Generator[Any, None, None]:
    """make(step) for each step, computed `depth` steps ahead on a background thread."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-data") as pool:
        pending = deque(pool.submit(make, s) for s in steps[:depth])
        for s in steps[depth:]:
            pending.append(pool.submit(make, s))
            yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


class EvalSuite:
    """The lm-eval suite (kiln.eval.harness), checked when the trainer is made so that a task
    that cannot load fails at step 0, not after hours of training."""

    def __init__(self, suite: Any, tokenizer_spec: Any, max_length: int):
        try:
            from kiln.eval import harness
        except ImportError as e:
            raise TrainingError(
                f"config.evals is set but the lm-eval harness cannot be imported ({e}); install "
                "lm-eval (3rdparty/python/runtime-requirements.txt) or set evals to null"
            ) from None
        from kiln.data.tokenizer import load_tokenizer

        try:
            harness.load_suite_tasks(suite, model_max_length=max_length)
            self.tokenizer = load_tokenizer(tokenizer_spec)
        except Exception as e:  # any failure to set evals up is a bad input, reported at once
            raise TrainingError(f"config.evals: {e}") from None
        self.run_suite = harness.run_eval_suite
        self.suite = suite.to_json()
        self.max_length = max_length

    def __call__(self, logprob_fn: Callable[[Any], Any], step: int) -> dict[str, float]:
        return self.run_suite(
            logprob_fn, self.tokenizer, self.suite, step, model_max_length=self.max_length
        )


def _finite(metrics: dict[str, float]) -> bool:
    return math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])


class Trainer:
    def __init__(
        self,
        spec: TrainSpec,
        metrics_observer: MetricsObserver | None = None,
        start_from: StartFrom | None = None,
    ):
        from kiln.train.mesh import batch_parallelism, make_mesh

        self.spec = spec
        self.cfg = spec.config
        self.runtime = spec.runtime
        self.output = spec.output_path
        self.is_main = jax.process_index() == 0
        check_devices(self.runtime.resources)
        self.data = open_data(spec)
        self.model_config = LlamaConfig.for_vocabulary(self.cfg.model, self.data.tokenizer.vocab_size)
        try:
            self.mesh = make_mesh(self.runtime.mesh)
        except ValueError as e:  # e.g. sizes that do not cover this machine's devices
            raise TrainingError(f"runtime.mesh: {e}") from None
        self.microbatches = microbatch_count(
            self.cfg.batch_size, self.runtime.per_device_parallelism, batch_parallelism(self.mesh)
        )
        try:
            self.wandb = WandbSettings.resolve(self.runtime.wandb, spec.name, spec.version)
        except ValueError as e:
            raise TrainingError(f"runtime.wandb: {e}") from None
        self.run_id = self.wandb.run_id
        self.checkpointer = Checkpointer.from_spec(
            self.output, self.runtime.checkpointer, name=spec.name, version=spec.version
        )
        self.throughput = self._throughput()
        self.last_checkpoint: CheckpointInfo | None = None
        self.step_times: list[float] = []
        self.data_waits: list[float] = []  # seconds each step waited for its batch
        self.unread: list[tuple[int, Any]] = []  # (step, device metrics) not yet on the host
        self.unread_since = 0.0  # when the first unread step asked for its batch
        self.first_step: dict[str, Any] = {}  # seconds, program source, compilation cache
        self.save_blocked_seconds = 0.0  # how long the latest save held training up
        self.requested_save_step: int | None = None  # a save asked for at the control endpoint
        self.metrics_observer = metrics_observer
        self.start_from = start_from
        if self.cfg.init_from is not None and start_from is None:
            raise TrainingError(
                "config.init_from needs the weights loaded by kiln.runner (python -m kiln.runner "
                "STEP.json), which reads them from the Hugging Face hub"
            )
        self._observed_step: int | None = None
        self._observed_at = time.monotonic()  # the first drawing comes after a while, or at the end
        self.train_step, self.eval_step = self._step_functions()
        self.evals = self._eval_suite()
        self.state, self.start_step = self._restore_or_initialise()
        self.logprobs = self._logprob_fn()
        self.hooks = self._hooks()
        # The run's outputs, opened by `run` (their files, display and server live as long as it):
        self.metrics: MetricsLogger
        self.progress: Progress
        self.control: Any = None  # kiln.control.server.ControlServer on process 0, if enabled

    # --- setup ------------------------------------------------------------------------------

    def resolved_config(self) -> dict[str, Any]:
        devices = jax.devices()
        return {
            "spec": self.spec.to_json(),
            "run_id": self.run_id,
            "wandb": self.wandb.to_json(),  # as resolved: the spec, then WANDB_* variables
            "model": self.model_config.to_json(),
            "tokenizer": self.data.tokenizer.to_json(),
            "mixture": {
                "block_size": self.data.mixture.block_size,
                "sequences_per_block": self.data.mixture.sequences_per_block(
                    [d.name for d in self.cfg.datasets]
                ),
            },
            "mesh": dict(self.mesh.shape),
            "microbatches": self.microbatches,
            "devices": {"count": len(devices), "kind": devices[0].device_kind},
            "process_count": jax.process_count(),
        }

    def _throughput(self) -> Throughput:
        from kiln.model.config import flops_per_token

        devices = jax.devices()
        peak = peak_flops_per_device(devices[0].device_kind, self.cfg.compute_dtype)
        return Throughput(
            tokens_per_step=self.cfg.batch_size * self.cfg.seq_len,
            flops_per_token=flops_per_token(self.model_config, self.cfg.seq_len),
            peak_flops=peak * len(devices) if peak else None,
        )

    def _model_options(self) -> dict[str, Any]:
        return {
            "mesh": self.mesh,
            "compute_dtype": self.cfg.compute_dtype,
            "param_dtype": self.cfg.param_dtype,
            "attention": self.runtime.attention,
            "remat": self.runtime.gradient_checkpointing,
        }

    def initial_state(self) -> tuple[Any, int]:
        """(state, step) the trainer starts from, made with it (`_restore_or_initialise`)."""
        return self.state, self.start_step

    def _restore_or_initialise(self) -> tuple[Any, int]:
        """(state, step): restored from the newest intact complete checkpoint (damaged ones are
        skipped, kiln.train.checkpoints), else freshly initialised."""
        from kiln.train.step import abstract_train_state, init_train_state

        self.checkpointer.remove_incomplete()
        args = (self.model_config, self.cfg.optimizer, self.cfg.num_train_steps)
        try:
            restored = self.checkpointer.restore_latest(
                abstract_train_state(*args, **self._model_options())
            )
        except CheckpointDamaged as e:
            raise TrainingError(str(e)) from None
        if restored is None:
            state = init_train_state(*args, seed=self.cfg.seed, **self._model_options())
            return self._started_from_init_from(state), 0
        state, latest = restored
        if int(state.step) != latest.step:
            raise TrainingError(
                f"checkpoint {latest.path} says step {latest.step} but holds a state at step "
                f"{int(state.step)}; delete it to resume from an earlier one"
            )
        self.last_checkpoint = latest
        return state, latest.step

    def _started_from_init_from(self, state: Any) -> Any:
        """A fresh state starts from `config.init_from`'s weights when the run names some."""
        source = self.cfg.init_from
        if source is None or self.start_from is None:
            return state
        return self.start_from(source, state, self.model_config, self.data.tokenizer)

    def _step_functions(self) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """The jitted train step and validation step (compiled at their first call)."""
        from kiln.train.step import make_eval_step, make_train_step

        train_step = make_train_step(
            self.cfg.optimizer,
            self.cfg.num_train_steps,
            z_loss_weight=self.cfg.z_loss_weight,
            mesh=self.mesh,
            microbatches=self.microbatches,
        )
        return train_step, make_eval_step(mesh=self.mesh)

    def _logprob_fn(self) -> Callable[..., Any] | None:
        """The evals' log-probability function of the model's graph (None without evals)."""
        from kiln.train.step import make_logprob_fn

        if self.evals is None:
            return None
        return make_logprob_fn(self.state.graphdef, with_is_argmax=True)

    def _eval_suite(self) -> EvalSuite | None:
        if self.cfg.evals is None:
            return None
        return EvalSuite(self.cfg.evals, self.data.tokenizer_spec, self.model_config.max_seq_len)

    def _hooks(self) -> TrainerHooks:
        """What runs at the loop's sync points, in this order (docs/training.md, "One step")."""
        hooks = TrainerHooks()
        hooks.add_hook(lambda point: self._validate(point.step), every=self.runtime.validation_every)
        if self.evals is not None and self.cfg.evals is not None:
            hooks.add_hook(lambda point: self._run_evals(point.step), every=self.cfg.evals.every)
        hooks.add_hook(self._checkpoint_hook)
        hooks.add_hook(self._control_hook)
        hooks.add_hook(self._signal_hook)
        return hooks

    def _metrics_logger(self, resume_step: int) -> MetricsLogger:
        return MetricsLogger(
            self.output,
            # A fresh run also drops step-0 lines: an earlier attempt's validation at the start.
            resume_step=resume_step if resume_step else -1,
            wandb=self.wandb,
            run_config=self.resolved_config() if self.is_main else None,
            write=self.is_main,
        )

    def _control_server(self, progress: Progress) -> Any:
        control = self.runtime.control
        if not (control.enabled and self.is_main):
            return None
        try:
            from kiln.control.server import ControlServer
        except ImportError as e:
            log.warning("training control endpoint unavailable (%s); continuing without it", e)
            return None
        server = ControlServer(
            self.output,
            {"run_id": self.run_id, "name": self.spec.name, "version": self.spec.version,
             "fingerprint": self.spec.fingerprint, "output_path": str(self.output)},
            self.resolved_config(),
            host=control.host,
            port=control.port,
            token_ttl_minutes=control.token_ttl_minutes,
        )  # fmt: skip
        progress.message(f"training control: {server.start()}")
        return server

    # --- the loop ---------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        started = time.monotonic()
        self.output.mkdir(parents=True, exist_ok=True)
        if self.is_main:
            atomic_write_json(self.output / RUN_CONFIG_FILE, self.resolved_config())
        with contextlib.ExitStack() as cleanup:
            self._open_outputs(cleanup)
            end_step = self.cfg.num_train_steps
            if self.runtime.max_steps_this_run is not None:
                end_step = min(end_step, self.start_step + self.runtime.max_steps_this_run)
            if self.start_step == 0 and self.runtime.validate_at_start:
                self._validate(0)
            signals = cleanup.enter_context(StopSignals())
            steps = cleanup.enter_context(contextlib.closing(self.training_steps(end_step, signals)))
            for info in steps:
                self._after_step(info)
            return self._finish(started, end_step)

    def training_steps(
        self, end_step: int, signals: StopSignals
    ) -> Generator[StepInfo, None, None]:
        """Trains the steps after `start_step` up to `end_step`, yielding each once it is
        queued on the device (its metrics are read at the next sync point)."""
        total = self.cfg.num_train_steps
        batches = prefetched(self._batch, range(self.start_step, end_step), PREFETCH_BATCHES)
        with contextlib.closing(batches):
            for step in range(self.start_step + 1, end_step + 1):
                began = time.monotonic()  # step time includes waiting for data, not evaluation
                batch = next(batches)
                self.data_waits.append(time.monotonic() - began)
                if step == self.start_step + 1:
                    self._timed_first_step(step, batch, began)
                else:
                    self._train_one(step, batch, began)
                yield StepInfo(step, signals.received, stopping_early=step == end_step < total)

    def _open_outputs(self, cleanup: contextlib.ExitStack) -> None:
        """Opens what the loop writes to (closed by `cleanup`): the metrics log, the progress
        display and the control endpoint."""
        cleanup.callback(self.checkpointer.close)
        self.metrics = self._metrics_logger(self.start_step)
        cleanup.callback(self.metrics.close)
        # One progress stream for a multi-host run, process 0's (as Levanter logs): the other
        # processes' output is what only they say (warnings, errors).
        self.progress = (
            make_progress(
                self.runtime.progress,
                total_steps=self.cfg.num_train_steps,
                start_step=self.start_step,
            )
            if self.is_main
            else SilentProgress()
        )
        cleanup.callback(self.progress.close)
        if self.start_step and self.last_checkpoint is not None:
            self.progress.message(f"resumed from {self._shown(self.last_checkpoint.path)}")
        elif self.cfg.init_from is not None:
            self.progress.message(f"started from {self.cfg.init_from.label}")
        self.control = self._control_server(self.progress)
        if self.control is not None:
            cleanup.callback(self.control.stop)

    def _batch(self, step: int) -> dict[str, Any]:
        from kiln.train.step import shard_batch

        return shard_batch(self.data.mixture.batch(step, self.cfg.batch_size), self.mesh)

    def _eval_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        from kiln.train.step import shard_batch

        return jax.device_get(self.eval_step(self.state, shard_batch(batch, self.mesh)))

    def _train_one(self, step: int, batch: dict[str, Any], began: float) -> None:
        """Queues the step on the device; its metrics are read at the next sync point."""
        self.state, out = self.train_step(self.state, batch)
        if not self.unread:
            self.unread_since = began
        self.unread.append((step, out))

    def _timed_first_step(self, step: int, batch: dict[str, Any], began: float) -> None:
        """The invocation's first step, timed to its metrics on the host: it includes compiling
        the step, or reading it from the persistent cache (kiln.train.compilation_cache)."""
        with compilation_cache.watching() as compilations:
            self._train_one(step, batch, began)
            self._read_metrics()
        folder = compilation_cache.active_folder()
        seconds = self.step_times[-1]
        self.first_step = {"seconds": seconds, "program": compilations.source, "cache": folder}
        from_cache = compilations.source == "cache"
        first = {"throughput/first_step_seconds": seconds}
        self.metrics.log(step, {**first, "throughput/first_step_from_cache": from_cache})
        how = {
            "cache": f"its program read from the compilation cache {folder}",
            "compiled": f"compiled, and kept in the compilation cache {folder}",
            "partly cached": f"compiled in part; the rest read from the compilation cache {folder}",
            "no cache": "compiled (no compilation cache)",
        }[compilations.source]
        self.progress.message(f"first step in {seconds:.1f}s: {how}")

    def _read_metrics(self) -> None:
        """Brings the unread steps' metrics to the host (the loop's one wait for the device),
        logs them, and stops on a non-finite loss. Each unread step is given the mean time of
        the steps read together."""
        if not self.unread:
            return
        values = jax.device_get([out for _, out in self.unread])
        seconds = (time.monotonic() - self.unread_since) / len(self.unread)
        waits = self.data_waits[-len(self.unread) :]
        steps = [step for step, _ in self.unread]
        self.unread = []
        for step, out, data_wait in zip(steps, values, waits):
            self._log_step(step, {k: float(v) for k, v in out.items()}, seconds, data_wait)

    def _log_step(
        self, step: int, values: dict[str, float], seconds: float, data_wait: float
    ) -> None:
        self.step_times.append(seconds)
        metrics = {
            "train/loss": values["loss"],
            "train/cross_entropy": values["cross_entropy"],
            "train/z_loss": values["z_loss"],
            "optim/learning_rate": values["learning_rate"],
            "optim/grad_norm": values["grad_norm"],
            **self.throughput.metrics(seconds),
            "throughput/data_wait_seconds": data_wait,
            "timestamp": time.time(),
        }
        self.metrics.log(step, metrics)
        if not _finite(values):
            self._commit_save()  # a save begun at an earlier step holds a good state
            last = self._shown(self.last_checkpoint.path) if self.last_checkpoint else "none yet"
            raise TrainingDiverged(
                f"non-finite training loss at step {step} (loss {values['loss']}, grad_norm "
                f"{values['grad_norm']}); stopped without saving this state. Last good checkpoint: "
                f"{last}. Lower the learning rate, raise warmup or enable z-loss, with a new version."
            )
        self.progress.update(step, values["loss"], metrics["throughput/tokens_per_second"])

    def _after_step(self, info: StepInfo) -> None:
        """At sync points (SYNC_EVERY_STEPS, and the hooks' own steps): reads the steps' metrics
        and runs the hooks."""
        point = self._sync_point(info)
        if point is not None:
            self._read_metrics()
            self.hooks.run_hooks(point)

    def _sync_point(self, info: StepInfo) -> SyncPoint | None:
        """The step as a sync point, or None when the loop goes on without waiting for the
        device."""
        step, final = info.step, info.step == self.cfg.num_train_steps
        ending = final or info.stopping_early
        scheduled = (
            step % SYNC_EVERY_STEPS == 0 or ending or self.hooks.schedule(step, final=final)
            or self.checkpointer.due(step, final=final) == "permanent"
        )  # fmt: skip
        # A control request (process 0's endpoint), a signal and the save clock are one
        # process's: acted on at once by a lone process; on several, at the next scheduled point
        # (each process agrees on them there, or one would enter a save, a collective, alone).
        alone = jax.process_count() == 1
        requested = (scheduled or alone) and self.control is not None and \
            self.control.take_checkpoint_request()  # fmt: skip
        if requested:
            self.requested_save_step = step
        save = self.checkpointer.due(
            step, final=final, requested=requested or info.signum is not None or ending
        )
        if not (scheduled or (alone and save is not None)):
            return None
        return SyncPoint(step, final, ending, save, info.signum)

    def _checkpoint_hook(self, point: SyncPoint) -> None:
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
            self._commit_save()  # a save begun earlier has written its files on every process
        if kind is not None:
            ending = point.ending or point.signum is not None
            self._save(point.step, temporary=kind == "temporary", wait=ending)

    def _control_hook(self, point: SyncPoint) -> None:
        if self.control is not None:
            self.control.update(
                step=point.step, total_steps=self.cfg.num_train_steps,
                loss=self.metrics.latest.get("train/loss"),
                tokens_per_second=self.metrics.latest.get("throughput/tokens_per_second"),
                eta_seconds=self._eta_seconds(point.step),
                last_checkpoint=self._shown(self.last_checkpoint.path)
                if self.last_checkpoint else None,
            )  # fmt: skip

    def _signal_hook(self, point: SyncPoint) -> None:
        if point.signum is None:
            return
        assert self.last_checkpoint is not None  # saved by the checkpoint hook
        message = (
            f"interrupted by {signal.Signals(point.signum).name} after step {point.step}; "
            f"saved {self._shown(self.last_checkpoint.path)}. Rerun to resume."
        )
        if self.is_main:  # beside STATUS before the way out (W&B, orbax), which may be cut short
            with contextlib.suppress(OSError):
                ArtifactFolder.at(self.output).record_stop(message)
        raise TrainingInterrupted(message, point.signum)

    def _save(self, step: int, *, temporary: bool, wait: bool) -> None:
        """Saves the state after `step`. Training is held up only while orbax copies the state
        off the devices (logged as throughput/checkpoint_blocked_seconds), unless `wait`; the
        checkpoint counts once committed (`_commit_save`)."""
        self._commit_save()  # the previous save first: one in progress at a time
        began = time.monotonic()
        done = self.checkpointer.begin_save(step, self.state, temporary=temporary)
        if wait:
            done = self.checkpointer.commit() or done
        self.save_blocked_seconds = time.monotonic() - began
        self.metrics.log(step, {"throughput/checkpoint_blocked_seconds": self.save_blocked_seconds})
        if done is not None:
            self._saved(done)

    def _commit_save(self) -> None:
        """Completes the save in progress (waiting for its files, if it must)."""
        committed = self.checkpointer.commit()
        if committed is not None:
            self._saved(committed)

    def _saved(self, checkpoint: CheckpointInfo) -> None:
        self.last_checkpoint = checkpoint
        kind = "temporary" if checkpoint.is_temporary else "permanent"  # it may have been promoted
        held_up = f"training held up {self.save_blocked_seconds:.2f}s"
        if checkpoint.step == self.requested_save_step:
            held_up = f"asked for at the control endpoint; {held_up}"
        self.progress.message(f"saved {kind} checkpoint {self._shown(checkpoint.path)} ({held_up})")

    def _validate(self, step: int) -> None:
        if not self.data.validation:
            return
        began = time.monotonic()
        metrics = validation_metrics(self._eval_batch, self.data.validation)
        self.metrics.log(step, {**metrics, "eval/total_time": time.monotonic() - began})
        self._observe_metrics(step)

    def _shown(self, path: Path) -> str:
        """A path of the run's output as people and records name it: the artifact's own location
        (a bucket URL) when the trainer writes a local staging copy of it."""
        location = self.spec.location
        if location is None or not path.is_relative_to(self.output):
            return str(path)
        relative = path.relative_to(self.output).as_posix()
        return location if relative == "." else f"{location}/{relative}"

    def _eta_seconds(self, step: int) -> float:
        recent = self.step_times[-20:]
        return sum(recent) / len(recent) * (self.cfg.num_train_steps - step)

    def _run_evals(self, step: int) -> None:
        assert self.evals is not None and self.logprobs is not None  # added only with evals
        logprobs = self.logprobs
        self.metrics.log(step, self.evals(lambda tokens: logprobs(self.state, tokens), step))

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

    def _finish(self, started: float, end_step: int) -> dict[str, Any]:
        complete = end_step == self.cfg.num_train_steps
        self._read_metrics()
        self._commit_save()
        if complete:  # a no-op when the last step already saved it (the usual case)
            self.last_checkpoint = self.checkpointer.save(end_step, self.state, temporary=False)
        self._observe_metrics(end_step, final=True)
        summary = self._summary(started, end_step, complete)
        if self.is_main:
            atomic_write_json(self.output / RUN_SUMMARY_FILE, summary)
            if complete:
                record = {"config": self.resolved_config(), "summary": summary}
                atomic_write_text(self.output / TRACKER_FILE, _json_line(record))
        barrier("run files written")  # what follows on any process (the report) may read them
        return summary

    def _summary(self, started: float, end_step: int, complete: bool) -> dict[str, Any]:
        # The first step of a run includes compilation: leave it out of the throughput.
        timed = self.step_times[1:] or self.step_times
        tokens_per_second = (
            self.throughput.tokens_per_step * len(timed) / sum(timed) if timed else None
        )
        latest = {k: v for k, v in self.metrics.latest.items() if not k.startswith("throughput/")}
        latest.pop("timestamp", None)
        return {
            **latest,
            "complete": complete,
            "step": end_step,
            "num_train_steps": self.cfg.num_train_steps,
            "steps_this_run": len(self.step_times),
            "tokens_per_second": tokens_per_second,
            "data_wait_seconds_p50": _percentile(self.data_waits, 50),
            "data_wait_seconds_p99": _percentile(self.data_waits, 99),
            "first_step_seconds": self.first_step.get("seconds"),
            "first_step_program": self.first_step.get("program"),  # cache | compiled | ...
            "compilation_cache": self.first_step.get("cache"),
            "wall_time_seconds": time.monotonic() - started,
            "output_path": self._shown(self.output),
            "checkpoint": self._shown(self.last_checkpoint.path) if self.last_checkpoint else None,
            "metrics_file": str(self.metrics.path),
        }


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _json_line(record: dict[str, Any]) -> str:
    return json.dumps(record, sort_keys=True) + "\n"


def train(
    spec: TrainSpec,
    metrics_observer: MetricsObserver | None = None,
    start_from: StartFrom | None = None,
) -> dict[str, Any]:
    """Trains (or resumes) the run described by `spec`; returns the summary dict."""
    return Trainer(spec, metrics_observer, start_from).run()


def train_to_end(
    spec: TrainSpec,
    metrics_observer: MetricsObserver | None = None,
    start_from: StartFrom | None = None,
) -> dict[str, Any]:
    """`train`, for the callers that report how a run ended (`python -m kiln.train`, kiln.runner):
    the summary of a complete run; else TrainingError (failed: bad input, unreadable data, a
    diverged loss) or TrainingStopped (resumable: a signal, runtime.max_steps_this_run), each
    with its process exit code."""
    try:
        summary = train(spec, metrics_observer, start_from)
    except (KilnDataError, MixtureError) as e:
        raise TrainingError(str(e)) from None
    except KeyboardInterrupt:
        raise TrainingStopped("interrupted before a checkpoint could be saved", 130) from None
    if not summary["complete"]:
        raise TrainingStopped(
            f"stopped early at step {summary['step']} of {summary['num_train_steps']} "
            "(runtime.max_steps_this_run); rerun without it to finish",
            EXIT_STOPPED_EARLY,
        )
    return summary

