"""Building an `lm_checkpoint`.

`pants run experiments:X` builds the input caches (cached processes), then runs
`python -m kiln.runner` interactively (live progress, Ctrl-C resumable) against the artifact
store. `pants package experiments:X` runs the same runner as a cached process writing into the
sandbox: the hermetic path, whose result a remote cache serves to a clean machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from pants.backend.python.subsystems.setup import PythonSetup
from pants.backend.python.util_rules.interpreter_constraints import InterpreterConstraints
from pants.backend.python.util_rules.pex_environment import PexEnvironment, PythonExecutable
from pants.base.build_root import BuildRoot
from pants.core.goals.package import BuiltPackage, BuiltPackageArtifact, PackageFieldSet
from pants.core.goals.run import RunFieldSet, RunInSandboxBehavior, RunRequest, RunSubsystem
from pants.engine.addresses import Address, Addresses
from pants.engine.fs import (
    EMPTY_DIGEST,
    AddPrefix,
    CreateDigest,
    Digest,
    FileContent,
    MergeDigests,
    PathGlobs,
    RemovePrefix,
)
from pants.engine.process import Process, ProcessCacheScope, ProcessResult
from pants.engine.rules import Get, MultiGet, collect_rules, rule
from pants.engine.target import (
    InvalidTargetException,
    Tags,
    Target,
    WrappedTarget,
    WrappedTargetRequest,
)
from pants.engine.unions import UnionRule
from pants.util.frozendict import FrozenDict

from kiln_contract.layout import RECORD_FILE, STATUS_FILE, SUMMARY_TEXT_FILE
from kiln_contract.location import in_bucket
from kiln_contract.parsing import SpecError
from kiln_contract.record import served_message
from kiln_contract.step import STEP_FILE, Provenance, StepInput, StepSpec
from kiln_contract.train import (
    CheckpointerSpec,
    ControlSpec,
    DatasetRef,
    HfModelSource,
    MixtureStage,
    ParentRun,
    Resources,
    RuntimeSpec,
    TrainConfig,
    WandbSpec,
)
from kiln_pants.artifact_graph import (
    Artifact,
    ArtifactGraph,
    ReferencedFiles,
    ReferencedFilesRequest,
    artifact_and_graph,
    parent_run,
    target_and_graph,
)
from kiln_pants.artifact_store import (
    StoredFiles,
    StoredFilesRequest,
    artifact_path,
    artifact_record,
    recorded_state,
    runtime_provenance,
)
from kiln_pants.field_values import CheckpointInit
from kiln_pants.mixture_budget import MixtureBudgetRequest, MixtureFits
from kiln_pants.runtime import (
    ACCELERATOR_PLUGINS,
    RUN_STEP,
    EntryPointSources,
    EntryPointSourcesRequest,
    KilnProcess,
    Runtime,
    RuntimeProcess,
    RuntimeRequest,
    shipped_to_nodes,
)
from kiln_pants.subsystem import KilnSubsystem
from kiln_pants.target_types import (
    BatchSizeField,
    CacheStorageField,
    CheckpointEveryField,
    CheckpointIntervalField,
    ComputeDtypeField,
    DataOrderField,
    DatasetsField,
    EvalNameField,
    EvalsField,
    GradientCheckpointingField,
    InitFromField,
    LossPositionsField,
    MaxEvalBatchesField,
    MeshField,
    ModelField,
    NumTrainStepsField,
    OptimizerField,
    PerDeviceParallelismField,
    ResourcesField,
    SeedField,
    SeqLenField,
    TemporaryBasePathField,
    ValidateAtStartField,
    WandbField,
    ZLossWeightField,
)
from kiln_pants.tokenize_rules import CachesAsInputs, CachesAsInputsRequest, cache_location

OUTPUT_DIR = "out"


# Validation batches per set when the target does not say: the same windows in every run of a
# batch_size and seq_len, however long it trains, so that a child validates where its parent did.
DEFAULT_EVAL_BATCHES = 12


def runtime_section(
    target: Target, wandb_options: Mapping[str, str], validation_names: Mapping[str, str]
) -> RuntimeSpec:
    """Operational choices (not identity): how the trainer runs, not what it makes. The BUILD
    file's run-time fields, then `[kiln]` options (`wandb_options`), then Kiln's defaults (W&B's
    unset settings are left to the trainer: `WANDB_*` variables, then its defaults).

    Validation runs ~10 times per run (at most every 1000 steps) on the first
    DEFAULT_EVAL_BATCHES batches of each set, and at the start of a run that starts from weights
    (`init_from`); temporary checkpoints every 10 minutes, or every minute on a CPU, where runs
    are short and saves cost ~0.2 s.
    """
    resources = target[ResourcesField].value
    validation_every = max(1, min(1000, target[NumTrainStepsField].value // 10))
    max_eval_batches = target[MaxEvalBatchesField].value
    if max_eval_batches is None:
        max_eval_batches = DEFAULT_EVAL_BATCHES
    validate_at_start = target[ValidateAtStartField].value
    if validate_at_start is None:  # a child's first row: where its parent's weights stand
        validate_at_start = target[InitFromField].value is not None
    wandb = {**wandb_options, **dict(target[WandbField].value or {})}
    interval = target[CheckpointIntervalField].value
    return RuntimeSpec(
        resources=resources,
        mesh=dict(target[MeshField].value),
        attention="auto",
        gradient_checkpointing=target[GradientCheckpointingField].value,
        per_device_parallelism=target[PerDeviceParallelismField].value,
        validation_every=validation_every,
        max_eval_batches=None if max_eval_batches == "all" else max_eval_batches,
        validate_at_start=validate_at_start,
        validation_names=dict(validation_names),
        checkpointer=CheckpointerSpec(
            save_interval_minutes=interval or (1 if resources.kind == "cpu" else 10),
            keep_last_temporary=2,
            every=target[CheckpointEveryField].value,
            temporary_base_path=_optional_path(target[TemporaryBasePathField].value),
        ),
        wandb=WandbSpec(**wandb, tags=tuple(target[Tags].value or ())),
        control=ControlSpec(enabled=True, host="127.0.0.1", port=0, token_ttl_minutes=720),
        progress="auto",
        max_steps_this_run=None,
    )


def _optional_path(value: str | None) -> Path | None:
    return None if value is None else Path(value)


@dataclass(frozen=True)
class LmCheckpointFieldSet(RunFieldSet, PackageFieldSet):
    required_fields = (ModelField, DatasetsField)
    run_in_sandbox_behavior = RunInSandboxBehavior.NOT_SUPPORTED

    model: ModelField


@dataclass(frozen=True)
class PreparedStep:
    artifact: Artifact
    runtime: Runtime
    digest: Digest  # step.json, the input caches under inputs/ and the lockfiles
    plugin_lock: Optional[str]  # the accelerator plugins' lockfile, for a cluster's nodes
    # What the training process starts with (Resources.process_env); a cluster's hosts get it
    # from the step, so its submitter gets none.
    training_env: FrozenDict[str, str]


def _dataset(artifact: Artifact, weight: float = 0.0) -> DatasetRef:
    return DatasetRef(artifact.name, artifact.version, artifact.fingerprint, weight)


@dataclass(frozen=True)
class _Run:
    """An lm_checkpoint as its step spec is made from it: the target, its artifact, the graph
    and its caches' targets. Artifact.cache_inputs lists the `datasets` in declaration order,
    then the `validation` sets."""

    target: Any
    artifact: Artifact
    graph: ArtifactGraph
    caches: Mapping[Address, Target]

    @property
    def weights(self) -> Mapping[str, float]:
        return self.target[DatasetsField].value.weights

    @property
    def dataset_inputs(self) -> list[Artifact]:
        return [self.graph.get(a) for a in self.artifact.cache_inputs[: len(self.weights)]]

    @property
    def validation_inputs(self) -> list[Artifact]:
        return [self.graph.get(a) for a in self.artifact.cache_inputs[len(self.weights) :]]

    @property
    def inputs(self) -> list[Artifact]:
        """Every cache it reads, once."""
        caches = self.dataset_inputs + self.validation_inputs
        return list({cache.address: cache for cache in caches}.values())


def _step(
    run: _Run,
    eval_task_dirs: tuple[str, ...],
    provenance: Provenance,
    store_prefix: str,
    wandb_options: Mapping[str, str],
) -> StepSpec:
    artifact, graph = run.artifact, run.graph
    validation_names = {
        c.name: run.caches[c.address][EvalNameField].value for c in run.validation_inputs
    }
    return StepSpec(
        name=artifact.name,
        version=artifact.version,
        fingerprint=artifact.fingerprint,
        # The record names every artifact the run was built from: its caches and its parent.
        record=artifact_record(artifact, run.inputs + _parents(artifact, graph)),
        config=_train_config(run, eval_task_dirs),
        runtime=runtime_section(run.target, wandb_options, validation_names),
        inputs=_step_inputs(run, store_prefix),
        provenance=provenance,
    )


def _train_config(run: _Run, eval_task_dirs: tuple[str, ...]) -> TrainConfig:
    target, weights = run.target, run.weights
    evals = target[EvalsField].value
    return TrainConfig(
        model=target[ModelField].value,
        optimizer=target[OptimizerField].value,
        datasets=tuple(
            _dataset(cache, weight) for cache, weight in zip(run.dataset_inputs, weights.values())
        ),
        validation=tuple(_dataset(cache) for cache in run.validation_inputs),
        batch_size=target[BatchSizeField].value,
        seq_len=target[SeqLenField].value,
        num_train_steps=target[NumTrainStepsField].value,
        z_loss_weight=target[ZLossWeightField].value,
        # Local lm-eval task directories travel with the step's inputs.
        evals=dataclasses.replace(evals.suite, task_paths=eval_task_dirs) if evals else None,
        seed=target[SeedField].value,
        compute_dtype=target[ComputeDtypeField].value,
        param_dtype="float32",
        init_from=_init_from(target[InitFromField].value, run.artifact, run.graph),
        loss_positions=target[LossPositionsField].value,
        data_order=target[DataOrderField].value,
        stages=tuple(
            MixtureStage(step, tuple(stage.get(key, 0.0) for key in weights))
            for step, stage in target[DatasetsField].value.stages
        ),
    )


def _step_inputs(run: _Run, store_prefix: str) -> tuple[StepInput, ...]:
    """The caches a step reads: inline caches travel with the step; store caches are already
    in place, at their path in the store."""
    store_paths = {
        address: artifact_path(store_prefix, run.graph.get(address))
        for address, cache in run.caches.items()
        if cache[CacheStorageField].value == "store"
    }
    return tuple(
        StepInput(
            ref=i.ref,
            name=i.name,
            version=i.version,
            record=artifact_record(i, []),
            store_path=store_paths.get(i.address),
            location=None if i.address in store_paths else cache_location(i),
        )
        for i in run.inputs
    )


def _parents(artifact: Artifact, graph: ArtifactGraph) -> list[Artifact]:
    return [graph.get(artifact.parent)] if artifact.parent is not None else []


def _init_from(
    init_from: Union[HfModelSource, CheckpointInit, None], artifact: Artifact, graph: ArtifactGraph
) -> Union[HfModelSource, ParentRun, None]:
    """A run of the graph as the runtime finds it (name, version, fingerprint, step)."""
    if isinstance(init_from, CheckpointInit):
        assert artifact.parent is not None  # the graph resolved the address
        return parent_run(init_from, graph.get(artifact.parent), training=True)
    return init_from


@dataclass(frozen=True)
class StepJsonRequest:
    address: Address
    provenance: Provenance  # the runtime that will run the step


@dataclass(frozen=True)
class StepJson:
    """step.json: the step spec (kiln_contract.step) of an lm_checkpoint, as the runner reads
    it, and the local eval task files it names (empty without any)."""

    content: bytes
    eval_task_files: Digest


@rule(desc="Writing an lm_checkpoint's step spec")
async def step_json(
    request: StepJsonRequest, kiln: KilnSubsystem, build_root: BuildRoot
) -> StepJson:
    address = request.address
    target, graph = await target_and_graph(address, "<kiln run>")
    artifact = graph.get(address)
    caches = await MultiGet(
        Get(WrappedTarget, WrappedTargetRequest(a, description_of_origin="<kiln run>"))
        for a in artifact.cache_inputs
    )
    evals = target[EvalsField].value
    task_files = None
    if evals and evals.task_files:
        files_request = ReferencedFilesRequest(address, evals.task_files, "evals")
        task_files = (await Get(ReferencedFiles, ReferencedFilesRequest, files_request)).sources
    task_dirs = tuple(
        sorted({os.path.dirname(f) for f in task_files.files if f.endswith(".yaml")})
        if task_files
        else ()
    )
    try:
        cache_targets = {cache.target.address: cache.target for cache in caches}
        run = _Run(target, artifact, graph, cache_targets)
        step = _step(
            run,
            task_dirs,
            request.provenance,
            kiln.prefix_location(build_root.path),
            kiln.wandb_settings(),
        )
    except SpecError as e:
        if e.field.startswith("runtime.validation_names"):
            raise InvalidTargetException(
                f"The validation caches of {address} have `eval_name`s that clash: {e.problem}."
            ) from None
        raise InvalidTargetException(f"{address}: {e}") from None
    except ValueError as e:  # a bad `[kiln]` option
        raise InvalidTargetException(f"{address}: {e}") from None
    return StepJson(
        json.dumps(step.to_json(), indent=2).encode(),
        task_files.snapshot.digest if task_files else EMPTY_DIGEST,
    )


@dataclass(frozen=True)
class PrepareStepRequest:
    address: Address
    # Trains on another machine (a cluster's nodes, a bundle's), which has or installs the
    # accelerator plugins its resources need: the runtime built here is the CPU one.
    elsewhere: bool = False


@rule(desc="Preparing an lm_checkpoint step")
async def prepare_step(request: PrepareStepRequest, python_setup: PythonSetup) -> PreparedStep:
    address = request.address
    target, graph = await target_and_graph(address, "<kiln run>")
    await Get(MixtureFits, MixtureBudgetRequest(address))  # before any cache is built
    resources = target[ResourcesField].value
    accelerator = resources.kind
    resolves = [python_setup.default_resolve]
    if accelerator in ACCELERATOR_PLUGINS:
        resolves.append(ACCELERATOR_PLUGINS[accelerator].resolve)
    here = "cpu" if request.elsewhere else accelerator
    artifact = graph.get(address)
    # The caches tokenize with the runtime PEX, once it is built.
    lockfile, runtime, caches = await MultiGet(
        Get(Digest, PathGlobs([python_setup.resolves[name] for name in resolves])),
        Get(Runtime, RuntimeRequest(RUN_STEP, accelerator=here)),
        Get(CachesAsInputs, CachesAsInputsRequest(Addresses(set(artifact.cache_inputs)))),
    )
    step = await Get(StepJson, StepJsonRequest(address, runtime_provenance(runtime, lockfile)))
    step_digest = await Get(Digest, CreateDigest([FileContent(STEP_FILE, step.content)]))
    plugin_lock = python_setup.resolves[resolves[-1]] if len(resolves) > 1 else None
    return PreparedStep(
        artifact,
        runtime,
        await Get(Digest, MergeDigests([step_digest, caches.digest, step.eval_task_files, lockfile])),
        plugin_lock,
        FrozenDict() if request.elsewhere else FrozenDict(resources.process_env()),
    )


# Counts this machine's accelerator device nodes, without PATH (Pants processes do not get one).
_DEVICE_PROBE = {
    "gpu": 'n=0; for d in /dev/nvidia[0-9]*; do [ -e "$d" ] && n=$((n+1)); done; echo $n',
    "tpu": 'n=0; for d in /dev/accel[0-9]* /dev/vfio/[0-9]*; do [ -e "$d" ] && n=$((n+1)); done; echo $n',
}


class MissingAccelerators(Exception):
    pass


@dataclass(frozen=True)
class AcceleratorsPresent:
    count: int


@dataclass(frozen=True)
class CheckAcceleratorsRequest:
    address: Address
    resources: Resources


@rule(desc="Checking for accelerators")
async def check_accelerators(request: CheckAcceleratorsRequest) -> AcceleratorsPresent:
    """Fails in seconds, before any data is built, when the run's hardware is not here."""
    resources = request.resources
    if resources.kind == "cpu":
        return AcceleratorsPresent(0)
    probe = await Get(
        ProcessResult,
        Process(
            argv=("/bin/sh", "-c", _DEVICE_PROBE[resources.kind]),
            description=f"Looking for {resources.kind.upper()}s",
            cache_scope=ProcessCacheScope.PER_SESSION,
        ),
    )
    found = int(probe.stdout.decode().strip() or 0)
    if found == 0:
        wanted = f"{resources.kind}({resources.type!r}" + (
            f", count={resources.count})" if resources.count else ")"
        )
        raise MissingAccelerators(
            f"{request.address} trains on resources={wanted}, and this machine has no "
            f"{resources.kind.upper()}. Run it where one is, or plan it here: "
            f"./pants plan {request.address}. Nothing was built."
        )
    return AcceleratorsPresent(found)


