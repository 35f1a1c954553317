"""The suite config: CORE_TASKS as the reference lists them, and validation errors."""

from __future__ import annotations

import pytest

from kiln.eval.tasks import CORE_TASKS, EvalSuiteConfig, EvalTask


def test_core_tasks_are_the_reference_suite():
    # From the reference (DCLM's CORE set as Marin runs it): (name, shots, alias).
    reference = [
        ("agieval_lsat_ar", 3, None),
        ("arc_easy", 10, None),
        ("arc_challenge", 10, None),
        ("boolq", 10, None),
        ("commonsense_qa", 10, None),
        ("copa", 0, None),
        ("hellaswag", 0, "hellaswag_0shot"),
        ("hellaswag", 10, "hellaswag_10shot"),
        ("lambada_openai", 0, None),
        ("openbookqa", 0, None),
        ("piqa", 10, None),
        ("wsc273", 0, None),
        ("winogrande", 0, None),
    ]
    assert [(t.name, t.num_fewshot, t.alias) for t in CORE_TASKS] == reference
    assert len({t.label for t in CORE_TASKS}) == len(CORE_TASKS)


def test_suite_round_trips_through_json_dicts():
    raw = {
        "tasks": [t.to_dict() for t in CORE_TASKS],
        "every": 10000,
        "max_examples": 50,
        "task_paths": ["/data/tasks"],
    }
    config = EvalSuiteConfig.from_dict(raw)
    assert config.tasks == CORE_TASKS
    assert config.to_dict() == raw


def test_spec_form_without_optional_fields():
    config = EvalSuiteConfig.from_dict(
        {"tasks": [{"name": "copa", "num_fewshot": 0}], "every": 5, "max_examples": None}
    )
    assert config == EvalSuiteConfig(tasks=(EvalTask("copa", 0),), every=5)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"tasks": [], "every": 1}, r"evals\.tasks must be a non-empty list"),
        ({"tasks": [{"name": "copa", "num_fewshot": 0}]}, r"evals is missing \['every'\]"),
        ({"tasks": [{"name": "copa", "num_fewshot": 0}], "every": 0}, r"evals\.every must be"),
        (
            {"tasks": [{"name": "copa", "num_fewshot": 0}], "every": 1, "shots": 2},
            r"unknown keys \['shots'\]",
        ),
        (
            {"tasks": [{"name": "copa", "num_fewshot": -1}], "every": 1},
            r"evals\.tasks\[0\]\.num_fewshot",
        ),
        (
            {"tasks": [{"name": "copa"}], "every": 1},
            r"evals\.tasks\[0\] is missing \['num_fewshot'\]",
        ),
        (
            {"tasks": [{"name": "copa", "num_fewshot": 0}], "every": 1, "max_examples": 0},
            r"evals\.max_examples",
        ),
        (
            {
                "tasks": [
                    {"name": "hellaswag", "num_fewshot": 0},
                    {"name": "hellaswag", "num_fewshot": 10},
                ],
                "every": 1,
            },
            r"two entries logged as 'hellaswag': give each an alias",
        ),
    ],
)
def test_bad_suites_name_the_field(raw, message):
    with pytest.raises(ValueError, match=message):
        EvalSuiteConfig.from_dict(raw)
