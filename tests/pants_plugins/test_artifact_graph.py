"""Fingerprints, inferred dependencies and the plan goal."""

from __future__ import annotations

import json
import subprocess

import pytest
from pants.core.goals.run import RunRequest
from pants.engine.addresses import Address, Addresses
from pants.engine.internals.scheduler import ExecutionError
from pants.engine.target import Dependencies, DependenciesRequest
from pants.testutil.rule_runner import RuleRunner

from kiln_pants.artifact_graph import ArtifactGraph, ArtifactGraphRequest
from kiln_pants.build_steps import log_path
from kiln_pants.mixture_budget import MixtureBudgetRequest, MixtureFits
from kiln_pants.plan import Plan
from kiln_pants.train_rules import LmCheckpointFieldSet

BUILD = """
tokenized_cache(
    name="train",
    sources=["train.jsonl"],
    tokenizer="//exp/tok:tok",
    version="2026.06.28",
)
tokenized_cache(
    name="valid",
    source="stdlib:docstrings",
    split="validation",
    tokenizer="//exp/tok:tok",
    version="2026.06.28",
)
lm_checkpoint(
    name="ckpt",
    version="2026.06.28",
    model=llama(max_seq_len=256, hidden_dim=64, intermediate_dim=128, num_heads=4,
                num_kv_heads=2, num_layers=2),
    optimizer=adam(learning_rate=1e-3, warmup=10),
    datasets={":train": 1.0},
    validation=[":valid"],
    batch_size=8,
    seq_len=128,
    num_train_steps=100,
    z_loss_weight=1e-4,
    evals=None,
    resources=RESOURCES,
)
"""

FILES = {
    "exp/train.jsonl": '{"text": "hello world"}\n',
    "exp/tok/BUILD": 'files(name="tok", sources=["kiln-tok/*"])',
    "exp/tok/kiln-tok/tokenizer.json": '{"model": "fake"}',
}


def graph(
    rule_runner: RuleRunner, resources: str = "cpu()", build: str = BUILD, **files: str
) -> ArtifactGraph:
    rule_runner.write_files({**FILES, "exp/BUILD": build.replace("RESOURCES", resources), **files})
    return rule_runner.request(
        ArtifactGraph, [ArtifactGraphRequest(Addresses([Address("exp", target_name="ckpt")]))]
    )


def fingerprints(g: ArtifactGraph) -> dict[str, str]:
    return {a.address.target_name: a.fingerprint for a in g}


def test_inputs_come_first_and_are_referenced_by_name_and_version(rule_runner: RuleRunner) -> None:
    g = graph(rule_runner)
    assert [a.address.target_name for a in g] == ["train", "valid", "ckpt"]
    identity = g.get(Address("exp", target_name="ckpt")).identity
    assert identity["datasets"] == [
        {
            "input": "tokenized/train@2026.06.28",
            "fingerprint": fingerprints(g)["train"],
            "weight": 1.0,
        }
    ]
    assert "resources" not in identity


def test_fingerprints_are_pinned(rule_runner: RuleRunner) -> None:
    # The same BUILD and files give these values on every clone and machine: nothing of this
    # machine (paths, prefix, environment) enters a fingerprint. Change them only with intent.
    assert fingerprints(graph(rule_runner)) == {
        "train": "b12ee569c12d99fc",
        "valid": "9cab791bd006f5b2",
        "ckpt": "aef2fc5178d0c3b7",
    }


def test_resources_do_not_change_the_fingerprint(rule_runner: RuleRunner) -> None:
    on_cpu = fingerprints(graph(rule_runner))
    on_gpus = fingerprints(graph(rule_runner, resources="gpu('H100', count=8)"))
    accumulating = fingerprints(
        graph(
            rule_runner,
            resources="gpu('H100', count=8), per_device_parallelism=2, mesh={'fsdp': -1}",
        )
    )
    on_two_hosts = fingerprints(graph(rule_runner, resources="cpu(hosts=2)"))
    assert on_cpu == on_gpus == accumulating == on_two_hosts


def test_init_from_is_in_the_fingerprint_and_the_step(rule_runner: RuleRunner) -> None:
    def with_init_from(revision: str) -> ArtifactGraph:
        source = f"hf_model_source('org/llama', revision='{revision}')"
        return graph(rule_runner, resources=f"cpu(), init_from={source}")

    plain = fingerprints(graph(rule_runner))
    at_a, at_b = fingerprints(with_init_from("a" * 40)), fingerprints(with_init_from("b" * 40))
    assert plain["train"] == at_a["train"] == at_b["train"]
    assert len({plain["ckpt"], at_a["ckpt"], at_b["ckpt"]}) == 3
    identity = with_init_from("a" * 40).get(Address("exp", target_name="ckpt")).identity
    assert identity["init_from"] == {"model": "org/llama", "revision": "a" * 40}