@dataclass(frozen=True)
class ServedRunRequest:
    address: Address
    prefix: str


@dataclass(frozen=True)
class ServedRun:
    """What the runner would print serving the artifact, or None when the runner must decide
    (not built, drift, a dev version, a bucket)."""

    message: Optional[str]


@rule(desc="Looking for an lm_checkpoint in the artifact store")
async def served_run(request: ServedRunRequest) -> ServedRun:
    """Decides "already built" as the runner does, from the local store's STATUS and record,
    without building the inputs or starting the runtime: a no-op `pants run` costs Pants alone."""
    artifact, graph = await artifact_and_graph(request.address)
    if artifact.mutable or in_bucket(request.prefix):
        return ServedRun(None)
    folder = artifact_path(request.prefix, artifact)
    files = await Get(
        StoredFiles, StoredFilesRequest(folder, (STATUS_FILE, RECORD_FILE, SUMMARY_TEXT_FILE))
    )
    status, record, summary = files.texts
    if record is None or recorded_state(artifact, status, record).status != "built":
        return ServedRun(None)
    # The runner's sources now, not its PEX: the PEX's requirements would have Pants check every
    # entry point's closure on each run.
    runner = await Get(EntryPointSources, EntryPointSourcesRequest(RUN_STEP))
    return ServedRun(served_text(artifact, folder, record, summary, runner.digest.fingerprint))


