"""The train spec: what a training run makes (`config`, its identity) and how it runs (`runtime`).

A step spec (kiln_contract.step) carries `config` with its input caches named by name and
version; once the runner has placed them, `StepSpec.train_spec` gives the trainer a `TrainSpec`
whose caches have absolute paths. `python -m kiln.train SPEC.json` reads one from a file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar, Union

from kiln_contract.adam import AdamConfig
from kiln_contract.evals import EvalSuiteConfig
from kiln_contract.llama import LlamaArchitecture
from kiln_contract.parsing import (
    SpecError,
    build,
    check_absolute_path,
    check_bool,
    check_choice,
    check_int,
    check_location,
    check_number,
    check_optional,
    check_str,
    check_tuple_of,
    field_path,
    json_fields,
    json_list,
    json_location,
    json_path,
    read_json,
    scalar_json,
    shown,
)
from kiln_contract.vocabulary import (
    ATTENTION_IMPLS,
    DATA_ORDERS,
    DTYPES,
    HF_REPO_ID,
    LEVANTER_MIXTURE_BLOCK,
    LOSS_POSITIONS,
    PROGRESS_MODES,
    REMAT_POLICIES,
    RESOURCE_KINDS,
    WANDB_MODES,
    check_address,
    check_eval_name,
    check_eval_names,
    check_hf_revision,
    check_seed,
    check_token_ttl,
    mesh_sizes,
)

SPEC_VERSION = 1
SPEC_KIND = "lm_checkpoint"


# --- config: the run's identity ------------------------------------------------------------------


@dataclass(frozen=True)
class DatasetRef:
    """A token cache as a step names it: a training component (its mixture weight) or a
    validation set (weight 0, and none in JSON)."""

    name: str
    version: str
    fingerprint: str
    weight: float = 0.0

    def __post_init__(self) -> None:
        _check_dataset(self)

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    def located(self, path: Path | str) -> DatasetInput:
        return DatasetInput(self.name, self.version, self.fingerprint, path, self.weight)


@dataclass(frozen=True)
class DatasetInput:
    """A token cache the run reads, at an absolute path or a bucket URL (`s3://…`, `gs://…`,
    a string: the run streams it from the bucket)."""

    name: str
    version: str
    fingerprint: str
    path: Path | str
    weight: float = 0.0

    def __post_init__(self) -> None:
        _check_dataset(self)
        check_location("path", self.path)


Dataset = TypeVar("Dataset", DatasetRef, DatasetInput)


def _check_dataset(dataset: DatasetRef | DatasetInput) -> None:
    check_address(dataset)
    check_number("weight", dataset.weight, minimum=0)


def _read_datasets(
    kind: type[Dataset], items: Any, where: str, *, weighted: bool
) -> tuple[Dataset, ...]:
    parsed = []
    for i, item in enumerate(json_list(items, where)):
        at = field_path(where, f"[{i}]")
        values = json_fields(kind, item, at)
        if weighted and "weight" not in values:
            raise SpecError(field_path(at, "weight"), "required field is missing")
        if not weighted and "weight" in values:
            raise SpecError(at, "unknown field(s) weight (validation sets have no weight)")
        if "path" in values:
            values["path"] = json_location(values["path"])
        parsed.append(build(kind, at, values))
    return tuple(parsed)


def _dataset_json(dataset: DatasetRef | DatasetInput, weighted: bool) -> dict[str, Any]:
    values = scalar_json(dataset)
    return values if weighted else {k: v for k, v in values.items() if k != "weight"}


@dataclass(frozen=True)
class HfModelSource:
    """`hf_model_source("org/model", revision=...)` or `hf_model_source("/abs/folder")`:
    published Llama weights a run starts from (kiln.interop.hub). A hub model needs its
    revision (a branch moves: a commit hash makes the run reproducible); a local folder is
    identified by its path, so new weights go in a new folder."""

    model: str  # a hub id `org/name`, or the absolute path of a transformers Llama folder
    revision: str | None = None

    def __post_init__(self) -> None:
        check_str("model", self.model)
        if self.is_local:
            check_absolute_path("model", Path(self.model))
            if self.revision is not None:
                raise SpecError("revision", "a local folder has no revision; remove it")
            return
        if not HF_REPO_ID.match(self.model):
            raise SpecError(
                "model", f"{self.model!r} is neither a hub model id (`org/name`) nor an absolute path"
            )
        if self.revision is None:
            raise SpecError("revision", f"required for the hub model {self.model!r} (a commit hash)")
        check_hf_revision("revision", self.revision)

    @property
    def is_local(self) -> bool:
        return self.model.startswith("/")

    @property
    def label(self) -> str:
        """The source for people: `org/name@revision`, or the folder."""
        return self.model if self.is_local else f"{self.model}@{self.revision}"

    @classmethod
    def from_json(cls, obj: Any, where: str = "init_from") -> HfModelSource:
        return read_json(cls, obj, where)

    def to_json(self) -> dict[str, Any]:
        return scalar_json(self, omit_none=True)


@dataclass(frozen=True)
class MixtureStage:
    """From `start_step` on, the training mixture's weights: one per `config.datasets` entry, in
    its order (0: the dataset sits the stage out). Stage 0 is the datasets' own weights."""

    start_step: int
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        check_int("start_step", self.start_step, minimum=1)
        object.__setattr__(self, "weights", tuple(self.weights))
        for i, weight in enumerate(self.weights):
            check_number(f"weights[{i}]", weight, minimum=0)
        if not any(w > 0 for w in self.weights):
            raise SpecError("weights", "at least one dataset needs a weight > 0")

    @classmethod
    def from_json(cls, obj: Any, where: str) -> MixtureStage:
        values = json_fields(cls, obj, where)
        values["weights"] = tuple(json_list(values["weights"], field_path(where, "weights")))
        return build(cls, where, values)

    def to_json(self) -> dict[str, Any]:
        return {"start_step": self.start_step, "weights": list(self.weights)}


