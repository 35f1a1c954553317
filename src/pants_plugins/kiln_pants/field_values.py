"""Typed helper objects for BUILD files: `llama(...)`, `adam(...)`, `eval_task(...)`, `eval_suite(...)`,
`gpu(...)`, `tpu(...)`, `cpu(...)`, `hf_model_source(...)`, `levanter_cache(...)`, `url_files(...)` and the
`CORE_TASKS` constant.

The objects are the contract's (kiln_contract), the ones the runtime reads back from the step
spec: `llama(...)` is a LlamaArchitecture, `adam(...)` an AdamConfig, `gpu(...)` Resources.
They validate when the BUILD file is parsed. A call that fails returns an `InvalidHelperCall`
(the helper, its argument and the problem, and the BUILD file's line) instead of raising: the
target is not known while its arguments are evaluated, so the field that holds the value fails
(kiln_pants.target_types) naming the target, the field, the BUILD file's line, the helper and
its argument, where Kiln reads that target. A value no target uses fails nothing.
Each object is a frozen (hashable) dataclass, as Pants field values must be, and turns into
plain JSON with `to_json()`: that JSON is what enters fingerprints and step specs.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, TypeVar, Union

from kiln_contract.adam import AdamConfig
from kiln_contract.evals import CORE_TASKS, DEFAULT_SEQUENCE_START, EvalSuiteConfig, EvalTask
from kiln_contract.llama import LlamaArchitecture
from kiln_contract.parsing import SpecError
from kiln_contract.tokenize import LevanterCacheSource, url_files
from kiln_contract.tpu import tpu_slice_shape
from kiln_contract.train import HfModelSource, Resources

T = TypeVar("T")


class BuildSymbolError(ValueError):
    pass


def is_whole_number(value: Any, minimum: int = 0) -> bool:
    """An int >= minimum. bool is an int in Python: `True` where a count belongs is a typo, not
    a 1."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


@dataclass(frozen=True)
class InvalidHelperCall:
    """A helper call that failed, held until a target's field reads it (see the module doc)."""

    problem: str  # "llama(): `num_heads`: 4 is not a multiple of num_kv_heads (3)."
    where: str  # "experiments/BUILD:14": the BUILD file's line that made the call

    def describe(self, field: str, address: Any) -> str:
        return f"The `{field}` field in target {address} ({self.where}): {self.problem}"


def _helper(name: str, make: Callable[..., T]) -> Callable[..., Union[T, InvalidHelperCall]]:
    """`make` as the BUILD-file symbol `name(...)`: a bad argument gives an InvalidHelperCall
    naming the helper (as does an argument that is one already: a bad `eval_task(...)` inside
    `eval_suite(...)`)."""

    def helper(*args: Any, **kwargs: Any) -> Union[T, InvalidHelperCall]:
        invalid = first_invalid([*args, *kwargs.values()])
        if invalid is not None:
            return invalid
        try:
            return make(*args, **kwargs)
        except SpecError as e:
            field = f"`{e.field}`: " if e.field else ""
            return InvalidHelperCall(f"{name}(): {field}{e.problem}.", _build_file_line())
        except BuildSymbolError as e:
            return InvalidHelperCall(str(e), _build_file_line())
        except TypeError as e:  # a missing or unknown argument: "__init__() got an ..."
            problem = f"{name}(): {str(e).split('() ', 1)[-1]}."
            return InvalidHelperCall(problem, _build_file_line())

    helper.__name__ = name
    helper.__doc__ = make.__doc__
    return helper


def first_invalid(values: Any) -> Optional[InvalidHelperCall]:
    """The first InvalidHelperCall in `values` (lists, tuples and dicts searched)."""
    if isinstance(values, InvalidHelperCall):
        return values
    if isinstance(values, dict):
        values = list(values.values())
    if isinstance(values, (list, tuple)):
        for value in values:
            found = first_invalid(value)
            if found is not None:
                return found
    return None


