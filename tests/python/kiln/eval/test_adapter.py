"""KilnLM against a tiny Llama and a bigram model: the sequences each convention builds, exact
log-likelihoods, max_length in input tokens, rolling windows, buckets."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from kiln_testing.lm_eval_tasks import (
    BOS_ID,
    EOS_ID,
    VOCAB,
    VOCAB_SIZE,
    WORDS,
    bigram_sequence_logprob,
    make_bigram_logprob_fn,
    make_tokenizer,
)
from lm_eval.api.instance import Instance

from kiln.eval.adapter import KilnLM, default_bucket_lengths
from kiln.model.config import LlamaConfig
from kiln.model.llama import Llama
from kiln.train.step import make_logprob_fn

MAX_LENGTH = 32
CONVENTIONS = ("tokenizer", "document")


def _requests(request_type: str, arguments: list[tuple]) -> list[Instance]:
    return [Instance(request_type, {}, args, idx) for idx, args in enumerate(arguments)]


def _words(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(WORDS, size=n))


def _ids(text: str) -> list[int]:
    return [VOCAB[word] for word in text.split()]


class RecordingFn:
    """A bigram logprob_fn that keeps every batch it was called with."""

    def __init__(self, table: np.ndarray | None = None) -> None:
        table = np.zeros((VOCAB_SIZE, VOCAB_SIZE)) if table is None else table
        self._bigram = make_bigram_logprob_fn(table)
        self.batches: list[np.ndarray] = []

    def __call__(self, tokens: np.ndarray):
        self.batches.append(np.asarray(tokens).copy())
        return self._bigram(tokens)

    def rows(self, pad: int) -> list[list[int]]:
        """Every real row, right padding (`pad`) stripped."""
        rows = []
        for batch in self.batches:
            for row in batch.tolist():
                while row and row[-1] == pad:
                    row.pop()
                if row:
                    rows.append(row)
        return rows


@pytest.fixture(scope="module")
def llama():
    """A tiny float32 Llama (max_seq_len = MAX_LENGTH): its graphdef and parameters."""
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
    return nnx.split(Llama(config, rngs=nnx.Rngs(0), compute_dtype=jnp.float32))


def _model_score(llama, tokens: list[int], num_scored: int) -> tuple[float, bool]:
    """The model's own log-probs on exactly these tokens (it reads all but the last)."""
    graphdef, state = llama
    logits = np.asarray(nnx.merge(graphdef, state)(jnp.asarray([tokens[:-1]])), np.float64)[0]
    log_probs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    positions = range(len(tokens) - num_scored, len(tokens))
    total = sum(float(log_probs[t - 1, tokens[t]]) for t in positions)
    greedy = all(int(np.argmax(log_probs[t - 1])) == tokens[t] for t in positions)
    return total, greedy


def _expected_sequence(convention: str, with_bos: bool, context: str, continuation: str):
    """The sequence each convention scores, written out for the word-level tokenizer."""
    context = context.rstrip()
    start = BOS_ID if with_bos else EOS_ID
    if convention == "document":
        tokens = [start, *_ids(context)]
    elif not context:
        tokens = [start]  # lm-eval's prefix token, only for an empty context
    else:
        tokens = [BOS_ID] * with_bos + _ids(context)  # what the tokenizer itself adds
    continuation_ids = _ids(continuation)
    return [*tokens, *continuation_ids][-(MAX_LENGTH + 1) :], len(continuation_ids)


@pytest.mark.parametrize("with_bos", [False, True], ids=["no-bos", "bos"])
@pytest.mark.parametrize("convention", CONVENTIONS)
def test_loglikelihood_equals_the_models_own_log_probs(llama, convention, with_bos):
    rng = np.random.default_rng(1)
    pairs = [
        ("", _words(rng, 3)),  # empty context
        (_words(rng, 2), " " + _words(rng, 1)),
        (_words(rng, 9) + " ", _words(rng, 4)),  # trailing space moves to the continuation
        (_words(rng, 60), " " + _words(rng, 5)),  # longer than MAX_LENGTH: cut from the left
        (_words(rng, 40), " " + _words(rng, MAX_LENGTH)),  # the longest continuation there is
    ]
    graphdef, state = llama
    logprob_fn = make_logprob_fn(graphdef, with_is_argmax=True)
    lm = KilnLM(
        lambda tokens: logprob_fn(state, tokens),
        make_tokenizer(with_bos),
        max_length=MAX_LENGTH,
        batch_size=2,
        bucket_lengths=(16, MAX_LENGTH),
        sequence_start=convention,
    )
    results = lm.loglikelihood(_requests("loglikelihood", pairs))

    for (context, continuation), (logprob, greedy) in zip(pairs, results):
        tokens, num_scored = _expected_sequence(convention, with_bos, context, continuation)
        expected = _model_score(llama, tokens, num_scored)
        assert (logprob, greedy) == (pytest.approx(expected[0], abs=1e-4), expected[1])


