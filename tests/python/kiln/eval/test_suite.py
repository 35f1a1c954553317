"""run_eval_suite on real lm-eval tasks defined by local YAML over local JSONL, offline."""

from __future__ import annotations

import importlib.metadata
import math
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import lm_eval.tasks
import numpy as np
import pytest
from kiln_testing.lm_eval_tasks import (
    EOS_ID,
    LAMBADA_TASK,
    MC_TASK,
    ROLLING_TASK,
    VOCAB,
    bigram_sequence_logprob,
    make_bigram_logprob_fn,
)
from kiln_testing.processes import python_env
from lm_eval.tasks import TaskManager

from kiln.eval.adapter import default_bucket_lengths
from kiln.eval.harness import (
    EvalTaskUnavailable,
    load_suite_tasks,
    load_task,
    run_eval_suite,
)
from kiln.eval.metadata import eval_summary_lines
from kiln.eval.tasks import EvalSuiteConfig, EvalTask

MAX_LENGTH = 128  # buckets 64 and 128; the perplexity documents need both
HARNESS = f"lm-eval {importlib.metadata.version('lm_eval')}"


def _suite(local_tasks, tasks: list[dict], max_examples: int | None = None) -> dict:
    return {
        "tasks": tasks,
        "every": 100,
        "max_examples": max_examples,
        "task_paths": [str(local_tasks.task_dir)],
    }


@pytest.fixture(scope="module")
def suite_run(local_tasks, tokenizer):
    logprob_fn = make_bigram_logprob_fn(local_tasks.table)
    suite = _suite(
        local_tasks,
        [
            {"name": MC_TASK, "num_fewshot": 0, "alias": "mc_0shot"},
            {"name": MC_TASK, "num_fewshot": 2, "alias": "mc_2shot"},
            {"name": LAMBADA_TASK, "num_fewshot": 0},
            {"name": ROLLING_TASK, "num_fewshot": 0},
        ],
    )
    metrics = run_eval_suite(logprob_fn, tokenizer, suite, step=7, model_max_length=MAX_LENGTH)
    return metrics, logprob_fn


def test_multiple_choice_accuracy_is_what_the_model_forces(suite_run, local_tasks):
    metrics, _ = suite_run
    for alias in ("mc_0shot", "mc_2shot"):  # few-shot context does not move a bigram's choice
        assert metrics[f"lm_eval/{alias}/acc"] == pytest.approx(local_tasks.mc_expected_acc)
        assert metrics[f"lm_eval/{alias}/acc_norm"] == pytest.approx(local_tasks.mc_expected_acc)
        # What guessing scores: one in three choices, beside the accuracy to read it against.
        assert metrics[f"lm_eval/{alias}/acc_chance"] == pytest.approx(1 / 3)
    assert f"lm_eval/{LAMBADA_TASK}/acc_chance" not in metrics  # not a multiple-choice task


def test_last_word_accuracy_and_perplexity(suite_run, local_tasks, tokenizer):
    metrics, _ = suite_run
    log_likelihoods = []
    for doc in local_tasks.lambada_docs:
        *_, cue, target = doc.split(" ")
        log_likelihoods.append(
            bigram_sequence_logprob(local_tasks.table, [VOCAB[cue], VOCAB[target]])
        )
    expected_perplexity = math.exp(-np.mean(log_likelihoods))

    assert metrics[f"lm_eval/{LAMBADA_TASK}/acc"] == pytest.approx(local_tasks.lambada_expected_acc)
    assert metrics[f"lm_eval/{LAMBADA_TASK}/perplexity"] == pytest.approx(
        expected_perplexity, rel=1e-4
    )


def test_rolling_perplexity_metrics(suite_run, local_tasks, tokenizer):
    metrics, _ = suite_run
    docs = local_tasks.rolling_docs
    total = sum(
        bigram_sequence_logprob(
            local_tasks.table, [EOS_ID, *tokenizer.encode(doc, add_special_tokens=False)]
        )
        for doc in docs
    )
    words = sum(len(re.split(r"\s+", doc)) for doc in docs)
    num_bytes = sum(len(doc.encode("utf-8")) for doc in docs)

    prefix = f"lm_eval/{ROLLING_TASK}"
    assert metrics[f"{prefix}/word_perplexity"] == pytest.approx(math.exp(-total / words), rel=1e-4)
    assert metrics[f"{prefix}/byte_perplexity"] == pytest.approx(
        math.exp(-total / num_bytes), rel=1e-4
    )
    assert metrics[f"{prefix}/bits_per_byte"] == pytest.approx(
        -total / num_bytes / math.log(2), rel=1e-4
    )