def _build_file_line() -> str:
    """`FILE:LINE` of the BUILD file's top-level statement that is running (Pants compiles
    each BUILD file under its path)."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_name != "<module>":
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


@dataclass(frozen=True)
class EvalSuite:
    """`eval_suite(...)`: the suite a checkpoint evaluates, its local task files (if any) named
    by the address of a `files`/`resources` target holding lm-eval task YAML and its data."""

    suite: EvalSuiteConfig
    task_files: Optional[str] = None

    def to_json(self) -> Dict[str, Any]:
        suite = {k: v for k, v in self.suite.to_json().items() if k != "task_paths"}
        return {**suite, "task_files": self.task_files}


def eval_suite(
    tasks: Any,
    every: int,
    max_examples: Optional[int] = None,
    task_files: Optional[str] = None,
    sequence_start: str = DEFAULT_SEQUENCE_START,
    max_length: Optional[int] = None,
    apply_chat_template: bool = False,
    fewshot_as_multiturn: Optional[bool] = None,
    system_instruction: Optional[str] = None,
) -> EvalSuite:
    tasks = tuple(_eval_task(task) for task in tasks)
    if not tasks:
        raise BuildSymbolError("eval_suite(): `tasks` is empty; pass evals=None to opt out.")
    if task_files is not None and not (
        isinstance(task_files, str) and task_files.startswith(("//", ":"))
    ):
        raise BuildSymbolError(
            "eval_suite(): `task_files` must be the address of a files target with lm-eval "
            f"task YAML, e.g. ':eval_tasks'; got {task_files!r}."
        )
    suite = EvalSuiteConfig(
        tasks,
        every,
        max_examples,
        sequence_start=sequence_start,
        max_length=max_length,
        apply_chat_template=apply_chat_template,
        fewshot_as_multiturn=fewshot_as_multiturn,
        system_instruction=system_instruction,
    )
    return EvalSuite(suite, task_files)


def _eval_task(task: Any) -> EvalTask:
    if isinstance(task, EvalTask):
        return task
    if isinstance(task, str):
        return EvalTask(task)
    raise BuildSymbolError(
        f"eval_suite(): each task must be a task name or eval_task(...), got {task!r}."
    )




@dataclass(frozen=True)
class CheckpointInit:
    """`init_from=":run"` or `from_checkpoint(":run", step=N, optimizer_state=...,
    reset_data_loader_on_init=...)`: a run starts from another artifact of the graph, an
    `lm_checkpoint` (at a saved step; default its final one) or an `hf_model`, named by address
    (a real dependency: kiln_contract.train's ParentRun once resolved). From an lm_checkpoint a
    run carries the optimizer state unless `optimizer_state=False` (None: the default) and
    continues the data stream unless `reset_data_loader_on_init=True`."""

    address: str
    step: Optional[int] = None
    optimizer_state: Optional[bool] = None
    reset_data_loader_on_init: bool = False


def from_checkpoint(
    address: str,
    step: Optional[int] = None,
    optimizer_state: Optional[bool] = None,
    reset_data_loader_on_init: bool = False,
) -> CheckpointInit:
    if not isinstance(address, str) or not address.startswith(("//", ":")):
        raise BuildSymbolError(
            "from_checkpoint(): the run to start from is the address of an lm_checkpoint or "
            f"hf_model target, e.g. ':dclm_1b'; got {address!r}."
        )
    if step is not None and not is_whole_number(step):
        raise BuildSymbolError(f"from_checkpoint(): `step` must be a saved step >= 0, got {step!r}.")
    if optimizer_state is not None and not isinstance(optimizer_state, bool):
        raise BuildSymbolError(
            f"from_checkpoint(): `optimizer_state` must be True or False, got {optimizer_state!r}."
        )
    if not isinstance(reset_data_loader_on_init, bool):
        raise BuildSymbolError(
            "from_checkpoint(): `reset_data_loader_on_init` must be True or False, got "
            f"{reset_data_loader_on_init!r}."
        )
    return CheckpointInit(address, step, optimizer_state, reset_data_loader_on_init)


def gpu(type: str, count: int = 1, hosts: Optional[int] = None) -> Resources:  # noqa: A002
    """`count` GPUs of model `type` on each of `hosts` hosts (a cluster run; default one)."""
    if not isinstance(type, str) or not type:
        raise BuildSymbolError(f"gpu(): `type` must be a GPU model such as 'H100', got {type!r}.")
    return Resources("gpu", type, count, hosts)


def tpu(type: str) -> Resources:  # noqa: A002
    """A TPU slice by its type, e.g. 'v4-128' (64 v4 chips): kiln_contract.tpu."""
    if not isinstance(type, str):
        raise BuildSymbolError(f"tpu(): `type` must be a slice such as 'v4-128', got {type!r}.")
    try:
        tpu_slice_shape(type)
    except SpecError as e:
        raise BuildSymbolError(f"tpu(): `type`: {e.problem}.") from None
    return Resources("tpu", type)


def cpu(hosts: Optional[int] = None) -> Resources:
    """CPUs; `hosts` > 1 trains over that many hosts of a cluster (one process each)."""
    return Resources("cpu", hosts=hosts)


BUILD_FILE_OBJECTS = {
    "llama": _helper("llama", LlamaArchitecture),
    "adam": _helper("adam", AdamConfig),
    "eval_task": _helper("eval_task", EvalTask),
    "eval_suite": _helper("eval_suite", eval_suite),
    "gpu": _helper("gpu", gpu),
    "tpu": _helper("tpu", tpu),
    "cpu": _helper("cpu", cpu),
    "hf_model_source": _helper("hf_model_source", HfModelSource),
    "from_checkpoint": _helper("from_checkpoint", from_checkpoint),
    "levanter_cache": _helper("levanter_cache", LevanterCacheSource),
    "url_files": _helper("url_files", url_files),
    "CORE_TASKS": CORE_TASKS,
}