def served_text(
    artifact: Artifact, folder: str, record: str, summary: Optional[str], code_digest: str
) -> str:
    """The runner's words for a built artifact at `folder` (its artifact.json text `record`)."""
    stored = json.loads(record)
    return served_message(artifact.ref, folder, artifact.fingerprint, stored, code_digest, summary)


def cluster_of_run(option: str, args: tuple[str, ...]) -> str:
    """The cluster a `pants run` trains on: `-- --cluster X` (the runner reads the last one),
    else `[kiln] cluster`; "" for this machine."""
    chosen = option
    for i, arg in enumerate(args):
        if arg == "--cluster" and i + 1 < len(args):
            chosen = args[i + 1]
        elif arg.startswith("--cluster="):
            chosen = arg.partition("=")[2]
    return "" if chosen in ("", "local") else chosen


def bundles_run(args: tuple[str, ...]) -> bool:
    """`-- --bundle DIR`: the runner writes the step for another machine and trains nowhere."""
    return any(arg == "--bundle" or arg.startswith("--bundle=") for arg in args)


# Prints its first argument: the served message, with no runtime started.
_PRINT = 'printf "%s\\n" "$0"'
# Prints its first argument as Kiln's goals print an error, and fails.
_REFUSE = 'printf "kiln: error: %s\\n" "$0" >&2; exit 1'


