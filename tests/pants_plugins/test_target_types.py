"""BUILD-file validation: bad values fail when targets load, naming the target, field and reason."""

from __future__ import annotations

import pytest
from kiln_reading import read_target
from pants.engine.addresses import Address, Addresses
from pants.engine.internals.scheduler import ExecutionError
from pants.testutil.rule_runner import RuleRunner

from kiln_pants.artifact_graph import ArtifactGraph, ArtifactGraphRequest
from kiln_pants.field_values import CORE_TASKS

CACHE = """
tokenized_cache(name="cache", source="org/data", revision="abc1234", tokenizer="package:gpt2", version="2026.06.28")
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
        read_target(rule_runner, Address("exp", target_name=name))
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
            "`seq_len` field in target exp:ckpt: 512 exceeds model.max_seq_len 256",
        ),
        ({"datasets": '{":cache": 0}'}, "weights must be finite numbers > 0"),
        ({"datasets": '{":cache": "high"}'}, "weights must be finite numbers > 0"),
        ({"datasets": '{":cache": float("nan")}'}, "gives ':cache' the weight nan"),
        ({"datasets": '{":cache": 1e999}'}, "gives ':cache' the weight inf"),
        ({"version": '"june"'}, "`version` field in target exp:ckpt must be a calendar version"),
        ({"version": '"2026.13.01"'}, "must be a calendar version"),
        ({"z_loss_weight": None}, "z_loss_weight"),
        ({"z_loss_weight": 'float("nan")'}, "`z_loss_weight` field in target exp:ckpt expects a"),
        ({"z_loss_weight": "-1e999"}, "expects a number >= 0, got -inf"),
        ({"seed": "-1"}, "`seed` field in target exp:ckpt expects an integer >= 0, got -1"),
        ({"seed": str(2**32)}, "expects an integer from 0 to 2**32 - 1, got 4294967296"),
        ({"batch_size": "True"}, "`batch_size` field in target exp:ckpt must be > 0, got True"),
        (
            {"optimizer": "adam(warmup=500)"},
            "`optimizer` field in target exp:ckpt: `warmup`: 500 is 500 steps, more than "
            "num_train_steps (100)",
        ),
        ({"optimizer": "adam(warmup=50, decay=60)"}, "`decay`: warmup + decay = 50 + 60 steps"),
        ({"evals": None}, "evals"),
        ({"model": '"big"'}, "model"),
        ({"resources": None}, "resources"),
        ({"artifact_name": '"../escape"'}, "`artifact_name` field in target exp:ckpt must be `/`-"),
        (
            {"wandb": '{"mode": "ofline"}'},
            "The `wandb` field in target exp:ckpt: `mode` expects one of online, offline, "
            "disabled, got 'ofline'.",
        ),
        ({"wandb": '{"projcet": "x"}'}, "unknown setting 'projcet'; known: project, entity,"),
        ({"max_eval_batches": "0"}, "`max_eval_batches` field in target exp:ckpt expects an"),
        ({"max_eval_batches": '"some"'}, "`max_eval_batches` field in target exp:ckpt expects"),
        ({"temporary_base_path": '"scratch"'}, "expects an absolute path, got 'scratch'"),
        ({"checkpoint_interval_minutes": "0"}, "`checkpoint_interval_minutes` field in target"),
        ({"loss_positions": '"every"'}, "'loss_positions' field in target exp:ckpt must be one of"),
        ({"data_order": '"marin"'}, "'data_order' field in target exp:ckpt must be one of"),
    ],
)
def test_invalid_checkpoint_fields(rule_runner: RuleRunner, overrides: dict, expected: str) -> None:
    message = load_error(rule_runner, checkpoint(**overrides))
    assert expected in message
    assert "exp:ckpt" in message


HOSTILE_NAMES = [
    "../escape", "/etc/passwd", "checkpoints/", "a//b", "a/./b", "a/../../b", ".hidden",
    "checkpoints/.hidden", "a b", "x:y", "s3://bucket/x", "caf\u00e9", "tab\there", "a\\b",
    "a%2Fb", "a@b", "new\nline", "-flag", "x" * 201,
]  # fmt: skip
HOSTILE_VERSIONS = [
    "../../etc-dev", "a/b-dev", ".x-dev", "-dev", "x y-dev", "2026.06.28/..", "dev\n",
    "..-dev", "caf\u00e9-dev", "2026.06.28 ", "2026.06.28\n", "a:b-dev", "x" * 61 + "-dev",
]  # fmt: skip


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_hostile_artifact_names_fail_at_load(rule_runner: RuleRunner, name: str) -> None:
    message = load_error(rule_runner, checkpoint(artifact_name=repr(name)))
    assert "The `artifact_name` field in target exp:ckpt must be `/`-separated parts" in message


@pytest.mark.parametrize("version", HOSTILE_VERSIONS)
def test_hostile_versions_fail_at_load(rule_runner: RuleRunner, version: str) -> None:
    message = load_error(rule_runner, checkpoint(version=repr(version)))
    assert "The `version` field in target exp:ckpt must be a calendar version" in message


@pytest.mark.parametrize("version", ["dev", "my-exp_2.1-dev", "2026.06.28-dev", "2026.06.28.3"])
def test_safe_versions_load(rule_runner: RuleRunner, version: str) -> None:
    rule_runner.write_files({"exp/BUILD": checkpoint(version=repr(version))})
    assert rule_runner.get_target(Address("exp", target_name="ckpt")).alias == "lm_checkpoint"


def test_a_target_name_that_is_no_artifact_name_needs_artifact_name(
    rule_runner: RuleRunner,
) -> None:
    build = checkpoint().replace("name='ckpt'", "name='my run'")
    message = load_error(rule_runner, build, name="my run")
    assert "would be stored as 'checkpoints/my run' (from its name)" in message
    assert "give it an `artifact_name`" in message
    rule_runner.write_files({"exp/BUILD": build.replace("name='my run',", "name='my run', artifact_name='checkpoints/my_run',")})
    assert rule_runner.get_target(Address("exp", target_name="my run")).alias == "lm_checkpoint"


def test_a_stdlib_cache_needs_a_stdlib_split(rule_runner: RuleRunner) -> None:
    build = 'tokenized_cache(name="c", source="stdlib:all", split="test", tokenizer="package:gpt2", version="dev")'
    assert "`split` field in target exp:c is 'test'" in load_error(rule_runner, build, name="c")


@pytest.mark.parametrize(
    "helper, expected",
    [
        ("llama(max_seq_len=256, hidden_dim=64, intermediate_dim=128, num_heads=4, "
         "num_kv_heads=2, num_layers=2, rope_theta=1e999)", "llama(): `rope_theta`: expected a "
         "number > 0, got inf"),
        ("llama(max_seq_len=256, hidden_dim=64, intermediate_dim=128, num_heads=4, "
         "num_kv_heads=2, num_layers=2, norm_eps=float('nan'))", "`norm_eps`: expected a number "
         "> 0, got nan"),
        ("adam(learning_rate=float('inf'))", "adam(): `learning_rate`: expected a number > 0, got inf"),
        ("adam(beta2=float('nan'))", "adam(): `beta2`: expected a number >= 0 and < 1, got nan"),
        ("adam(max_grad_norm=1e999)", "adam(): `max_grad_norm`: expected a number > 0, got inf"),
        ("adam(warmup=-1e999)", "adam(): `warmup`: expected a number >= 0, got -inf"),
        ("adam(min_lr_ratio=1.5)", "adam(): `min_lr_ratio`: expected a number >= 0 and <= 1"),
        ("eval_suite(['copa'], every=1e999)", "eval_suite(): `every`: expected an integer >= 1"),
        ("eval_suite([eval_task('copa', num_fewshot=float('nan'))], every=5)",
         "eval_task(): `num_fewshot`: expected an integer >= 0, got nan"),
        ("gpu('H100', count=1e999)", "gpu(): `count`: expected an integer >= 1, got inf"),
        ("gpu('H100', count=0)", "gpu(): `count`: expected an integer >= 1, got 0"),
        ("tpu('v4-129')", "tpu(): `type`: 'v4-129' is not a TPU slice type Kiln knows; write "
         "GENERATION-SIZE"),
        ("tpu('v5e-16')", "tpu(): `type`: 'v5e-16' is not a TPU slice type"),  # v5litepod-16
        ("tpu('v4-12')", "tpu(): `type`: 'v4-12' has 6 chips, which do not fill hosts of 4"),
    ],
)  # fmt: skip
def test_non_finite_and_out_of_range_helper_values_fail_at_load(
    rule_runner: RuleRunner, helper: str, expected: str
) -> None:
    field = helper.split("(")[0]
    field = {"llama": "model", "adam": "optimizer", "eval_suite": "evals", "gpu": "resources",
             "tpu": "resources"}[field]  # fmt: skip
    message = load_error(rule_runner, checkpoint(**{field: helper}))
    assert expected in message
    assert f"The `{field}` field in target exp:ckpt (exp/BUILD:" in message  # target, field, line


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
        (
            "llama(max_seq_len=256, hidden_dim=64, intermediate_dim=128, num_heads=4, "
            "num_kv_heads=2, num_layers=2, initialization='lev')",
            "llama(): `initialization`: expected one of normal, levanter, got 'lev'",
        ),
        (
            "llama(max_seq_len=256, hidden_dim=64, intermediate_dim=128, num_heads=4, "
            "num_kv_heads=2, num_layers=2, initialization='levanter', init_std=0.01)",
            "llama(): `init_std`: 0.01 has no effect with initialization='levanter'",
        ),
    ],
)
def test_field_values_validate_at_parse_time(
    rule_runner: RuleRunner, model: str, expected: str
) -> None:
    message = load_error(rule_runner, checkpoint(model=model))
    assert expected in message
    assert "exp/BUILD" in message


@pytest.mark.parametrize(
    "init_from, expected",
    [
        ("hf_model_source('meta-llama/Llama-3.2-1B')",
         "hf_model_source(): `revision`: required for the hub model 'meta-llama/Llama-3.2-1B'"),
        ("hf_model_source('llama', revision='main')",
         "hf_model_source(): `model`: 'llama' is neither a hub model id (`org/name`) nor an "
         "absolute path"),
        ("hf_model_source('/models/llama', revision='main')",
         "hf_model_source(): `revision`: a local folder has no revision; remove it"),
        ("hf_model_source('org/m', revision='../x')",
         "hf_model_source(): `revision`: '../x' is not a hub revision"),
        ("'org/m'", "init_from"),
    ],
)  # fmt: skip
def test_init_from_names_a_hub_model_at_a_revision(
    rule_runner: RuleRunner, init_from: str, expected: str
) -> None:
    message = load_error(rule_runner, checkpoint(init_from=init_from))
    assert expected in message and "exp/BUILD" in message


def test_eval_suite_task_files_must_be_an_address(rule_runner: RuleRunner) -> None:
    message = load_error(
        rule_runner, checkpoint(evals="eval_suite(['t'], every=5, task_files='tasks/')")
    )
    assert "eval_suite(): `task_files` must be the address of a files target" in message


def test_adam_rejects_bad_schedule(rule_runner: RuleRunner) -> None:
    fraction = load_error(rule_runner, checkpoint(optimizer="adam(warmup=2.5)"))
    assert "adam(): `warmup`: 2.5 is neither a fraction of the run (<= 1) nor a whole" in fraction
    message = load_error(rule_runner, checkpoint(optimizer="adam(lr_schedule='cosin')"))
    assert (
        "adam(): `lr_schedule`: expected one of cosine, linear, constant, inv_sqrt, got 'cosin'"
        in message
    )


def test_cache_needs_exactly_one_source(rule_runner: RuleRunner) -> None:
    build = 'tokenized_cache(name="c", tokenizer="package:gpt2", version="dev")'
    assert "needs exactly one of `source`" in load_error(rule_runner, build, name="c")


@pytest.mark.parametrize("field", ["text_key", "split", "revision", "subset"])
def test_an_empty_name_is_refused_when_the_target_loads(rule_runner: RuleRunner, field: str) -> None:
    fields = {"source": '"org/data"', "revision": '"abc1234"', "tokenizer": '"package:gpt2"',
              "version": '"dev"', field: '""'}  # fmt: skip
    build = f'tokenized_cache(name="c", {", ".join(f"{k}={v}" for k, v in fields.items())})'
    message = load_error(rule_runner, build, name="c")
    assert f"The `{field}` field in target exp:c expects a non-empty string, got ''." in message


def test_a_helper_error_names_the_target_that_uses_it(rule_runner: RuleRunner) -> None:
    """A helper's value shared by two targets: each names itself, the field and the line."""
    model = (
        "llama(max_seq_len=256, hidden_dim=64, intermediate_dim=128, num_heads=4, "
        "num_kv_heads=3, num_layers=2)"
    )
    build = f"MODEL = {model}\n" + checkpoint(model="MODEL")
    message = load_error(rule_runner, build)
    assert (
        "The `model` field in target exp:ckpt (exp/BUILD:1): llama(): `num_heads`: 4 is not a "
        "multiple of num_kv_heads (3)" in message
    )


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


