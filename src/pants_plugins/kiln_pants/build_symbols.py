"""Typed helper objects for BUILD files: `llama(...)`, `adam(...)`, `eval_task(...)`, `eval_suite(...)`,
`gpu(...)`, `tpu(...)`, `cpu()` and the `CORE_TASKS` constant.

They validate when the BUILD file is parsed, so a typo fails `pants list` with the BUILD file, the
line, the helper and the field. Each is a frozen (hashable) dataclass, as Pants field values must be,
and turns into plain JSON with `to_json()`: that JSON is what enters fingerprints and step specs.
Defaults mirror Levanter's `LlamaConfig` and `AdamConfig`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

Number = Union[int, float]


class BuildSymbolError(ValueError):
    pass


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(helper: str, field: str, value: Any, *, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise BuildSymbolError(f"{helper}(): `{field}` must be an integer, got {value!r}.")
    if value < minimum:
        raise BuildSymbolError(f"{helper}(): `{field}` must be >= {minimum}, got {value}.")


def _check_number(
    helper: str, field: str, value: Any, *, positive: bool = False, at_least: float | None = None
) -> None:
    if not _is_number(value):
        raise BuildSymbolError(f"{helper}(): `{field}` must be a number, got {value!r}.")
    if positive and not value > 0:
        raise BuildSymbolError(f"{helper}(): `{field}` must be > 0, got {value}.")
    if at_least is not None and value < at_least:
        raise BuildSymbolError(f"{helper}(): `{field}` must be >= {at_least}, got {value}.")


class BuildSymbol:
    """Common JSON form: the dataclass fields, plus nothing a machine or run contributes."""

    def to_json(self) -> dict[str, Any]:
        fields = dataclasses.fields(self)  # type: ignore[arg-type]  # subclasses are dataclasses
        return {f.name: _jsonable(getattr(self, f.name)) for f in fields}


def _jsonable(value: Any) -> Any:
    if isinstance(value, BuildSymbol):
        return value.to_json()
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


@dataclass(frozen=True)
class LlamaConfig(BuildSymbol):
    max_seq_len: int
    hidden_dim: int
    intermediate_dim: int
    num_heads: int
    num_kv_heads: int
    num_layers: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for field in (
            "max_seq_len",
            "hidden_dim",
            "intermediate_dim",
            "num_heads",
            "num_kv_heads",
            "num_layers",
        ):
            _check_int("llama", field, getattr(self, field))
        if self.hidden_dim % self.num_heads:
            raise BuildSymbolError(
                f"llama(): `hidden_dim` ({self.hidden_dim}) must be divisible by `num_heads` "
                f"({self.num_heads})."
            )
        if self.num_heads % self.num_kv_heads:
            raise BuildSymbolError(
                f"llama(): `num_heads` ({self.num_heads}) must be a multiple of `num_kv_heads` "
                f"({self.num_kv_heads}) for grouped-query attention."
            )
        _check_number("llama", "rope_theta", self.rope_theta, positive=True)
        _check_number("llama", "norm_eps", self.norm_eps, positive=True)
        _check_number("llama", "init_std", self.init_std, positive=True)
        if not isinstance(self.tie_embeddings, bool):
            raise BuildSymbolError(
                f"llama(): `tie_embeddings` must be True or False, got {self.tie_embeddings!r}."
            )


LR_SCHEDULES = ("cosine", "linear", "constant", "inv_sqrt")


@dataclass(frozen=True)
class AdamConfig(BuildSymbol):
    learning_rate: float = 6e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    epsilon: float = 1e-8
    max_grad_norm: Optional[float] = 1.0
    warmup: Number = 0.01
    decay: Optional[Number] = None
    min_lr_ratio: float = 0.1
    lr_schedule: str = "cosine"

    def __post_init__(self) -> None:
        _check_number("adam", "learning_rate", self.learning_rate, positive=True)
        _check_number("adam", "weight_decay", self.weight_decay, at_least=0)
        for beta in ("beta1", "beta2"):
            value = getattr(self, beta)
            _check_number("adam", beta, value, at_least=0)
            if value >= 1:
                raise BuildSymbolError(f"adam(): `{beta}` must be < 1, got {value}.")
        _check_number("adam", "epsilon", self.epsilon, positive=True)
        if self.max_grad_norm is not None:
            _check_number("adam", "max_grad_norm", self.max_grad_norm, positive=True)
        _check_number("adam", "warmup", self.warmup, at_least=0)
        if self.decay is not None:
            _check_number("adam", "decay", self.decay, at_least=0)
        _check_number("adam", "min_lr_ratio", self.min_lr_ratio, at_least=0)
        if self.min_lr_ratio > 1:
            raise BuildSymbolError(f"adam(): `min_lr_ratio` must be <= 1, got {self.min_lr_ratio}.")
        if self.lr_schedule not in LR_SCHEDULES:
            raise BuildSymbolError(
                f"adam(): `lr_schedule` must be one of {', '.join(LR_SCHEDULES)}, "
                f"got {self.lr_schedule!r}."
            )


@dataclass(frozen=True)
class EvalTask(BuildSymbol):
    name: str
    num_fewshot: int = 0
    alias: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise BuildSymbolError(f"eval_task(): `name` must be a task name, got {self.name!r}.")
        _check_int("eval_task", "num_fewshot", self.num_fewshot, minimum=0)
        if self.alias is not None and not isinstance(self.alias, str):
            raise BuildSymbolError(f"eval_task(): `alias` must be a string, got {self.alias!r}.")


@dataclass(frozen=True)
class EvalSuite(BuildSymbol):
    tasks: Tuple[EvalTask, ...]
    every: int
    max_examples: Optional[int] = None
    # The address of a `files`/`resources` target with local lm-eval task YAML (and its data),
    # for tasks that are not lm-eval's own or must run without the hub.
    task_files: Optional[str] = None

    def __init__(
        self,
        tasks: Any,
        every: int,
        max_examples: Optional[int] = None,
        task_files: Optional[str] = None,
    ) -> None:
        object.__setattr__(self, "tasks", tuple(_eval_task(t) for t in tasks))
        object.__setattr__(self, "every", every)
        object.__setattr__(self, "max_examples", max_examples)
        object.__setattr__(self, "task_files", task_files)
        self.__post_init__()

    def __post_init__(self) -> None:
        if not self.tasks:
            raise BuildSymbolError("eval_suite(): `tasks` is empty; pass evals=None to opt out.")
        _check_int("eval_suite", "every", self.every)
        if self.max_examples is not None:
            _check_int("eval_suite", "max_examples", self.max_examples)
        if self.task_files is not None and not (
            isinstance(self.task_files, str) and self.task_files.startswith(("//", ":"))
        ):
            raise BuildSymbolError(
                "eval_suite(): `task_files` must be the address of a files target with lm-eval "
                f"task YAML, e.g. ':eval_tasks'; got {self.task_files!r}."
            )


def _eval_task(task: Any) -> EvalTask:
    if isinstance(task, EvalTask):
        return task
    if isinstance(task, str):
        return EvalTask(task)
    raise BuildSymbolError(
        f"eval_suite(): each task must be a task name or eval_task(...), got {task!r}."
    )


# The DCLM paper's CORE suite, as the reference runs it.
CORE_TASKS: Tuple[EvalTask, ...] = (
    EvalTask("agieval_lsat_ar", 3),
    EvalTask("arc_easy", 10),
    EvalTask("arc_challenge", 10),
    EvalTask("boolq", 10),
    EvalTask("commonsense_qa", 10),
    EvalTask("copa", 0),
    EvalTask("hellaswag", 0, "hellaswag_0shot"),
    EvalTask("hellaswag", 10, "hellaswag_10shot"),
    EvalTask("lambada_openai", 0),
    EvalTask("openbookqa", 0),
    EvalTask("piqa", 10),
    EvalTask("wsc273", 0),
    EvalTask("winogrande", 0),
)


@dataclass(frozen=True)
class Resources(BuildSymbol):
    """Where training runs. A run-time choice: never part of a fingerprint."""

    kind: str
    type: Optional[str] = None
    count: Optional[int] = None  # devices on one host (gpu); a TPU slice's size is in its type


def gpu(type: str, count: int = 1) -> Resources:  # noqa: A002 - mirrors ResourceConfig.with_gpu
    if not isinstance(type, str) or not type:
        raise BuildSymbolError(f"gpu(): `type` must be a GPU model such as 'H100', got {type!r}.")
    _check_int("gpu", "count", count)
    return Resources("gpu", type, count)


def tpu(type: str) -> Resources:  # noqa: A002
    if not isinstance(type, str) or "-" not in type:
        raise BuildSymbolError(f"tpu(): `type` must be a slice such as 'v4-128', got {type!r}.")
    return Resources("tpu", type)


def cpu() -> Resources:
    return Resources("cpu")


BUILD_FILE_OBJECTS = {
    "llama": LlamaConfig,
    "adam": AdamConfig,
    "eval_task": EvalTask,
    "eval_suite": EvalSuite,
    "gpu": gpu,
    "tpu": tpu,
    "cpu": cpu,
    "CORE_TASKS": CORE_TASKS,
}