@pytest.mark.parametrize(
    ("convention", "with_bos", "expected_rows"),
    [
        # lm-eval's HF runner: only what the tokenizer adds; the prefix token for "" only.
        ("tokenizer", False, [[3, 4, 5], [EOS_ID, 5, 6]]),
        ("tokenizer", True, [[BOS_ID, 3, 4, 5], [BOS_ID, 5, 6]]),
        # Kiln's training convention: every sequence starts where a document does.
        ("document", False, [[EOS_ID, 3, 4, 5], [EOS_ID, 5, 6]]),
        ("document", True, [[BOS_ID, 3, 4, 5], [BOS_ID, 5, 6]]),
    ],
)
def test_the_sequences_each_convention_scores(convention, with_bos, expected_rows):
    record = RecordingFn()
    lm = KilnLM(record, make_tokenizer(with_bos), max_length=8, sequence_start=convention)
    lm.loglikelihood(_requests("loglikelihood", [("w1 w2", " w3"), ("", "w3 w4")]))
    pad = BOS_ID if with_bos else EOS_ID  # rows are padded with the prefix token
    assert sorted(record.rows(pad), key=len, reverse=True) == expected_rows


def test_max_length_counts_the_models_input_tokens():
    record = RecordingFn()
    lm = KilnLM(record, make_tokenizer(), max_length=8, bucket_lengths=(4, 8))
    context = " ".join(WORDS[2:30])
    lm.loglikelihood(_requests("loglikelihood", [(context, " w40 w41"), ("w1 w2", " w3")]))
    long_row, short_row = sorted(record.rows(EOS_ID), key=len, reverse=True)
    # 8 input tokens (the context's last 7 words, then w40) and the last target: 9 in all.
    assert long_row == [*_ids(" ".join(WORDS[23:30])), VOCAB["w40"], VOCAB["w41"]]
    assert short_row == _ids("w1 w2 w3")
    assert {batch.shape[1] for batch in record.batches} == {4 + 1, 8 + 1}


@pytest.mark.parametrize("with_bos", [False, True], ids=["no-bos", "bos"])
@pytest.mark.parametrize("convention", CONVENTIONS)
def test_rolling_windows_cover_every_token_once(convention, with_bos):
    # Under a bigram model each token's log-prob depends on its predecessor only, so the sum
    # over lm-eval's windows equals the whole token list's sum after the prefix token.
    table = np.random.default_rng(2).normal(size=(VOCAB_SIZE, VOCAB_SIZE))
    rng = np.random.default_rng(3)
    docs = [_words(rng, n) for n in (1, 7, 8, 9, 31, 100)]
    lm = KilnLM(
        make_bigram_logprob_fn(table),
        make_tokenizer(with_bos),
        max_length=8,
        batch_size=4,
        sequence_start=convention,
    )

    totals = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(d,) for d in docs]))

    prefix = BOS_ID if with_bos else EOS_ID
    # The tokenizer convention encodes the document as the tokenizer does: a BOS tokenizer's
    # BOS is part of it, and lm-eval scores it after the prefix token (BOS) too.
    own_start = [BOS_ID] if with_bos and convention == "tokenizer" else []
    for doc, total in zip(docs, totals):
        tokens = [prefix, *own_start, *_ids(doc)]
        assert total == pytest.approx(bigram_sequence_logprob(table, tokens), abs=1e-4)


def test_rolling_windows_hold_max_length_input_tokens():
    record = RecordingFn()
    lm = KilnLM(record, make_tokenizer(), max_length=8, bucket_lengths=(8,))
    lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(" ".join(WORDS[2:22]),)]))
    # 20 tokens: [EOS] + 8 predicted, then 8 + 8 predicted, then 8 + the last 4.
    assert record.rows(EOS_ID) == [
        [EOS_ID, *_ids(" ".join(WORDS[2:10]))],
        _ids(" ".join(WORDS[9:18])),
        _ids(" ".join(WORDS[13:22])),
    ]