def test_a_bad_eval_name_fails_at_load(rule_runner: RuleRunner) -> None:
    build = CACHE.replace('version="2026.06.28")', 'version="2026.06.28", eval_name="paloma/")')
    assert "The `eval_name` field in target exp:cache expects a name of" in load_error(
        rule_runner, build, "cache"
    )


def test_a_levanter_cache_source_is_checked_at_load_and_identified_by_location(
    rule_runner: RuleRunner,
) -> None:
    build = 'tokenized_cache(name="c", source=levanter_cache(LOCATION), tokenizer="package:gpt2", version="dev")'
    message = load_error(rule_runner, build.replace("LOCATION", "'tokenized/dclm'"), name="c")
    assert "levanter_cache(): `location`: expected an absolute path, s3://BUCKET/PATH" in message
    assert "exp/BUILD" in message
    fingerprints = []
    for location in ("s3://bucket/tokenized/dclm/train", "s3://bucket/tokenized/dclm/validation"):
        rule_runner.write_files({"exp/BUILD": build.replace("LOCATION", repr(location))})
        address = Address("exp", target_name="c")
        graph = rule_runner.request(ArtifactGraph, [ArtifactGraphRequest(Addresses([address]))])
        identity = graph.get(address).identity
        assert identity["source"] == {"kind": "levanter_cache", "location": location}
        fingerprints.append(graph.get(address).fingerprint)
    assert fingerprints[0] != fingerprints[1]
    imported = build.replace("LOCATION", "'/data/dclm/train'")
    message = load_error(rule_runner, imported[:-1] + ", num_shards=4, revision='main')", name="c")
    assert "imports a Levanter cache, which is used as it is: remove `revision`, `num_shards`" in message
    message = load_error(rule_runner, imported[:-1] + ", max_tokens=1000)", name="c")
    assert "used as it is: remove `max_tokens`" in message
    message = load_error(rule_runner, imported[:-1] + ", framing='levanter')", name="c")
    assert "used as it is: remove `framing`" in message


