"""The step spec the backend writes for a BUILD file, read back by the runtime's parser
(kiln_contract.step, the module kiln.runner parses step.json with)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from pants.engine.addresses import Address, Addresses
from pants.engine.internals.scheduler import ExecutionError
from pants.testutil.rule_runner import RuleRunner

from kiln_contract.llama import LlamaArchitecture
from kiln_contract.parsing import SpecError
from kiln_contract.step import Provenance, StepSpec
from kiln_contract.train import CheckpointerSpec, HfModelSource, Resources, TrainSpec, WandbSpec
from kiln_pants.artifact_graph import ArtifactGraph, ArtifactGraphRequest
from kiln_pants.train_rules import StepJson, StepJsonRequest

BUILD = """
tokenized_cache(name="train", sources=["train.jsonl"], tokenizer="package:gpt2",
                version="2026.06.28")
tokenized_cache(name="valid", source="stdlib:docstrings", split="validation",
                tokenizer="package:gpt2", version="2026.06.28", storage="store",
                eval_name="stdlib/docstrings")
lm_checkpoint(
    name="ckpt",
    version="2026.06.28",
    model=llama(max_seq_len=256, hidden_dim=64, intermediate_dim=128, num_heads=4,
                num_kv_heads=2, num_layers=2, rope_theta=10000),
    optimizer=adam(learning_rate=1e-3, warmup=10),
    datasets={":train": 1.0},
    validation=[":valid"],
    batch_size=8,
    seq_len=128,
    num_train_steps=100,
    z_loss_weight=1e-4,
    evals=eval_suite(["stdlib_mc", eval_task("copa", 2)], every=50, task_files=":tasks"),
    resources=gpu("H100", count=8, hosts=2),
    mesh={"data": 2, "fsdp": -1},
    gradient_checkpointing="full",
    tags=["DCLM_1B_1X", "baseline"],
    wandb={"project": "marin", "group": "dclm"},
    temporary_base_path="/scratch/kiln",
    checkpoint_every=40,
    checkpoint_interval_minutes=30,
    validate_at_start=True,
    init_from=hf_model_source("org/llama", revision="v1.0"),
)
files(name="tasks", sources=["tasks/*"])
"""
CHECKPOINT = Address("exp", target_name="ckpt")
PROVENANCE = Provenance(code_digest="c" * 64, lockfile_digest="l" * 64)


def test_a_step_from_a_build_file_parses_with_the_runtimes_parser(rule_runner: RuleRunner) -> None:
    rule_runner.write_files(
        {
            "exp/BUILD": BUILD,
            "exp/train.jsonl": '{"text": "hello world"}\n',
            "exp/tasks/stdlib_mc.yaml": "task: stdlib_mc\n",
        }
    )
    written = rule_runner.request(StepJson, [StepJsonRequest(CHECKPOINT, PROVENANCE)])
    raw = json.loads(written.content)
    step = StepSpec.from_json(raw)
    assert step.to_json() == raw  # nothing the backend writes is lost or added by the parser

    artifact = rule_runner.request(ArtifactGraph, [ArtifactGraphRequest(Addresses([CHECKPOINT]))])
    checkpoint = artifact.get(CHECKPOINT)
    assert (step.ref, step.fingerprint) == ("checkpoints/ckpt@2026.06.28", checkpoint.fingerprint)
    assert step.record.identity == checkpoint.identity
    assert step.config.model == LlamaArchitecture(256, 64, 128, 4, 2, 2, rope_theta=10000)
    assert step.config.model.to_json() == checkpoint.identity["model"]  # same literals: 10000
    assert (step.config.optimizer.learning_rate, step.config.optimizer.warmup) == (1e-3, 10)
    assert [(d.ref, d.weight) for d in step.config.datasets] == [("tokenized/train@2026.06.28", 1.0)]
    assert [d.ref for d in step.config.validation] == ["tokenized/valid@2026.06.28"]
    assert step.config.evals is not None
    assert [t.label for t in step.config.evals.tasks] == ["stdlib_mc", "copa"]
    assert step.config.evals.task_paths == ("exp/tasks",)
    assert step.config.init_from == HfModelSource("org/llama", revision="v1.0")
    assert step.runtime.resources == Resources("gpu", "H100", 8, hosts=2)
    assert step.runtime.mesh == {"data": 2, "fsdp": -1, "tensor": 1}
    assert step.runtime.gradient_checkpointing == "full"
    assert step.provenance == PROVENANCE
    # Run-time choices from the target, then [kiln] options, then Kiln's defaults.
    assert step.runtime.wandb == WandbSpec(
        project="marin", group="dclm", tags=("DCLM_1B_1X", "baseline")
    )  # the rest: WANDB_* variables when the run starts, else Kiln's defaults
    assert step.runtime.checkpointer == CheckpointerSpec(30, 2, 40, Path("/scratch/kiln"))
    assert step.runtime.validation_names == {"tokenized/valid": "stdlib/docstrings"}
    assert step.runtime.validate_at_start is True
    assert step.runtime.max_eval_batches == 12  # Kiln's default, whatever the run's length

    inline, store = step.inputs
    assert (inline.location, inline.store_path) == ("inputs/tokenized/train/2026.06.28", None)
    assert store.store_path == f"{rule_runner.build_root}/artifacts/tokenized/valid/2026.06.28"

    paths = {i.ref: Path("/store") / i.name for i in step.inputs}
    spec = step.train_spec(Path("/out/ckpt"), paths, Path("/inputs"))
    assert spec.config.datasets[0].path == Path("/store/tokenized/train")
    assert spec.config.evals is not None and spec.config.evals.task_paths == ("/inputs/exp/tasks",)
    assert TrainSpec.from_json(spec.to_json()) == spec


def test_a_store_cache_under_a_bucket_prefix_is_named_by_its_url(rule_runner: RuleRunner) -> None:
    rule_runner.set_options(["--kiln-prefix=s3://kiln-bucket/artifacts"])
    rule_runner.write_files(
        {
            "exp/BUILD": BUILD,
            "exp/train.jsonl": '{"text": "hello world"}\n',
            "exp/tasks/stdlib_mc.yaml": "task: stdlib_mc\n",
        }
    )
    written = rule_runner.request(StepJson, [StepJsonRequest(CHECKPOINT, PROVENANCE)])
    _, store = StepSpec.from_json(json.loads(written.content)).inputs
    assert store.store_path == "s3://kiln-bucket/artifacts/tokenized/valid/2026.06.28"


STEP = {
    "step_version": 1,
    "kind": "lm_checkpoint",
    "name": "checkpoints/x",
    "version": "dev",
    "fingerprint": "f" * 16,
    "record": {
        "record_version": 1,
        "kind": "lm_checkpoint",
        "name": "checkpoints/x",
        "version": "dev",
        "fingerprint": "f" * 16,
        "identity": {},
        "inputs": [],
    },
    "config": {
        "model": {"max_seq_len": 64, "hidden_dim": 64, "intermediate_dim": 128, "num_heads": 4,
                  "num_kv_heads": 2, "num_layers": 2},
        "optimizer": {"warmup": 3},
        "datasets": [{"name": "tokenized/a", "version": "dev", "fingerprint": "a", "weight": 1}],
        "validation": [],
        "batch_size": 8, "seq_len": 64, "num_train_steps": 10, "z_loss_weight": None,
        "evals": None, "seed": 0, "compute_dtype": "float32", "param_dtype": "float32",
    },
    "runtime": {
        "resources": {"kind": "cpu"}, "mesh": {}, "attention": "auto",
        "gradient_checkpointing": "none", "per_device_parallelism": None,
        "validation_every": 5, "max_eval_batches": 2,
        "checkpointer": {"save_interval_minutes": 1, "keep_last_temporary": 2, "every": None,
                         "temporary_base_path": None},
        "wandb": {"mode": "disabled", "project": "kiln", "entity": None, "run_id": None},
        "control": {"enabled": False, "host": "127.0.0.1", "port": 0, "token_ttl_minutes": 1},
        "progress": "log", "max_steps_this_run": None,
    },
    "inputs": [{"ref": "tokenized/a@dev", "name": "tokenized/a", "version": "dev",
                "record": {"record_version": 1, "kind": "tokenized_cache", "name": "tokenized/a",
                           "version": "dev", "fingerprint": "a", "identity": {}},
                "location": "inputs/tokenized/a/dev"}],
    "provenance": {"code_digest": "c", "lockfile_digest": "l"},
}  # fmt: skip


def test_a_minimal_step_parses_with_defaults() -> None:
    step = StepSpec.from_json(STEP)
    assert step.config.model.rope_theta == 500000.0 and step.config.optimizer.warmup == 3
    assert step.runtime.mesh == {"data": 1, "fsdp": 1, "tensor": 1}
    assert StepSpec.from_json(step.to_json()) == step


@pytest.mark.parametrize(
    "path, value, message",
    [
        (("step_version",), 0, "step_version: expected 1, got 0; build the step with a matching"),
        (("kind",), "tokenized_cache", "kind: expected 'lm_checkpoint'"),
        (("config", "optimizer", "warmup"), -1, "config.optimizer.warmup: expected a number >= 0"),
        (("config", "model", "num_heads"), 3, "config.model.hidden_dim: 64 is not divisible by"),
        (("config", "seq_len"), 65, "config.seq_len: 65 exceeds model.max_seq_len 64"),
        (("runtime", "mesh", "data"), 0, "runtime.mesh.data: expected a positive integer or -1"),
        (("runtime", "attention"), "flash", "runtime.attention: expected one of auto, xla,"),
        (("runtime", "speed"), "fast", "runtime: unknown field(s) speed"),
        (("inputs", 0, "location"), None, "inputs[0]: expected exactly one of location and"),
        (("config", "datasets", 0, "name"), "tokenized/b", "config.datasets[0]: tokenized/b@dev is"),
        (("record", "record_version"), 2, "record.record_version: expected 1, got 2"),
        # Containment: names, versions and locations cannot leave their folders.
        (("name",), "../../etc", "name: must be `/`-separated parts of ASCII letters"),
        (("version",), "../x-dev", "version: must be a calendar version like 2026.06.28"),
        (("record", "name"), "/abs", "record.name: must be `/`-separated parts"),
        (("config", "datasets", 0, "version"), "a/b-dev", "config.datasets[0].version: must be"),
        (("inputs", 0, "name"), "tokenized/../../x", "inputs[0].name: must be `/`-separated"),
        (("inputs", 0, "ref"), "tokenized/b@dev", "inputs[0].ref: expected tokenized/a@dev"),
        (("inputs", 0, "location"), "../../etc", "inputs[0].location: expected a relative path"),
        (("inputs", 0, "location"), "/etc", "inputs[0].location: expected a relative path"),
        # Out of range, and checked where the schema is, for both halves.
        (("config", "seed"), 2**32, "config.seed: expected an integer from 0 to 2**32 - 1"),
        (("config", "optimizer", "warmup"), 11, "config.optimizer.warmup: 11 is 11 steps, more"),
        (("runtime", "control", "token_ttl_minutes"), 0, "token_ttl_minutes: expected a number > 0"),
        (("runtime", "control", "token_ttl_minutes"), 10081, "expected a number > 0 and <= 10080"),
        (("runtime", "checkpointer", "save_interval_minutes"), float("nan"), "got nan"),
        (("config", "datasets", 0, "weight"), float("inf"), "weight: expected a number >= 0, got inf"),
    ],
)
def test_a_bad_step_names_the_field(path: tuple, value: object, message: str) -> None:
    step = copy.deepcopy(STEP)
    *parents, key = path
    target: dict = step
    for parent in parents:
        target = target[parent]
    target[key] = value
    with pytest.raises(SpecError) as error:
        StepSpec.from_json(step)
    assert message in str(error.value)


def test_run_time_settings_change_no_fingerprint(rule_runner: RuleRunner) -> None:
    plain = BUILD.replace('    wandb={"project": "marin", "group": "dclm"},\n', "")
    plain = plain.replace('    validate_at_start=True,\n', "").replace(
        ',\n                eval_name="stdlib/docstrings"', ""
    )
    fingerprints = []
    for build in (BUILD, plain):
        rule_runner.write_files({"exp/BUILD": build, "exp/train.jsonl": "{}\n", "exp/tasks/a.yaml": ""})
        graph = rule_runner.request(ArtifactGraph, [ArtifactGraphRequest(Addresses([CHECKPOINT]))])
        fingerprints.append(graph.get(CHECKPOINT).fingerprint)
    assert fingerprints[0] == fingerprints[1]


def test_kiln_options_are_the_wandb_defaults(rule_runner: RuleRunner) -> None:
    rule_runner.write_files(
        {"exp/BUILD": BUILD.replace('"group": "dclm"', '"mode": "online"'),
         "exp/train.jsonl": "{}\n", "exp/tasks/a.yaml": ""}
    )  # fmt: skip
    rule_runner.set_options(["--kiln-wandb-entity=lab", "--kiln-wandb-mode=disabled"])
    step = StepSpec.from_json(
        json.loads(rule_runner.request(StepJson, [StepJsonRequest(CHECKPOINT, PROVENANCE)]).content)
    )
    wandb = step.runtime.wandb
    assert (wandb.project, wandb.entity, wandb.mode, wandb.group) == ("marin", "lab", "online", None)


def test_clashing_eval_names_are_refused_naming_the_checkpoint(rule_runner: RuleRunner) -> None:
    build = BUILD.replace('eval_name="stdlib/docstrings"', 'eval_name="stdlib"').replace(
        'validation=[":valid"]', 'validation=[":valid", ":more"]'
    )
    build += (
        'tokenized_cache(name="more", source="stdlib:pydoc_topics", split="validation", '
        'tokenizer="package:gpt2", version="2026.06.28", eval_name="stdlib/pydoc_topics")\n'
    )
    rule_runner.write_files({"exp/BUILD": build, "exp/train.jsonl": "{}\n", "exp/tasks/a.yaml": ""})
    with pytest.raises(ExecutionError) as error:
        rule_runner.request(StepJson, [StepJsonRequest(CHECKPOINT, PROVENANCE)])
    assert (
        "The validation caches of exp:ckpt have `eval_name`s that clash: stdlib name(s) a "
        "validation set and a group of others; rename one."
    ) in str(error.value)