INIT_KINDS = ("lm_checkpoint", "hf_model")  # the artifacts of the graph a run may start from


@dataclass(frozen=True)
class ParentRun:
    """`init_from=":parent"` (or `from_checkpoint(":parent", step=N)`): an artifact of the graph
    a run starts from, found by its `name/version` in the run's own store: an `lm_checkpoint` at
    one of its saved steps (None: its final one), or an `hf_model` export. What comes along from
    an lm_checkpoint: its weights; with `optimizer_state`, Adam's moments and count (the step and
    the learning-rate schedule start afresh either way); with `data_continues`, its data stream's
    position (each cache the two share reads on where the parent stopped)."""

    kind: str  # INIT_KINDS
    name: str
    version: str
    fingerprint: str
    step: int | None = None
    optimizer_state: bool = False
    data_continues: bool = False

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, INIT_KINDS)
        check_address(self)
        check_optional(check_int, "step", self.step, minimum=0)
        check_bool("optimizer_state", self.optimizer_state)
        check_bool("data_continues", self.data_continues)
        if self.kind == "hf_model":
            given = [name for name, value in (("step", self.step is not None),
                     ("optimizer_state", self.optimizer_state),
                     ("data_continues", self.data_continues)) if value]  # fmt: skip
            if given:
                raise SpecError(
                    given[0],
                    "an hf_model export holds one step's weights: give the lm_checkpoint instead",
                )

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def label(self) -> str:
        """The source for people: `name@version`, and the step when one is chosen."""
        return self.ref if self.step is None else f"{self.ref} step {self.step}"

    @classmethod
    def from_json(cls, obj: Any, where: str = "init_from") -> ParentRun:
        return read_json(cls, obj, where)

    def to_json(self) -> dict[str, Any]:
        values = scalar_json(self)
        return {k: v for k, v in values.items() if v is not None and v is not False}


InitFrom = Union[HfModelSource, ParentRun]


def init_from_json(obj: Any, where: str = "init_from") -> InitFrom:
    """Either kind of `init_from`, told apart by the `kind` a ParentRun carries."""
    if isinstance(obj, Mapping) and "kind" in obj:
        return ParentRun.from_json(obj, where)
    return HfModelSource.from_json(obj, where)


def check_run_shape(
    model: LlamaArchitecture, optimizer: AdamConfig, seq_len: int, num_train_steps: int
) -> None:
    """The checks across a run's fields, shared by the BUILD-file target and the step spec:
    the training windows fit the model, and the optimizer's warmup and decay fit the run.
    SpecError names the field (`seq_len`, `optimizer.warmup`, `optimizer.decay`)."""
    if seq_len > model.max_seq_len:
        raise SpecError("seq_len", f"{seq_len} exceeds model.max_seq_len {model.max_seq_len}")
    try:
        optimizer.schedule_steps(num_train_steps)
    except SpecError as e:
        raise e.within("optimizer") from None