def test_framing_is_one_of_the_known_framings(rule_runner: RuleRunner) -> None:
    build = CACHE.replace('version="2026.06.28"', 'version="2026.06.28", framing="gpt"')
    message = load_error(rule_runner, build, name="cache")
    assert "framing" in message and "'levanter'" in message and "'marin'" in message


def test_max_tokens_must_be_positive(rule_runner: RuleRunner) -> None:
    build = CACHE.replace('version="2026.06.28"', 'version="2026.06.28", max_tokens=0')
    message = load_error(rule_runner, build, name="cache")
    assert "The `max_tokens` field in target exp:cache must be > 0, got 0" in message


def test_a_hub_source_needs_a_revision(rule_runner: RuleRunner) -> None:
    message = load_error(rule_runner, CACHE.replace('revision="abc1234", ', ""), name="cache")
    assert "exp:cache reads the Hugging Face dataset 'org/data' and needs a `revision`" in message


def test_an_empty_target_name_is_refused_where_a_given_one_is_kept(rule_runner: RuleRunner) -> None:
    """`name=""` would make Pants name the target after its directory (`exp:exp`)."""
    fields = 'source="stdlib:pydoc_topics", split="validation", tokenizer="package:gpt2", version="dev"'
    build = f'\ntokenized_cache(\n    name="",\n    {fields},\n)\n'
    message = load_error(rule_runner, build, name="exp")
    assert 'The `tokenized_cache` target at exp/BUILD:2 has `name=""`, which Pants replaces' in message
    # The value, however it is written: a variable, a macro's argument.
    through_a_variable = f'N = ""\ntokenized_cache(name=N, {fields})\n'
    message = load_error(rule_runner, through_a_variable, name="exp")
    assert 'The `tokenized_cache` target at exp/BUILD:2 has `name=""`' in message
    through_a_macro = f'def cache(n):\n    tokenized_cache(name=n, {fields})\n\ncache("")\n'
    message = load_error(rule_runner, through_a_macro, name="exp")
    assert 'The `tokenized_cache` target at exp/BUILD:2 has `name=""`' in message
    rule_runner.write_files({"exp/BUILD": f'tokenized_cache(name="exp", {fields})'})
    assert rule_runner.get_target(Address("exp")).address.target_name == "exp"
    named = f'def cache(n):\n    tokenized_cache(name=n, {fields})\n\ncache("exp")\n'
    rule_runner.write_files({"exp/BUILD": named})
    assert rule_runner.get_target(Address("exp")).address.target_name == "exp"


