from __future__ import annotations

import math

import numpy as np
import pytest
from kiln_testing.data import STDLIB_TOKENIZER
from kiln_testing.training import build_tiny_cache

from kiln.data.cache import TokenCache
from kiln.data.mixture import fixed_batches
from kiln.data.tokenizer import load_tokenizer
from kiln.eval.validation import ValidationSet, predicted_target_bytes, validation_metrics

SEQ_LEN = 32


def uniform_model(vocab_size: int):
    """The eval function of a model that gives every token probability 1/V: CE = ln V each."""

    def eval_fn(batch):
        count = batch["loss_mask"][:, :-1].sum()
        return {"loss_sum": count * math.log(vocab_size), "token_count": count}

    return eval_fn


def test_predicted_target_bytes_counts_only_masked_positions() -> None:
    byte_lengths = np.array([0, 1, 2, 3, 4])
    batch = {
        "tokens": np.array([[1, 2, 3, 0, 4]]),
        "loss_mask": np.array([[1, 1, 0, 1, 0]], np.float32),  # predicts 2, 3 and (t=3) 4
    }
    assert predicted_target_bytes(batch, byte_lengths) == 2 + 3 + 4


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> list[TokenCache]:
    folder = tmp_path_factory.mktemp("val")
    return [TokenCache.open(build_tiny_cache(folder, f"val{i}", 30 + 30 * i, seed=10 + i))
            for i in range(2)]  # fmt: skip


def test_target_bytes_equal_the_decoded_text(caches: list[TokenCache]) -> None:
    cache = caches[0]
    batch = fixed_batches(cache, SEQ_LEN, batch_size=4, num_batches=1)[0]
    tokenizer = load_tokenizer(STDLIB_TOKENIZER)
    expected = 0
    for tokens, mask in zip(batch["tokens"], batch["loss_mask"]):
        predicted = tokens[1:][mask[:-1] > 0]  # EOS is special: 0 bytes, and decodes to ""
        expected += len(
            tokenizer.decode([t for t in predicted if t != cache.tokenizer.eos_id]).encode()
        )
    assert predicted_target_bytes(batch, cache.token_byte_lengths) == expected > 0


def test_uniform_model_loss_is_ln_vocab_and_bpb_follows(caches: list[TokenCache]) -> None:
    byte_lengths = caches[0].token_byte_lengths
    vocab = caches[0].tokenizer.vocab_size
    sets = [ValidationSet.build(f"tokenized/v{i}", fixed_batches(c, SEQ_LEN, 4, 2), byte_lengths)
            for i, c in enumerate(caches)]  # fmt: skip
    metrics = validation_metrics(uniform_model(vocab), sets)

    tokens = [sum(b["loss_mask"][:, :-1].sum() for b in s.batches) for s in sets]
    nats = [t * math.log(vocab) for t in tokens]
    for s, n in zip(sets, nats):
        assert metrics[f"eval/{s.name}/loss"] == pytest.approx(math.log(vocab))
        assert metrics[f"eval/{s.name}/bpb"] == pytest.approx(n / (math.log(2) * s.target_bytes))
    assert metrics["eval/loss"] == pytest.approx(math.log(vocab))
    total_bytes = sum(s.target_bytes for s in sets)
    assert metrics["eval/bpb"] == pytest.approx(sum(nats) / (math.log(2) * total_bytes))
    per_set = [metrics[f"eval/{s.name}/bpb"] for s in sets]
    assert metrics["eval/macro_bpb"] == pytest.approx(sum(per_set) / 2)
    assert per_set[0] != per_set[1]  # so the weighted and macro averages are really different
    assert metrics["eval/bpb"] != pytest.approx(metrics["eval/macro_bpb"], rel=1e-9)


def scripted_set(name: str, nats: float, tokens: float, target_bytes: int) -> ValidationSet:
    return ValidationSet(name, ({"nats": np.float64(nats), "tokens": np.float64(tokens)},), target_bytes)


def test_groups_get_macro_and_micro_averages_as_levanter_logs_them() -> None:
    sets = [scripted_set("paloma/c4_en", 20, 10, 40), scripted_set("paloma/ptb", 30, 30, 50),
            scripted_set("uncheatable/bbc_news", 40, 10, 10)]  # fmt: skip
    metrics = validation_metrics(lambda b: {"loss_sum": b["nats"], "token_count": b["tokens"]}, sets)
    bits = 1 / math.log(2)
    expected = {
        "eval/paloma/c4_en/loss": 2.0, "eval/paloma/c4_en/bpb": 20 / 40 * bits,
        "eval/paloma/ptb/loss": 1.0, "eval/paloma/ptb/bpb": 30 / 50 * bits,
        "eval/uncheatable/bbc_news/loss": 4.0, "eval/uncheatable/bbc_news/bpb": 40 / 10 * bits,
        "eval/paloma/macro_loss": 1.5, "eval/paloma/micro_loss": 50 / 40,
        "eval/paloma/macro_bpb": (20 / 40 + 30 / 50) / 2 * bits, "eval/paloma/bpb": 50 / 90 * bits,
        "eval/uncheatable/macro_loss": 4.0, "eval/uncheatable/micro_loss": 4.0,
        "eval/uncheatable/macro_bpb": 4 * bits, "eval/uncheatable/bpb": 4 * bits,
        "eval/loss": 90 / 50, "eval/macro_loss": 7 / 3,
        "eval/bpb": 90 / 100 * bits, "eval/macro_bpb": (0.5 + 0.6 + 4) / 3 * bits,
    }  # fmt: skip
    assert metrics == pytest.approx(expected)


def test_no_sets_no_metrics() -> None:
    assert validation_metrics(uniform_model(10), []) == {}
