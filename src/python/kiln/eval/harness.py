"""lm-eval-harness in-process: an `LM` adapter over a JAX log-prob function, and the suite runner.

The adapter only sees `logprob_fn(tokens int32[B, T]) -> float32[B, T-1]`, the log-probability of
each next token. It packs (context, continuation) pairs into fixed-shape batches: B is fixed and T
is rounded up to one of a few bucket lengths, so a jitted `logprob_fn` compiles once per bucket,
never per example. See docs/evals.md.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from lm_eval.api.instance import Instance
from lm_eval.api.model import LM
from lm_eval.evaluator import evaluate
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from kiln.eval.tasks import EvalSuiteConfig, EvalTask

logger = logging.getLogger(__name__)

# log p(tokens[:, t+1] | tokens[:, :t+1]) as [B, T-1]; optionally also whether each next token is
# the model's argmax ([B, T-1] bool), which makes `is_greedy` exact (lambada's acc needs it).
LogprobFn = Callable[[np.ndarray], Any]

DEFAULT_BATCH_SIZE = 16
SMALLEST_BUCKET = 64
FEWSHOT_SEED = 1234  # lm-eval's own default: few-shot examples match other lm-eval runs
AVERAGED_METRICS = ("acc", "acc_norm")


class EvalTaskUnavailable(RuntimeError):
    """A suite task could not be loaded (unknown name, or its data is not reachable offline)."""


def default_bucket_lengths(max_length: int) -> tuple[int, ...]:
    """Powers of two from SMALLEST_BUCKET up to max_length, which is always the last bucket."""
    buckets = []
    length = SMALLEST_BUCKET
    while length < max_length:
        buckets.append(length)
        length *= 2
    return (*buckets, max_length)


@dataclass(frozen=True)
class TextEncoder:
    """What the adapter needs from a tokenizer: text -> ids (no special tokens), and the token
    every scored sequence starts with (BOS when the tokenizer has one, else EOS: a document in
    the packed training stream starts right after one)."""

    encode: Callable[[str], list[int]]
    prefix_id: int

    @classmethod
    def of(cls, tokenizer: Any) -> TextEncoder:
        """From kiln.data.tokenizer.LoadedTokenizer (encode(text) adds no specials; .info has
        bos_id / eos_id as the token caches frame documents) or a Hugging Face tokenizer."""
        info = getattr(tokenizer, "info", None)
        if info is not None and hasattr(info, "eos_id"):
            prefix_id = info.bos_id if info.bos_id is not None else info.eos_id
            return cls(encode=tokenizer.encode, prefix_id=int(prefix_id))

        bos_id = getattr(tokenizer, "bos_token_id", None)
        prefix_id = bos_id if bos_id is not None else getattr(tokenizer, "eos_token_id", None)
        if prefix_id is None:
            raise ValueError(
                f"tokenizer {type(tokenizer).__name__} defines neither bos_token_id nor "
                "eos_token_id: the adapter needs one to start every scored sequence"
            )

        def encode(text: str) -> list[int]:
            return list(tokenizer.encode(text, add_special_tokens=False))

        return cls(encode=encode, prefix_id=int(prefix_id))


@dataclass(frozen=True)
class _Scored:
    """A token sequence of which the last `num_scored` tokens are summed."""

    tokens: list[int]
    num_scored: int


class KilnLM(LM):
    """lm-eval `LM` over `logprob_fn`: loglikelihood and loglikelihood_rolling, no generation."""

    def __init__(
        self,
        logprob_fn: LogprobFn,
        tokenizer: Any,
        *,
        max_length: int,
        batch_size: int = DEFAULT_BATCH_SIZE,
        bucket_lengths: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        if max_length < 2:
            raise ValueError(
                f"max_length must be >= 2 (one context + one scored token), got {max_length}"
            )
        buckets = tuple(bucket_lengths or default_bucket_lengths(max_length))
        if list(buckets) != sorted(set(buckets)) or buckets[-1] != max_length:
            raise ValueError(
                f"bucket_lengths must increase strictly and end at max_length={max_length}, got {buckets}"
            )
        self._logprob_fn = logprob_fn
        self._text = TextEncoder.of(tokenizer)
        self.max_length = max_length
        self.batch_size = batch_size
        self.bucket_lengths = buckets
        self._warned_inexact_greedy = False

    # ---- the LM interface

    def loglikelihood(
        self, requests: list[Instance], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        return self._score([self._pair_to_scored(*request.args) for request in requests])

    def loglikelihood_rolling(
        self, requests: list[Instance], disable_tqdm: bool = False
    ) -> list[float]:
        windows: list[_Scored] = []
        owners: list[int] = []
        for owner, request in enumerate(requests):
            (text,) = request.args[:1]
            for window in self._rolling_windows(self._text.encode(text)):
                windows.append(window)
                owners.append(owner)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._score(windows)):
            totals[owner] += logprob
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        raise NotImplementedError(
            "Kiln's adapter scores log-likelihoods only: generate_until tasks are not supported. "
            "Use multiple_choice / loglikelihood / loglikelihood_rolling tasks."
        )

    # ---- requests -> token sequences

    def _pair_to_scored(self, context: str, continuation: str) -> _Scored:
        # As lm-eval's HFLM: trailing spaces of the context belong to the continuation, and the
        # continuation's ids are cut from the encoding of the whole text (BPE merges across).
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        whole = self._text.encode(context + continuation)
        context_ids = self._text.encode(context)
        continuation_ids = whole[len(context_ids) :]
        if len(continuation_ids) > self.max_length - 1:
            raise ValueError(
                f"a continuation of {len(continuation_ids)} tokens does not fit max_length "
                f"{self.max_length} (it needs at least one context token): {continuation[:80]!r}"
            )
        tokens = [self._text.prefix_id, *context_ids, *continuation_ids]
        # Long contexts lose their oldest tokens, as the model can only see max_length.
        return _Scored(tokens[-self.max_length :], len(continuation_ids))

    def _rolling_windows(self, token_ids: list[int]) -> Iterator[_Scored]:
        # Disjoint windows of at most max_length tokens, each predicting the tokens the previous
        # windows did not, with as much context as fits (lm-eval's perplexity convention).
        for context, predicted in map(
            make_disjoint_window,
            get_rolling_token_windows(
                token_list=token_ids,
                prefix_token=self._text.prefix_id,
                max_seq_len=self.max_length - 1,
                context_len=1,
            ),
        ):
            yield _Scored([*context, *predicted], len(predicted))

    # ---- batched scoring

    def _score(self, sequences: list[_Scored]) -> list[tuple[float, bool]]:
        results: list[tuple[float, bool]] = [(0.0, True)] * len(sequences)
        for bucket, indices in self._batches(sequences):
            batch = np.full((self.batch_size, bucket), self._text.prefix_id, dtype=np.int32)
            for row, index in enumerate(indices):
                tokens = sequences[index].tokens
                batch[row, : len(tokens)] = tokens
            logprobs, is_argmax = self._call(batch)
            for row, index in enumerate(indices):
                # logprobs[:, t] scores tokens[t + 1]: the last num_scored tokens of a sequence of
                # length n sit at t = n - 1 - num_scored ... n - 2.
                n, k = len(sequences[index].tokens), sequences[index].num_scored
                scored = slice(n - 1 - k, n - 1)
                results[index] = (
                    float(logprobs[row, scored].astype(np.float64).sum()),
                    bool(is_argmax[row, scored].all()),
                )
        return results

    def _batches(self, sequences: list[_Scored]) -> Iterator[tuple[int, list[int]]]:
        """(bucket length, up to batch_size sequence indices), shortest sequences first."""
        by_length = sorted(range(len(sequences)), key=lambda i: len(sequences[i].tokens))
        by_bucket: dict[int, list[int]] = {}
        for index in by_length:
            by_bucket.setdefault(self._bucket(len(sequences[index].tokens)), []).append(index)
        for bucket, indices in by_bucket.items():
            for start in range(0, len(indices), self.batch_size):
                yield bucket, indices[start : start + self.batch_size]

    def _bucket(self, length: int) -> int:
        return next(bucket for bucket in self.bucket_lengths if bucket >= length)

    def _call(self, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        output = self._logprob_fn(batch)
        if isinstance(output, tuple):
            logprobs, is_argmax = (np.asarray(x) for x in output)
            return logprobs, is_argmax.astype(bool)
        logprobs = np.asarray(output)
        if not self._warned_inexact_greedy:
            logger.warning(
                "logprob_fn returns log-probs only: is_greedy counts a token as the argmax only "
                "when its probability > 1/2, so metrics built on it (lambada acc) are lower bounds. "
                "Return (log_probs, is_argmax) from logprob_fn for exact values."
            )
            self._warned_inexact_greedy = True
        return logprobs, logprobs > math.log(0.5)


# ---- the suite


def run_eval_suite(
    logprob_fn: LogprobFn,
    tokenizer: Any,
    suite: dict[str, Any],
    step: int,
    *,
    max_length: int = 2048,
    batch_size: int = DEFAULT_BATCH_SIZE,
) -> dict[str, float]:
    """Run every task of `suite` (the spec's `evals` object) and return W&B-ready metrics:
    lm_eval/{alias or name}/{metric}, lm_eval/averages/{macro,micro}_{acc,acc_norm},
    lm_eval/{label}/seconds and lm_eval/seconds. Pass max_length = the model's max_seq_len."""
    config = EvalSuiteConfig.from_json(suite)
    started = time.perf_counter()
    loaded_tasks = load_suite_tasks(config)  # all of them first: a missing dataset fails fast
    lm = KilnLM(logprob_fn, tokenizer, max_length=max_length, batch_size=batch_size)
    metrics: dict[str, float] = {}
    sample_counts: dict[str, int] = {}
    for task, task_dict in zip(config.tasks, loaded_tasks):
        task_started = time.perf_counter()
        results = evaluate(
            lm, task_dict, limit=config.max_examples, bootstrap_iters=0, log_samples=False
        )
        metrics.update(task_metrics(task, results))
        sample_counts[task.label] = results["n-samples"][task.name]["effective"]
        metrics[f"lm_eval/{task.label}/seconds"] = time.perf_counter() - task_started
    metrics.update(average_metrics(metrics, sample_counts))
    metrics["lm_eval/seconds"] = time.perf_counter() - started
    logger.info(
        "lm_eval at step %d: %d tasks in %.1f s",
        step,
        len(config.tasks),
        metrics["lm_eval/seconds"],
    )
    return metrics


def load_suite_tasks(config: EvalSuiteConfig) -> list[dict[str, Any]]:
    """Build every task of the suite (downloading nothing: datasets come from the HF cache or
    local files). Call it when a run starts to learn at step 0 that a task cannot load."""
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
            f"{error}. With no network, pre-download it into the Hugging Face cache on a machine "
            "that has one (HF_HOME / HF_DATASETS_CACHE, then run with HF_DATASETS_OFFLINE=1), or "
            "point evals.task_paths at local YAML tasks whose data_files are local files."
        ) from error
    if list(loaded["tasks"]) != [task.name]:
        raise EvalTaskUnavailable(
            f"{task.name!r} (suite entry {task.label!r}) is an lm-eval group or tag of "
            f"{sorted(loaded['tasks'])}: list those tasks in the suite one by one"
        )
    task_object = loaded["tasks"][task.name]
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
