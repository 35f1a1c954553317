"""Which lm-eval-harness tasks a run evaluates: `config.evals`, part of a checkpoint's identity.

    {"tasks": [{"name": "hellaswag", "num_fewshot": 0, "alias": "hellaswag_0shot"}, ...],
     "every": 10000, "max_examples": null, "task_paths": ["exp/eval_tasks"]}

`task_paths` are folders of local task YAML: relative to the step's inputs in a step spec,
absolute in a train spec. docs/evals.md describes the suite.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln_contract.parsing import (
    SpecError,
    build,
    check_int,
    check_optional,
    check_str,
    check_tuple_of,
    field_path,
    json_fields,
    json_list,
    read_json,
    scalar_json,
)


@dataclass(frozen=True)
class EvalTask:
    """One lm-eval task at a fixed number of few-shot examples."""

    name: str
    num_fewshot: int = 0
    alias: str | None = None

    def __post_init__(self) -> None:
        check_str("name", self.name)
        check_int("num_fewshot", self.num_fewshot, minimum=0)
        check_optional(check_str, "alias", self.alias)

    @property
    def label(self) -> str:
        """The key metrics are logged under: the alias when given (hellaswag runs twice)."""
        return self.alias or self.name

    @classmethod
    def from_json(cls, obj: Any, where: str = "task") -> EvalTask:
        return read_json(cls, obj, where)

    def to_json(self) -> dict[str, Any]:
        return scalar_json(self)


@dataclass(frozen=True)
class EvalSuiteConfig:
    """The reference's `EvalSuite(tasks, every)` plus `max_examples` and local task folders."""

    tasks: tuple[EvalTask, ...]
    every: int
    max_examples: int | None = None
    task_paths: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_tuple_of("tasks", self.tasks, EvalTask)
        if not self.tasks:
            raise SpecError("tasks", "expected at least one task")
        labels = [task.label for task in self.tasks]
        twice = sorted({label for label in labels if labels.count(label) > 1})
        if twice:
            raise SpecError("tasks", f"two entries are logged as {twice[0]!r}: give each an alias")
        check_int("every", self.every, minimum=1)
        check_optional(check_int, "max_examples", self.max_examples, minimum=1)
        check_tuple_of("task_paths", self.task_paths, str)

    @classmethod
    def from_json(cls, obj: Any, where: str = "evals") -> EvalSuiteConfig:
        values = json_fields(cls, obj, where)
        tasks = json_list(values["tasks"], field_path(where, "tasks"))
        values["tasks"] = tuple(
            EvalTask.from_json(task, field_path(where, f"tasks[{i}]")) for i, task in enumerate(tasks)
        )
        if "task_paths" in values:
            values["task_paths"] = tuple(
                json_list(values["task_paths"], field_path(where, "task_paths"))
            )
        return build(cls, where, values)

    def to_json(self) -> dict[str, Any]:
        return {
            **scalar_json(self),
            "tasks": [task.to_json() for task in self.tasks],
            "task_paths": list(self.task_paths),
        }