@dataclass(frozen=True)
class TrainConfig(Generic[Dataset]):
    """`config`: the identity of the run (all of it is in the fingerprint)."""

    model: LlamaArchitecture
    optimizer: AdamConfig
    datasets: tuple[Dataset, ...]
    validation: tuple[Dataset, ...]
    batch_size: int  # global: all devices
    seq_len: int
    num_train_steps: int
    z_loss_weight: float | None  # None: no z-loss
    evals: EvalSuiteConfig | None
    seed: int  # model init and data order
    compute_dtype: str
    param_dtype: str
    # Weights the run starts from instead of a random initialisation; None: random (seed).
    init_from: InitFrom | None = None
    # The positions the loss counts (LOSS_POSITIONS); None: same_document.
    loss_positions: str | None = None
    # Later stages of the mixture (Levanter's varying mixture); none: one stage all run long.
    stages: tuple[MixtureStage, ...] = ()
    # The order the training windows are read in (DATA_ORDERS); None: kiln.
    data_order: str | None = None

    def __post_init__(self) -> None:
        _check_instance("model", self.model, LlamaArchitecture)
        _check_instance("optimizer", self.optimizer, AdamConfig)
        for key in ("batch_size", "seq_len", "num_train_steps"):
            check_int(key, getattr(self, key), minimum=1)
        check_run_shape(self.model, self.optimizer, self.seq_len, self.num_train_steps)
        if not self.datasets:
            raise SpecError("datasets", "at least one training dataset is required")
        if not any(d.weight > 0 for d in self.datasets):
            raise SpecError("datasets", "at least one dataset needs a weight > 0")
        _check_unique_names("datasets", self.datasets)
        _check_unique_names("validation", self.validation)
        check_optional(check_number, "z_loss_weight", self.z_loss_weight, minimum=0)
        if self.evals is not None:
            _check_instance("evals", self.evals, EvalSuiteConfig)
        check_seed("seed", self.seed)
        check_choice("compute_dtype", self.compute_dtype, DTYPES)
        check_choice("param_dtype", self.param_dtype, DTYPES)
        if self.init_from is not None:
            _check_instance("init_from", self.init_from, (HfModelSource, ParentRun))
        if self.loss_positions is not None:
            check_choice("loss_positions", self.loss_positions, LOSS_POSITIONS)
        if self.data_order is not None:
            check_choice("data_order", self.data_order, DATA_ORDERS)
        self._check_stages()

    def _check_stages(self) -> None:
        starts = [stage.start_step for stage in self.stages]
        for i, stage in enumerate(self.stages):
            _check_instance(f"stages[{i}]", stage, MixtureStage)
            if len(stage.weights) != len(self.datasets):
                raise SpecError(
                    f"stages[{i}].weights",
                    f"{len(stage.weights)} weights for {len(self.datasets)} datasets",
                )
            if stage.start_step >= self.num_train_steps:
                raise SpecError(
                    f"stages[{i}].start_step",
                    f"{stage.start_step} is not before num_train_steps ({self.num_train_steps})",
                )
        if starts != sorted(set(starts)):
            raise SpecError("stages", f"stages must start at increasing steps, got {starts}")
        for i, start in enumerate(starts):
            if self.data_order == "levanter" and start * self.batch_size % LEVANTER_MIXTURE_BLOCK:
                raise SpecError(
                    f"stages[{i}].start_step",
                    f"Levanter's data order starts a stage on a block of {LEVANTER_MIXTURE_BLOCK} "
                    f"sequences: start_step x batch_size ({start} x {self.batch_size}) must be a "
                    "multiple of it",
                )

    @classmethod
    def from_json(cls, obj: Any, where: str, dataset: type[Dataset]) -> TrainConfig[Dataset]:
        values = json_fields(cls, obj, where)
        values["model"] = LlamaArchitecture.from_json(values["model"], field_path(where, "model"))
        values["optimizer"] = AdamConfig.from_json(
            values["optimizer"], field_path(where, "optimizer")
        )
        for key, weighted in (("datasets", True), ("validation", False)):
            values[key] = _read_datasets(
                dataset, values[key], field_path(where, key), weighted=weighted
            )
        if values["evals"] is not None:
            values["evals"] = EvalSuiteConfig.from_json(values["evals"], field_path(where, "evals"))
        if "init_from" in values:
            values["init_from"] = init_from_json(values["init_from"], field_path(where, "init_from"))
        if "stages" in values:
            at = field_path(where, "stages")
            values["stages"] = tuple(
                MixtureStage.from_json(item, field_path(at, f"[{i}]"))
                for i, item in enumerate(json_list(values["stages"], at))
            )
        return build(cls, where, values)

    def to_json(self) -> dict[str, Any]:
        init_from = {"init_from": self.init_from.to_json()} if self.init_from else {}
        stages = {"stages": [stage.to_json() for stage in self.stages]} if self.stages else {}
        optional = ("init_from", "loss_positions", "stages", "data_order")
        return {
            **{k: v for k, v in scalar_json(self).items() if k not in optional},
            # only when set: the JSON of a run without them is unchanged
            **init_from,
            **stages,
            **({"loss_positions": self.loss_positions} if self.loss_positions else {}),
            **({"data_order": self.data_order} if self.data_order else {}),
            "model": self.model.to_json(),
            "optimizer": self.optimizer.to_json(),
            "datasets": [_dataset_json(d, weighted=True) for d in self.datasets],
            "validation": [_dataset_json(d, weighted=False) for d in self.validation],
            "evals": self.evals.to_json() if self.evals else None,
        }

    def located(
        self: TrainConfig[DatasetRef], paths: Mapping[str, Path | str], inputs_root: Path
    ) -> TrainConfig[DatasetInput]:
        """This config with every cache at its path (`paths` by `name@version`) and the local
        eval task folders, relative to the step's inputs, under `inputs_root`."""
        evals = self.evals
        if evals is not None:
            task_paths = tuple(str((inputs_root / p).resolve()) for p in evals.task_paths)
            evals = dataclasses.replace(evals, task_paths=task_paths)
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values["datasets"] = tuple(d.located(paths[d.ref]) for d in self.datasets)
        values["validation"] = tuple(d.located(paths[d.ref]) for d in self.validation)
        values["evals"] = evals
        return TrainConfig(**values)


