"""BUILD-file validation: bad values fail when targets load, naming the target, field and reason."""

from __future__ import annotations

import pytest
from pants.engine.addresses import Address
from pants.engine.internals.scheduler import ExecutionError
from pants.testutil.rule_runner import RuleRunner

from kiln_pants.build_symbols import CORE_TASKS

CACHE = """
tokenized_cache(name="cache", source="org/data", tokenizer="package:gpt2", version="2026.06.28")
"""


def checkpoint(**overrides: str) -> str:
    fields = {
        "version": '"2026.06.28"',
        "model": "llama(max_seq_len=256, hidden_dim=64, intermediate_dim=128, num_heads=4, "
        "num_kv_heads=2, num_layers=2)",
        "optimizer": "adam(learning_rate=1e-3, warmup=10)",
        "datasets": '{":cache": 1.0}',
        "validation": "[]",
        "batch_size": "8",
        "seq_len": "128",
        "num_train_steps": "100",
        "z_loss_weight": "None",
        "evals": "None",
        "resources": "cpu()",
    }
    fields.update(overrides)
    body = ",\n    ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
    return CACHE + f"lm_checkpoint(\n    name='ckpt',\n    {body},\n)\n"


def load_error(rule_runner: RuleRunner, build: str, name: str = "ckpt") -> str:
    rule_runner.write_files({"exp/BUILD": build})
    with pytest.raises(ExecutionError) as error:
        rule_runner.get_target(Address("exp", target_name=name))
    return str(error.value)


def test_valid_checkpoint_loads(rule_runner: RuleRunner) -> None:
    rule_runner.write_files({"exp/BUILD": checkpoint()})
    target = rule_runner.get_target(Address("exp", target_name="ckpt"))
    assert target.alias == "lm_checkpoint"


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"batch_size": "0"}, "The `batch_size` field in target exp:ckpt must be > 0, got 0"),
        ({"num_train_steps": "-5"}, "`num_train_steps` field in target exp:ckpt must be > 0"),
        ({"gradient_checkpointing": '"some"'}, "gradient_checkpointing"),
        ({"mesh": '{"model": 2}'}, "expected one of data, fsdp, tensor, got 'model'"),
        ({"mesh": '{"data": -1, "fsdp": -1}'}, "at most one axis may be -1"),
        ({"mesh": '{"fsdp": 0}'}, "fsdp: expected a positive integer or -1, got 0"),
        (
            {"per_device_parallelism": "0"},
            "`per_device_parallelism` field in target exp:ckpt must be > 0, got 0",
        ),
        (
            {"seq_len": "512"},
            "`seq_len` field in target exp:ckpt is 512, larger than the model's max_seq_len 256",
        ),
        ({"datasets": '{":cache": 0}'}, "weights must be positive numbers"),
        ({"datasets": '{":cache": "high"}'}, "weights must be positive numbers"),
        ({"version": '"june"'}, "`version` field in target exp:ckpt must be a calendar version"),
        ({"version": '"2026.13.01"'}, "must be a calendar version"),
        ({"z_loss_weight": None}, "z_loss_weight"),
        ({"evals": None}, "evals"),
        ({"model": '"big"'}, "model"),
        ({"resources": None}, "resources"),
        ({"artifact_name": '"../escape"'}, "has an empty, `.` or `..` component"),
    ],
)
def test_invalid_checkpoint_fields(rule_runner: RuleRunner, overrides: dict, expected: str) -> None:
    message = load_error(rule_runner, checkpoint(**overrides))
    assert expected in message
    assert "exp:ckpt" in message


@pytest.mark.parametrize(
    "model, expected",
    [
        (
            "llama(max_seq_len=256, hidden_dim=64, intermediate_dim=128, num_heads=4, num_kv_heads=2, "
            "num_layers=2, hiden=3)",
            "llama(): got an unexpected keyword argument 'hiden'",
        ),
        (
            "llama(max_seq_len=256, hidden_dim=64, intermediate_dim=128, num_heads=4, num_kv_heads=3, "
            "num_layers=2)",
            "llama(): `num_heads`: 4 is not a multiple of num_kv_heads (3)",
        ),
        (
            "llama(max_seq_len=0, hidden_dim=64, intermediate_dim=128, num_heads=4, num_kv_heads=2, "
            "num_layers=2)",
            "llama(): `max_seq_len`: expected an integer >= 1, got 0",
        ),
        (
            "llama(max_seq_len=256, hidden_dim='64', intermediate_dim=128, num_heads=4, num_kv_heads=2, "
            "num_layers=2)",
            "llama(): `hidden_dim`: expected an integer >= 1, got '64'",
        ),
    ],
)
def test_build_symbols_validate_at_parse_time(
    rule_runner: RuleRunner, model: str, expected: str
) -> None:
    message = load_error(rule_runner, checkpoint(model=model))
    assert expected in message
    assert "exp/BUILD" in message


def test_eval_suite_task_files_must_be_an_address(rule_runner: RuleRunner) -> None:
    message = load_error(
        rule_runner, checkpoint(evals="eval_suite(['t'], every=5, task_files='tasks/')")
    )
    assert "eval_suite(): `task_files` must be the address of a files target" in message


def test_adam_rejects_bad_schedule(rule_runner: RuleRunner) -> None:
    message = load_error(rule_runner, checkpoint(optimizer="adam(lr_schedule='cosin')"))
    assert (
        "adam(): `lr_schedule`: expected one of cosine, linear, constant, inv_sqrt, got 'cosin'"
        in message
    )


def test_cache_needs_exactly_one_source(rule_runner: RuleRunner) -> None:
    build = 'tokenized_cache(name="c", tokenizer="package:gpt2", version="dev")'
    assert "needs exactly one of `source`" in load_error(rule_runner, build, name="c")


def test_cache_rejects_unknown_stdlib_source(rule_runner: RuleRunner) -> None:
    build = (
        'tokenized_cache(name="c", source="stdlib:poems", tokenizer="package:gpt2", version="dev")'
    )
    assert "unknown stdlib source 'stdlib:poems'" in load_error(rule_runner, build, name="c")


def test_core_tasks_are_the_reference_suite() -> None:
    # DCLM's CORE set as the reference runs it: (name, shots, alias).
    assert [(t.name, t.num_fewshot, t.alias) for t in CORE_TASKS] == [
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
