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


def test_conventions_round_trip_and_are_left_out_at_their_defaults():
    tasks = [{"name": "copa", "num_fewshot": 0, "alias": None}]
    default = {"tasks": tasks, "every": 5, "max_examples": None, "task_paths": []}
    # The canonical form of a suite that sets neither is what it was before they existed, so
    # its checkpoints keep their fingerprints.
    assert EvalSuiteConfig.from_json(default).to_json() == default
    assert EvalSuiteConfig.from_json(default).sequence_start == "tokenizer"
    custom = {**default, "sequence_start": "document", "max_length": 1024}
    config = EvalSuiteConfig.from_json(custom)
    assert (config.sequence_start, config.max_length) == ("document", 1024)
    assert config.to_json() == custom


def test_the_chat_template_is_an_option_in_the_identity_only_when_applied():
    default = {"tasks": [{"name": "copa", "num_fewshot": 0, "alias": None}], "every": 1,
               "max_examples": None, "task_paths": []}  # fmt: skip
    config = EvalSuiteConfig.from_json(default)
    assert (config.apply_chat_template, config.multiturn) == (False, False)
    assert config.to_json() == default
    chat = EvalSuiteConfig.from_json({**default, "apply_chat_template": True})
    assert chat.multiturn  # lm-eval's command line: few-shot examples as turns by default
    assert chat.to_json() == {**default, "apply_chat_template": True}
    single = {**default, "apply_chat_template": True, "fewshot_as_multiturn": False}
    assert not EvalSuiteConfig.from_json(single).multiturn
    assert EvalSuiteConfig.from_json(single).to_json() == single


def test_a_system_instruction_is_in_the_identity_only_when_given():
    default = {"tasks": [{"name": "copa", "num_fewshot": 0, "alias": None}], "every": 1,
               "max_examples": None, "task_paths": []}  # fmt: skip
    assert EvalSuiteConfig.from_json(default).system_instruction is None
    instructed = {**default, "system_instruction": "Answer briefly."}
    assert EvalSuiteConfig.from_json(instructed).to_json() == instructed


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
        (
            {"tasks": [{"name": "copa"}], "every": 1, "sequence_start": "bos"},
            r"evals\.sequence_start: expected one of tokenizer, document, got 'bos'",
        ),
        (
            {"tasks": [{"name": "copa"}], "every": 1, "max_length": 0},
            r"evals\.max_length: expected an integer >= 1",
        ),
        (
            {"tasks": [{"name": "copa"}], "every": 1, "apply_chat_template": "yes"},
            r"evals\.apply_chat_template: expected true or false",
        ),
        (
            {"tasks": [{"name": "copa"}], "every": 1, "fewshot_as_multiturn": True},
            r"evals\.fewshot_as_multiturn: few-shot examples are chat turns only when",
        ),
        (
            {"tasks": [{"name": "copa"}], "every": 1, "system_instruction": ""},
            r"evals\.system_instruction: expected a non-empty string",
        ),
        (
            {"tasks": [{"name": "copa", "alias": "averages"}], "every": 1},
            r"evals\.tasks: 'averages' names metrics the harness logs itself",
        ),
    ],
)
def test_bad_suites_name_the_field(raw, message):
    with pytest.raises(ValueError, match=message):
        EvalSuiteConfig.from_json(raw)