def test_levanter_behaviours_are_in_the_fingerprint_only_when_set(rule_runner: RuleRunner) -> None:
    levanter_init = BUILD.replace("num_layers=2)", "num_layers=2, initialization='levanter')")
    plain = fingerprints(graph(rule_runner))["ckpt"]
    variants = {
        "initialization": graph(rule_runner, build=levanter_init),
        "loss_positions": graph(rule_runner, resources="cpu(), loss_positions='all'"),
        "data_order": graph(rule_runner, resources="cpu(), data_order='levanter'"),
    }
    assert len({plain, *(fingerprints(g)["ckpt"] for g in variants.values())}) == 4
    ckpt = Address("exp", target_name="ckpt")
    assert variants["initialization"].get(ckpt).identity["model"]["initialization"] == "levanter"
    assert variants["loss_positions"].get(ckpt).identity["loss_positions"] == "all"
    assert variants["data_order"].get(ckpt).identity["data_order"] == "levanter"
    plain_identity = graph(rule_runner).get(ckpt).identity
    assert "loss_positions" not in plain_identity and "data_order" not in plain_identity
    assert "initialization" not in plain_identity["model"]


def test_changed_data_changes_the_cache_and_its_dependents(rule_runner: RuleRunner) -> None:
    before = fingerprints(graph(rule_runner))
    after = fingerprints(graph(rule_runner, **{"exp/train.jsonl": '{"text": "other"}\n'}))
    assert after["valid"] == before["valid"]
    assert after["train"] != before["train"]
    assert after["ckpt"] != before["ckpt"]


def test_changed_tokenizer_changes_every_cache(rule_runner: RuleRunner) -> None:
    before = fingerprints(graph(rule_runner))
    after = fingerprints(graph(rule_runner, **{"exp/tok/kiln-tok/tokenizer.json": "{}"}))
    assert all(after[name] != before[name] for name in before)


def test_dependencies_are_inferred(rule_runner: RuleRunner) -> None:
    rule_runner.write_files({**FILES, "exp/BUILD": BUILD.replace("RESOURCES", "cpu()")})
    target = rule_runner.get_target(Address("exp", target_name="ckpt"))
    deps = rule_runner.request(Addresses, [DependenciesRequest(target[Dependencies])])
    assert {a.target_name for a in deps} == {"train", "valid"}


def test_a_dataset_that_is_not_a_cache_is_refused(rule_runner: RuleRunner) -> None:
    rule_runner.write_files(
        {
            **FILES,
            "exp/BUILD": BUILD.replace("RESOURCES", "cpu()").replace(
                ':train": 1.0', '//exp/tok:tok": 1.0'
            ),
        }
    )
    target = rule_runner.get_target(Address("exp", target_name="ckpt"))
    with pytest.raises(ExecutionError) as error:
        rule_runner.request(Addresses, [DependenciesRequest(target[Dependencies])])
    assert "The `datasets` field in target exp:ckpt refers to exp/tok:tok, a `files` target" in str(
        error.value
    )


# Enough text for a window of 128 tokens (FILES' 24 bytes are not).
WINDOW_OF_TEXT = {"exp/train.jsonl": '{"text": "%s"}\n' % ("hello world " * 12)}


def test_plan_reports_built_would_run_and_drift(plan_rule_runner: RuleRunner, tmp_path) -> None:
    rule_runner = plan_rule_runner
    g = graph(rule_runner, **WINDOW_OF_TEXT)
    ckpt = g.get(Address("exp", target_name="ckpt"))
    args = [f"--kiln-prefix={tmp_path}", "exp:ckpt"]

    result = rule_runner.run_goal_rule(Plan, args=args)
    assert result.exit_code == 0
    # The inline caches live in Pants' cache, where plan cannot look: never "would run" at a
    # store path no build writes (a build of them alone leaves them there).
    assert "3 artifacts: 2 inline, 1 would run" in result.stdout
    assert f"{tmp_path}/checkpoints/ckpt/2026.06.28" in result.stdout
    assert (
        "-> Pants' cache: its processes build it when a step needs it (cache hits once they have "
        f"run); a run that reads it places it at {tmp_path}/tokenized/train/2026.06.28"
    ) in result.stdout

    record_dir = tmp_path / "checkpoints/ckpt/2026.06.28"
    record_dir.mkdir(parents=True)
    record = {"fingerprint": ckpt.fingerprint, "identity": ckpt.identity}
    (record_dir / "artifact.json").write_text(json.dumps(record))
    (record_dir / "STATUS").write_text("SUCCESS\n")
    assert "1 built, 2 inline" in rule_runner.run_goal_rule(Plan, args=args).stdout

    stale = {**ckpt.identity, "batch_size": 16}
    (record_dir / "artifact.json").write_text(
        json.dumps({"fingerprint": "0" * 16, "identity": stale})
    )
    drift = rule_runner.run_goal_rule(Plan, args=args)
    assert drift.exit_code == 1
    assert "differs in: batch_size" in drift.stdout


