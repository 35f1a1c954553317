from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kiln.model.config import LlamaConfig
from kiln.model.llama import REMAT_POLICIES, Llama, apply_rope, rope_tables

CONFIG = LlamaConfig(
    max_seq_len=16,
    hidden_dim=32,
    intermediate_dim=64,
    num_heads=4,
    num_kv_heads=2,
    num_layers=2,
    vocab_size=61,
)


def make_model(**options) -> Llama:
    return Llama(CONFIG, rngs=nnx.Rngs(0), compute_dtype=jnp.float32, **options)


@nnx.jit
def forward(model: Llama, tokens: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    return model(tokens, segment_ids)


def random_tokens(seed: int, shape=(2, 12)) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), shape, 0, CONFIG.vocab_size, jnp.int32)


def test_logits_are_float32_and_finite_in_bf16_compute() -> None:
    model = Llama(CONFIG, rngs=nnx.Rngs(0))  # bf16 compute, fp32 params
    logits = forward(model, random_tokens(0))
    assert logits.shape == (2, 12, CONFIG.vocab_size) and logits.dtype == jnp.float32
    assert bool(jnp.isfinite(logits).all())
    assert model.embed.embedding[...].dtype == jnp.float32


def test_bf16_compute_stays_close_to_fp32() -> None:
    tokens = random_tokens(1)
    fp32 = forward(make_model(), tokens)
    bf16 = forward(Llama(CONFIG, rngs=nnx.Rngs(0), compute_dtype=jnp.bfloat16), tokens)
    np.testing.assert_allclose(bf16, fp32, atol=5e-2)


def test_init_follows_init_std() -> None:
    model = make_model()
    assert float(jnp.std(model.embed.embedding[...])) == pytest.approx(0.02, rel=0.1)
    assert float(jnp.std(model.blocks[0].mlp.up_proj.kernel[...])) == pytest.approx(0.02, rel=0.1)
    assert bool((model.final_norm.scale[...] == 1).all())


def test_no_position_sees_the_future() -> None:
    model = make_model()
    tokens = random_tokens(2)
    changed = tokens.at[:, 7].set((tokens[:, 7] + 1) % CONFIG.vocab_size)
    before, after = forward(model, tokens), forward(model, changed)
    np.testing.assert_array_equal(before[:, :7], after[:, :7])
    assert not np.allclose(before[:, 7:], after[:, 7:])


def test_packed_documents_do_not_see_each_other() -> None:
    model = make_model()
    tokens = random_tokens(3, (1, 12))
    segment_ids = jnp.asarray([[1] * 5 + [2] * 7], jnp.int32)
    changed_first_doc = tokens.at[:, :5].set((tokens[:, :5] + 3) % CONFIG.vocab_size)
    before = forward(model, tokens, segment_ids)
    after = forward(model, changed_first_doc, segment_ids)
    np.testing.assert_allclose(before[:, 5:], after[:, 5:], atol=1e-6)
    # Without segment ids the second document does see the first.
    assert not np.allclose(forward(model, tokens)[:, 5:], forward(model, changed_first_doc)[:, 5:])


def test_tied_embeddings_use_the_embedding_as_lm_head() -> None:
    config = dataclasses.replace(CONFIG, tie_embeddings=True)
    model = Llama(config, rngs=nnx.Rngs(0), compute_dtype=jnp.float32)
    assert model.lm_head is None
    tokens = random_tokens(4)
    hidden = nnx.clone(model)
    hidden.embed.embedding[...] = hidden.embed.embedding[...] * 2
    assert not np.allclose(forward(model, tokens), forward(hidden, tokens))


@functools.cache
def loss_and_grads(remat: str):
    tokens = random_tokens(5)
    graphdef, params = nnx.split(make_model(remat=remat))

    def loss(params):
        return jnp.mean(nnx.merge(graphdef, params)(tokens) ** 2)

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("policy", [p for p in REMAT_POLICIES if p != "none"])
def test_remat_policies_do_not_change_the_math(policy: str) -> None:
    expected, actual = loss_and_grads("none"), loss_and_grads(policy)
    for got, want in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_rope_scores_depend_only_on_relative_position() -> None:
    cos, sin = rope_tables(16, 8, 500000.0)
    q = jax.random.normal(jax.random.key(0), (1, 1, 1, 8))
    k = jax.random.normal(jax.random.key(1), (1, 1, 1, 8))

    def score(q_pos: int, k_pos: int) -> float:
        rq = apply_rope(q, cos[q_pos : q_pos + 1], sin[q_pos : q_pos + 1])
        rk = apply_rope(k, cos[k_pos : k_pos + 1], sin[k_pos : k_pos + 1])
        return float(jnp.sum(rq * rk))

    assert score(5, 2) == pytest.approx(score(13, 10), rel=1e-5)
    assert score(5, 2) != pytest.approx(score(5, 4), rel=1e-3)
    assert score(0, 0) == pytest.approx(float(jnp.sum(q * k)), rel=1e-6)


def test_rejects_bad_options_and_long_inputs() -> None:
    with pytest.raises(ValueError, match="remat must be one of"):
        make_model(remat="some")
    with pytest.raises(ValueError, match="attention must be one of"):
        make_model(attention="flash")
    with pytest.raises(ValueError, match="exceeds LlamaConfig.max_seq_len 16"):
        forward(make_model(), random_tokens(0, (1, 17)))