def _check_instance(field: str, value: Any, kind: type | tuple[type, ...]) -> None:
    if not isinstance(value, kind):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        raise SpecError(field, f"expected a {' or '.join(k.__name__ for k in kinds)}, got {shown(value)}")


def _check_unique_names(field: str, datasets: tuple[Any, ...]) -> None:
    names = [d.name for d in datasets]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise SpecError(field, f"dataset(s) listed twice: {', '.join(twice)}")


# --- runtime: run-time choices, not in the fingerprint --------------------------------------------

# glibc's malloc in a process that trains on CPUs: one arena, no mmap, no trimming. XLA's CPU
# executables allocate their buffers afresh at every step (the lm head's logits alone are
# tokens x vocabulary x 4 bytes: 64 MiB for the quickstart); by default glibc serves each thread's
# large ones with fresh pages and hands them back when they are freed, so every step faults its
# memory in again. Kept, the quickstart's step takes about three quarters of the time; the first
# step takes ~1 s longer (benchmarks/RESULTS.md, "The CPU trainer's allocator").
CPU_MALLOC_TUNABLES = (
    "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"
)


@dataclass(frozen=True)
class Resources:
    """Where training runs: `cpu(hosts)`, `gpu(type, count, hosts)` or `tpu(type)` in a BUILD
    file."""

    kind: str
    type: str | None = None  # GPU model or TPU slice, e.g. H100, v4-128
    count: int | None = None  # devices on one host (gpu); a TPU slice's size is in its type
    hosts: int | None = None  # hosts of a cluster run (one trainer process each); None: 1

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, RESOURCE_KINDS)
        check_optional(check_str, "type", self.type)
        check_optional(check_int, "count", self.count, minimum=1)
        check_optional(check_int, "hosts", self.hosts, minimum=1)

    @classmethod
    def from_json(cls, obj: Any, where: str = "resources") -> Resources:
        return read_json(cls, obj, where)

    def process_env(self) -> dict[str, str]:
        """Variables a training process on these resources starts with (read at its start)."""
        return {"GLIBC_TUNABLES": CPU_MALLOC_TUNABLES} if self.kind == "cpu" else {}

    def to_json(self) -> dict[str, Any]:
        return scalar_json(self, omit_none=True)