# The checkpoint again at another learning rate, under the same artifact name and version.
TWIN = BUILD[BUILD.index("lm_checkpoint("):].replace('name="ckpt",', 'name="ckpt_lr", '
    'artifact_name="checkpoints/ckpt",').replace("learning_rate=1e-3", "learning_rate=3e-3")
# Two caches of one identity that exp:ckpt does not read, and a target wrong elsewhere.
ELSEWHERE = """
tokenized_cache(name="a", artifact_name="tokenized/same", sources=["a.jsonl"],
                tokenizer="//exp/tok:tok", version="2026.06.28")
tokenized_cache(name="b", artifact_name="tokenized/same", sources=["a.jsonl"],
                tokenizer="//exp/tok:tok", version="2026.06.28")
tokenized_cache(name="undated", sources=["a.jsonl"], tokenizer="//exp/tok:tok", version="soon")
"""


def test_two_targets_of_one_artifact_name_and_version_are_refused_naming_both(
    plan_rule_runner: RuleRunner, tmp_path
) -> None:
    """Before anything runs, `plan` (and every goal reading the graph) refuses an artifact that
    another target of the repository also names, whether the command needs both or one; two
    such targets that it does not need stop nothing. Renamed, each has a log of its own."""
    rule_runner = plan_rule_runner
    ckpt, twin = Address("exp", target_name="ckpt"), Address("exp", target_name="ckpt_lr")
    refusal = (
        "Targets exp:ckpt and exp:ckpt_lr are both the artifact checkpoints/ckpt@2026.06.28 "
        "(the same artifact name and version): they would build into one folder of the store "
        "and one log. Bump one's `version`, or give it another `artifact_name`."
    )
    twins = (BUILD + TWIN).replace("RESOURCES", "cpu()")
    elsewhere = {"other/BUILD": ELSEWHERE, "other/a.jsonl": "{}"}
    rule_runner.write_files({**FILES, "exp/BUILD": twins, **elsewhere})
    for needed in ([ckpt], [ckpt, twin]):
        with pytest.raises(ExecutionError) as error:
            rule_runner.request(ArtifactGraph, [ArtifactGraphRequest(Addresses(needed))])
        assert refusal in str(error.value)
    with pytest.raises(ExecutionError) as error:
        rule_runner.run_goal_rule(Plan, args=[f"--kiln-prefix={tmp_path}", "exp:ckpt"])
    assert refusal in str(error.value)
    assert not list(tmp_path.iterdir())  # refused before anything ran or was written

    bumped = TWIN.replace('version="2026.06.28"', 'version="2026.06.29"', 1)
    g = graph(rule_runner, build=BUILD + bumped)  # other/'s twins and undated cache stay
    both = rule_runner.request(ArtifactGraph, [ArtifactGraphRequest(Addresses([ckpt, twin]))])
    assert {log_path("dist", both.get(a)) for a in (ckpt, twin)} == {
        "dist/logs/checkpoints/ckpt/2026.06.28.log", "dist/logs/checkpoints/ckpt/2026.06.29.log"
    }  # fmt: skip
    assert g.get(ckpt).fingerprint != both.get(twin).fingerprint


def test_max_tokens_is_in_the_fingerprint_when_set(rule_runner: RuleRunner) -> None:
    plain = graph(rule_runner)
    bounded = graph(rule_runner, **{"exp/BUILD": bounded_build(50_000)})
    train = Address("exp", target_name="train")
    assert "max_tokens" not in plain.get(train).identity
    assert bounded.get(train).identity["max_tokens"] == 50_000
    assert fingerprints(plain)["train"] != fingerprints(bounded)["train"]
    assert fingerprints(plain)["valid"] == fingerprints(bounded)["valid"]


