"""How lm-eval requests become token sequences: the conventions `evals.sequence_start` names.

Every request is scored as one sequence of token ids whose last `num_scored` tokens are summed.
The model reads the sequence without its last token, at most `max_length` tokens: lm-eval's
`max_length` counts input tokens, so a sequence holds up to max_length + 1 tokens (the context
cut from the left, as lm-eval's Hugging Face runner does).

- `tokenizer` (the default) builds exactly what lm-eval 0.4's Hugging Face runner (HFLM, causal,
  `add_bos_token` and `prefix_token_id` unset) builds for the same tokenizer: texts encoded with
  the tokenizer's own special tokens (a Llama-3-style tokenizer adds BOS, a GPT-2-style one adds
  nothing), the continuation cut from the encoding of context + continuation, and lm-eval's
  prefix token (BOS, else EOS) as the whole context only when the context is empty. Rolling
  windows start from that prefix token.
- `document` starts every sequence with the token a document follows in Kiln's training stream
  (BOS when the token caches frame documents with one, else EOS), and encodes text as the token
  caches do (no special tokens; special-token strings are plain text).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from lm_eval.utils import get_rolling_token_windows, make_disjoint_window


@dataclass(frozen=True)
class ScoredSequence:
    """Token ids of which the last `num_scored` are scored; the model reads tokens[:-1]."""

    tokens: list[int]
    num_scored: int


class SequenceConvention(Protocol):
    """Turns request texts into (context ids, continuation ids)."""

    prefix_id: int  # the token a rolling document's first window conditions on

    def pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]: ...

    def document(self, text: str) -> list[int]: ...


def scored_pair(context: list[int], continuation: list[int], max_length: int) -> ScoredSequence:
    """HFLM's `_loglikelihood_tokens`: the model reads (context + continuation)[:-1], cut from the
    left to its last max_length tokens, and the continuation's tokens are scored."""
    if not context:
        raise ValueError("a request has no context tokens to condition on (an all-space context)")
    if not continuation:
        raise ValueError("a request has an empty continuation: nothing to score")
    if len(continuation) > max_length:
        raise ValueError(
            f"a continuation of {len(continuation)} tokens does not fit max_length {max_length}"
        )
    return ScoredSequence([*context, *continuation][-(max_length + 1) :], len(continuation))


def rolling_windows(tokens: list[int], prefix_id: int, max_length: int) -> list[ScoredSequence]:
    """lm-eval's disjoint perplexity windows: each token predicted once, with as much context
    as max_length input tokens allow; the first window conditions on `prefix_id`."""
    windows = get_rolling_token_windows(
        token_list=tokens, prefix_token=prefix_id, max_seq_len=max_length, context_len=1
    )
    return [
        scored_pair(context, predicted, max_length)
        for context, predicted in map(make_disjoint_window, windows)
    ]


def split_trailing_spaces(context: str, continuation: str) -> tuple[str, str]:
    """lm-eval's rule: trailing spaces of the context belong to the continuation."""
    n_spaces = len(context) - len(context.rstrip())
    if not n_spaces:
        return context, continuation
    return context[:-n_spaces], context[-n_spaces:] + continuation


class TokenizerConvention:
    """lm-eval 0.4.13's HFLM (`tok_encode`, `_encode_pair`, the empty-context rule of
    `TemplateLM.loglikelihood`, `loglikelihood_rolling`) over a Hugging Face tokenizer."""

    def __init__(self, hf_tokenizer: Any) -> None:
        bos_id, eos_id = hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id
        if bos_id is None and eos_id is None:
            raise ValueError(
                f"tokenizer {type(hf_tokenizer).__name__} defines neither bos_token_id nor "
                "eos_token_id: lm-eval needs one as the prefix token of an empty context"
            )
        self._tokenizer = hf_tokenizer
        self.prefix_id = int(bos_id if bos_id is not None else eos_id)
        self._prefix_text = hf_tokenizer.decode(self.prefix_id)

    def _encode(self, text: str) -> list[int]:
        # The tokenizer's own special tokens, unless the text already starts with the prefix.
        if self._prefix_text and text.startswith(self._prefix_text):
            return list(self._tokenizer.encode(text, add_special_tokens=False))
        return list(self._tokenizer.encode(text))

    def pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        if context == "":
            ids = list(self._tokenizer.encode(continuation, add_special_tokens=False))
            if ids and ids[0] == self.prefix_id:
                return ids[:1], ids[1:]
            return [self.prefix_id], ids
        context, continuation = split_trailing_spaces(context, continuation)
        whole = self._encode(context + continuation)
        context_ids = self._encode(context)
        return context_ids, whole[len(context_ids) :]

    def document(self, text: str) -> list[int]:
        return self._encode(text)


class DocumentConvention:
    """Sequences as Kiln trains on them: `start_id`, then text without special tokens."""

    def __init__(self, encode: Callable[[str], list[int]], start_id: int) -> None:
        self._encode = encode
        self.prefix_id = start_id

    def pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        context, continuation = split_trailing_spaces(context, continuation)
        whole = self._encode(context + continuation)
        context_ids = self._encode(context)
        return [self.prefix_id, *context_ids], whole[len(context_ids) :]

    def document(self, text: str) -> list[int]:
        return self._encode(text)


def sequence_convention(tokenizer: Any, sequence_start: str) -> SequenceConvention:
    """The convention over kiln.data.tokenizer.LoadedTokenizer or a Hugging Face tokenizer."""
    info: Any = getattr(tokenizer, "info", None)  # LoadedTokenizer.info, else None
    is_loaded = info is not None and hasattr(info, "eos_id")
    if sequence_start == "tokenizer":
        return TokenizerConvention(_as_loaded_by_hf(tokenizer) if is_loaded else tokenizer)
    if sequence_start != "document":
        raise ValueError(f"sequence_start must be 'tokenizer' or 'document', got {sequence_start!r}")
    if is_loaded:  # the token caches' own framing and encoding
        start_id = info.bos_id if info.bos_id is not None else info.eos_id
        return DocumentConvention(tokenizer.encode, int(start_id))
    start_id = tokenizer.bos_token_id
    if start_id is None:
        start_id = tokenizer.eos_token_id
    if start_id is None:
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} defines neither bos_token_id nor eos_token_id: "
            "sequence_start='document' needs one to start every sequence"
        )

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    return DocumentConvention(encode, int(start_id))


def _as_loaded_by_hf(loaded: Any) -> Any:
    """The Hugging Face tokenizer as `AutoTokenizer.from_pretrained` gives it (what lm-eval
    loads): Kiln's token caches read special-token strings as plain text, lm-eval does not."""
    hf_tokenizer = copy.deepcopy(loaded.hf_tokenizer)
    hf_tokenizer.backend_tokenizer.encode_special_tokens = False
    return hf_tokenizer
