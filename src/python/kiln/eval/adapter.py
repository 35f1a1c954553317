"""lm-eval's `LM` interface over a JAX log-prob function: KilnLM.

The adapter only sees `logprob_fn(tokens int32[B, T]) -> float32[B, T-1]`, the log-probability of
each next token; the model reads tokens[:, :-1], so T is at most max_length + 1. Requests become
token sequences by the suite's `sequence_start` convention (kiln.eval.sequences: lm-eval's own
Hugging Face runner by default). Sequences are packed into fixed-shape batches: B is fixed and
the model's input length is rounded up to one of a few bucket lengths, so a jitted `logprob_fn`
compiles once per bucket, never per example. With a suite's `apply_chat_template`, lm-eval
renders each context through `apply_chat_template`, which does what lm-eval's own runner does
with the Hugging Face tokenizer's chat template; the rendered context is then encoded like any
other. See docs/evals.md.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from lm_eval.api.instance import Instance
from lm_eval.api.model import LM

from kiln.eval.sequences import (
    ScoredSequence,
    rolling_windows,
    scored_pair,
    sequence_convention,
)
from kiln.eval.tasks import DEFAULT_SEQUENCE_START

logger = logging.getLogger(__name__)

# log p(tokens[:, t+1] | tokens[:, :t+1]) as [B, T-1], the model reading tokens[:, :-1]; optionally
# also whether each next token is the model's argmax ([B, T-1] bool), which makes `is_greedy`
# exact (lambada's acc needs it).
LogprobFn = Callable[[np.ndarray], Any]

DEFAULT_BATCH_SIZE = 16
SMALLEST_BUCKET = 64


def default_bucket_lengths(max_length: int) -> tuple[int, ...]:
    """Model input lengths: powers of two from SMALLEST_BUCKET up to max_length, which is always
    the last bucket."""
    buckets = []
    length = SMALLEST_BUCKET
    while length < max_length:
        buckets.append(length)
        length *= 2
    return (*buckets, max_length)


def chat_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer whose chat template lm-eval's runner would apply: a
    kiln.data.tokenizer.LoadedTokenizer's `hf_tokenizer`, else the tokenizer itself."""
    return getattr(tokenizer, "hf_tokenizer", tokenizer)


class KilnLM(LM):
    """lm-eval `LM` over `logprob_fn`: loglikelihood and loglikelihood_rolling, no generation.
    `max_length` counts the model's input tokens, as lm-eval's max_length does."""

    def __init__(
        self,
        logprob_fn: LogprobFn,
        tokenizer: Any,
        *,
        max_length: int,
        batch_size: int = DEFAULT_BATCH_SIZE,
        bucket_lengths: Sequence[int] | None = None,
        sequence_start: str = DEFAULT_SEQUENCE_START,
    ) -> None:
        super().__init__()
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1 input token, got {max_length}")
        buckets = tuple(bucket_lengths or default_bucket_lengths(max_length))
        if list(buckets) != sorted(set(buckets)) or buckets[-1] != max_length:
            raise ValueError(
                f"bucket_lengths must increase strictly and end at max_length={max_length}, got {buckets}"
            )
        self._logprob_fn = logprob_fn
        self._convention = sequence_convention(tokenizer, sequence_start)
        self._hf_tokenizer = chat_tokenizer(tokenizer)
        self.max_length = max_length
        self.batch_size = batch_size
        self.bucket_lengths = buckets
        self._warned_inexact_greedy = False

    # ---- the LM interface

    def loglikelihood(
        self, requests: list[Instance], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        return self.score_sequences([self._pair_to_scored(*request.args) for request in requests])

    def loglikelihood_rolling(
        self, requests: list[Instance], disable_tqdm: bool = False
    ) -> list[float]:
        windows: list[ScoredSequence] = []
        owners: list[int] = []
        for owner, request in enumerate(requests):
            (text,) = request.args[:1]
            tokens = self._convention.document(text)
            for window in rolling_windows(tokens, self._convention.prefix_id, self.max_length):
                windows.append(window)
                owners.append(owner)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self.score_sequences(windows)):
            totals[owner] += logprob
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        raise NotImplementedError(
            "Kiln's adapter scores log-likelihoods only: generate_until tasks are not supported. "
            "Use multiple_choice / loglikelihood / loglikelihood_rolling tasks."
        )

    # ---- chat templates, as lm-eval's HFLM applies them

    @property
    def tokenizer_name(self) -> str:
        """HFLM's: part of lm-eval's request-cache key when a chat template is applied."""
        return str(self._hf_tokenizer.name_or_path).replace("/", "__")

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """HFLM's `apply_chat_template` (lm-eval 0.4.13, no chat_template_args): the Hugging Face
        tokenizer's chat template rendered to text, the system turn dropped when the template
        refuses it. The text is encoded as every context is (the tokenizer's special tokens,
        unless it already starts with the prefix token's text: a template that writes BOS)."""

        def render(history: list[dict[str, str]]) -> str:
            return str(
                self._hf_tokenizer.apply_chat_template(
                    history,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=not add_generation_prompt,
                )
            )

        import jinja2

        try:
            return render(chat_history)
        except jinja2.TemplateError:
            logger.warning("Failed to apply chat template: retrying without the system turn.")
            return render([message for message in chat_history if message["role"] != "system"])

    # ---- requests -> token sequences

    def _pair_to_scored(self, context: str, continuation: str) -> ScoredSequence:
        context_ids, continuation_ids = self._convention.pair(context, continuation)
        try:
            return scored_pair(context_ids, continuation_ids, self.max_length)
        except ValueError as error:
            raise ValueError(
                f"{error}: context ...{context[-80:]!r}, continuation {continuation[:80]!r}..."
            ) from None

    # ---- batched scoring

    def score_sequences(self, sequences: list[ScoredSequence]) -> list[tuple[float, bool]]:
        """(sum of the scored tokens' log-probs, whether each is the argmax) per sequence."""
        results: list[tuple[float, bool]] = [(0.0, True)] * len(sequences)
        for bucket, indices in self._batches(sequences):
            # bucket input positions + the last target; padding (right) is any valid token id.
            batch = np.full((self.batch_size, bucket + 1), self._convention.prefix_id, np.int32)
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

    def _batches(self, sequences: list[ScoredSequence]) -> Iterator[tuple[int, list[int]]]:
        """(bucket input length, up to batch_size sequence indices), shortest sequences first."""
        by_length = sorted(range(len(sequences)), key=lambda i: len(sequences[i].tokens))
        by_bucket: dict[int, list[int]] = {}
        for index in by_length:
            input_length = len(sequences[index].tokens) - 1
            by_bucket.setdefault(self._bucket(input_length), []).append(index)
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
