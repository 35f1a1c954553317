"""The unigram baseline: the loss a model that ignores context would get on a validation set.

A trained model's validation loss means little alone; next to the cross-entropy of the training
data's token frequencies it says how much the model learned beyond "which tokens are common".

Distribution: the training caches' token frequencies, mixed by the run's weights (each cache's
relative frequencies, weighted as the mixture samples them), with add-one smoothing over the
vocabulary at the scale of the tokens counted: p(v) = (q(v) N + 1) / (N + V), where q is the mixed
frequency, N the training tokens counted and V the vocabulary size. With one cache this is the
textbook add-one estimate. A training cache of more than MAX_TRAIN_TOKENS tokens is estimated from
evenly spaced chunks of that many tokens, so a terabyte cache costs seconds, not hours.

Positions: exactly those the validation loss counts (kiln.eval.validation via
kiln.data.mixture.fixed_batches): the targets tokens[t + 1] where loss_mask[t] is 1, in the first
`num_windows` windows of `seq_len` tokens. That is every token of those windows except each
document's first token and each window's first token (which has no context in the window).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from kiln.data.cache import TokenCache

# Tokens read per training-cache chunk (a power of two: see _stream_chunks) and per read.
CHUNK_TOKENS = 1 << 16
READ_TOKENS = 1 << 20
MAX_TRAIN_TOKENS = 1 << 25


def unigram_baseline(
    train: Sequence[tuple[TokenCache, float]],
    validation: TokenCache,
    *,
    seq_len: int,
    num_windows: int | None = None,
) -> float:
    """Cross-entropy (nats/token) of `validation`'s loss positions (the first `num_windows`
    windows of `seq_len`; all windows when None) under the smoothed unigram of `train`, a list
    of (cache, mixture weight)."""
    return cross_entropy(unigram_log_probs(train), validation, seq_len, num_windows)


def cross_entropy(
    log_probs: np.ndarray, validation: TokenCache, seq_len: int, num_windows: int | None
) -> float:
    """Mean -log p(target) over the validation loss positions, for log_probs [vocab] of
    unigram_log_probs (computed once for several validation sets)."""
    counts = target_counts(validation, seq_len, num_windows, vocab_size=len(log_probs))
    total = counts.sum()
    if total == 0:
        raise ValueError(f"{validation.path}: its validation windows predict no tokens")
    return float(-(counts @ log_probs) / total)


def unigram_log_probs(train: Sequence[tuple[TokenCache, float]]) -> np.ndarray:
    """float64 [vocab]: log p(v) of the weighted, add-one smoothed training unigram."""
    used = [(cache, float(weight)) for cache, weight in train if weight > 0]
    if not used:
        raise ValueError("the unigram baseline needs a training cache with a weight > 0")
    vocab_size = _shared_vocab_size([cache for cache, _ in used])
    total_weight = sum(weight for _, weight in used)
    mixed = np.zeros(vocab_size, np.float64)
    counted = 0
    for cache, weight in used:
        counts = token_counts(cache, vocab_size)
        mixed += weight / total_weight * counts / counts.sum()
        counted += int(counts.sum())
    return np.log((mixed * counted + 1.0) / (counted + vocab_size))


def token_counts(cache: TokenCache, vocab_size: int) -> np.ndarray:
    """int64 [vocab]: how often each token occurs in the cache (or its evenly spaced sample)."""
    counts = np.zeros(vocab_size, np.int64)
    for tokens in _stream_chunks(cache):
        counts += _bincount(tokens, vocab_size, cache)
    if counts.sum() == 0:
        raise ValueError(f"{cache.path}: the training cache holds no tokens")
    return counts


def target_counts(
    cache: TokenCache, seq_len: int, num_windows: int | None, *, vocab_size: int
) -> np.ndarray:
    """int64 [vocab]: how often each token is a counted target of the validation loss."""
    available = cache.num_windows(seq_len)
    total = available if num_windows is None else min(num_windows, available)
    if total < 1:
        raise ValueError(f"{cache.path} has fewer tokens than one window of seq_len={seq_len}")
    counts = np.zeros(vocab_size, np.int64)
    per_read = max(1, READ_TOKENS // seq_len)
    for start in range(0, total, per_read):
        batch = cache.windows(range(start, min(start + per_read, total)), seq_len)
        targets = batch.tokens[:, 1:][batch.loss_mask[:, :-1] > 0]
        counts += _bincount(targets, vocab_size, cache)
    return counts


def _stream_chunks(cache: TokenCache) -> Iterator[np.ndarray]:
    """The cache's tokens in chunks: all of them, or evenly spaced chunks of at most
    MAX_TRAIN_TOKENS in all.

    TokenCache reads aligned windows only, so the tail after the last whole chunk is read as
    windows of halving power-of-two sizes: each tail position is a multiple of the next size.
    """
    full = cache.num_windows(CHUNK_TOKENS)
    sampled = full * CHUNK_TOKENS > MAX_TRAIN_TOKENS
    if sampled:
        indices = np.linspace(0, full - 1, MAX_TRAIN_TOKENS // CHUNK_TOKENS).astype(np.int64)
    else:
        indices = np.arange(full)
    per_read = max(1, READ_TOKENS // CHUNK_TOKENS)
    for start in range(0, len(indices), per_read):
        yield cache.windows(indices[start : start + per_read].tolist(), CHUNK_TOKENS).tokens
    if sampled:
        return
    position, size = full * CHUNK_TOKENS, CHUNK_TOKENS
    while position < cache.num_tokens:
        while position + size > cache.num_tokens:
            size //= 2
        yield cache.windows([position // size], size).tokens
        position += size


def _bincount(tokens: np.ndarray, vocab_size: int, cache: TokenCache) -> np.ndarray:
    tokens = tokens.ravel()
    if len(tokens) and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(
            f"{cache.path}: token ids outside the vocabulary [0, {vocab_size}): "
            f"min {tokens.min()}, max {tokens.max()}"
        )
    return np.bincount(tokens, minlength=vocab_size)


def _shared_vocab_size(caches: Sequence[TokenCache]) -> int:
    sizes = {int(cache.tokenizer.vocab_size) for cache in caches}
    if len(sizes) != 1:
        raise ValueError(f"the training caches have different vocabulary sizes {sorted(sizes)}")
    return sizes.pop()
