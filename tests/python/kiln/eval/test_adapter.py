"""KilnLM against a tiny Llama and a bigram model: exact log-likelihoods, windows, buckets."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from kiln_testing.lm_eval_tasks import (
    EOS_ID,
    VOCAB,
    VOCAB_SIZE,
    WORDS,
    bigram_sequence_logprob,
    make_bigram_logprob_fn,
)
from lm_eval.api.instance import Instance

from kiln.eval.harness import KilnLM, default_bucket_lengths
from kiln.model.config import LlamaConfig
from kiln.model.llama import Llama

MAX_LENGTH = 32


def _requests(request_type: str, arguments: list[tuple]) -> list[Instance]:
    return [Instance(request_type, {}, args, idx) for idx, args in enumerate(arguments)]


def _words(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(WORDS, size=n))


@pytest.fixture(scope="module")
def llama_logits():
    """A tiny float32 Llama's jitted logits function, tokens [B, T] -> [B, T, V]."""
    config = LlamaConfig(
        max_seq_len=MAX_LENGTH,
        hidden_dim=32,
        intermediate_dim=64,
        num_heads=4,
        num_kv_heads=2,
        num_layers=1,
        vocab_size=VOCAB_SIZE,
        init_std=0.5,  # sharper than the default, so argmax and sums are not all alike
    )
    graphdef, state = nnx.split(Llama(config, rngs=nnx.Rngs(0), compute_dtype=jnp.float32))
    return jax.jit(lambda tokens: nnx.merge(graphdef, state)(tokens))


def _logprob_fn(logits_fn):
    @jax.jit
    def logprob_fn(tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        log_probs = jax.nn.log_softmax(logits_fn(tokens)[:, :-1], axis=-1)
        targets = tokens[:, 1:]
        picked = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
        return picked, jnp.argmax(log_probs, axis=-1) == targets

    return logprob_fn


def _model_continuation_score(logits_fn, tokens: list[int], num_scored: int):
    """The model's own log-probs, run on exactly these tokens (no padding, no batching)."""
    logits = np.asarray(logits_fn(np.asarray([tokens], np.int32))[0], np.float64)
    log_probs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    positions = range(len(tokens) - num_scored, len(tokens))
    total = sum(float(log_probs[t - 1, tokens[t]]) for t in positions)
    greedy = all(int(np.argmax(log_probs[t - 1])) == tokens[t] for t in positions)
    return total, greedy


def test_loglikelihood_equals_the_models_own_log_probs(llama_logits, tokenizer):
    rng = np.random.default_rng(1)
    pairs = [
        ("", _words(rng, 3)),  # empty context: scored after the prefix token alone
        (_words(rng, 2), " " + _words(rng, 1)),  # as long as the first: one more reference shape
        (_words(rng, 9) + " ", _words(rng, 4)),  # trailing space moves to the continuation
        (_words(rng, 60), " " + _words(rng, 5)),  # longer than MAX_LENGTH: cut from the left
    ]
    lm = KilnLM(
        _logprob_fn(llama_logits),
        tokenizer,
        max_length=MAX_LENGTH,
        batch_size=2,
        bucket_lengths=(16, MAX_LENGTH),
    )
    results = lm.loglikelihood(_requests("loglikelihood", pairs))

    for (context, continuation), (logprob, greedy) in zip(pairs, results):
        context_ids = tokenizer.encode(context.rstrip(), add_special_tokens=False)
        continuation_ids = tokenizer.encode(continuation, add_special_tokens=False)
        tokens = ([EOS_ID, *context_ids, *continuation_ids])[-MAX_LENGTH:]
        expected = _model_continuation_score(llama_logits, tokens, len(continuation_ids))
        assert (logprob, greedy) == (pytest.approx(expected[0], abs=1e-4), expected[1])


def test_is_greedy_is_true_for_the_models_argmax_continuation(llama_logits, tokenizer):
    context = "w1 w2 w3"
    context_tokens = [EOS_ID, *tokenizer.encode(context, add_special_tokens=False)]
    logits = llama_logits(np.asarray([context_tokens], np.int32))
    next_id = int(np.argmax(np.asarray(logits)[0, -1]))
    next_word = tokenizer.convert_ids_to_tokens(next_id)
    other_word = next(w for w in WORDS if w != next_word)
    lm = KilnLM(
        _logprob_fn(llama_logits), tokenizer, max_length=MAX_LENGTH, bucket_lengths=(16, MAX_LENGTH)
    )

    (_, argmax_greedy), (_, other_greedy) = lm.loglikelihood(
        _requests("loglikelihood", [(context, f" {next_word}"), (context, f" {other_word}")])
    )
    assert argmax_greedy is True
    assert other_greedy is False


def test_rolling_windows_cover_every_token_once(tokenizer):
    # Under a bigram model each token's log-prob depends on its predecessor only, so the sum
    # over lm-eval's windows must equal the whole document's sum after the prefix token.
    table = np.random.default_rng(2).normal(size=(VOCAB_SIZE, VOCAB_SIZE))
    rng = np.random.default_rng(3)
    docs = [_words(rng, n) for n in (1, 7, 31, 32, 100)]
    lm = KilnLM(make_bigram_logprob_fn(table), tokenizer, max_length=8, batch_size=4)

    totals = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(d,) for d in docs]))

    for doc, total in zip(docs, totals):
        tokens = [EOS_ID, *tokenizer.encode(doc, add_special_tokens=False)]
        assert total == pytest.approx(bigram_sequence_logprob(table, tokens), abs=1e-4)


