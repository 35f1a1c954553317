"""Runs that start from runs: `init_from=":parent"` / `from_checkpoint(":parent", step=N)` is a
real dependency whose fingerprint is part of the child's, checked against the child's `model`
before anything is built, and carried to the runtime in the step spec."""

from __future__ import annotations

import json

import pytest
from kiln_reading import read_target
from pants.base.specs import DirLiteralSpec, RawSpecs
from pants.engine.addresses import Address, Addresses
from pants.engine.internals.scheduler import ExecutionError
from pants.engine.target import Dependencies, DependenciesRequest, Targets
from pants.testutil.rule_runner import RuleRunner

from kiln_contract.step import Provenance, StepSpec
from kiln_contract.train import ParentRun
from kiln_pants.artifact_graph import Artifact, ArtifactGraph, ArtifactGraphRequest
from kiln_pants.plan import Plan
from kiln_pants.train_rules import StepJson, StepJsonRequest

MODEL = "llama(max_seq_len=128, hidden_dim=64, intermediate_dim=128, num_heads=4, num_kv_heads=2, num_layers=2)"
RUN = """
lm_checkpoint(
    name="{name}",
    version="2026.12.02",
    model={model},
    optimizer=adam(learning_rate={lr}, warmup=2),
    datasets={datasets},
    validation=[],
    batch_size=8,
    seq_len=64,
    num_train_steps=100,
    z_loss_weight=None,
    evals=None,
    resources=cpu(),
    {extra}
)
"""
CACHE = """
tokenized_cache(name="train", sources=["train.jsonl"], tokenizer="package:gpt2",
                version="2026.12.02")
hf_model(name="base_hf", version="2026.12.02", checkpoint=":base")
files(name="notes", sources=["train.jsonl"])
"""
TRAIN = '{":train": 1.0}'
TEXT = '{"text": "%s"}\n' % ("hi there " * 8)  # 84 bytes: more than one window of 64 tokens
BASE, COOLDOWN = Address("exp", target_name="base"), Address("exp", target_name="cooldown")


def build_file(child_init: str, *, base_lr: str = "3e-3", child_model: str = MODEL) -> str:
    base = RUN.format(name="base", model=MODEL, lr=base_lr, datasets=TRAIN,
                      extra="checkpoint_every=40,")  # fmt: skip
    child = RUN.format(name="cooldown", model=child_model, lr="1e-3", datasets=TRAIN,
                       extra=f"init_from={child_init},")  # fmt: skip
    return CACHE + base + child


def graph(rule_runner: RuleRunner, build: str) -> ArtifactGraph:
    rule_runner.write_files({"exp/BUILD": build, "exp/train.jsonl": TEXT})
    return rule_runner.request(ArtifactGraph, [ArtifactGraphRequest(Addresses([COOLDOWN]))])


def test_the_parent_is_a_dependency_built_first_and_part_of_the_identity(
    rule_runner: RuleRunner,
) -> None:
    g = graph(rule_runner, build_file('":base"'))
    assert [a.address.target_name for a in g] == ["train", "base", "cooldown"]
    base, child = g.get(BASE), g.get(COOLDOWN)
    assert child.parent == BASE and child.cache_inputs == (Address("exp", target_name="train"),)
    # By default a run carries its parent's optimizer state and continues its data stream.
    assert child.identity["init_from"] == {
        "kind": "lm_checkpoint", "name": "checkpoints/base", "version": "2026.12.02",
        "fingerprint": base.fingerprint, "optimizer_state": True, "data_continues": True,
    }  # fmt: skip
    target = rule_runner.get_target(COOLDOWN)
    deps = rule_runner.request(Addresses, [DependenciesRequest(target[Dependencies])])
    assert {a.target_name for a in deps} == {"train", "base"}

    # A changed parent changes the child: `plan` then says it would run.
    changed = graph(rule_runner, build_file('":base"', base_lr="1e-2"))
    assert changed.get(BASE).fingerprint != base.fingerprint
    assert changed.get(COOLDOWN).fingerprint != child.fingerprint
    at_step = graph(rule_runner, build_file('from_checkpoint(":base", step=40)'))
    assert at_step.get(COOLDOWN).identity["init_from"]["step"] == 40
    assert at_step.get(COOLDOWN).fingerprint != child.fingerprint
    # Weights alone, data afresh: each choice is identity.
    alone = graph(rule_runner, build_file(
        'from_checkpoint(":base", optimizer_state=False, reset_data_loader_on_init=True)'))
    assert alone.get(COOLDOWN).identity["init_from"] == {
        "kind": "lm_checkpoint", "name": "checkpoints/base", "version": "2026.12.02",
        "fingerprint": base.fingerprint,
    }  # fmt: skip