@pytest.mark.parametrize("name", [" ", " exp"])
def test_a_target_name_with_spaces_at_its_ends_is_refused(rule_runner: RuleRunner, name: str) -> None:
    build = checkpoint(artifact_name='"checkpoints/spaced"').replace("name='ckpt'", f"name={name!r}")
    message = load_error(rule_runner, build, name=name)
    assert f"has `name={name!r}`: give it a name without spaces at its ends" in message


def test_a_huge_value_is_echoed_by_its_start_and_length(rule_runner: RuleRunner) -> None:
    message = load_error(rule_runner, checkpoint(version=repr("x" * 10_000_000)))
    assert "got 'xxxx" in message and "... (10,000,002 characters)" in message
    assert "x" * 1000 not in message


def test_a_formats_own_fields_only_with_that_format(rule_runner: RuleRunner) -> None:
    template = 'chat_template="{% generation %}x{% endgeneration %}"'
    build = CACHE.replace('version="2026.06.28"', f'version="2026.06.28", {template}')
    assert "has a `chat_template` but format 'text'" in load_error(rule_runner, build, name="cache")
    framed = 'version="2026.06.28", format="chat", framing="levanter"'
    message = load_error(rule_runner, CACHE.replace('version="2026.06.28"', framed), name="cache")
    assert "format='chat', whose documents are framed by their format" in message
