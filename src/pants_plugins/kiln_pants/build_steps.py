"""One step of `pants build`: a cache, a training, an export or an evaluation, and what became
of it.

Caches build as cached Pants processes, exports and evaluations as per-session processes; a training runs
the runner of `pants run` (`kiln.runner`) as a per-session process whose output goes to the
step's log file. Trainings on this machine take one of `[build] trainings_at_once` slots first
(a lock file each, under `dist/`, held by the training's process until it ends), so that at most
that many train at once however the graph's other steps run.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Optional

from pants.base.build_root import BuildRoot
from pants.core.goals.package import BuiltPackage
from pants.engine.addresses import Address, Addresses
from pants.engine.env_vars import EnvironmentVars, EnvironmentVarsRequest
from pants.engine.internals.session import RunId
from pants.engine.process import (
    FallibleProcessResult,
    Process,
    ProcessCacheScope,
    ProcessResultMetadata,
)
from pants.engine.rules import Get, _uncacheable_rule, collect_rules, rule
from pants.engine.target import WrappedTarget, WrappedTargetRequest
from pants.util.frozendict import FrozenDict

from kiln_contract.layout import DEP_FAILED
from kiln_pants.artifact_graph import Artifact
from kiln_pants.eval_rules import LmEvalRunPackageFieldSet
from kiln_pants.eval_targets import LmEvalRunTarget
from kiln_pants.hf_model_rules import HfModelPackageFieldSet
from kiln_pants.runtime import KilnProcess, RuntimeProcess, shipped_to_nodes
from kiln_pants.store_process import STORE_ENVIRONMENT
from kiln_pants.subsystem import KilnSubsystem
from kiln_pants.target_types import LmCheckpointTarget, ResourcesField, TokenizedCacheTarget
from kiln_pants.tokenize_rules import (
    BatchedCacheRequest,
    BuildCachesRequest,
    BuiltCache,
    BuiltCaches,
    CacheBatch,
)
from kiln_pants.train_rules import (
    STEP_FILE,
    AcceleratorsPresent,
    CheckAcceleratorsRequest,
    PreparedStep,
    PrepareStepRequest,
)

# What a training step gets from the caller's environment besides the store's credentials: the
# tracker's settings and key, the Hub's token. Per-session processes only: never in a cache key.
TRAINING_ENVIRONMENT = (
    *STORE_ENVIRONMENT,
    "WANDB_API_KEY", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_MODE", "WANDB_BASE_URL",
    "HF_TOKEN", "HF_HOME", "RAY_ADDRESS",
)  # fmt: skip

# Runs the runner with its output in the step's log file (Pants processes get no PATH: builtins).
_TO_LOG = 'log="$1"; shift; exec "$@" >"$log" 2>&1'

# Takes one of N slot locks (flock: released by the kernel when the process ends, however it
# ends), then becomes the runner with its output in the log. Run by the runtime's Python.
_IN_A_SLOT = """
import fcntl, os, sys, time
folder, count, log, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
os.makedirs(folder, exist_ok=True)
out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.dup2(out, 1)
os.dup2(out, 2)
said = False
while True:
    for i in range(count):
        fd = os.open(os.path.join(folder, f"slot-{i}"), os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        os.set_inheritable(fd, True)
        print(f"kiln: training in slot {i + 1} of {count}", flush=True)
        os.execv(argv[0], argv)
    if not said:
        print(f"kiln: waiting for one of {count} training slot(s) (--build-trainings-at-once)",
              flush=True)
        said = True
    time.sleep(1)
"""

SUCCESS, SERVED, FAILED = "SUCCESS", "SERVED", "FAILED"
FROM_PANTS_CACHE = "from Pants' cache: nothing ran"


@dataclass(frozen=True)
class StepOutcome:
    status: str  # SUCCESS | SERVED | FAILED | DEP_FAILED
    detail: str = ""  # one line, for the console
    seconds: float = 0.0
    error: str = ""  # a failure's whole text, for the step's log (the goal writes it)

    @property
    def failed(self) -> bool:
        return self.status in (FAILED, DEP_FAILED)


@dataclass(frozen=True)
class TrainingSlots:
    """At most `count` trainings at once on this machine: one lock file each in `folder`."""

    folder: str
    count: int

    def command_prefix(self, python: str, log: str) -> tuple[str, ...]:
        """The command's prefix that waits for a free slot, holds it (a lock the training
        inherits) and then starts the training with its output in `log`."""
        return (python, "-c", _IN_A_SLOT, self.folder, str(self.count), log)


@dataclass(frozen=True)
class StepRequest:
    address: Address
    kind: str  # the target alias
    log: str  # the step's log file
    slots: Optional[TrainingSlots]  # None: trainings are not capped here (a cluster's jobs)
    batch: Optional[CacheBatch] = None  # a small cache: tokenized with these in one process


@dataclass(frozen=True)
class CacheStep:
    address: Address
    batch: Optional[CacheBatch]


@dataclass(frozen=True)
class TrainingStep:
    address: Address
    log: str
    slots: Optional[TrainingSlots]


@dataclass(frozen=True)
class PackagedStep:
    """An export or an evaluation: written into the store by its `package` rule."""

    address: Address
    kind: str


@rule(desc="Building a step")
async def build_step(request: StepRequest) -> StepOutcome:
    address, log = request.address, request.log
    if request.kind == TokenizedCacheTarget.alias:
        return await Get(StepOutcome, CacheStep(address, request.batch))
    if request.kind == LmCheckpointTarget.alias:
        return await Get(StepOutcome, TrainingStep(address, log, request.slots))
    return await Get(StepOutcome, PackagedStep(address, request.kind))


def _failure(text: str, started: float) -> StepOutcome:
    """FAILED, with `text` for the step's log and its last error line for the console."""
    return StepOutcome(FAILED, _last_error(text), time.monotonic() - started, text)