def test_an_export_is_a_parent_too(rule_runner: RuleRunner) -> None:
    g = graph(rule_runner, build_file('":base_hf"'))
    assert [a.address.target_name for a in g] == ["train", "base", "base_hf", "cooldown"]
    assert g.get(COOLDOWN).identity["init_from"] == {  # weights alone: an export holds no more
        "kind": "hf_model", "name": "hf/base_hf", "version": "2026.12.02",
        "fingerprint": g.get(Address("exp", target_name="base_hf")).fingerprint,
    }  # fmt: skip
    with pytest.raises(ExecutionError, match=r"gives a step, optimizer_state or reset_data_"):
        graph(rule_runner, build_file('from_checkpoint(":base_hf", step=3)'))


@pytest.mark.parametrize("step", [500, 50, 0])
def test_a_step_the_parent_does_not_keep_is_refused_in_the_graph(
    rule_runner: RuleRunner, step: int
) -> None:
    """The base saves every 40 steps (its checkpoint_every) and its last, 100."""
    with pytest.raises(ExecutionError, match=rf"names step {step} of exp:base, which it does not "
                       r"keep: it saves every 40 steps and its last, 100"):  # fmt: skip
        graph(rule_runner, build_file(f'from_checkpoint(":base", step={step})'))
    for kept in (40, 80, 100):
        graph(rule_runner, build_file(f'from_checkpoint(":base", step={kept})'))


def test_a_child_continuing_its_parents_data_reads_kilns_order(rule_runner: RuleRunner) -> None:
    levanter = 'from_checkpoint(":base"), data_order="levanter"'
    with pytest.raises(ExecutionError, match=r"a run continuing exp:base's data stream reads"):
        graph(rule_runner, build_file(levanter))
    afresh = 'from_checkpoint(":base", reset_data_loader_on_init=True), data_order="levanter"'
    assert graph(rule_runner, build_file(afresh)).get(COOLDOWN).identity["data_order"] == "levanter"


@pytest.mark.parametrize(
    ("init_from", "message"),
    [
        ('":notes"', r"refers to exp:notes, which is neither an `lm_checkpoint` nor an `hf_model`"),
        ('":train"', r"refers to exp:train, which is neither an `lm_checkpoint` nor an `hf_model`"),
        ('from_checkpoint("base")', r"from_checkpoint\(\): the run to start from is the address"),
    ],
)
def test_a_parent_of_the_wrong_kind_is_refused(
    rule_runner: RuleRunner, init_from: str, message: str
) -> None:
    with pytest.raises(ExecutionError, match=message):
        graph(rule_runner, build_file(init_from))


def test_a_child_of_another_architecture_is_refused_before_anything_runs(
    rule_runner: RuleRunner,
) -> None:
    wider = MODEL.replace("hidden_dim=64", "hidden_dim=128").replace("max_seq_len=128", "max_seq_len=256")
    with pytest.raises(ExecutionError) as error:
        graph(rule_runner, build_file('":base"', child_model=wider))
    message = str(error.value)
    assert "The `init_from` field in target exp:cooldown names exp:base" in message
    assert "hidden_dim: model=128, weights=64" in message
    assert "max_seq_len" not in message  # a longer context is the same weights