def test_framing_is_in_the_fingerprint_when_set(rule_runner: RuleRunner) -> None:
    """Unset (or "kiln", the default) it changes no fingerprint: test_fingerprints_are_pinned."""
    train = Address("exp", target_name="train")
    framed = {}
    for framing in ("kiln", "levanter", "marin"):
        build = BUILD.replace("RESOURCES", "cpu()").replace(
            'sources=["train.jsonl"],', f'sources=["train.jsonl"], framing="{framing}",'
        )
        framed[framing] = graph(rule_runner, **{"exp/BUILD": build})
    assert fingerprints(framed["kiln"]) == fingerprints(graph(rule_runner))
    assert "framing" not in framed["kiln"].get(train).identity
    assert framed["marin"].get(train).identity["framing"] == "marin"
    assert len({fingerprints(g)["train"] for g in framed.values()}) == 3
    assert len({fingerprints(g)["valid"] for g in framed.values()}) == 1


def test_hub_credentials_change_no_fingerprint(rule_runner: RuleRunner) -> None:
    hub_build = BUILD.replace("RESOURCES", "cpu()").replace(
        'source="stdlib:docstrings",',
        'source="kiln-test/prose", revision="0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a",',
    )
    seen = []
    for token in ("hf_first_token", "hf_second_token", None):
        env = {"HF_TOKEN": token, "HF_ENDPOINT": "http://127.0.0.1:9"} if token else {}
        rule_runner.set_options([], env=env)
        seen.append(fingerprints(graph(rule_runner, **{"exp/BUILD": hub_build})))
    assert seen[0] == seen[1] == seen[2]


def bounded_build(max_tokens: int) -> str:
    """BUILD with `train` bounded; ckpt reads 8 x 128 x 100 = 102,400 tokens, all from train."""
    return BUILD.replace("RESOURCES", "cpu()").replace(
        'sources=["train.jsonl"],', f'sources=["train.jsonl"], max_tokens={max_tokens},'
    )


def test_a_malformed_prefix_fails_plan_and_run_in_one_line(plan_rule_runner: RuleRunner) -> None:
    """An unknown scheme or a bad bucket name is Kiln's one line and exit 1, not the engine's
    traceback header above it: `plan` prints it, and `run` runs a process that does."""
    rule_runner = plan_rule_runner
    graph(rule_runner)
    target = rule_runner.get_target(Address("exp", target_name="ckpt"))
    for url, problem in (("s4://x", "Kiln stores artifacts in"), ("s3://", "'' is not a valid")):
        error = f"kiln: error: [kiln] prefix = {url!r}: {problem}"
        planned = rule_runner.run_goal_rule(Plan, args=[f"--kiln-prefix={url}", "exp:ckpt"])
        assert planned.exit_code == 1 and planned.stdout == ""
        assert planned.stderr.startswith(error) and planned.stderr.count("\n") == 1
        rule_runner.set_options([f"--kiln-prefix={url}"])
        run = rule_runner.request(RunRequest, [LmCheckpointFieldSet.create(target)])
        ran = subprocess.run(run.args, capture_output=True, text=True)
        assert (ran.returncode, ran.stdout) == (1, "")
        assert ran.stderr.startswith(error) and ran.stderr.count("\n") == 1


