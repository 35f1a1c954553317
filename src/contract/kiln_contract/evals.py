"""Which lm-eval-harness tasks a run evaluates: `config.evals`, part of a checkpoint's identity.

    {"tasks": [{"name": "hellaswag", "num_fewshot": 0, "alias": "hellaswag_0shot"}, ...],
     "every": 10000, "max_examples": null, "task_paths": ["exp/eval_tasks"],
     "sequence_start": "tokenizer", "max_length": 2048,
     "apply_chat_template": true, "fewshot_as_multiturn": true,
     "system_instruction": "Answer with the letter."}

`task_paths` are folders of local task YAML: relative to the step's inputs in a step spec,
absolute in a train spec. `sequence_start`, `max_length`, `apply_chat_template`,
`fewshot_as_multiturn` and `system_instruction` are optional and left out of the JSON at their
defaults, so suites that do not set them keep their fingerprints. docs/evals.md describes the
suite.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln_contract.parsing import (
    SpecError,
    build,
    check_bool,
    check_choice,
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

# How a scored sequence starts. "tokenizer": as lm-eval's Hugging Face runner (HFLM) builds it,
# with what the tokenizer itself adds (BOS for Llama-3-style tokenizers, nothing for GPT-2-style
# ones) and lm-eval's prefix token only for an empty context. "document": every sequence starts
# with the token a document follows in Kiln's training stream (BOS, else EOS).
SEQUENCE_STARTS = ("tokenizer", "document")
DEFAULT_SEQUENCE_START = "tokenizer"
# Metric groups the harness itself logs under lm_eval/: a task label must not shadow them.
RESERVED_LABELS = ("averages", "dclm_core", "meta")


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
    """The reference's `EvalSuite(tasks, every)` plus `max_examples`, local task folders, how
    sequences start and lm-eval's `max_length` (input tokens per sequence; None: the model's
    max_seq_len), and lm-eval's `apply_chat_template`, `fewshot_as_multiturn` (None: as
    lm-eval's command line defaults it, True exactly when the chat template is applied) and
    `system_instruction` (None: none; else the system turn, or with no chat template the text
    before each context)."""

    tasks: tuple[EvalTask, ...]
    every: int
    max_examples: int | None = None
    task_paths: tuple[str, ...] = ()
    sequence_start: str = DEFAULT_SEQUENCE_START
    max_length: int | None = None
    apply_chat_template: bool = False
    fewshot_as_multiturn: bool | None = None
    system_instruction: str | None = None

    def __post_init__(self) -> None:
        check_tuple_of("tasks", self.tasks, EvalTask)
        if not self.tasks:
            raise SpecError("tasks", "expected at least one task")
        labels = [task.label for task in self.tasks]
        twice = sorted({label for label in labels if labels.count(label) > 1})
        if twice:
            raise SpecError("tasks", f"two entries are logged as {twice[0]!r}: give each an alias")
        reserved = sorted(set(labels) & set(RESERVED_LABELS))
        if reserved:
            raise SpecError(
                "tasks",
                f"{reserved[0]!r} names metrics the harness logs itself "
                f"(lm_eval/{reserved[0]}/...): give the entry another alias",
            )
        check_int("every", self.every, minimum=1)
        check_optional(check_int, "max_examples", self.max_examples, minimum=1)
        check_tuple_of("task_paths", self.task_paths, str)
        check_choice("sequence_start", self.sequence_start, SEQUENCE_STARTS)
        check_optional(check_int, "max_length", self.max_length, minimum=1)
        check_bool("apply_chat_template", self.apply_chat_template)
        check_optional(check_bool, "fewshot_as_multiturn", self.fewshot_as_multiturn)
        if self.fewshot_as_multiturn and not self.apply_chat_template:
            raise SpecError(
                "fewshot_as_multiturn",
                "few-shot examples are chat turns only when apply_chat_template is true",
            )
        check_optional(check_str, "system_instruction", self.system_instruction)

    @property
    def multiturn(self) -> bool:
        """lm-eval's fewshot_as_multiturn for this suite: given, else apply_chat_template."""
        if self.fewshot_as_multiturn is None:
            return self.apply_chat_template
        return self.fewshot_as_multiturn

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
        """The canonical form: optional fields at their defaults are left out (fingerprints)."""
        defaults = {
            "sequence_start": DEFAULT_SEQUENCE_START,
            "max_length": None,
            "apply_chat_template": False,
            "fewshot_as_multiturn": None,
            "system_instruction": None,
        }
        fields = scalar_json(self)
        return {
            **{k: v for k, v in fields.items() if not (k in defaults and v == defaults[k])},
            "tasks": [task.to_json() for task in self.tasks],
            "task_paths": list(self.task_paths),
        }


# The DCLM paper's CORE suite, as the reference runs it.
CORE_TASKS: tuple[EvalTask, ...] = (
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
