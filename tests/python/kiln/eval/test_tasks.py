"""The suite config: JSON round trips and validation errors."""

from __future__ import annotations

import pytest

from kiln.eval.tasks import EvalSuiteConfig, EvalTask

SUITE = (
    EvalTask("agieval_lsat_ar", 3),
    EvalTask("hellaswag", 0, "hellaswag_0shot"),
    EvalTask("hellaswag", 10, "hellaswag_10shot"),
)


def test_suite_round_trips_through_json_dicts():
    raw = {
        "tasks": [t.to_json() for t in SUITE],
        "every": 10000,
        "max_examples": 50,
        "task_paths": ["/data/tasks"],
    }
    config = EvalSuiteConfig.from_json(raw)
    assert config.tasks == SUITE
    assert config.to_json() == raw


def test_spec_form_without_optional_fields():
    config = EvalSuiteConfig.from_json(
        {"tasks": [{"name": "copa"}], "every": 5, "max_examples": None}
    )
    assert config == EvalSuiteConfig(tasks=(EvalTask("copa", 0),), every=5)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"tasks": [], "every": 1}, r"evals\.tasks: expected at least one task"),
        ({"tasks": [{"name": "copa", "num_fewshot": 0}]}, r"evals\.every: required field"),
        ({"tasks": [{"name": "copa", "num_fewshot": 0}], "every": 0}, r"evals\.every: expected"),
        (
            {"tasks": [{"name": "copa", "num_fewshot": 0}], "every": 1, "shots": 2},
            r"evals: unknown field\(s\) shots",
        ),
        (
            {"tasks": [{"name": "copa", "num_fewshot": -1}], "every": 1},
            r"evals\.tasks\[0\]\.num_fewshot",
        ),
        (
            {"tasks": [{"num_fewshot": 0}], "every": 1},
            r"evals\.tasks\[0\]\.name: required field is missing",
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
            r"evals\.tasks: two entries are logged as 'hellaswag': give each an alias",
        ),
    ],
)
def test_bad_suites_name_the_field(raw, message):
    with pytest.raises(ValueError, match=message):
        EvalSuiteConfig.from_json(raw)
