"""The `hf_model` target: its fields, its fingerprint (derived from its checkpoint's), its inferred
dependency, its place in `plan`, and the one-line refusal when the checkpoint is not built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kiln_reading import read_target
from pants.engine.addresses import Address, Addresses
from pants.engine.internals.scheduler import ExecutionError
from pants.engine.target import Dependencies, DependenciesRequest
from pants.testutil.rule_runner import RuleRunner

from kiln_pants.artifact_graph import ArtifactGraph, ArtifactGraphRequest
from kiln_pants.hf_model_rules import StoredCheckpoint, StoredCheckpointRequest
from kiln_pants.plan import Plan

CHECKPOINT = """
tokenized_cache(name="train", source="org/data", revision="abc1234", tokenizer="package:gpt2", version="2026.06.28")
lm_checkpoint(
    name="ckpt",
    version=CKPT_VERSION,
    model=llama(max_seq_len=256, hidden_dim=64, intermediate_dim=128, num_heads=4,
                num_kv_heads=2, num_layers=2),
    optimizer=adam(learning_rate=1e-3, warmup=10),
    datasets={":train": 1.0},
    validation=[],
    batch_size=8,
    seq_len=128,
    num_train_steps=NUM_TRAIN_STEPS,
    z_loss_weight=None,
    evals=None,
    resources=cpu(),
)
"""


def build(
    hf_fields: str = "",
    num_train_steps: int = 100,
    ckpt_version: str = "2026.06.28",
    version: str = "2026.06.28",
) -> str:
    checkpoint = CHECKPOINT.replace("NUM_TRAIN_STEPS", str(num_train_steps)).replace(
        "CKPT_VERSION", repr(ckpt_version)
    )
    return checkpoint + (
        f'hf_model(name="hf", checkpoint=":ckpt", version={version!r}{hf_fields})\n'
    )


def hf_graph(rule_runner: RuleRunner, build_file: str) -> ArtifactGraph:
    rule_runner.write_files({"exp/BUILD": build_file})
    return rule_runner.request(
        ArtifactGraph, [ArtifactGraphRequest(Addresses([Address("exp", target_name="hf")]))]
    )


def hf_artifact(rule_runner: RuleRunner, build_file: str):
    return hf_graph(rule_runner, build_file).get(Address("exp", target_name="hf"))


def test_defaults_name_and_identity(rule_runner: RuleRunner) -> None:
    graph = hf_graph(rule_runner, build())
    assert [a.kind for a in graph] == ["tokenized_cache", "lm_checkpoint", "hf_model"]
    checkpoint, export = graph[1], graph[2]
    assert export.name == "hf/hf" and export.version == "2026.06.28"
    assert export.inputs == (checkpoint.address,)
    assert export.identity == {
        "kind": "hf_model",
        "format": 1,
        "checkpoint": {
            "input": "checkpoints/ckpt@2026.06.28",
            "fingerprint": checkpoint.fingerprint,
        },
        "step": "last",
        "dtype": "bfloat16",
    }


def test_fingerprint_follows_the_checkpoint_step_and_dtype_only(rule_runner: RuleRunner) -> None:
    base = hf_artifact(rule_runner, build()).fingerprint
    assert hf_artifact(rule_runner, build()).fingerprint == base
    changed = {
        "checkpoint": hf_artifact(rule_runner, build(num_train_steps=200)).fingerprint,
        "step": hf_artifact(rule_runner, build(", step=50")).fingerprint,
        "dtype": hf_artifact(rule_runner, build(', dtype="float32"')).fingerprint,
    }
    assert base not in changed.values() and len(set(changed.values())) == 3
    # Where it lands is not what it is.
    named = hf_artifact(rule_runner, build(', artifact_name="hf/other"'))
    assert named.fingerprint == base and named.name == "hf/other"


def test_the_checkpoint_is_an_inferred_dependency(rule_runner: RuleRunner) -> None:
    rule_runner.write_files({"exp/BUILD": build()})
    target = rule_runner.get_target(Address("exp", target_name="hf"))
    deps = rule_runner.request(Addresses, [DependenciesRequest(target[Dependencies])])
    assert [a.target_name for a in deps] == ["ckpt"]


@pytest.mark.parametrize(
    "fields, expected",
    [
        (', step="first"', "The `step` field in target exp:hf must be `last` or a step number"),
        (", step=-1", "must be `last` or a step number >= 0; got -1"),
        (', dtype="float16"', "dtype"),
        (', artifact_name="/abs"', "The `artifact_name` field in target exp:hf "),
    ],
)
def test_bad_fields_are_refused_at_load(
    rule_runner: RuleRunner, fields: str, expected: str
) -> None:
    rule_runner.write_files({"exp/BUILD": build(fields)})
    with pytest.raises(ExecutionError) as error:
        read_target(rule_runner, Address("exp", target_name="hf"))
    assert expected in str(error.value)


def test_a_checkpoint_field_naming_a_cache_is_refused(rule_runner: RuleRunner) -> None:
    rule_runner.write_files(
        {"exp/BUILD": build().replace('checkpoint=":ckpt"', 'checkpoint=":train"')}
    )
    target = rule_runner.get_target(Address("exp", target_name="hf"))
    with pytest.raises(ExecutionError) as error:
        rule_runner.request(Addresses, [DependenciesRequest(target[Dependencies])])
    assert (
        "The `checkpoint` field in target exp:hf refers to exp:train, a `tokenized_cache` "
        "target; it must be an `lm_checkpoint`."
    ) in str(error.value)


def test_a_fixed_version_may_not_export_a_dev_checkpoint(rule_runner: RuleRunner) -> None:
    with pytest.raises(ExecutionError) as error:
        hf_graph(rule_runner, build(ckpt_version="dev"))
    assert "The `hf_model` exp:hf has the fixed version '2026.06.28'" in str(error.value)
    assert hf_artifact(rule_runner, build(ckpt_version="dev", version="dev")).mutable


def write_record(folder: Path, fingerprint: str, identity: dict, status: str = "SUCCESS") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "artifact.json").write_text(
        json.dumps({"fingerprint": fingerprint, "identity": identity})
    )
    (folder / "STATUS").write_text(status + "\n")


def test_plan_shows_the_export_after_its_checkpoint(
    plan_rule_runner: RuleRunner, tmp_path: Path
) -> None:
    rule_runner = plan_rule_runner
    export = hf_artifact(rule_runner, build())
    args = [f"--kiln-prefix={tmp_path}", "exp:hf"]
    result = rule_runner.run_goal_rule(Plan, args=args)
    lines = result.stdout.splitlines()
    assert "3 artifacts: 1 inline, 2 would run" in result.stdout
    assert any("hf_model" in line and "hf/hf@2026.06.28" in line for line in lines)
    assert f"{tmp_path}/hf/hf/2026.06.28" in result.stdout

    write_record(tmp_path / "hf/hf/2026.06.28", export.fingerprint, export.identity)
    assert "1 built, 1 inline, 1 would run" in rule_runner.run_goal_rule(Plan, args=args).stdout
    write_record(tmp_path / "hf/hf/2026.06.28", "0" * 16, {**export.identity, "dtype": "float32"})
    drift = rule_runner.run_goal_rule(Plan, args=args)
    assert drift.exit_code == 1 and "differs in: dtype" in drift.stdout


def probe(rule_runner: RuleRunner, checkpoint, folder: Path) -> StoredCheckpoint:
    """What `package` checks before it builds anything: the checkpoint's folder in the store,
    read afresh in every Pants session (each command is one)."""
    rule_runner.set_options([])  # a new session
    prefix = str(folder).removesuffix(f"/{checkpoint.name}/{checkpoint.version}")
    request = StoredCheckpointRequest(Address("exp", target_name="hf"), checkpoint, prefix)
    return rule_runner.request(StoredCheckpoint, [request])


def probe_error(rule_runner: RuleRunner, checkpoint, folder: Path) -> str:
    with pytest.raises(ExecutionError) as error:
        probe(rule_runner, checkpoint, folder)
    return str(error.value)


def test_packaging_before_the_checkpoint_is_built_names_the_command(
    plan_rule_runner: RuleRunner, tmp_path: Path
) -> None:
    rule_runner = plan_rule_runner  # the checkpoint may be in a bucket: read through a PEX
    graph = hf_graph(rule_runner, build())
    checkpoint = graph.get(Address("exp", target_name="ckpt"))
    folder = tmp_path / "checkpoints/ckpt/2026.06.28"
    assert (
        f"exp:hf exports exp:ckpt (checkpoints/ckpt@2026.06.28), which is not built in the "
        f"artifact store ({folder}: would run): build it with `./pants run exp:ckpt`, then "
        "package again."
    ) in probe_error(rule_runner, checkpoint, folder)

    write_record(folder, checkpoint.fingerprint, checkpoint.identity, status="RUNNING")
    assert f"({folder}: incomplete (will resume)): build it with `./pants run exp:ckpt`" in probe_error(
        rule_runner, checkpoint, folder
    )
    write_record(folder, "0" * 16, {**checkpoint.identity, "batch_size": 4})
    assert (
        "holds another configuration of checkpoints/ckpt@2026.06.28 (built with fingerprint "
        "0000000000000000; differs in: batch_size): bump the checkpoint's `version`"
    ) in probe_error(rule_runner, checkpoint, folder)
    write_record(folder, checkpoint.fingerprint, checkpoint.identity)
    assert probe(rule_runner, checkpoint, folder).path == str(folder)
