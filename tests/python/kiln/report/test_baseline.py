"""The unigram baseline against a plain-Python recomputation on tiny real token caches."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

# The trainer tests' helpers build real caches with the committed tokenizer.
from kiln_testing.training import build_tiny_cache

from kiln.data.cache import TokenCache
from kiln.report import baseline
from kiln.report.baseline import target_counts, token_counts, unigram_baseline, unigram_log_probs

VOCAB = 8192  # experiments/tokenizers/kiln-stdlib-8k


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TokenCache]:
    folder = tmp_path_factory.mktemp("caches")
    sizes = {"a": (30, 1), "b": (12, 2), "val": (10, 3)}
    return {
        name: TokenCache.open(build_tiny_cache(folder, name, documents, seed))
        for name, (documents, seed) in sizes.items()
    }


def documents(cache: TokenCache) -> list[list[int]]:
    return [cache.document(i).tolist() for i in range(cache.num_documents)]


def stream(cache: TokenCache) -> list[int]:
    return [token for doc in documents(cache) for token in doc]


def expected_targets(cache: TokenCache, seq_len: int, num_windows: int) -> Counter:
    """Window w covers stream[w*L : (w+1)*L]; a position is counted when it and the position
    before it are in the window and in the same document."""
    doc_of = [i for i, doc in enumerate(documents(cache)) for _ in doc]
    tokens = stream(cache)
    counted = Counter()
    for w in range(num_windows):
        for pos in range(w * seq_len + 1, (w + 1) * seq_len):
            if doc_of[pos] == doc_of[pos - 1]:
                counted[tokens[pos]] += 1
    return counted


def expected_baseline(train: list[tuple[TokenCache, float]], val: Counter) -> float:
    counts = [(Counter(stream(c)), w) for c, w in train]
    n = sum(sum(c.values()) for c, _ in counts)
    total_weight = sum(w for _, w in train)

    def prob(token: int) -> float:
        mixed = sum(w / total_weight * c[token] / sum(c.values()) for c, w in counts)
        return (mixed * n + 1) / (n + VOCAB)

    return -sum(k * math.log(prob(t)) for t, k in val.items()) / sum(val.values())


@pytest.fixture(params=[None, 64], ids=["default-chunks", "64-token-chunks"])
def chunking(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small chunks force several reads and the power-of-two tail of _stream_chunks."""
    if request.param is not None:
        monkeypatch.setattr(baseline, "CHUNK_TOKENS", request.param)
        monkeypatch.setattr(baseline, "READ_TOKENS", 2 * request.param)


def test_token_counts_count_every_token(caches: dict[str, TokenCache], chunking: None) -> None:
    cache = caches["a"]
    assert cache.num_tokens % 64 != 0  # the tail after whole chunks is not empty
    expected = np.bincount(np.asarray(stream(cache)), minlength=VOCAB)
    np.testing.assert_array_equal(token_counts(cache, VOCAB), expected)


def test_a_large_cache_is_estimated_from_evenly_spaced_chunks(
    caches: dict[str, TokenCache], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(baseline, "CHUNK_TOKENS", 64)
    monkeypatch.setattr(baseline, "MAX_TRAIN_TOKENS", 128)
    cache, tokens = caches["a"], stream(caches["a"])
    last = cache.num_tokens // 64 - 1
    sampled = tokens[:64] + tokens[last * 64 : (last + 1) * 64]
    np.testing.assert_array_equal(
        token_counts(cache, VOCAB), np.bincount(np.asarray(sampled), minlength=VOCAB)
    )


def test_targets_are_the_validation_loss_positions(
    caches: dict[str, TokenCache], chunking: None
) -> None:
    val = caches["val"]
    counts = target_counts(val, 16, 5, vocab_size=VOCAB)
    expected = expected_targets(val, 16, 5)
    assert {t: int(counts[t]) for t in np.flatnonzero(counts)} == dict(expected)
    every = target_counts(val, 16, None, vocab_size=VOCAB).sum()
    assert every == sum(expected_targets(val, 16, val.num_windows(16)).values()) > counts.sum()


def test_baseline_matches_a_plain_recomputation(
    caches: dict[str, TokenCache], chunking: None
) -> None:
    train = [(caches["a"], 3.0), (caches["b"], 1.0)]
    got = unigram_baseline(train, caches["val"], seq_len=16, num_windows=5)
    assert got == pytest.approx(expected_baseline(train, expected_targets(caches["val"], 16, 5)))
    # The weights matter: b alone gives another value.
    alone = unigram_baseline([(caches["b"], 1.0)], caches["val"], seq_len=16, num_windows=5)
    assert abs(alone - got) > 1e-3


def test_smoothed_distribution_is_normalised_and_ignores_zero_weights(
    caches: dict[str, TokenCache],
) -> None:
    log_probs = unigram_log_probs([(caches["a"], 2.0), (caches["b"], 0.0)])
    assert np.exp(log_probs).sum() == pytest.approx(1.0)
    np.testing.assert_array_equal(log_probs, unigram_log_probs([(caches["a"], 1.0)]))
    with pytest.raises(ValueError, match="weight > 0"):
        unigram_log_probs([(caches["a"], 0.0)])