def test_averages_and_timing(suite_run, local_tasks):
    metrics, _ = suite_run
    mc, lambada = local_tasks.mc_expected_acc, local_tasks.lambada_expected_acc
    # acc: two MC runs (6 docs each) and the last-word task (5 docs); acc_norm: the MC runs only.
    assert metrics["lm_eval/averages/macro_acc"] == pytest.approx((2 * mc + lambada) / 3)
    assert metrics["lm_eval/averages/micro_acc"] == pytest.approx((12 * mc + 5 * lambada) / 17)
    assert metrics["lm_eval/averages/macro_acc_norm"] == pytest.approx(mc)
    assert metrics["lm_eval/seconds"] >= sum(
        metrics[f"lm_eval/{label}/seconds"]
        for label in ("mc_0shot", "mc_2shot", LAMBADA_TASK, ROLLING_TASK)
    )
    assert all(key.startswith("lm_eval/") for key in metrics)


def test_each_score_records_what_produced_it(suite_run):
    metrics, _ = suite_run
    assert metrics["lm_eval/mc_0shot/num_fewshot"] == 0
    assert metrics["lm_eval/mc_2shot/num_fewshot"] == 2
    assert metrics["lm_eval/mc_2shot/num_docs"] == 6
    assert metrics[f"lm_eval/{LAMBADA_TASK}/num_docs"] == 5
    assert metrics[f"lm_eval/{ROLLING_TASK}/num_docs"] == 3
    assert metrics[f"lm_eval/meta/harness={HARNESS}"] == 1.0
    assert metrics["lm_eval/meta/sequence_start=tokenizer"] == 1.0
    assert metrics["lm_eval/meta/max_length"] == MAX_LENGTH  # the model's, as none is set
    assert not any(key.startswith("lm_eval/dclm_core/") for key in metrics)  # no CORE task


def test_the_summary_prints_shots_docs_and_conventions_beside_the_scores(suite_run, local_tasks):
    metrics, _ = suite_run
    lines = eval_summary_lines({**metrics, "train/loss": 2.5, "step": 7})
    assert lines[0] == (
        f"lm-eval (last run; harness={HARNESS}, sequence_start=tokenizer, "
        f"max_length={MAX_LENGTH} input tokens)"
    )
    entry = lines.index("  mc_2shot (2-shot, 6 docs)")
    assert lines[entry + 1].split() == ["acc", f"{local_tasks.mc_expected_acc:.4f}"]
    assert f"  {ROLLING_TASK} (0-shot, 3 docs)" in lines
    assert not any(word in line for line in lines for word in ("seconds", "num_docs", "meta"))
    assert eval_summary_lines({"train/loss": 2.5}) == []


def test_the_document_convention_and_max_length_are_options(local_tasks, tokenizer):
    widths = []
    bigram = make_bigram_logprob_fn(local_tasks.table)

    def recording_logprob_fn(tokens):
        widths.append(tokens.shape[1])
        return bigram(tokens)

    suite = {
        **_suite(local_tasks, [{"name": ROLLING_TASK}, {"name": MC_TASK}]),
        "sequence_start": "document",
        "max_length": 16,
    }
    metrics = run_eval_suite(
        recording_logprob_fn, tokenizer, suite, step=0, model_max_length=MAX_LENGTH
    )
    # Every sequence starts with EOS (this tokenizer has no BOS): a MC choice after its cue
    # word is still the model's; perplexity windows of 16 input tokens, each token once.
    assert metrics[f"lm_eval/{MC_TASK}/acc"] == pytest.approx(local_tasks.mc_expected_acc)
    total = sum(
        bigram_sequence_logprob(
            local_tasks.table, [EOS_ID, *tokenizer.encode(doc, add_special_tokens=False)]
        )
        for doc in local_tasks.rolling_docs
    )
    num_bytes = sum(len(doc.encode("utf-8")) for doc in local_tasks.rolling_docs)
    assert metrics[f"lm_eval/{ROLLING_TASK}/byte_perplexity"] == pytest.approx(
        math.exp(-total / num_bytes), rel=1e-4
    )
    assert metrics["lm_eval/meta/sequence_start=document"] == 1.0
    assert metrics["lm_eval/meta/max_length"] == 16
    assert set(widths) == {16 + 1}  # the one bucket of max_length input tokens, + the target


def test_a_max_length_longer_than_the_model_fails_before_any_task_loads(local_tasks):
    suite = EvalSuiteConfig.from_json({**_suite(local_tasks, [{"name": MC_TASK}]), "max_length": 512})
    with pytest.raises(EvalTaskUnavailable, match="max_length is 512 .* at most 256"):
        load_suite_tasks(suite, model_max_length=256)


