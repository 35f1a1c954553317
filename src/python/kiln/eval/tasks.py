"""Which lm-eval-harness tasks a run evaluates: the suite config.

The reference CORE_TASKS list lives where experiments name it, in the BUILD-file symbols
(src/pants_plugins/kiln_pants/build_symbols.py); the runtime runs whatever suite the spec gives.

A suite is plain JSON in the step spec (`config.evals`, part of the checkpoint's fingerprint):

    {"tasks": [{"name": "hellaswag", "num_fewshot": 0, "alias": "hellaswag_0shot"}, ...],
     "every": 10000, "max_examples": null, "task_paths": ["/abs/dir/of/yaml"]}

See docs/evals.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EvalTask:
    """One lm-eval task at a fixed number of few-shot examples."""

    name: str
    num_fewshot: int
    alias: str | None = None

    @property
    def label(self) -> str:
        """The key metrics are logged under: the alias when given (hellaswag runs twice)."""
        return self.alias or self.name

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], where: str = "task") -> EvalTask:
        _check_keys(raw, required={"name", "num_fewshot"}, optional={"alias"}, where=where)
        name, num_fewshot, alias = raw["name"], raw["num_fewshot"], raw.get("alias")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.name must be a non-empty string, got {name!r}")
        if isinstance(num_fewshot, bool) or not isinstance(num_fewshot, int) or num_fewshot < 0:
            raise ValueError(f"{where}.num_fewshot must be an integer >= 0, got {num_fewshot!r}")
        if alias is not None and (not isinstance(alias, str) or not alias):
            raise ValueError(f"{where}.alias must be a non-empty string or null, got {alias!r}")
        return cls(name=name, num_fewshot=num_fewshot, alias=alias)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "num_fewshot": self.num_fewshot, "alias": self.alias}


@dataclass(frozen=True)
class EvalSuiteConfig:
    """The reference's `EvalSuite(tasks, every)` plus `max_examples` and local task folders."""

    tasks: tuple[EvalTask, ...]
    every: int
    max_examples: int | None = None
    task_paths: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], where: str = "evals") -> EvalSuiteConfig:
        _check_keys(
            raw, required={"tasks", "every"}, optional={"max_examples", "task_paths"}, where=where
        )
        if not isinstance(raw["tasks"], list) or not raw["tasks"]:
            raise ValueError(f"{where}.tasks must be a non-empty list of task objects")
        tasks = tuple(
            EvalTask.from_dict(task, where=f"{where}.tasks[{i}]")
            for i, task in enumerate(raw["tasks"])
        )
        _check_unique_labels(tasks, where)
        every, max_examples = raw["every"], raw.get("max_examples")
        if isinstance(every, bool) or not isinstance(every, int) or every <= 0:
            raise ValueError(f"{where}.every must be a positive integer, got {every!r}")
        if max_examples is not None and (
            isinstance(max_examples, bool) or not isinstance(max_examples, int) or max_examples <= 0
        ):
            raise ValueError(
                f"{where}.max_examples must be a positive integer or null, got {max_examples!r}"
            )
        task_paths = raw.get("task_paths") or []
        if not isinstance(task_paths, list) or not all(isinstance(p, str) for p in task_paths):
            raise ValueError(f"{where}.task_paths must be a list of directory paths")
        return cls(
            tasks=tasks, every=every, max_examples=max_examples, task_paths=tuple(task_paths)
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "tasks": [task.to_dict() for task in self.tasks],
            "every": self.every,
            "max_examples": self.max_examples,
            "task_paths": list(self.task_paths),
        }


def _check_keys(
    raw: Mapping[str, Any], *, required: set[str], optional: set[str], where: str
) -> None:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where} must be an object, got {type(raw).__name__}")
    missing = sorted(required - raw.keys())
    unknown = sorted(raw.keys() - required - optional)
    if missing:
        raise ValueError(f"{where} is missing {missing}")
    if unknown:
        raise ValueError(
            f"{where} has unknown keys {unknown}; allowed: {sorted(required | optional)}"
        )


def _check_unique_labels(tasks: tuple[EvalTask, ...], where: str) -> None:
    seen: set[str] = set()
    for task in tasks:
        if task.label in seen:
            raise ValueError(
                f"{where}.tasks has two entries logged as {task.label!r}: give each an alias"
            )
        seen.add(task.label)