def test_compilations_are_bounded_by_buckets_not_lengths(tokenizer):
    table = np.random.default_rng(4).normal(size=(VOCAB_SIZE, VOCAB_SIZE))
    logprob_fn = make_bigram_logprob_fn(table)
    max_length = 256
    lm = KilnLM(logprob_fn, tokenizer, max_length=max_length, batch_size=8)
    rng = np.random.default_rng(5)
    lengths = list(range(1, 200, 3))
    pairs = [(_words(rng, n), " w7") for n in lengths]

    results = lm.loglikelihood(_requests("loglikelihood", pairs))

    buckets_hit = {next(b for b in lm.bucket_lengths if b >= n + 2) for n in lengths}
    assert lm.bucket_lengths == default_bucket_lengths(max_length) == (64, 128, 256)
    assert len(set(lengths)) > 20
    assert logprob_fn._cache_size() == len(buckets_hit) == 3
    for (context, _), (logprob, _) in zip(pairs, results):
        prev = tokenizer.encode(context, add_special_tokens=False)[-1]
        assert logprob == pytest.approx(
            bigram_sequence_logprob(table, [prev, VOCAB["w7"]]), abs=1e-4
        )


def test_log_probs_only_fn_gives_the_same_sums(tokenizer):
    table = np.random.default_rng(6).normal(size=(VOCAB_SIZE, VOCAB_SIZE))
    both = make_bigram_logprob_fn(table)
    pairs = [("w1 w2", " w3 w4"), ("w5", " w6")]

    exact = KilnLM(both, tokenizer, max_length=16).loglikelihood(_requests("loglikelihood", pairs))
    only = KilnLM(lambda tokens: both(tokens)[0], tokenizer, max_length=16).loglikelihood(
        _requests("loglikelihood", pairs)
    )
    assert [logprob for logprob, _ in only] == pytest.approx([lp for lp, _ in exact])


def test_generation_is_refused_clearly(tokenizer):
    lm = KilnLM(
        make_bigram_logprob_fn(np.zeros((VOCAB_SIZE, VOCAB_SIZE))), tokenizer, max_length=16
    )
    with pytest.raises(NotImplementedError, match="log-likelihoods only"):
        lm.generate_until(_requests("generate_until", [("w1", {"until": ["\n"]})]))


def test_continuation_longer_than_the_model_is_an_error(tokenizer):
    lm = KilnLM(make_bigram_logprob_fn(np.zeros((VOCAB_SIZE, VOCAB_SIZE))), tokenizer, max_length=8)
    with pytest.raises(ValueError, match="does not fit max_length 8"):
        lm.loglikelihood(_requests("loglikelihood", [("w1", " " + " ".join(WORDS[:8]))]))


@pytest.mark.parametrize("buckets", [(8, 4, 16), (8, 12)])
def test_bucket_lengths_must_increase_to_max_length(tokenizer, buckets):
    with pytest.raises(ValueError, match="bucket_lengths"):
        KilnLM(lambda t: t, tokenizer, max_length=16, bucket_lengths=buckets)


def test_kiln_loaded_tokenizer_scores_like_the_hf_one(tokenizer, tmp_path):
    from kiln.data.tokenizer import load_tokenizer

    tokenizer.save_pretrained(tmp_path / "word_level")
    loaded = load_tokenizer({"kind": "local", "path": str(tmp_path / "word_level")})
    logprob_fn = make_bigram_logprob_fn(np.random.default_rng(7).normal(size=(VOCAB_SIZE,) * 2))
    pairs = [("", " w1 w2"), ("w3 w4 ", "w5"), ("w6", " w7 w8 w9")]

    via_kiln = KilnLM(logprob_fn, loaded, max_length=16).loglikelihood(
        _requests("loglikelihood", pairs)
    )
    via_hf = KilnLM(logprob_fn, tokenizer, max_length=16).loglikelihood(
        _requests("loglikelihood", pairs)
    )
    assert loaded.info.eos_id == EOS_ID and loaded.info.bos_id is None
    assert via_kiln == via_hf