def _last_error(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["no output"])[-1][:300]


@_uncacheable_rule(desc="Building a cache step")
async def build_cache_step(step: CacheStep, run_id: RunId) -> StepOutcome:
    """Uncacheable, so that a new session times it from its start: pantsd would otherwise
    "clean" the last session's node, building the cache beneath it before it starts again."""
    started = time.monotonic()
    try:
        if step.batch is None:
            built = await Get(BuiltCaches, BuildCachesRequest(Addresses([step.address])))
            [cache] = built.caches
        else:
            cache = await Get(BuiltCache, BatchedCacheRequest(step.address, step.batch))
    except Exception as e:  # noqa: BLE001 - reported as this step's failure; others go on
        return _failure(str(e), started)
    return cache_outcome(cache.process, step.batch, run_id, time.monotonic() - started)


def cache_outcome(
    process: Optional[ProcessResultMetadata],
    batch: Optional[CacheBatch],
    run_id: RunId,
    seconds: float,
) -> StepOutcome:
    """SERVED when the process that makes the cache did not run in this run (Pants' cache, or
    pantsd's memory, had its result); a cache built in a batch of others reports the batch and
    its time, which is not its own."""
    if process is not None and process.source(run_id) != ProcessResultMetadata.Source.RAN:
        return StepOutcome(SERVED, FROM_PANTS_CACHE)
    if batch is None or len(batch.addresses) == 1 or process is None:
        return StepOutcome(SUCCESS, seconds=seconds)
    took = process.total_elapsed_ms
    return StepOutcome(
        SUCCESS,
        f"built in a batch of {len(batch.addresses)}"
        + (f", {took / 1000:.1f}s" if took is not None else ""),
    )


@rule(desc="Building an export or evaluation step")
async def build_packaged_step(step: PackagedStep) -> StepOutcome:
    started = time.monotonic()
    try:
        wrapped = await Get(
            WrappedTarget, WrappedTargetRequest(step.address, description_of_origin="<kiln build>")
        )
        if step.kind == LmEvalRunTarget.alias:
            await Get(
                BuiltPackage, LmEvalRunPackageFieldSet,
                LmEvalRunPackageFieldSet.create(wrapped.target),
            )  # fmt: skip
        else:
            await Get(
                BuiltPackage, HfModelPackageFieldSet, HfModelPackageFieldSet.create(wrapped.target)
            )
    except Exception as e:  # noqa: BLE001 - reported as this step's failure; others go on
        return _failure(str(e), started)
    return StepOutcome(SUCCESS, seconds=time.monotonic() - started)


@rule(desc="Building a training step")
async def build_training_step(
    step: TrainingStep, kiln: KilnSubsystem, build_root: BuildRoot
) -> StepOutcome:
    """The runner as `pants run` starts it, but as a per-session process logging to a file."""
    started = time.monotonic()
    try:
        wrapped = await Get(
            WrappedTarget, WrappedTargetRequest(step.address, description_of_origin="<kiln build>")
        )
        if not kiln.cluster:  # a cluster run's accelerators are on the cluster's hosts
            await Get(
                AcceleratorsPresent,
                CheckAcceleratorsRequest(step.address, wrapped.target[ResourcesField].value),
            )
        prepared = await Get(PreparedStep, PrepareStepRequest(step.address, bool(kiln.cluster)))
    except Exception as e:  # noqa: BLE001 - reported as this step's failure; others go on
        return _failure(str(e), started)
    environment = {
        **(await Get(EnvironmentVars, EnvironmentVarsRequest(TRAINING_ENVIRONMENT))),
        **(shipped_to_nodes(prepared.runtime, prepared.plugin_lock) if kiln.cluster else {}),
    }
    process = (await Get(
        KilnProcess,
        RuntimeProcess(
            prepared.runtime,
            argv=(
                STEP_FILE,
                "--inputs",
                ".",
                "--prefix",
                kiln.prefix_location(build_root.path),
                *(("--cluster", kiln.cluster) if kiln.cluster else ()),
            ),
            description=f"Training {prepared.artifact.ref} (log: {step.log})",
            input_digest=prepared.digest,
            output_directories=(),
            # The store is the cache: the runner serves a built artifact itself.
            cache_scope=ProcessCacheScope.PER_SESSION,
            env=FrozenDict(environment),
            settings=prepared.training_env,
        ),
    )).process
    if step.slots is None:
        wrapper: tuple[str, ...] = ("/bin/sh", "-c", _TO_LOG, "kiln-build", step.log)
    else:
        wrapper = step.slots.command_prefix(prepared.runtime.pex.python.argv0, step.log)
    result = await Get(
        FallibleProcessResult, Process, replace(process, argv=(*wrapper, *process.argv))
    )
    seconds = time.monotonic() - started
    if result.exit_code != 0:
        detail = _last_error(_read_log(step.log) or result.stderr.decode(errors="replace"))
        return StepOutcome(FAILED, f"exit {result.exit_code}: {detail}", seconds)
    return StepOutcome(SUCCESS, seconds=seconds)


def _read_log(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:  # the process failed before it opened its log
        return ""


def dep_failed(names: str) -> StepOutcome:
    return StepOutcome(DEP_FAILED, f"input {names} failed")


def log_path(dist: str, artifact: Artifact) -> str:
    """`dist/logs/{name}/{version}.log`: from the artifact's identity, which no other target of
    the repository shares (kiln_pants.artifact_folders), so no two steps write one log."""
    return os.path.join(dist, "logs", f"{artifact.folder}.log")


def rules():
    return collect_rules()
