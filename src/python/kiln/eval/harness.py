"""The lm-eval suite of a run: load its tasks (checked when the run starts), score them with
KilnLM, and return W&B-ready metrics with what produced them. See docs/evals.md.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

from lm_eval.evaluator import evaluate
from lm_eval.tasks import TaskManager

from kiln.eval.adapter import DEFAULT_BATCH_SIZE, KilnLM, LogprobFn
from kiln.eval.dclm_core import dclm_core_metrics
from kiln.eval.metadata import run_metadata, task_metadata
from kiln.eval.tasks import EvalSuiteConfig, EvalTask

logger = logging.getLogger(__name__)

FEWSHOT_SEED = 1234  # lm-eval's own default: few-shot examples match other lm-eval runs
AVERAGED_METRICS = ("acc", "acc_norm")
SCORED_OUTPUT_TYPES = ("loglikelihood", "loglikelihood_rolling", "multiple_choice")


class EvalTaskUnavailable(RuntimeError):
    """A suite cannot run: a task that does not load (unknown name, data not reachable offline,
    generation), or a max_length the model cannot read."""


def run_eval_suite(
    logprob_fn: LogprobFn,
    tokenizer: Any,
    suite: dict[str, Any],
    step: int,
    *,
    model_max_length: int,
    batch_size: int = DEFAULT_BATCH_SIZE,
) -> dict[str, float]:
    """Run every task of `suite` (the spec's `evals` object) and return W&B-ready metrics:
    lm_eval/{alias or name}/{metric}, its num_fewshot and num_docs, lm_eval/averages/...,
    lm_eval/dclm_core/... (when the suite has DCLM CORE tasks), lm_eval/meta/... (harness
    version and conventions) and timings. `model_max_length`: the model's max_seq_len."""
    config = EvalSuiteConfig.from_json(suite)
    started = time.perf_counter()
    loaded_tasks = load_suite_tasks(config, model_max_length=model_max_length)
    max_length = effective_max_length(config, model_max_length)
    lm = KilnLM(
        logprob_fn,
        tokenizer,
        max_length=max_length,
        batch_size=batch_size,
        sequence_start=config.sequence_start,
    )
    metrics: dict[str, float] = {}
    sample_counts: dict[str, int] = {}
    for task, task_dict in zip(config.tasks, loaded_tasks):
        task_started = time.perf_counter()
        results = evaluate(
            lm,
            task_dict,
            limit=config.max_examples,
            bootstrap_iters=0,
            log_samples=False,
            apply_chat_template=config.apply_chat_template,
            fewshot_as_multiturn=config.multiturn,
            system_instruction=config.system_instruction,
        )
        metrics.update(task_metrics(task, results))
        metrics.update(chance_metrics(task, task_dict, config.max_examples))
        metrics.update(task_metadata(task, results))
        sample_counts[task.label] = results["n-samples"][task.name]["effective"]
        metrics[f"lm_eval/{task.label}/seconds"] = time.perf_counter() - task_started
    metrics.update(average_metrics(metrics, sample_counts))
    metrics.update(dclm_core_metrics(config, metrics))
    metrics.update(run_metadata(config.sequence_start, max_length, chat_template_turns(config)))
    metrics["lm_eval/seconds"] = time.perf_counter() - started
    logger.debug(
        "lm_eval at step %d: %d tasks in %.1f s", step, len(config.tasks), metrics["lm_eval/seconds"]
    )
    return metrics


def chat_template_turns(config: EvalSuiteConfig) -> str | None:
    """How contexts meet the chat template: "multiturn" (each few-shot example a turn),
    "singleturn" (one user turn), None when no chat template is applied."""
    if not config.apply_chat_template:
        return None
    return "multiturn" if config.multiturn else "singleturn"


def effective_max_length(config: EvalSuiteConfig, model_max_length: int) -> int:
    """lm-eval's max_length for this suite: its own, else the model's (as lm-eval's runner
    reads max_position_embeddings); longer than the model reads is refused."""
    if config.max_length is not None and config.max_length > model_max_length:
        raise EvalTaskUnavailable(
            f"evals.max_length is {config.max_length} tokens but the model reads at most "
            f"{model_max_length} (its max_seq_len): lower evals.max_length or leave it unset"
        )
    return config.max_length or model_max_length


def load_suite_tasks(config: EvalSuiteConfig, *, model_max_length: int) -> list[dict[str, Any]]:
    """Check the suite against the model and build every task (downloading nothing: datasets
    come from the HF cache or local files). Call it when a run starts to learn at step 0 that
    the suite cannot run."""
    effective_max_length(config, model_max_length)
    manager = _task_manager_for(config)
    return [load_task(manager, task) for task in config.tasks]


def _task_manager_for(config: EvalSuiteConfig) -> TaskManager:
    # Indexing lm-eval's ~200 built-in task folders takes seconds: skip it when every task is local.
    local = _task_manager(config.task_paths, include_defaults=False) if config.task_paths else None
    if local is not None and all(task.name in local.all_tasks for task in config.tasks):
        return local
    return _task_manager(config.task_paths, include_defaults=True)


@functools.cache
def _task_manager(task_paths: tuple[str, ...], include_defaults: bool) -> TaskManager:
    return TaskManager(include_path=list(task_paths) or None, include_defaults=include_defaults)


def load_task(manager: TaskManager, task: EvalTask) -> dict[str, Any]:
    """One suite entry as lm-eval's TaskManager.load() result, set to its few-shot count."""
    if task.name not in manager.all_tasks:
        raise EvalTaskUnavailable(
            f"lm-eval has no task named {task.name!r} (suite entry {task.label!r}): check the name "
            "against `lm_eval --tasks list`, or put its YAML in a directory listed in evals.task_paths"
        )
    try:
        loaded = manager.load([task.name])
    except Exception as error:  # datasets raises ConnectionError, FileNotFoundError, ValueError...
        raise EvalTaskUnavailable(
            f"cannot load the data of lm-eval task {task.name!r} (suite entry {task.label!r}): "
            f"{error}. With no network, pre-fill the Hugging Face datasets cache on a machine "
            "that has one (HF_HOME / HF_DATASETS_CACHE, then run with HF_DATASETS_OFFLINE=1), or "
            "point evals.task_paths at local YAML tasks whose data_files are local files."
        ) from error
    if list(loaded["tasks"]) != [task.name]:
        raise EvalTaskUnavailable(
            f"{task.name!r} (suite entry {task.label!r}) is an lm-eval group or tag of "
            f"{sorted(loaded['tasks'])}: list those tasks in the suite one by one"
        )
    task_object = loaded["tasks"][task.name]
    if task_object.OUTPUT_TYPE not in SCORED_OUTPUT_TYPES:
        raise EvalTaskUnavailable(
            f"lm-eval task {task.name!r} (suite entry {task.label!r}) is a "
            f"{task_object.OUTPUT_TYPE} task: Kiln scores log-likelihoods only "
            f"({', '.join(SCORED_OUTPUT_TYPES)})"
        )
    task_object.set_config(key="num_fewshot", value=task.num_fewshot)
    task_object.set_fewshot_seed(seed=FEWSHOT_SEED)
    return loaded


def task_metrics(task: EvalTask, results: dict[str, Any]) -> dict[str, float]:
    """lm-eval's {"acc,none": 0.5, "acc_stderr,none": "N/A", "alias": ...} for the task ->
    {"lm_eval/{label}/acc": 0.5}; a non-default filter is kept as a suffix (acc_strict)."""
    metrics = {}
    for key, value in results["results"][task.name].items():
        metric, _, filter_name = key.partition(",")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # the alias, and stderr that bootstrap_iters=0 leaves as "N/A"
        name = metric if filter_name in ("", "none") else f"{metric}_{filter_name}"
        metrics[f"lm_eval/{task.label}/{name}"] = float(value)
    return metrics


def chance_metrics(task: EvalTask, loaded: dict[str, Any], limit: int | None) -> dict[str, float]:
    """{"lm_eval/{label}/acc_chance": ...}: the accuracy a model guessing at random has on the
    scored documents of a multiple-choice task (the mean of one over each one's choice count),
    the baseline to read `acc` against, as a loss is read against the unigram's."""
    task_object = loaded["tasks"][task.name]
    if task_object.OUTPUT_TYPE != "multiple_choice":
        return {}
    docs = list(task_object.eval_docs)
    docs = docs[:limit] if limit is not None else docs
    if not docs:
        return {}
    chance = sum(1.0 / len(task_object.doc_to_choice(doc)) for doc in docs) / len(docs)
    return {f"lm_eval/{task.label}/acc_chance": chance}


def average_metrics(metrics: dict[str, float], sample_counts: dict[str, int]) -> dict[str, float]:
    """Macro (each task counts once) and micro (each example counts once) averages of acc and
    acc_norm over the tasks that report them."""
    averages = {}
    for metric in AVERAGED_METRICS:
        values = {
            label: metrics[f"lm_eval/{label}/{metric}"]
            for label in sample_counts
            if f"lm_eval/{label}/{metric}" in metrics
        }
        if not values:
            continue
        counts = {label: sample_counts[label] for label in values}
        averages[f"lm_eval/averages/macro_{metric}"] = sum(values.values()) / len(values)
        averages[f"lm_eval/averages/micro_{metric}"] = sum(
            values[label] * counts[label] for label in values
        ) / sum(counts.values())
    return averages