@dataclass(frozen=True)
class CheckpointerSpec:
    save_interval_minutes: float  # a temporary checkpoint when this much time has passed
    keep_last_temporary: int
    every: int | None  # a permanent checkpoint every N steps; None: only the final one
    temporary_base_path: Path | None  # None: temporaries go beside the permanent ones
    # Set by the runner when each host of a run trains in a folder of its own (a staging folder
    # mirrored into a bucket): every host then writes its own shards and the metadata, and the
    # union of the hosts' folders is the checkpoint (kiln.train.checkpoints).
    per_host_folders: bool = False

    def __post_init__(self) -> None:
        check_number("save_interval_minutes", self.save_interval_minutes, minimum=0)
        check_bool("per_host_folders", self.per_host_folders)
        check_int("keep_last_temporary", self.keep_last_temporary, minimum=1)
        check_optional(check_int, "every", self.every, minimum=1)
        check_optional(check_absolute_path, "temporary_base_path", self.temporary_base_path)

    @classmethod
    def from_json(cls, obj: Any, where: str = "checkpointer") -> CheckpointerSpec:
        values = json_fields(cls, obj, where)
        values["temporary_base_path"] = json_path(values["temporary_base_path"])
        return build(cls, where, values)


@dataclass(frozen=True)
class WandbSpec:
    """The W&B run's settings given explicitly: by the BUILD target (`wandb={...}`, `tags`), else
    by `[kiln]` options. At run time an unset one comes from its `WANDB_*` variable, else Kiln's
    default (kiln.train.metrics.WandbSettings)."""

    mode: str | None = None
    project: str | None = None
    entity: str | None = None
    run_id: str | None = None
    group: str | None = None
    tags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_optional(check_choice, "mode", self.mode, choices=WANDB_MODES)
        for key in ("project", "entity", "run_id", "group"):
            check_optional(check_str, key, getattr(self, key))
        check_tuple_of("tags", self.tags, str)

    @classmethod
    def from_json(cls, obj: Any, where: str = "wandb") -> WandbSpec:
        values = json_fields(cls, obj, where)
        if "tags" in values:
            values["tags"] = tuple(json_list(values["tags"], field_path(where, "tags")))
        return build(cls, where, values)

    def to_json(self) -> dict[str, Any]:
        return {**scalar_json(self), "tags": list(self.tags)}


@dataclass(frozen=True)
class ControlSpec:
    """The training-control endpoint (docs/training-control.md)."""

    enabled: bool
    host: str
    port: int  # 0: any free port
    token_ttl_minutes: float

    def __post_init__(self) -> None:
        check_bool("enabled", self.enabled)
        check_str("host", self.host)
        check_int("port", self.port, minimum=0)
        if self.port > 65535:
            raise SpecError("port", f"expected 0 (any free port) to 65535, got {self.port}")
        check_token_ttl("token_ttl_minutes", self.token_ttl_minutes)


