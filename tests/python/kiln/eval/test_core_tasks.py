"""The reference's CORE suite: a real lm-eval CORE task on data in the Hugging Face datasets
cache, offline, and DCLM CORE's centered accuracy as the reference computes it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import lm_eval.tasks
import pytest
from kiln_testing.lm_eval_tasks import VOCAB, WORDS, write_hub_dataset_cache
from kiln_testing.processes import python_env

from kiln.eval.dclm_core import DCLM_CORE_TASKS, dclm_core_metrics
from kiln.eval.tasks import EvalSuiteConfig, EvalTask
from kiln_contract.evals import CORE_TASKS

UNK_ID = VOCAB["<unk>"]


def _arc_rows(count: int, gold_first: int) -> list[dict]:
    """ARC-shaped rows: 4 choices of equal length; the bigram model below prefers choice 0
    (WORDS[20 + i]) after "Answer:" (<unk> for the word-level tokenizer). Gold is choice 0 for
    the first `gold_first` rows, choice 1 for the rest."""
    rows = []
    for i in range(count):
        choices = [WORDS[20 + i], WORDS[30 + i % 10], WORDS[40 + i % 8], WORDS[12 + i % 8]]
        rows.append(
            {
                "id": f"kiln-{i}",
                "question": f"{WORDS[i % 10]} {WORDS[(i + 3) % 10]}",
                "choices": {"text": choices, "label": ["A", "B", "C", "D"]},
                "answerKey": "A" if i < gold_first else "B",
            }
        )
    return rows


def test_a_core_task_runs_its_real_yaml_on_cached_data_offline(tmp_path: Path):
    # lm-eval's own arc_easy.yaml (allenai/ai2_arc, ARC-Easy), unchanged; its data where a
    # machine that downloaded it keeps it. CORE runs arc_easy at 10 shots: the train split gives
    # the examples. A fresh interpreter, so the cache and offline switches hold from the start.
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    shutil.copy(Path(lm_eval.tasks.__file__).parent / "arc" / "arc_easy.yaml", tasks)
    cache = tmp_path / "hf_datasets_cache"
    write_hub_dataset_cache(
        cache,
        "allenai/ai2_arc",
        "ARC-Easy",
        {
            "train": _arc_rows(12, gold_first=12),
            "validation": _arc_rows(4, gold_first=4),
            "test": _arc_rows(8, gold_first=6),
        },
    )
    script = textwrap.dedent(
        f"""
        import json
        import numpy as np
        from kiln_testing.lm_eval_tasks import make_bigram_logprob_fn, make_tokenizer, VOCAB
        from kiln.eval.harness import run_eval_suite

        table = np.zeros((len(VOCAB), len(VOCAB)))
        for i in range(8):
            table[{UNK_ID}, VOCAB["w" + str(20 + i)]] = 5.0
        suite = {{"tasks": [{{"name": "arc_easy", "num_fewshot": 10}}], "every": 1,
                  "task_paths": [{str(tasks)!r}]}}
        metrics = run_eval_suite(make_bigram_logprob_fn(table), make_tokenizer(), suite, step=0,
                                 model_max_length=1024)
        print(json.dumps(metrics))
        """
    )
    env = python_env(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HOME=str(tmp_path / "hf_home"),
        HF_DATASETS_CACHE=str(cache),
    )
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads(result.stdout.strip().splitlines()[-1])

    # Gold is the preferred choice in 6 of 8 test rows; choices are equally long, so acc_norm
    # (normalised by bytes) agrees with acc.
    assert metrics["lm_eval/arc_easy/acc"] == pytest.approx(6 / 8)
    assert metrics["lm_eval/arc_easy/acc_norm"] == pytest.approx(6 / 8)
    assert metrics["lm_eval/arc_easy/num_fewshot"] == 10
    assert metrics["lm_eval/arc_easy/num_docs"] == 8
    centered = (6 / 8 - 0.25) / (1 - 0.25)
    assert metrics["lm_eval/dclm_core/arc_easy_10shot/centered_accuracy"] == pytest.approx(centered)
    assert metrics["lm_eval/dclm_core/centered_accuracy_macro"] == pytest.approx(centered)
    assert metrics["lm_eval/dclm_core/task_count"] == 1
    assert metrics["lm_eval/dclm_core/missing_task_count"] == len(DCLM_CORE_TASKS) - 1


# The reference suite, as the backend writes it.
CORE_SUITE = EvalSuiteConfig(tasks=CORE_TASKS, every=10000)


def test_centered_accuracy_uses_each_tasks_primary_metric_and_baseline():
    metrics = {
        "lm_eval/boolq/acc": 0.75,  # baseline 0.62
        "lm_eval/boolq/acc_norm": 0.0,  # not boolq's primary metric
        "lm_eval/hellaswag_0shot/acc_norm": 0.70,  # baseline 0.25
        "lm_eval/hellaswag_10shot/acc_norm": 0.40,
        "lm_eval/lambada_openai/acc": 0.30,  # baseline 0
        "lm_eval/wsc273/acc": 0.9,  # not in the reference's inventory
    }
    scores = dclm_core_metrics(CORE_SUITE, metrics)

    expected = {
        "boolq_10shot": (0.75 - 0.62) / 0.38,
        "hellaswag_0shot": 0.60,
        "hellaswag_10shot": 0.20,
        "lambada_0shot": 0.30,
    }
    for alias, centered in expected.items():
        assert scores[f"lm_eval/dclm_core/{alias}/centered_accuracy"] == pytest.approx(centered)
    assert scores["lm_eval/dclm_core/boolq_10shot/raw_score"] == 0.75
    assert scores["lm_eval/dclm_core/task_count"] == 4
    assert scores["lm_eval/dclm_core/missing_task_count"] == len(DCLM_CORE_TASKS) - 4 == 18
    assert scores["lm_eval/dclm_core/centered_accuracy_macro"] == pytest.approx(
        sum(expected.values()) / 4
    )


def test_the_reference_suite_scores_twelve_inventory_tasks():
    every_score = {
        f"lm_eval/{task.label}/{metric}": 0.5
        for task in CORE_SUITE.tasks
        for metric in ("acc", "acc_norm")
    }
    scores = dclm_core_metrics(CORE_SUITE, every_score)
    assert scores["lm_eval/dclm_core/task_count"] == 12  # all but wsc273
    assert scores["lm_eval/dclm_core/missing_task_count"] == 10


def test_an_inventory_task_at_other_shots_is_not_the_core_task():
    suite = EvalSuiteConfig((EvalTask("arc_easy", 0),), every=1)
    assert dclm_core_metrics(suite, {"lm_eval/arc_easy/acc_norm": 0.5}) == {}


def test_a_suite_without_core_tasks_has_no_core_score():
    suite = EvalSuiteConfig((EvalTask("kiln_stdlib_mc", 0),), every=1)
    assert dclm_core_metrics(suite, {"lm_eval/kiln_stdlib_mc/acc": 0.5}) == {}


def test_the_cache_layout_is_the_one_datasets_reads(tmp_path: Path):
    folder = write_hub_dataset_cache(
        tmp_path, "allenai/ai2_arc", "ARC-Easy", {"test": _arc_rows(2, gold_first=2)}
    )
    (info_file,) = folder.glob("ARC-Easy/0.0.0/*/dataset_info.json")
    info = json.loads(info_file.read_text())
    assert folder.name == "allenai___ai2_arc"
    assert info["config_name"] == "ARC-Easy" and info["splits"]["test"]["num_examples"] == 2
    assert (info_file.parent / "ai2_arc-test.arrow").is_file()