def test_generation_tasks_are_refused_when_the_suite_loads(local_tasks, tmp_path):
    (tmp_path / "gen.yaml").write_text(
        (local_tasks.task_dir / f"{LAMBADA_TASK}.yaml")
        .read_text()
        .replace(f"task: {LAMBADA_TASK}", "task: kiln_test_gen")
        .replace("output_type: loglikelihood", "output_type: generate_until")
    )
    manager = TaskManager(include_path=str(tmp_path), include_defaults=False)
    with pytest.raises(EvalTaskUnavailable, match="generate_until task: Kiln scores log-lik"):
        load_task(manager, EvalTask("kiln_test_gen", 0))


def test_the_whole_suite_compiles_once_per_bucket(suite_run):
    _, logprob_fn = suite_run
    # Dozens of distinct sequence lengths went through; shapes are (batch, bucket) only.
    assert logprob_fn._cache_size() == len(default_bucket_lengths(MAX_LENGTH)) == 2


def test_few_shot_examples_reach_the_model(local_tasks, tokenizer):
    bigram = make_bigram_logprob_fn(local_tasks.table)

    def real_tokens_scored(num_fewshot: int) -> int:
        counts = []

        def recording_logprob_fn(tokens):
            counts.append(int(np.count_nonzero(tokens)))  # padding and prefix are EOS_ID = 0
            return bigram(tokens)

        suite = _suite(local_tasks, [{"name": MC_TASK, "num_fewshot": num_fewshot}])
        run_eval_suite(recording_logprob_fn, tokenizer, suite, step=0, model_max_length=64)
        return sum(counts)

    # 6 docs x 3 choices, each preceded by 2 copies of the train example "w12 w13" + " w14".
    assert real_tokens_scored(2) - real_tokens_scored(0) == 6 * 3 * 2 * 3


def test_max_examples_limits_each_task(local_tasks, tokenizer):
    suite = _suite(local_tasks, [{"name": MC_TASK, "num_fewshot": 0}], max_examples=4)
    metrics = run_eval_suite(
        make_bigram_logprob_fn(local_tasks.table), tokenizer, suite, step=0, model_max_length=64
    )
    # The first four docs are exactly the ones where the model prefers the gold choice.
    assert metrics[f"lm_eval/{MC_TASK}/acc"] == 1.0


def test_hub_tasks_fail_fast_and_clearly_offline(tmp_path: Path):
    # lm-eval's own hellaswag definition (a CORE task, data on the hub), found through task_paths
    # so the test skips indexing all built-in tasks. A fresh interpreter, so the offline switches
    # hold before `datasets` is first imported, and an empty HF cache: nothing pre-downloaded.
    shutil.copytree(Path(lm_eval.tasks.__file__).parent / "hellaswag", tmp_path / "tasks")
    script = textwrap.dedent(
        f"""
        from kiln.eval.harness import EvalTaskUnavailable, load_suite_tasks
        from kiln.eval.tasks import EvalSuiteConfig, EvalTask
        task = EvalTask("hellaswag", 10, "hellaswag_10shot")
        try:
            suite = EvalSuiteConfig((task,), every=1, task_paths=({str(tmp_path / "tasks")!r},))
            load_suite_tasks(suite, model_max_length=2048)
        except EvalTaskUnavailable as error:
            print(error)
        """
    )
    env = python_env(
        HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home")
    )
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]

    message = result.stdout
    assert "lm-eval task 'hellaswag' (suite entry 'hellaswag_10shot')" in message
    assert "Rowan/hellaswag" in message  # lm-eval's dataset id, from the underlying error
    assert "HF_DATASETS_OFFLINE=1" in message and "evals.task_paths" in message


def test_unknown_task_names_say_where_tasks_come_from(local_tasks):
    manager = TaskManager(include_path=str(local_tasks.task_dir), include_defaults=False)
    with pytest.raises(EvalTaskUnavailable, match="no task named 'hellaswg'.*evals.task_paths"):
        load_task(manager, EvalTask("hellaswg", 0))


def test_groups_are_refused_with_their_tasks_named(local_tasks, tmp_path):
    (tmp_path / "group.yaml").write_text(f"group: kiln_group\ntask: [{MC_TASK}, {LAMBADA_TASK}]\n")
    manager = TaskManager(
        include_path=[str(local_tasks.task_dir), str(tmp_path)], include_defaults=False
    )
    with pytest.raises(EvalTaskUnavailable, match="group or tag of .*list those tasks"):
        load_task(manager, EvalTask("kiln_group", 0))