def test_plan_sets_what_the_run_reads_against_what_each_cache_holds(
    plan_rule_runner: RuleRunner, tmp_path
) -> None:
    rule_runner = plan_rule_runner
    args = [f"--kiln-prefix={tmp_path}", "exp:ckpt"]
    g = graph(rule_runner, **{"exp/BUILD": bounded_build(110_000)})
    fits = rule_runner.run_goal_rule(Plan, args=args)
    assert fits.exit_code == 0
    assert "Training data of checkpoints/ckpt@2026.06.28: 8 x 128 tokens x 100 steps" in fits.stdout
    assert "tokenized/train@2026.06.28" in fits.stdout
    assert "weight 1 (100.0%): reads 102.40k tokens, will hold >= 110.00k (max_tokens)" in (
        fits.stdout
    )
    assert "estimate: 110.00k tokens (max_tokens), 0.00 GB as uint32, 0.0 CPU-hours" in fits.stdout
    assert "estimate: tokens unknown (a python_stdlib source is sized when it is read)" in (
        fits.stdout
    )

    graph(rule_runner, **{"exp/BUILD": bounded_build(100_000)})
    small = rule_runner.run_goal_rule(Plan, args=args)
    assert small.exit_code == 1
    assert "!! too small for its share: raise `max_tokens` on exp:train" in small.stdout

    # Built: what its cache.json counts, here less than max_tokens promised.
    train = g.get(Address("exp", target_name="train"))
    folder = tmp_path / "tokenized/train/2026.06.28"
    folder.mkdir(parents=True)
    record = {"fingerprint": train.fingerprint, "identity": train.identity}
    (folder / "artifact.json").write_text(json.dumps(record))
    (folder / "cache.json").write_text(json.dumps({"tokens": 90_000}))
    (folder / "STATUS").write_text("SUCCESS\n")
    graph(rule_runner, **{"exp/BUILD": bounded_build(110_000)})
    built = rule_runner.run_goal_rule(Plan, args=args)
    assert built.exit_code == 1
    assert "reads 102.40k tokens, holds 90.00k (built)" in built.stdout

    # Unbounded, the cache is the whole source: the run reads it again, and says so.
    unbounded = graph(rule_runner).get(Address("exp", target_name="train"))
    record = {"fingerprint": unbounded.fingerprint, "identity": unbounded.identity}
    (folder / "artifact.json").write_text(json.dumps(record))
    (folder / "cache.json").write_text(json.dumps({"tokens": 25_600}))
    repeated = rule_runner.run_goal_rule(Plan, args=args)
    assert repeated.exit_code == 0
    assert "holds 25.60k (built); read 4.0 times" in repeated.stdout


def test_plan_and_run_refuse_a_cache_whose_files_cannot_give_one_window(
    plan_rule_runner: RuleRunner, tmp_path
) -> None:
    """24 bytes of jsonl hold at most 24 tokens: less than one window of seq_len=128."""
    rule_runner = plan_rule_runner
    graph(rule_runner, **{"exp/train.jsonl": '{"text": "hello world"}\n'})
    planned = rule_runner.run_goal_rule(Plan, args=[f"--kiln-prefix={tmp_path}", "exp:ckpt"])
    assert planned.exit_code == 1
    assert ("!! its files hold 24 bytes, so at most as many tokens, less than one window of "
            "seq_len=128: add documents to exp:train or leave it out of the mixture") in (
        planned.stdout)  # fmt: skip
    rule_runner.set_options([f"--kiln-prefix={tmp_path}"])
    with pytest.raises(ExecutionError, match="exp:ckpt reads windows of 128 tokens, and these "
                       "caches cannot give one, so the run would fail; nothing was built"):  # fmt: skip
        rule_runner.request(MixtureFits, [MixtureBudgetRequest(Address("exp", target_name="ckpt"))])


def test_a_run_refuses_a_bounded_cache_too_small_for_its_share(
    rule_runner: RuleRunner, tmp_path
) -> None:
    rule_runner.set_options([f"--kiln-prefix={tmp_path}"])
    graph(rule_runner, **{"exp/BUILD": bounded_build(100_000)})
    with pytest.raises(ExecutionError) as error:
        rule_runner.request(MixtureFits, [MixtureBudgetRequest(Address("exp", target_name="ckpt"))])
    assert "exp:ckpt reads more tokens from these caches than their `max_tokens`" in str(error.value)
    graph(rule_runner, **{"exp/BUILD": bounded_build(110_000)})
    rule_runner.request(MixtureFits, [MixtureBudgetRequest(Address("exp", target_name="ckpt"))])


def test_a_tokenizer_directory_on_disk_is_identified_by_its_path(rule_runner: RuleRunner) -> None:
    def cache_fingerprint(tokenizer: str) -> str:
        rule_runner.write_files(
            {
                "disk/BUILD": (
                    f'tokenized_cache(name="c", source="org/data", revision="abc1234", '
                    f'tokenizer="{tokenizer}", version="2026.06.28")'
                )
            }
        )
        graph = rule_runner.request(
            ArtifactGraph, [ArtifactGraphRequest(Addresses([Address("disk", target_name="c")]))]
        )
        assert graph[0].identity["tokenizer"] == {"kind": "local", "path": tokenizer}
        return graph[0].fingerprint

    assert cache_fingerprint("/data/tokenizers/a") != cache_fingerprint("/data/tokenizers/b")


