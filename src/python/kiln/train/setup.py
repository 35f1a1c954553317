"""What a run trains with, set up from its spec before any step (as Levanter's `Trainer`
set-up): the opened data and its batches (prefetched on a thread), the model's config, the
mesh, the trackers' settings, the checkpointer, the step functions (jitted, compiled at their
first call) and the lm-eval suite; and the state the run starts from, restored from its newest
intact complete checkpoint or freshly initialised (`TrainerSetup.initial_state`). Bad run-time
settings fail here, at step 0, with a TrainingError naming the field.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax

from kiln.data.cache import TokenCache, open_caches, shared_tokenizer
from kiln.data.mixture import MixtureDataset, StreamPosition, fixed_batches, mixture_block_size
from kiln.data.tokenizer import TokenizerInfo
from kiln.eval.validation import ValidationSet
from kiln.model.config import LlamaConfig
from kiln.train.checkpoints import CheckpointDamaged, Checkpointer, CheckpointInfo
from kiln.train.errors import TrainingError
from kiln.train.metrics import Throughput, WandbSettings, peak_flops_per_device
from kiln.train.spec import Resources, RuntimeSpec, TrainConfig, TrainSpec

log = logging.getLogger(__name__)

PREFETCH_BATCHES = 2

# The state a run starts from when `config.init_from` names weights: given by the runner (which
# reads published weights or a parent run), called with init_from and the freshly initialised
# state, only when a run starts without a checkpoint of its own.
StartFrom = Callable[[Any, Any, LlamaConfig, TokenizerInfo], Any]


@dataclass(frozen=True)
class RunStart:
    """What kiln.runner gives a run whose config names `init_from`: the state it starts from,
    and where its data stream starts (a parent run's position, when the run continues its
    parent's data; None: every dataset from its beginning)."""

    state: StartFrom
    data: StreamPosition | None = None


@dataclass(frozen=True)
class RunData:
    """The opened inputs: training mixture, validation sets and their shared tokenizer."""

    caches: tuple[TokenCache, ...]  # config.datasets', then config.validation's
    mixture: MixtureDataset
    validation: tuple[ValidationSet, ...]
    tokenizer: TokenizerInfo
    tokenizer_spec: Any  # what kiln.data.tokenizer.load_tokenizer takes (for evals)
    chat_template: str | None  # what the training chats were rendered with (chat_template_of)


def open_data(spec: TrainSpec, data_start: StreamPosition | None = None) -> RunData:
    """The run's caches, its mixture (continuing `data_start`, a parent run's data position,
    when given) and its validation sets."""
    cfg, runtime = spec.config, spec.runtime
    inputs = [*cfg.datasets, *cfg.validation]
    caches = open_caches(inputs)
    tokenizer = shared_tokenizer(inputs, caches)
    train_caches = caches[: len(cfg.datasets)]
    stage_starts = [stage.start_step * cfg.batch_size for stage in cfg.stages]
    mixture = MixtureDataset(
        [(c, d.weight) for c, d in zip(train_caches, cfg.datasets)],
        cfg.seq_len,
        cfg.seed,
        block_size=mixture_block_size(
            cfg.batch_size, cfg.num_train_steps, stage_starts, cfg.data_order
        ),
        loss_positions=cfg.loss_positions,
        stages=[(start, stage.weights) for start, stage in zip(stage_starts, cfg.stages)],
        data_order=cfg.data_order,
        fingerprints=[d.fingerprint for d in cfg.datasets],
        start=data_start,
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
    tokenizer_spec = caches[0].info["tokenizer"].get("spec")
    return RunData(
        tuple(caches), mixture, validation, tokenizer, tokenizer_spec, chat_template_of(train_caches)
    )


def chat_template_of(caches: Sequence[TokenCache]) -> str | None:
    """The chat template a BUILD file gave the run's training chat caches, which its export
    writes into the tokenizer's files: theirs when they agree; None when none was given (the
    tokenizer's own is theirs) or they differ."""
    templates = {cache.info.get("chat_template") for cache in caches} - {None}
    return templates.pop() if len(templates) == 1 else None


def prefetched(make: Callable[[int], Any], steps: range, depth: int) -> Generator[Any, None, None]:
    """make(step) for each step, computed `depth` steps ahead on a background thread."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-data") as pool:
        pending = deque(pool.submit(make, s) for s in steps[:depth])
        for s in steps[depth:]:
            pending.append(pool.submit(make, s))
            yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def eval_batches(runtime: RuntimeSpec, cache: Any, cfg: TrainConfig) -> int:
    """Validation batches of one set: runtime.max_eval_batches, or all of the set's windows."""
    whole_set = -(-cache.num_windows(cfg.seq_len) // cfg.batch_size)
    return min(whole_set, runtime.max_eval_batches or whole_set)


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
        self._logprobs: Any = None  # the model's log-probability function, made at first use

    def __call__(self, state: Any, step: int) -> dict[str, float]:
        """The suite's scores of the model in `state` (a TrainState) after `step`."""
        from kiln.train.step import make_logprob_fn

        if self._logprobs is None:
            self._logprobs = make_logprob_fn(state.graphdef, with_is_argmax=True)
        logprobs = self._logprobs
        return self.run_suite(
            lambda tokens: logprobs(state, tokens), self.tokenizer, self.suite, step,
            model_max_length=self.max_length,
        )  # fmt: skip


@dataclass(frozen=True)
class TrainStart:
    """The state a run starts from: after `step` (0: fresh), restored from `checkpoint`."""

    state: Any  # kiln.train.step.TrainState
    step: int
    checkpoint: CheckpointInfo | None


class TrainerSetup:
    """Everything a run trains with, from its spec; nothing here has trained or restored."""

    def __init__(self, spec: TrainSpec, start: RunStart | None = None):
        from kiln.train.mesh import batch_parallelism, make_mesh, microbatch_count
        from kiln.train.step import make_eval_step, make_train_step

        self.spec, self.cfg, self.runtime = spec, spec.config, spec.runtime
        if self.cfg.init_from is not None and start is None:
            raise TrainingError(
                "config.init_from needs the weights loaded by kiln.runner (python -m kiln.runner "
                "STEP.json), which reads them from the Hugging Face hub"
            )
        self.start_from = None if start is None else start.state
        check_devices(self.runtime.resources)
        self.data_start = None if start is None else start.data
        self.data = open_data(spec, self.data_start)
        vocab_size = self.data.tokenizer.vocab_size
        self.model_config = LlamaConfig.for_vocabulary(self.cfg.model, vocab_size)
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
        self.checkpointer = Checkpointer.from_spec(
            spec.output_path,
            self.runtime.checkpointer,
            name=spec.name,
            version=spec.version,
            data_at=lambda step: self.data.mixture.position(step * self.cfg.batch_size).to_json(),
        )
        self.throughput = self._throughput()
        self.train_step = make_train_step(
            self.cfg.optimizer,
            self.cfg.num_train_steps,
            z_loss_weight=self.cfg.z_loss_weight,
            mesh=self.mesh,
            microbatches=self.microbatches,
        )
        self.eval_step = make_eval_step(mesh=self.mesh)
        self.evals = None
        if self.cfg.evals is not None:
            self.evals = EvalSuite(
                self.cfg.evals, self.data.tokenizer_spec, self.model_config.max_seq_len
            )

    def resolved_config(self) -> dict[str, Any]:
        devices = jax.devices()
        return {
            "spec": self.spec.record_json(),
            "run_id": self.wandb.run_id,
            "wandb": self.wandb.to_json(),  # as resolved: the spec, then WANDB_* variables
            "model": self.model_config.to_json(),
            "tokenizer": self.data.tokenizer.to_json(),
            "chat_template": self.data.chat_template,
            "mixture": {
                # Where the stream started: a parent run's data position, or null.
                "continues": None if self.data_start is None else self.data_start.to_json(),
                "block_size": self.data.mixture.block_size,
                "sequences_per_block": self.data.mixture.sequences_per_block(
                    [d.name for d in self.cfg.datasets]
                ),
            },
            "mesh": dict(self.mesh.shape),
            "microbatches": self.microbatches,
            "devices": {
                "count": len(devices),
                "kind": devices[0].device_kind,
                "platform": devices[0].platform,
            },
            # The JAX the run ran on: a TPU or GPU machine's own can differ from the lockfile's.
            "jax": {"version": jax.__version__, "jaxlib": jax.lib.__version__},
            "process_count": jax.process_count(),
            # The allocator setting the process started with (Resources.process_env), or None.
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        }

    def batches(self, steps: range) -> Generator[dict[str, Any], None, None]:
        """The mixture's batches of `steps` (0-based), sharded over the mesh, each made
        PREFETCH_BATCHES steps ahead on a background thread."""
        from kiln.train.step import shard_batch

        def batch(step: int) -> dict[str, Any]:
            return shard_batch(self.data.mixture.batch(step, self.cfg.batch_size), self.mesh)

        return prefetched(batch, steps, PREFETCH_BATCHES)

    def _throughput(self) -> Throughput:
        from kiln.model.config import flops_per_token

        devices = jax.devices()
        peak = peak_flops_per_device(devices[0].device_kind, self.cfg.compute_dtype)
        return Throughput(
            tokens_per_step=self.cfg.batch_size * self.cfg.seq_len,
            flops_per_token=flops_per_token(self.model_config, self.cfg.seq_len),
            peak_flops=peak * len(devices) if peak else None,
        )

    def initial_state(self) -> TrainStart:
        """Restored from the newest intact complete checkpoint (damaged ones are skipped,
        kiln.train.checkpoints; incomplete ones removed), else freshly initialised, from
        `config.init_from`'s weights when it names some."""
        from kiln.train.step import ModelOptions, abstract_train_state, init_train_state

        self.checkpointer.remove_incomplete()
        args = (self.model_config, self.cfg.optimizer, self.cfg.num_train_steps)
        options = ModelOptions(
            compute_dtype=self.cfg.compute_dtype,
            param_dtype=self.cfg.param_dtype,
            attention=self.runtime.attention,
            remat=self.runtime.gradient_checkpointing,
        )
        try:
            restored = self.checkpointer.restore_latest(
                abstract_train_state(*args, mesh=self.mesh, options=options)
            )
        except CheckpointDamaged as e:
            raise TrainingError(str(e)) from None
        if restored is None:
            state = init_train_state(*args, seed=self.cfg.seed, mesh=self.mesh, options=options)
            if self.cfg.init_from is not None and self.start_from is not None:
                state = self.start_from(
                    self.cfg.init_from, state, self.model_config, self.data.tokenizer
                )
            return TrainStart(state, 0, None)
        state, latest = restored
        if int(state.step) != latest.step:
            raise TrainingError(
                f"checkpoint {latest.path} says step {latest.step} but holds a state at step "
                f"{int(state.step)}; delete it to resume from an earlier one"
            )
        return TrainStart(state, latest.step, latest)
