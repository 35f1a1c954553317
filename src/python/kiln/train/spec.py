"""The train step spec: the JSON contract between the Pants backend and `python -m kiln.train`.

The lead's Pants rules write it; this module parses and validates it into frozen dataclasses.
Every error names the JSON field (`config.optimizer.warmup`, `runtime.mesh.data`, ...) and says
what is expected. The format is documented in docs/step-spec.md (spec_version 1).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, overload

SPEC_VERSION = 1
SPEC_KIND = "lm_checkpoint"

DTYPES = ("bfloat16", "float32", "float16")
ATTENTION_IMPLS = ("auto", "xla", "pallas", "cudnn")
REMAT_POLICIES = ("none", "full", "save_dots", "offload")
RESOURCE_KINDS = ("cpu", "gpu", "tpu")
WANDB_MODES = ("online", "offline", "disabled")
PROGRESS_MODES = ("auto", "bar", "log", "none")
MESH_AXES = ("data", "fsdp", "tensor")


class SpecError(ValueError):
    """The step spec is malformed; the message names the field and what is expected."""


class _Fields:
    """Reads one JSON object, naming `where.key` in every error and refusing unknown keys."""

    def __init__(self, obj: Any, where: str, known: tuple[str, ...]):
        if not isinstance(obj, Mapping):
            raise SpecError(
                f"{where or 'the spec'}: expected a JSON object, got {type(obj).__name__}"
            )
        unknown = sorted(set(obj) - set(known))
        if unknown:
            raise SpecError(
                f"{where or 'the spec'}: unknown field(s) {', '.join(unknown)} "
                f"(known: {', '.join(known)})"
            )
        self.obj = obj
        self.where = where

    def path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def get(self, key: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
        if key not in self.obj:
            if optional:
                return None
            raise SpecError(f"{self.path(key)}: required field is missing")
        value = self.obj[key]
        if value is None and optional:
            return None
        # bool is an int in Python; a `true` where a number belongs is a typo, not a 1.
        if isinstance(value, bool) and bool not in _as_tuple(kind):
            raise SpecError(f"{self.path(key)}: expected {_kind_name(kind)}, got {value!r}")
        if not isinstance(value, kind):
            raise SpecError(f"{self.path(key)}: expected {_kind_name(kind)}, got {value!r}")
        return value

    def number(self, key: str, *, optional: bool = False, minimum: float | None = None) -> Any:
        value = self.get(key, (int, float), optional=optional)
        if value is None:
            return None
        if not math.isfinite(value) or (minimum is not None and value < minimum):
            raise SpecError(f"{self.path(key)}: expected a finite number >= {minimum}, got {value}")
        return float(value)

    @overload
    def positive_int(self, key: str, *, optional: Literal[False] = False) -> int: ...
    @overload
    def positive_int(self, key: str, *, optional: bool) -> int | None: ...
    def positive_int(self, key: str, *, optional: bool = False) -> int | None:
        value = self.get(key, int, optional=optional)
        if value is not None and value < 1:
            raise SpecError(f"{self.path(key)}: expected a positive integer, got {value}")
        return value

    def choice(self, key: str, choices: tuple[str, ...]) -> str:
        value = self.get(key, str)
        if value not in choices:
            raise SpecError(
                f"{self.path(key)}: expected one of {', '.join(choices)}, got {value!r}"
            )
        return value

    @overload
    def absolute_path(self, key: str, *, optional: Literal[False] = False) -> Path: ...
    @overload
    def absolute_path(self, key: str, *, optional: bool) -> Path | None: ...
    def absolute_path(self, key: str, *, optional: bool = False) -> Path | None:
        value = self.get(key, str, optional=optional)
        if value is None:
            return None
        if not Path(value).is_absolute():
            raise SpecError(f"{self.path(key)}: expected an absolute path, got {value!r}")
        return Path(value)


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true/false"}
    names |= {list: "a JSON list", dict: "a JSON object"}
    return " or ".join(names.get(k, k.__name__) for k in _as_tuple(kind))


@dataclass(frozen=True)
class DatasetInput:
    """A token cache the run reads: a training component (weight > 0 or 0) or a validation set."""

    name: str
    version: str
    fingerprint: str
    path: Path
    weight: float = 0.0


@dataclass(frozen=True)
class TrainConfig:
    """`config`: the identity of the run (all of it is in the fingerprint)."""

    model: Mapping[str, Any]  # LlamaConfig fields without vocab_size (that comes from the caches)
    optimizer: Any  # kiln.train.optimizer.AdamConfig
    datasets: tuple[DatasetInput, ...]
    validation: tuple[DatasetInput, ...]
    batch_size: int
    seq_len: int
    num_train_steps: int
    z_loss_weight: float | None
    evals: Any  # kiln.eval.tasks.EvalSuiteConfig | None
    seed: int
    compute_dtype: str
    param_dtype: str

    def model_config(self, vocab_size: int) -> Any:
        """The LlamaConfig for this run, with the vocabulary size of the dataset caches."""
        from kiln.model.config import LlamaConfig

        declared = self.model.get("vocab_size")
        if declared is not None and declared != vocab_size:
            raise SpecError(
                f"config.model.vocab_size: {declared} differs from the dataset caches' tokenizer "
                f"vocabulary ({vocab_size}); drop the field (it comes from the caches)"
            )
        return LlamaConfig.from_dict({**self.model, "vocab_size": vocab_size})


@dataclass(frozen=True)
class Resources:
    kind: str
    type: str | None = None
    count: int | None = None


@dataclass(frozen=True)
class CheckpointerSpec:
    save_interval_minutes: float
    keep_last_temporary: int
    every: int | None  # permanent checkpoint every N steps; None: only the final one
    temporary_base_path: Path | None  # None: temporaries go beside permanents


@dataclass(frozen=True)
class WandbSpec:
    mode: str
    project: str
    entity: str | None
    run_id: str | None


@dataclass(frozen=True)
class ControlSpec:
    enabled: bool
    host: str
    port: int
    token_ttl_minutes: float


@dataclass(frozen=True)
class RuntimeSpec:
    """`runtime`: run-time choices, NOT in the fingerprint."""

    resources: Resources
    mesh: Mapping[str, int]
    attention: str
    gradient_checkpointing: str
    per_device_parallelism: int | None  # sequences per device per microbatch; None: all at once
    validation_every: int
    validation_batches: int
    checkpointer: CheckpointerSpec
    wandb: WandbSpec
    control: ControlSpec
    progress: str
    max_steps_this_run: int | None


@dataclass(frozen=True)
class TrainSpec:
    name: str
    version: str
    fingerprint: str
    output_path: Path
    config: TrainConfig
    runtime: RuntimeSpec
    raw: Mapping[str, Any]  # the JSON as given, for config.json and tracker_metrics.jsonl


def load_spec(path: str | Path) -> TrainSpec:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise SpecError(f"cannot read the step spec {path}: {e.strerror}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecError(f"{path} is not valid JSON: {e}") from None
    return parse_spec(obj)


def parse_spec(obj: Any) -> TrainSpec:
    top = _Fields(
        obj,
        "",
        ("spec_version", "kind", "name", "version", "fingerprint", "output_path", "config",
         "runtime"),
    )  # fmt: skip
    version = top.get("spec_version", int)
    if version != SPEC_VERSION:
        raise SpecError(
            f"spec_version: this trainer reads version {SPEC_VERSION}, got {version}; "
            "rebuild the spec with a matching Kiln"
        )
    if top.get("kind", str) != SPEC_KIND:
        raise SpecError(f"kind: expected {SPEC_KIND!r}, got {obj['kind']!r}")
    return TrainSpec(
        name=top.get("name", str),
        version=top.get("version", str),
        fingerprint=top.get("fingerprint", str),
        output_path=top.absolute_path("output_path"),
        config=_parse_config(top.get("config", dict)),
        runtime=_parse_runtime(top.get("runtime", dict)),
        raw=obj,
    )


def _parse_config(obj: Mapping[str, Any]) -> TrainConfig:
    f = _Fields(
        obj,
        "config",
        ("model", "optimizer", "datasets", "validation", "batch_size", "seq_len",
         "num_train_steps", "z_loss_weight", "evals", "seed", "compute_dtype", "param_dtype"),
    )  # fmt: skip
    model = f.get("model", dict)
    seq_len = f.positive_int("seq_len")
    max_seq_len = model.get("max_seq_len")
    if isinstance(max_seq_len, int) and seq_len > max_seq_len:
        raise SpecError(f"config.seq_len: {seq_len} exceeds config.model.max_seq_len {max_seq_len}")
    num_train_steps = f.positive_int("num_train_steps")
    datasets = _parse_datasets(f.get("datasets", list), "config.datasets", weighted=True)
    if not datasets:
        raise SpecError("config.datasets: at least one training dataset is required")
    if not any(d.weight > 0 for d in datasets):
        raise SpecError("config.datasets: at least one dataset needs a weight > 0")
    config = TrainConfig(
        model=model,
        optimizer=_parse_optimizer(f.get("optimizer", dict)),
        datasets=datasets,
        validation=_parse_datasets(f.get("validation", list), "config.validation", weighted=False),
        batch_size=f.positive_int("batch_size"),
        seq_len=seq_len,
        num_train_steps=num_train_steps,
        z_loss_weight=f.number("z_loss_weight", optional=True, minimum=0.0),
        evals=_parse_evals(f.get("evals", dict, optional=True)),
        seed=_non_negative_int(f, "seed"),
        compute_dtype=f.choice("compute_dtype", DTYPES),
        param_dtype=f.choice("param_dtype", DTYPES),
    )
    _check_model(config)
    return config


def _non_negative_int(f: _Fields, key: str) -> int:
    value = f.get(key, int)
    if value < 0:
        raise SpecError(f"{f.path(key)}: expected an integer >= 0, got {value}")
    return value


def _parse_optimizer(obj: Mapping[str, Any]) -> Any:
    from kiln.train.optimizer import AdamConfig

    try:
        return AdamConfig.from_dict(dict(obj))
    except (TypeError, ValueError, KeyError) as e:
        raise SpecError(f"config.optimizer: {e}") from None


def _check_model(config: TrainConfig) -> None:
    """Validates config.model now (with a stand-in vocab size) rather than after loading caches."""
    try:
        config.model_config(vocab_size=config.model.get("vocab_size") or 256)
    except SpecError:
        raise
    except (TypeError, ValueError, KeyError) as e:
        raise SpecError(f"config.model: {e}") from None


def _parse_datasets(items: list[Any], where: str, *, weighted: bool) -> tuple[DatasetInput, ...]:
    known = ("name", "version", "fingerprint", "path") + (("weight",) if weighted else ())
    parsed = []
    for i, item in enumerate(items):
        f = _Fields(item, f"{where}[{i}]", known)
        parsed.append(
            DatasetInput(
                name=f.get("name", str),
                version=f.get("version", str),
                fingerprint=f.get("fingerprint", str),
                path=f.absolute_path("path"),
                weight=f.number("weight", minimum=0.0) if weighted else 0.0,
            )
        )
    names = [d.name for d in parsed]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise SpecError(f"{where}: dataset(s) listed twice: {', '.join(duplicates)}")
    return tuple(parsed)


def _parse_evals(obj: Mapping[str, Any] | None) -> Any:
    if obj is None:
        return None
    from kiln.eval.tasks import EvalSuiteConfig

    try:
        return EvalSuiteConfig.from_dict(obj, where="config.evals")
    except ValueError as e:
        raise SpecError(str(e)) from None


def _parse_runtime(obj: Mapping[str, Any]) -> RuntimeSpec:
    f = _Fields(
        obj,
        "runtime",
        ("resources", "mesh", "attention", "gradient_checkpointing", "per_device_parallelism",
         "validation_every", "validation_batches", "checkpointer", "wandb", "control", "progress",
         "max_steps_this_run"),
    )  # fmt: skip
    return RuntimeSpec(
        resources=_parse_resources(f.get("resources", dict)),
        mesh=_parse_mesh(f.get("mesh", dict)),
        attention=f.choice("attention", ATTENTION_IMPLS),
        gradient_checkpointing=f.choice("gradient_checkpointing", REMAT_POLICIES),
        per_device_parallelism=f.positive_int("per_device_parallelism", optional=True),
        validation_every=f.positive_int("validation_every"),
        validation_batches=f.positive_int("validation_batches"),
        checkpointer=_parse_checkpointer(f.get("checkpointer", dict)),
        wandb=_parse_wandb(f.get("wandb", dict)),
        control=_parse_control(f.get("control", dict)),
        progress=f.choice("progress", PROGRESS_MODES),
        max_steps_this_run=f.positive_int("max_steps_this_run", optional=True),
    )


def _parse_resources(obj: Mapping[str, Any]) -> Resources:
    f = _Fields(obj, "runtime.resources", ("kind", "type", "count"))
    return Resources(
        kind=f.choice("kind", RESOURCE_KINDS),
        type=f.get("type", str, optional=True),
        count=f.positive_int("count", optional=True),
    )


def _parse_mesh(obj: Mapping[str, Any]) -> Mapping[str, int]:
    f = _Fields(obj, "runtime.mesh", MESH_AXES)
    mesh = {}
    for axis in MESH_AXES:
        size = f.get(axis, int, optional=True)
        size = 1 if size is None else size
        if size == 0 or size < -1:
            raise SpecError(f"runtime.mesh.{axis}: expected a positive size or -1, got {size}")
        mesh[axis] = size
    if list(mesh.values()).count(-1) > 1:
        raise SpecError("runtime.mesh: at most one axis may be -1 (the rest of the devices)")
    return mesh


def _parse_checkpointer(obj: Mapping[str, Any]) -> CheckpointerSpec:
    f = _Fields(
        obj,
        "runtime.checkpointer",
        ("save_interval_minutes", "keep_last_temporary", "every", "temporary_base_path"),
    )
    interval = f.number("save_interval_minutes", minimum=0.0)
    keep = f.get("keep_last_temporary", int)
    if keep < 1:
        raise SpecError(f"runtime.checkpointer.keep_last_temporary: expected >= 1, got {keep}")
    return CheckpointerSpec(
        save_interval_minutes=interval,
        keep_last_temporary=keep,
        every=f.positive_int("every", optional=True),
        temporary_base_path=f.absolute_path("temporary_base_path", optional=True),
    )


def _parse_wandb(obj: Mapping[str, Any]) -> WandbSpec:
    f = _Fields(obj, "runtime.wandb", ("mode", "project", "entity", "run_id"))
    return WandbSpec(
        mode=f.choice("mode", WANDB_MODES),
        project=f.get("project", str),
        entity=f.get("entity", str, optional=True),
        run_id=f.get("run_id", str, optional=True),
    )


def _parse_control(obj: Mapping[str, Any]) -> ControlSpec:
    f = _Fields(obj, "runtime.control", ("enabled", "host", "port", "token_ttl_minutes"))
    port = f.get("port", int)
    if not 0 <= port <= 65535:
        raise SpecError(f"runtime.control.port: expected 0 (any free port) to 65535, got {port}")
    return ControlSpec(
        enabled=f.get("enabled", bool),
        host=f.get("host", str),
        port=port,
        token_ttl_minutes=f.number("token_ttl_minutes", minimum=0.0),
    )