def test_local_eval_task_files_are_a_dependency_and_count_by_content(
    rule_runner: RuleRunner,
) -> None:
    def evals_identity(yaml: str) -> dict:
        build = BUILD.replace("RESOURCES", "cpu()").replace(
            "evals=None",
            'evals=eval_suite(["stdlib_mc"], every=50, task_files="//exp/tasks:tasks")',
        )
        rule_runner.write_files(
            {
                **FILES,
                "exp/BUILD": build,
                "exp/tasks/BUILD": 'files(name="tasks", sources=["*.yaml", "*.jsonl"])',
                "exp/tasks/stdlib_mc.yaml": yaml,
                "exp/tasks/data.jsonl": "{}\n",
            }
        )
        target = rule_runner.get_target(Address("exp", target_name="ckpt"))
        deps = rule_runner.request(Addresses, [DependenciesRequest(target[Dependencies])])
        assert Address("exp/tasks", target_name="tasks") in deps
        graph = rule_runner.request(
            ArtifactGraph, [ArtifactGraphRequest(Addresses([target.address]))]
        )
        return graph.get(target.address).identity["evals"]

    first = evals_identity("task: stdlib_mc\n")
    assert first["tasks"] == [{"name": "stdlib_mc", "num_fewshot": 0, "alias": None}]
    assert first["task_files"] != "//exp/tasks:tasks"  # a content digest, not the address
    assert evals_identity("task: stdlib_mc\nnum_fewshot: 1\n")["task_files"] != first["task_files"]


def test_the_eval_chat_options_are_in_the_identity_only_when_set(
    rule_runner: RuleRunner,
) -> None:
    def evals_identity(options: str) -> dict:
        build = BUILD.replace("RESOURCES", "cpu()").replace(
            "evals=None", f'evals=eval_suite(["copa"], every=50{options})'
        )
        rule_runner.write_files({**FILES, "exp/BUILD": build})
        graph = rule_runner.request(
            ArtifactGraph, [ArtifactGraphRequest(Addresses([Address("exp", target_name="ckpt")]))]
        )
        return graph.get(Address("exp", target_name="ckpt")).identity["evals"]

    plain = evals_identity("")
    assert not {"apply_chat_template", "fewshot_as_multiturn", "system_instruction"} & set(plain)
    assert evals_identity(", apply_chat_template=False") == plain
    chat = evals_identity(", apply_chat_template=True")
    assert chat == {**plain, "apply_chat_template": True}
    single = evals_identity(", apply_chat_template=True, fewshot_as_multiturn=False")
    assert single == {**chat, "fewshot_as_multiturn": False}
    instructed = evals_identity(", apply_chat_template=True, system_instruction='Be brief.'")
    assert instructed == {**chat, "system_instruction": "Be brief."}


def test_an_unbuilt_import_is_budgeted_by_its_ledger(rule_runner: RuleRunner) -> None:
    """An imported Levanter cache's tokens are known before it is built: its ledger's."""
    from kiln_pants.mixture_budget import mixture_budget

    g = graph(rule_runner)
    checkpoint, train = g.get(Address("exp", target_name="ckpt")), g.get(Address("exp", target_name="train"))
    [component] = mixture_budget(checkpoint, g, held={}, imported={train.ref: 199_005}).components
    assert component.describe().endswith(
        "reads 102.40k tokens, holds 199.00k (its shard_ledger.json)"
    ), component.describe()


def test_document_format_is_in_the_fingerprint_when_not_text(rule_runner: RuleRunner) -> None:
    """format="text" (the default) changes no fingerprint: test_fingerprints_are_pinned; a chat
    cache's is pinned too; a supervised cache's names its encoding (FORMAT_ENCODINGS)."""
    train = Address("exp", target_name="train")
    formats = {
        "text": 'format="text",',
        "chat": 'format="chat", chat_template="{% generation %}x{% endgeneration %}",',
        "supervised": 'format="supervised", input_key="question", target_key="answer",',
    }
    graphs = {}
    for name, fields in formats.items():
        build = BUILD.replace("RESOURCES", "cpu()").replace(
            'sources=["train.jsonl"],', f'sources=["train.jsonl"], {fields}'
        )
        graphs[name] = graph(rule_runner, **{"exp/BUILD": build})
    assert fingerprints(graphs["text"]) == fingerprints(graph(rule_runner))
    assert "document_format" not in graphs["text"].get(train).identity
    assert graphs["supervised"].get(train).identity["document_format"] == {
        "format": "supervised", "input_key": "question", "target_key": "answer", "encoding": 2,
    }  # fmt: skip
    assert len({fingerprints(g)["train"] for g in graphs.values()}) == 3
    assert fingerprints(graphs["chat"])["train"] == "e19a275dd9aa2618"