@dataclass(frozen=True)
class RuntimeSpec:
    """`runtime`: how the trainer runs, not what it makes."""

    resources: Resources
    mesh: Mapping[str, int]  # every axis of MESH_AXES (missing ones are 1 in JSON)
    attention: str
    gradient_checkpointing: str
    per_device_parallelism: int | None  # sequences per device per microbatch; None: all
    validation_every: int
    max_eval_batches: int | None  # per validation set; None: the whole set
    checkpointer: CheckpointerSpec
    wandb: WandbSpec
    control: ControlSpec
    progress: str
    max_steps_this_run: int | None
    validate_at_start: bool = False  # also validate the initial model, at step 0
    # Validation cache name -> its name in metrics (`paloma/c4_en`); missing: the cache name's
    # last part.
    validation_names: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_instance("resources", self.resources, Resources)
        object.__setattr__(self, "mesh", mesh_sizes(self.mesh))
        check_choice("attention", self.attention, ATTENTION_IMPLS)
        check_choice("gradient_checkpointing", self.gradient_checkpointing, REMAT_POLICIES)
        check_optional(check_int, "per_device_parallelism", self.per_device_parallelism, minimum=1)
        check_int("validation_every", self.validation_every, minimum=1)
        check_optional(check_int, "max_eval_batches", self.max_eval_batches, minimum=1)
        check_bool("validate_at_start", self.validate_at_start)
        if not isinstance(self.validation_names, Mapping):
            raise SpecError("validation_names", f"expected an object, got {self.validation_names!r}")
        for cache, name in self.validation_names.items():
            check_eval_name(field_path("validation_names", cache), name)
        _check_instance("checkpointer", self.checkpointer, CheckpointerSpec)
        _check_instance("wandb", self.wandb, WandbSpec)
        _check_instance("control", self.control, ControlSpec)
        check_choice("progress", self.progress, PROGRESS_MODES)
        check_optional(check_int, "max_steps_this_run", self.max_steps_this_run, minimum=1)

    @classmethod
    def from_json(cls, obj: Any, where: str = "runtime") -> RuntimeSpec:
        values = json_fields(cls, obj, where)
        values["resources"] = Resources.from_json(
            values["resources"], field_path(where, "resources")
        )
        values["mesh"] = mesh_sizes(values["mesh"], field_path(where, "mesh"))
        values["checkpointer"] = CheckpointerSpec.from_json(
            values["checkpointer"], field_path(where, "checkpointer")
        )
        values["wandb"] = WandbSpec.from_json(values["wandb"], field_path(where, "wandb"))
        values["control"] = read_json(ControlSpec, values["control"], field_path(where, "control"))
        return build(cls, where, values)

    def to_json(self) -> dict[str, Any]:
        return {
            **scalar_json(self),
            "resources": self.resources.to_json(),
            "mesh": dict(self.mesh),
            "checkpointer": scalar_json(self.checkpointer),
            "wandb": self.wandb.to_json(),
            "control": scalar_json(self.control),
            "validation_names": dict(self.validation_names),
        }

    def eval_names(self, validation: Sequence[DatasetRef | DatasetInput]) -> tuple[str, ...]:
        """Each validation set's name in metrics, checked: unique, none another's group, and
        every `validation_names` entry naming one of the sets."""
        caches = {d.name for d in validation}
        for cache in self.validation_names:
            if cache not in caches:
                raise SpecError(
                    field_path("validation_names", cache), "is not one of config.validation"
                )
        names = [self.validation_names.get(d.name, d.name.split("/")[-1]) for d in validation]
        check_eval_names("validation_names", names)
        return tuple(names)


# --- the train spec --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainSpec:
    """One training run: its artifact's address and identity, where it writes, what it makes
    and how it runs."""

    name: str
    version: str
    fingerprint: str
    output_path: Path  # the trainer writes everything here (docs/training.md)
    config: TrainConfig[DatasetInput]
    runtime: RuntimeSpec
    # Where the artifact is, for people and records, when `output_path` is a local staging copy
    # of it (a run in a bucket: the bucket URL); None: `output_path` itself.
    location: str | None = None

    def __post_init__(self) -> None:
        check_address(self)
        check_absolute_path("output_path", self.output_path)
        check_optional(check_str, "location", self.location)
        _check_instance("config", self.config, TrainConfig)
        _check_instance("runtime", self.runtime, RuntimeSpec)
        try:
            self.runtime.eval_names(self.config.validation)
        except SpecError as e:
            raise e.within("runtime") from None

    def shown(self, path: Path) -> str:
        """A path of the run's output as people and records name it: under `location` when
        the output is a local staging copy of the artifact."""
        if self.location is None or not path.is_relative_to(self.output_path):
            return str(path)
        relative = path.relative_to(self.output_path).as_posix()
        return self.location if relative == "." else f"{self.location}/{relative}"

    def record_json(self) -> dict[str, Any]:
        """The spec as the artifact's files keep it (train_spec.json, config.json): its
        `output_path` where people find the artifact, never a staging folder of the host."""
        obj = self.to_json()
        if self.location is not None:
            obj["output_path"] = self.location
        return obj

    @classmethod
    def from_json(cls, obj: Any) -> TrainSpec:
        header = {"spec_version": SPEC_VERSION, "kind": SPEC_KIND}
        values = json_fields(cls, obj, "", header, "write the spec with a matching Kiln")
        values["output_path"] = json_path(values["output_path"])
        values["config"] = TrainConfig.from_json(values["config"], "config", DatasetInput)
        values["runtime"] = RuntimeSpec.from_json(values["runtime"])
        return build(cls, "", values)

    def to_json(self) -> dict[str, Any]:
        values = {k: v for k, v in scalar_json(self).items() if k != "location" or v is not None}
        return {
            "spec_version": SPEC_VERSION,
            "kind": SPEC_KIND,
            **values,
            "config": self.config.to_json(),
            "runtime": self.runtime.to_json(),
        }