def test_the_step_names_the_parent_for_the_runtime(rule_runner: RuleRunner) -> None:
    g = graph(rule_runner, build_file('from_checkpoint(":base", step=40, optimizer_state=True)'))
    provenance = Provenance(code_digest="c" * 64, lockfile_digest="l" * 64)
    written = rule_runner.request(StepJson, [StepJsonRequest(COOLDOWN, provenance)])
    step = StepSpec.from_json(json.loads(written.content))
    assert step.config.init_from == ParentRun(
        "lm_checkpoint", "checkpoints/base", "2026.12.02", g.get(BASE).fingerprint,
        step=40, optimizer_state=True, data_continues=True,
    )  # fmt: skip
    assert [i.ref for i in step.inputs] == ["tokenized/train@2026.12.02"]  # caches only
    assert [i.ref for i in step.record.inputs] == [
        "tokenized/train@2026.12.02", "checkpoints/base@2026.12.02"
    ]
    # The child validates first, where its parent's weights stand, on its parent's windows.
    parent = StepSpec.from_json(json.loads(
        rule_runner.request(StepJson, [StepJsonRequest(BASE, provenance)]).content))  # fmt: skip
    assert (step.runtime.validate_at_start, parent.runtime.validate_at_start) == (True, False)
    assert step.runtime.max_eval_batches == parent.runtime.max_eval_batches == 12