def refused_run(message: str) -> RunRequest:
    """A `pants run` that fails with one line, as Kiln's goals do: the engine would print its
    traceback header above an error raised here."""
    return RunRequest(digest=EMPTY_DIGEST, args=("/bin/sh", "-c", _REFUSE, message))


@rule(desc="Running an lm_checkpoint")
async def run_lm_checkpoint(
    field_set: LmCheckpointFieldSet,
    kiln: KilnSubsystem,
    run: RunSubsystem,
    build_root: BuildRoot,
    pex_env: PexEnvironment,
) -> RunRequest:
    wrapped = await Get(
        WrappedTarget, WrappedTargetRequest(field_set.address, description_of_origin="<kiln run>")
    )
    resources = wrapped.target[ResourcesField].value
    cluster = cluster_of_run(kiln.cluster, run.args)
    try:
        prefix = kiln.prefix_location(build_root.path)
    except ValueError as e:
        return refused_run(str(e))
    if not run.args:  # `-- ...` options (another prefix, --output) are the runner's to read
        # A built artifact is served wherever it is asked for, accelerators or not.
        served = await Get(ServedRun, ServedRunRequest(field_set.address, prefix))
        if served.message is not None:
            return RunRequest(digest=EMPTY_DIGEST, args=("/bin/sh", "-c", _PRINT, served.message))
    elsewhere = bool(cluster) or bundles_run(run.args)
    if not elsewhere:  # a cluster's or a bundle's accelerators are on the machine that trains
        await Get(AcceleratorsPresent, CheckAcceleratorsRequest(field_set.address, resources))
    prepared = await Get(PreparedStep, PrepareStepRequest(field_set.address, elsewhere))
    runtime = prepared.runtime
    # The runtime's venv PEX is already built for the sandbox environment: the one used here.
    venv_pex = runtime.pex
    environment = pex_env.in_sandbox(working_directory=None)
    python = await Get(
        PythonExecutable, InterpreterConstraints, runtime.pex_request.interpreter_constraints
    )
    digest = await Get(
        Digest, MergeDigests([prepared.digest, venv_pex.digest, runtime.sources.digest])
    )
    chroot = "{chroot}"
    return RunRequest(
        digest=digest,
        args=(
            os.path.join(chroot, venv_pex.pex.argv0),
            os.path.join(chroot, STEP_FILE),
            "--inputs",
            chroot,
            "--prefix",
            prefix,
            # `-- --cluster X` comes after these and wins (argparse keeps the last).
            *(("--cluster", kiln.cluster) if kiln.cluster else ()),
        ),
        extra_env={
            **environment.environment_dict(python=python),
            **runtime.process_env(chroot),
            **shipped_to_nodes(runtime, prepared.plugin_lock, root=chroot),
            **prepared.training_env,
        },
        append_only_caches={
            **environment.append_only_caches,
            **dict(venv_pex.append_only_caches or {}),
        },
    )


@rule(desc="Packaging an lm_checkpoint")
async def package_lm_checkpoint(field_set: LmCheckpointFieldSet) -> BuiltPackage:
    prepared = await Get(PreparedStep, PrepareStepRequest(field_set.address))
    artifact = prepared.artifact
    process = (await Get(
        KilnProcess,
        RuntimeProcess(
            prepared.runtime,
            argv=(STEP_FILE, "--inputs", ".", "--output", OUTPUT_DIR),
            description=f"Training {artifact.ref}",
            input_digest=prepared.digest,
            output_directories=(OUTPUT_DIR,),
            settings=prepared.training_env,
        ),
    )).process
    result = await Get(ProcessResult, Process, process)
    location = artifact.folder
    digest = await Get(Digest, RemovePrefix(result.output_digest, OUTPUT_DIR))
    digest = await Get(Digest, AddPrefix(digest, location))
    return BuiltPackage(digest, (BuiltPackageArtifact(location),))


def rules():
    return [
        *collect_rules(),
        *LmCheckpointFieldSet.rules(),
        UnionRule(PackageFieldSet, LmCheckpointFieldSet),
    ]