def test_compilations_are_bounded_by_buckets_not_lengths():
    table = np.random.default_rng(4).normal(size=(VOCAB_SIZE, VOCAB_SIZE))
    logprob_fn = make_bigram_logprob_fn(table)
    max_length = 256
    lm = KilnLM(logprob_fn, make_tokenizer(), max_length=max_length, batch_size=8)
    rng = np.random.default_rng(5)
    lengths = list(range(1, 200, 3))
    pairs = [(_words(rng, n), " w7") for n in lengths]

    results = lm.loglikelihood(_requests("loglikelihood", pairs))

    # n context tokens + 1 continuation token: the model reads n of them.
    buckets_hit = {next(b for b in lm.bucket_lengths if b >= n) for n in lengths}
    assert lm.bucket_lengths == default_bucket_lengths(max_length) == (64, 128, 256)
    assert len(set(lengths)) > 20
    assert logprob_fn._cache_size() == len(buckets_hit) == 3
    for (context, _), (logprob, _) in zip(pairs, results):
        prev = _ids(context)[-1]
        assert logprob == pytest.approx(
            bigram_sequence_logprob(table, [prev, VOCAB["w7"]]), abs=1e-4
        )


def test_log_probs_only_fn_gives_the_same_sums():
    table = np.random.default_rng(6).normal(size=(VOCAB_SIZE, VOCAB_SIZE))
    both = make_bigram_logprob_fn(table)
    pairs = [("w1 w2", " w3 w4"), ("w5", " w6")]
    tokenizer = make_tokenizer()

    exact = KilnLM(both, tokenizer, max_length=16).loglikelihood(_requests("loglikelihood", pairs))
    only = KilnLM(lambda tokens: both(tokens)[0], tokenizer, max_length=16).loglikelihood(
        _requests("loglikelihood", pairs)
    )
    assert [logprob for logprob, _ in only] == pytest.approx([lp for lp, _ in exact])


def test_generation_is_refused_clearly():
    lm = KilnLM(RecordingFn(), make_tokenizer(), max_length=16)
    with pytest.raises(NotImplementedError, match="log-likelihoods only"):
        lm.generate_until(_requests("generate_until", [("w1", {"until": ["\n"]})]))


def test_continuation_longer_than_max_length_is_an_error():
    lm = KilnLM(RecordingFn(), make_tokenizer(), max_length=8)
    lm.loglikelihood(_requests("loglikelihood", [("w1", " " + " ".join(WORDS[:8]))]))  # fits
    with pytest.raises(ValueError, match="continuation of 9 tokens does not fit max_length 8"):
        lm.loglikelihood(_requests("loglikelihood", [("w1", " " + " ".join(WORDS[:9]))]))


def test_a_context_of_spaces_has_nothing_to_condition_on():
    lm = KilnLM(RecordingFn(), make_tokenizer(), max_length=8)
    with pytest.raises(ValueError, match="no context tokens"):
        lm.loglikelihood(_requests("loglikelihood", [("  ", "w1")]))


@pytest.mark.parametrize("buckets", [(8, 4, 16), (8, 12)])
def test_bucket_lengths_must_increase_to_max_length(buckets):
    with pytest.raises(ValueError, match="bucket_lengths"):
        KilnLM(lambda t: t, make_tokenizer(), max_length=16, bucket_lengths=buckets)


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_kiln_loaded_tokenizer_scores_like_the_hf_one(tmp_path, convention):
    from kiln.data.tokenizer import load_tokenizer

    tokenizer = make_tokenizer()
    tokenizer.save_pretrained(tmp_path / "word_level")
    loaded = load_tokenizer({"kind": "local", "path": str(tmp_path / "word_level")})
    logprob_fn = make_bigram_logprob_fn(np.random.default_rng(7).normal(size=(VOCAB_SIZE,) * 2))
    pairs = [("", " w1 w2"), ("w3 w4 ", "w5"), ("w6", " w7 w8 w9")]

    def scores(tok):
        lm = KilnLM(logprob_fn, tok, max_length=16, sequence_start=convention)
        return lm.loglikelihood(_requests("loglikelihood", pairs))

    assert loaded.info.eos_id == EOS_ID and loaded.info.bos_id is None
    assert scores(loaded) == scores(tokenizer)


def test_the_chat_template_renders_as_lm_evals_runner_renders_it():
    """HFLM's apply_chat_template: text, the generation prompt or the final message continued,
    and a template that refuses the system turn rendered again without it."""
    tokenizer = make_tokenizer(with_bos=True)
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('no system turn') }}{% endif %}[{{ m['role'] }}] {{ m['content'] }} "
        "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    lm = KilnLM(RecordingFn(), tokenizer, max_length=MAX_LENGTH)
    history = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"}]
    assert lm.apply_chat_template(history[:1]) == "<bos>[user] w1 w2 [assistant]"
    assert lm.apply_chat_template(history, add_generation_prompt=False) == (
        "<bos>[user] w1 w2 [assistant] w3"
    )  # continue_final_message: the assistant's turn left open
    with_system = [{"role": "system", "content": "w4"}, *history[:1]]
    assert lm.apply_chat_template(with_system) == "<bos>[user] w1 w2 [assistant]"
    assert lm.tokenizer_name == str(tokenizer.name_or_path).replace("/", "__")