def test_plan_checks_a_local_folder_against_the_model(plan_rule_runner: RuleRunner, tmp_path) -> None:
    folder = tmp_path / "llama"
    folder.mkdir()
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 50257,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 500000.0}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    build = build_file(f'hf_model_source("{folder}")')
    graph(plan_rule_runner, build)
    args = [f"--kiln-prefix={tmp_path / 'store'}", "exp:cooldown"]
    result = plan_rule_runner.run_goal_rule(Plan, args=args)
    assert result.exit_code == 1
    assert (
        f"!! The `init_from` field in target exp:cooldown: {folder} is not the architecture "
        "`model` declares (num_layers: model=2, weights=3): make `model=llama(...)` match"
    ) in result.stdout

    (folder / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    biased = plan_rule_runner.run_goal_rule(Plan, args=args)
    assert biased.exit_code == 1
    assert "is not a plain Llama that Kiln computes: attention_bias=true" in biased.stdout

    (folder / "config.json").unlink()
    (folder / "artifact.json").write_text(
        json.dumps({"kind": "lm_checkpoint", "name": "checkpoints/base", "version": "2026.12.02"})
    )
    run_folder = plan_rule_runner.run_goal_rule(Plan, args=args)
    assert "is a Kiln lm_checkpoint's folder (checkpoints/base@2026.12.02)" in run_folder.stdout


STAGES = '[(0, {":train": 1.0}), (60, {":train": 0.5, ":hq": 0.5})]'
HQ = """
tokenized_cache(name="hq", sources=["train.jsonl"], tokenizer="package:gpt2",
                version="2026.12.03")
"""


def staged(datasets: str = STAGES) -> str:
    return CACHE + HQ + RUN.format(name="staged", model=MODEL, lr="1e-3", datasets=datasets,
                                   extra="")  # fmt: skip


STAGED_RUN = Address("exp", target_name="staged")


def test_a_mixture_with_stages_is_identity_and_reaches_the_step(
    rule_runner: RuleRunner,
) -> None:
    rule_runner.write_files({"exp/BUILD": staged(), "exp/train.jsonl": TEXT})
    g = rule_runner.request(ArtifactGraph, [ArtifactGraphRequest(Addresses([STAGED_RUN]))])
    identity = g.get(STAGED_RUN).identity
    refs = {"train": "tokenized/train@2026.12.02", "hq": "tokenized/hq@2026.12.03"}
    assert [(d["input"], d["weight"]) for d in identity["datasets"]] == [
        (refs["hq"], 0.0), (refs["train"], 1.0)
    ]  # every cache a stage reads; stage 0's weights
    assert [(s["start_step"], [(d["input"], d["weight"]) for d in s["datasets"]])
            for s in identity["stages"]] == [(60, [(refs["hq"], 0.5), (refs["train"], 0.5)])]  # fmt: skip
    provenance = Provenance(code_digest="c" * 64, lockfile_digest="l" * 64)
    written = rule_runner.request(StepJson, [StepJsonRequest(STAGED_RUN, provenance)])
    config = StepSpec.from_json(json.loads(written.content)).config
    assert [(d.name, d.weight) for d in config.datasets] == [("tokenized/train", 1.0),
                                                             ("tokenized/hq", 0.0)]  # fmt: skip
    assert [(s.start_step, s.weights) for s in config.stages] == [(60, (0.5, 0.5))]


@pytest.mark.parametrize(
    ("datasets", "message"),
    [
        ('[(5, {":train": 1.0})]', r"stages starting at steps \[5\]: the first starts at 0"),
        ('[(0, {":train": 1.0}), (0, {":train": 2.0})]', r"the others at increasing whole steps"),
        ('[(0, {":train": 1.0}), (50, {":train": 0})]', r"gives ':train' the weight 0"),
        ('[(0, {":train": 1.0}), (200, {":train": 2.0})]', r"a stage starts at step 200, at or after"),
    ],
)
def test_bad_stages_are_refused_naming_the_target(
    rule_runner: RuleRunner, datasets: str, message: str
) -> None:
    rule_runner.write_files({"exp/BUILD": staged(datasets), "exp/train.jsonl": TEXT})
    with pytest.raises(ExecutionError, match=message):
        rule_runner.request(StepJson, [StepJsonRequest(
            STAGED_RUN, Provenance(code_digest="c" * 64, lockfile_digest="l" * 64))])  # fmt: skip


def test_a_bad_target_fails_only_what_reads_it(rule_runner: RuleRunner) -> None:
    """A stage list that does not start at 0 in one target: every target of the directory still
    builds (as they all are for Python's dependency inference, which `pants run` of any target
    needs), the run beside it computes its graph and step, and reading the bad one raises,
    naming it and its field."""
    bad = RUN.format(name="bad", model=MODEL, lr="1e-3", datasets='[(5, {":train": 1.0})]',
                     extra="")  # fmt: skip
    rule_runner.write_files({"exp/BUILD": staged() + bad, "exp/train.jsonl": TEXT})
    every = rule_runner.request(
        Targets, [RawSpecs(dir_literals=(DirLiteralSpec("exp"),), description_of_origin="test")]
    )
    assert Address("exp", target_name="bad") in {target.address for target in every}
    rule_runner.request(StepJson, [StepJsonRequest(
        STAGED_RUN, Provenance(code_digest="c" * 64, lockfile_digest="l" * 64))])  # fmt: skip
    with pytest.raises(ExecutionError, match=r"The `datasets` field in target exp:bad has stages "
                       r"starting at steps \[5\]: the first starts at 0"):  # fmt: skip
        read_target(rule_runner, Address("exp", target_name="bad"))


def test_levanters_data_order_reaches_the_step_and_starts_stages_on_its_blocks(
    rule_runner: RuleRunner,
) -> None:
    plain = CACHE + RUN.format(name="staged", model=MODEL, lr="1e-3", datasets=TRAIN,
                               extra="data_order='levanter',")  # fmt: skip
    rule_runner.write_files({"exp/BUILD": plain, "exp/train.jsonl": TEXT})
    written = rule_runner.request(StepJson, [StepJsonRequest(
        STAGED_RUN, Provenance(code_digest="c" * 64, lockfile_digest="l" * 64))])  # fmt: skip
    assert StepSpec.from_json(json.loads(written.content)).config.data_order == "levanter"

    build = CACHE + HQ + RUN.format(name="staged", model=MODEL, lr="1e-3", datasets=STAGES,
                                    extra="data_order='levanter',")  # fmt: skip
    rule_runner.write_files({"exp/BUILD": build, "exp/train.jsonl": TEXT})
    message = (r"stages\[0\].start_step: Levanter's data order starts a stage on a block of 2048 "
               r"sequences: start_step x batch_size \(60 x 8\)")  # fmt: skip
    with pytest.raises(ExecutionError, match=message):
        rule_runner.request(StepJson, [StepJsonRequest(
            STAGED_RUN, Provenance(code_digest="c" * 64, lockfile_digest="l" * 64))])  # fmt: skip


def test_plan_reads_each_stage_by_its_weights(plan_rule_runner: RuleRunner, tmp_path) -> None:
    plan_rule_runner.write_files({"exp/BUILD": staged(), "exp/train.jsonl": TEXT})
    result = plan_rule_runner.run_goal_rule(Plan, args=[f"--kiln-prefix={tmp_path}", "exp:staged"])
    # 100 steps of 8 x 64: steps 0-59 all train (30.72k tokens), 60-99 half each (10.24k).
    assert "tokenized/train@2026.12.02" in result.stdout
    assert "reads 40.96k tokens (from step 0: 30.72k; from step 60: 10.24k)" in result.stdout
    assert "reads 10.24k tokens (from step 0: 0; from step 60: 10.24k)" in result.stdout


EVALS = """
lm_eval_run(name="base_eval", version="2026.12.02", model=MODEL_OF_EVAL, validation=[":train"],
            seq_len=64, batch_size=4, max_eval_batches=2)
lm_eval_run(name="nothing", version="2026.12.02", model=":base", seq_len=64, batch_size=4)
"""
BASE_EVAL = Address("exp", target_name="base_eval")


def eval_graph(rule_runner: RuleRunner, model: str) -> ArtifactGraph:
    build = build_file('":base"') + EVALS.replace("MODEL_OF_EVAL", model)
    rule_runner.write_files({"exp/BUILD": build, "exp/train.jsonl": TEXT})
    return rule_runner.request(ArtifactGraph, [ArtifactGraphRequest(Addresses([BASE_EVAL]))])


def test_an_evaluation_is_an_artifact_of_its_model_and_caches(rule_runner: RuleRunner) -> None:
    g = eval_graph(rule_runner, 'from_checkpoint(":base", step=40)')
    evaluation = g.get(BASE_EVAL)
    assert [a.address.target_name for a in g] == ["train", "base", "base_eval"]
    assert evaluation.name == "evals/base_eval" and evaluation.parent == BASE
    assert evaluation.identity["model"] == {
        "kind": "lm_checkpoint", "name": "checkpoints/base", "version": "2026.12.02",
        "fingerprint": g.get(BASE).fingerprint, "step": 40,
    }  # fmt: skip
    assert [v["input"] for v in evaluation.identity["validation"]] == ["tokenized/train@2026.12.02"]
    target = rule_runner.get_target(BASE_EVAL)
    deps = rule_runner.request(Addresses, [DependenciesRequest(target[Dependencies])])
    assert {a.target_name for a in deps} == {"train", "base"}
    final = eval_graph(rule_runner, '":base"').get(BASE_EVAL)
    assert final.fingerprint != evaluation.fingerprint  # another step is another evaluation
    published = eval_graph(rule_runner, 'hf_model_source("/models/llama")').get(BASE_EVAL)
    assert published.identity["model"] == {"model": "/models/llama"} and published.parent is None


def test_an_evaluation_of_all_windows_says_all_as_a_run_does(rule_runner: RuleRunner) -> None:
    def evaluation(max_eval_batches: str) -> Artifact:
        build = build_file('":base"') + EVALS.replace("MODEL_OF_EVAL", '":base"').replace(
            "max_eval_batches=2", f"max_eval_batches={max_eval_batches}")  # fmt: skip
        rule_runner.write_files({"exp/BUILD": build, "exp/train.jsonl": TEXT})
        graph = rule_runner.request(ArtifactGraph, [ArtifactGraphRequest(Addresses([BASE_EVAL]))])
        return graph.get(BASE_EVAL)

    whole = evaluation('"all"')
    assert whole.identity["max_eval_batches"] is None
    assert whole.fingerprint == evaluation("None").fingerprint
    assert whole.fingerprint != evaluation("2").fingerprint
    with pytest.raises(ExecutionError, match=r"The `max_eval_batches` field in target "
                       r"exp:base_eval must be a whole number > 0, or 'all'; got 'some'"):
        evaluation('"some"')


def test_an_evaluation_of_nothing_or_of_a_cache_is_refused(rule_runner: RuleRunner) -> None:
    rule_runner.write_files({"exp/BUILD": build_file('":base"') + EVALS.replace(
        "MODEL_OF_EVAL", '":base"'), "exp/train.jsonl": TEXT})  # fmt: skip
    with pytest.raises(ExecutionError, match="scores nothing: give it `evals`, `validation`"):
        read_target(rule_runner, Address("exp", target_name="nothing"))
    with pytest.raises(ExecutionError, match=r"The `model` field in target exp:base_eval refers "
                       r"to exp:train, which is neither an `lm_checkpoint` nor an `hf_model`"):
        eval_graph(rule_runner, '":train"')


def test_plan_json_gives_ci_each_artifact_state_fingerprint_and_path(
    plan_rule_runner: RuleRunner, tmp_path
) -> None:
    g = graph(plan_rule_runner, build_file('":base"'))
    args = ["--plan-json", f"--kiln-prefix={tmp_path}", "exp:cooldown"]
    result = plan_rule_runner.run_goal_rule(Plan, args=args)
    assert result.exit_code == 0
    plan = json.loads(result.stdout)
    assert plan["store"] == str(tmp_path) and plan["problems"] == []
    cooldown = plan["artifacts"][-1]
    assert cooldown == {
        "address": "exp:cooldown", "kind": "lm_checkpoint", "ref": "checkpoints/cooldown@2026.12.02",
        "fingerprint": g.get(COOLDOWN).fingerprint,
        "path": f"{tmp_path}/checkpoints/cooldown/2026.12.02", "state": "would run", "detail": None,
        "inputs": ["exp:train", "exp:base"], "estimate": None,
    }  # fmt: skip
    assert [a["address"] for a in plan["artifacts"]] == ["exp:train", "exp:base", "exp:cooldown"]
    # An unbuilt cache: what building it takes, as the text plan's estimate row says.
    estimate = plan["artifacts"][0]["estimate"]
    assert estimate["tokens"] > 0 and estimate["processes_at_once"] == 1  # one shard
    assert estimate["wall_hours"] == estimate["cpu_hours"]
    # What the text plan says of the training: the data and its parent, and the cost.
    base, child = plan["training"]
    assert (child["checkpoint"], child["tokens"], child["refusal"]) == (
        "checkpoints/cooldown@2026.12.02", 8 * 64 * 100, None)  # fmt: skip
    assert child["init_from"]["name"] == "checkpoints/base" and child["init_from"]["data_continues"]
    assert child["init_from"]["step"] == 100  # its parent's final step, said
    [train] = child["datasets"]
    assert (train["cache"], train["reads_tokens"], train["continues_at_sequence"]) == (
        "tokenized/train@2026.12.02", 51200, 800)  # fmt: skip
    assert base["datasets"][0]["continues_at_sequence"] is None
    assert child["cost"]["tokens"] == 51200 and child["cost"]["device"] == "cpu"
    assert child["cost"]["input_caches"] == 1  # its training cache: the parent is no cache

    # A graph that cannot be read is an error for scripts too: JSON on stdout, exit 1.
    graph(plan_rule_runner, build_file('":base"'))
    plan_rule_runner.write_files({"exp/BUILD": build_file('from_checkpoint(":base", step=50)')})
    refused = plan_rule_runner.run_goal_rule(Plan, args=args)
    assert refused.exit_code == 1
    assert "names step 50 of exp:base, which it does not keep" in json.loads(refused.stdout)["error"]


def test_plan_names_the_parent_and_what_a_child_reads_new(plan_rule_runner: RuleRunner, tmp_path) -> None:
    """A child continuing its parent's data reads on from the parent's position: 8 x 40 = 320
    sequences of `train` by step 40; its 800 are new while the cache has windows for them."""
    build = build_file('from_checkpoint(":base", step=40)')
    plan_rule_runner.write_files({"exp/BUILD": build, "exp/train.jsonl": TEXT})
    args = [f"--kiln-prefix={tmp_path}", "exp:cooldown"]
    result = plan_rule_runner.run_goal_rule(Plan, args=args)
    assert ("  starts from checkpoints/base@2026.12.02 at step 40 (weights and Adam's moments), "
            "continuing its data stream\n") in result.stdout  # fmt: skip
    assert ("continues its parent's stream at sequence 320 (new while the cache holds more than "
            "1120 windows)") in result.stdout  # fmt: skip

    # Built with 1,000 windows of 64: 680 sequences new, 120 re-read (the stream's second pass).
    g = graph(plan_rule_runner, build)
    train = g.get(Address("exp", target_name="train"))
    folder = tmp_path / "tokenized/train/2026.12.02"
    folder.mkdir(parents=True)
    record = {"fingerprint": train.fingerprint, "identity": train.identity}
    (folder / "artifact.json").write_text(json.dumps(record))
    (folder / "cache.json").write_text(json.dumps({"tokens": 64_000}))
    (folder / "STATUS").write_text("SUCCESS\n")
    built = plan_rule_runner.run_goal_rule(Plan, args=args)
    assert "continues its parent's stream at sequence 320: 43.52k new, 7.68k re-read" in built.stdout

    reset = build_file('from_checkpoint(":base", step=40, reset_data_loader_on_init=True)')
    plan_rule_runner.write_files({"exp/BUILD": reset})
    restarted = plan_rule_runner.run_goal_rule(Plan, args=args)
    assert "(weights and Adam's moments), its datasets from their beginning" in restarted.stdout
    assert "continues its parent's stream" not in restarted.stdout
    # Its 800 sequences from the stream's beginning: the 320 its parent read are re-read.
    assert ("reads its stream from the beginning, of which its line read 320 sequences: "
            "30.72k new, 20.48k re-read") in restarted.stdout  # fmt: skip
    as_json = plan_rule_runner.run_goal_rule(Plan, args=["--plan-json", *args])
    child = json.loads(as_json.stdout)["training"][-1]
    assert (child["init_from"]["data_continues"], child["init_from"]["step"]) == (False, 40)
    [train] = child["datasets"]
    assert (train["continues_at_sequence"], train["read_before_sequences"]) == (None, 320)
    assert (train["new_tokens"], train["reread_tokens"]) == (480 * 64, 320 * 64)


def test_an_evaluations_suite_cadence_is_no_part_of_it(rule_runner: RuleRunner) -> None:
    """An evaluation scores once: `every` changes nothing, so it is not in the fingerprint."""
    def scored(every: int) -> Artifact:
        suite = f'eval_suite([eval_task("hellaswag", num_fewshot=0)], every={every})'
        build = build_file('":base"') + (
            f'lm_eval_run(name="base_eval", version="2026.12.02", model=":base", evals={suite}, '
            'seq_len=64, batch_size=4)\n')  # fmt: skip
        rule_runner.write_files({"exp/BUILD": build, "exp/train.jsonl": TEXT})
        return rule_runner.request(
            ArtifactGraph, [ArtifactGraphRequest(Addresses([BASE_EVAL]))]).get(BASE_EVAL)  # fmt: skip

    once, often = scored(1), scored(500)
    assert "every" not in once.identity["evals"] and once.fingerprint == often.fingerprint
