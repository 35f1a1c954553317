"""DCLM CORE's centered accuracy, as the reference computes it over a run's lm-eval scores.

Marin (marin-community/marin, experiments/evals/dclm_core.py, `dclm_core_centered_accuracy`)
scores each task of the DCLM paper's 22-task CORE inventory by its primary metric `a` and its
random baseline `r` as (a - r) / (1 - r), and reports the mean over the tasks it found, with how
many it found and how many are missing:

    lm_eval/dclm_core/{alias}/centered_accuracy, lm_eval/dclm_core/{alias}/raw_score,
    lm_eval/dclm_core/task_count, lm_eval/dclm_core/missing_task_count,
    lm_eval/dclm_core/centered_accuracy_macro

The inventory below is Marin's (task, alias, shots, random baseline, primary metric). A suite
entry scores an inventory task when it runs the same lm-eval task at the same number of shots.
lm-eval's `wsc273` is not in it (DCLM's Winograd is a custom task there), so the reference
suite's 13 entries score 12 inventory tasks and 10 stay missing (generation tasks, which Kiln's
adapter does not run, among them): compare a macro only with one over the same tasks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from kiln.eval.tasks import EvalSuiteConfig

PREFIX = "lm_eval/dclm_core"


@dataclass(frozen=True)
class CoreTask:
    name: str  # the lm-eval task
    alias: str  # the reference's label, used in the metric keys
    num_fewshot: int
    random_baseline: float
    metric: str  # the primary metric


DCLM_CORE_TASKS = (
    CoreTask("agieval_lsat_ar", "agieval_lsat_ar_3shot", 3, 0.25, "acc_norm"),
    CoreTask("arc_easy", "arc_easy_10shot", 10, 0.25, "acc_norm"),
    CoreTask("arc_challenge", "arc_challenge_10shot", 10, 0.25, "acc_norm"),
    CoreTask("bigbench_qa_wikidata_generate_until", "bb_qa_wikidata_10shot", 10, 0.0, "exact_match"),
    CoreTask("bigbench_dyck_languages_generate_until", "bb_dyck_languages_10shot", 10, 0.0,
             "exact_match"),
    CoreTask("bigbench_operators_generate_until", "bb_operators_10shot", 10, 0.0, "exact_match"),
    CoreTask("bigbench_repeat_copy_logic_generate_until", "bb_repeat_copy_logic_10shot", 10, 0.0,
             "exact_match"),
    CoreTask("bigbench_cs_algorithms_generate_until", "bb_cs_algorithms_10shot", 10, 0.0,
             "exact_match"),
    CoreTask("bigbench_language_identification_multiple_choice",
             "bb_language_identification_10shot", 10, 0.25, "acc"),
    CoreTask("boolq", "boolq_10shot", 10, 0.62, "acc"),
    CoreTask("commonsense_qa", "commonsense_qa_10shot", 10, 0.403, "acc"),
    CoreTask("copa", "copa_0shot", 0, 0.5, "acc"),
    CoreTask("coqa", "coqa_0shot", 0, 0.0, "f1"),
    CoreTask("hellaswag", "hellaswag_0shot", 0, 0.25, "acc_norm"),
    CoreTask("hellaswag", "hellaswag_10shot", 10, 0.25, "acc_norm"),
    CoreTask("jeopardy", "jeopardy_10shot", 10, 0.0, "exact_match"),
    CoreTask("lambada_openai", "lambada_0shot", 0, 0.0, "acc"),
    CoreTask("openbookqa", "openbookqa_0shot", 0, 0.25, "acc_norm"),
    CoreTask("piqa", "piqa_10shot", 10, 0.5, "acc_norm"),
    CoreTask("squad_completion", "squad_10shot", 10, 0.0, "contains"),
    CoreTask("winograd", "winograd_0shot", 0, 0.5, "acc"),
    CoreTask("winogrande", "winogrande_0shot", 0, 0.5, "acc"),
)  # fmt: skip


def dclm_core_metrics(suite: EvalSuiteConfig, metrics: Mapping[str, float]) -> dict[str, float]:
    """The reference's centered accuracies and their macro, from this eval's metrics; {} when
    the suite runs no inventory task (a local suite has no CORE score)."""
    labels = {(task.name, task.num_fewshot): task.label for task in suite.tasks}
    scores: dict[str, float] = {}
    centered_values = []
    for core in DCLM_CORE_TASKS:
        label = labels.get((core.name, core.num_fewshot))
        raw = metrics.get(f"lm_eval/{label}/{core.metric}") if label else None
        if raw is None or not math.isfinite(raw):
            continue
        centered = (raw - core.random_baseline) / (1.0 - core.random_baseline)
        scores[f"{PREFIX}/{core.alias}/centered_accuracy"] = centered
        scores[f"{PREFIX}/{core.alias}/raw_score"] = raw
        centered_values.append(centered)
    if not centered_values:
        return {}
    scores[f"{PREFIX}/task_count"] = float(len(centered_values))
    scores[f"{PREFIX}/missing_task_count"] = float(len(DCLM_CORE_TASKS) - len(centered_values))
    scores[f"{PREFIX}/centered_accuracy_macro"] = sum(centered_values) / len(centered_values)
    return scores
