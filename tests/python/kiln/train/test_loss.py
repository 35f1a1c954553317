"""The blockwise loss against the whole-logits computation it replaces, values and gradients.

Tolerances: fp32 inputs agree to rtol 1e-5 (only the order of float32 sums differs). bf16 hidden
states: the loss to rtol 1e-5 (the forward is the same bf16 matmul with float32 accumulation),
the gradients to a relative norm error of 1e-2: the blockwise backward rounds d(logits) to bf16
before its two matmuls, as flash attention rounds dS, where autodiff of the whole-logits loss
multiplies float32 d(logits) into the bf16 operands (measured: at most 4e-3 over 40 seeds).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kiln.train.loss import next_token_loss, token_losses

VOCAB, DIM = 37, 16


def numpy_terms(logits: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per position t < T-1, float64: cross-entropy against tokens[t+1], and logsumexp."""
    logits = np.asarray(logits, np.float64)[:, :-1]
    top = logits.max(-1, keepdims=True)
    lse = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[..., 0]
    target = np.take_along_axis(logits, np.asarray(tokens)[:, 1:, None], -1)[..., 0]
    return lse - target, lse


def whole_logits(hidden: jax.Array, weights: jax.Array) -> jax.Array:
    """The model's logits (Llama.logits): hidden's dtype into the matmul, float32 out."""
    return jnp.einsum(
        "btd,dv->btv", hidden, weights.astype(hidden.dtype), preferred_element_type=jnp.float32
    )


def whole_logits_loss(hidden, weights, tokens, loss_mask, z_loss_weight):
    """The loss from the whole batch's float32 logits, the way it was computed before blocks."""
    logits = whole_logits(hidden, weights)[:, :-1]
    lse = jax.nn.logsumexp(logits, axis=-1)
    cross_entropy = lse - jnp.take_along_axis(logits, tokens[:, 1:, None], -1)[..., 0]
    mask = loss_mask[:, :-1]
    count = jnp.maximum(mask.sum(), 1.0)
    return ((cross_entropy + z_loss_weight * lse**2) * mask).sum() / count


@pytest.fixture
def example():
    keys = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(keys[0], (2, 7, DIM))
    weights = 0.7 * jax.random.normal(keys[1], (DIM, VOCAB))  # logits of a few units
    tokens = jax.random.randint(keys[2], (2, 7), 0, VOCAB)
    # Row 0: a document boundary after position 2 (position 2 does not predict position 3).
    loss_mask = jnp.asarray([[1, 1, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 0]], jnp.float32)
    return hidden, weights, tokens, loss_mask


@pytest.mark.parametrize("block_tokens", [4, 6, 4096], ids=["4-blocks", "padded", "one-block"])
def test_token_losses_equal_the_whole_logits_terms(example, block_tokens: int) -> None:
    hidden, weights, tokens, _ = example
    cross_entropy, log_normalizer = token_losses(hidden, weights, tokens, block_tokens)
    expected_ce, expected_lse = numpy_terms(whole_logits(hidden, weights), tokens)
    assert cross_entropy.shape == (2, 6) and cross_entropy.dtype == jnp.float32
    np.testing.assert_allclose(cross_entropy, expected_ce, rtol=1e-5)
    np.testing.assert_allclose(log_normalizer, expected_lse, rtol=1e-5)


def test_cross_entropy_and_z_loss_are_masked_means(example) -> None:
    hidden, weights, tokens, loss_mask = example
    ce, lse = numpy_terms(whole_logits(hidden, weights), tokens)
    mask = np.asarray(loss_mask)[:, :-1]
    loss, metrics = next_token_loss(hidden, weights, tokens, loss_mask, z_loss_weight=1e-2)
    expected_ce = (ce * mask).sum() / mask.sum()
    expected_z = 1e-2 * (lse**2 * mask).sum() / mask.sum()
    assert float(metrics["cross_entropy"]) == pytest.approx(expected_ce, rel=1e-5)
    assert float(metrics["z_loss"]) == pytest.approx(expected_z, rel=1e-5)
    assert float(loss) == pytest.approx(expected_ce + expected_z, rel=1e-5)


def test_no_z_loss_weight_omits_it(example) -> None:
    hidden, weights, tokens, loss_mask = example
    loss, metrics = next_token_loss(hidden, weights, tokens, loss_mask, z_loss_weight=None)
    assert float(metrics["z_loss"]) == 0.0
    assert float(loss) == float(metrics["cross_entropy"])


def relative_norm_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_gradients_equal_the_whole_logits_gradients(example, dtype) -> None:
    hidden, weights, tokens, loss_mask = example
    hidden = hidden.astype(dtype)  # the compute dtype; weights stay the float32 parameter

    def blockwise(hidden, weights):
        return next_token_loss(hidden, weights, tokens, loss_mask, 1e-2)[0]

    def whole(hidden, weights):
        return whole_logits_loss(hidden, weights, tokens, loss_mask, 1e-2)

    # 4 tokens per block: 2 positions of both rows, 4 blocks (the last one padded).
    loss, grads = jax.jit(jax.value_and_grad(blockwise, argnums=(0, 1)))(hidden, weights)
    expected_loss, expected_grads = jax.value_and_grad(whole, argnums=(0, 1))(hidden, weights)
    assert float(loss) == pytest.approx(float(expected_loss), rel=1e-5)
    tolerance = 1e-5 if dtype == jnp.float32 else 1e-2
    for name, actual, expected in zip(("d_hidden", "d_weights"), grads, expected_grads):
        assert actual.dtype == expected.dtype, name
        assert relative_norm_error(actual, expected) < tolerance, name


def test_masked_positions_get_no_gradient(example) -> None:
    hidden, weights, tokens, loss_mask = example
    grads = jax.grad(lambda h: next_token_loss(h, weights, tokens, loss_mask, 1e-4)[0])(hidden)
    assert float(jnp.abs(grads[0, 2]).max()) == 0.0  # masked boundary
    assert float(jnp.abs(grads[:, -1]).max()) == 0.0  # last position predicts nothing
    assert float(jnp.abs(grads[0, 1]).max()) > 0.0


def test_the_loss_keeps_one_block_of_logits() -> None:
    """The compiled loss and gradient hold no [batch, seq, vocab] array: one block's logits."""
    batch, seq_len, vocab = 4, 64, 1000
    hidden = jax.ShapeDtypeStruct((batch, seq_len, DIM), jnp.float32)
    weights = jax.ShapeDtypeStruct((DIM, vocab), jnp.float32)
    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)

    def loss(hidden, weights, tokens, block_tokens):
        return token_losses(hidden, weights, tokens, block_tokens)[0].sum()

    def temp_bytes(block_tokens: int) -> int:
        grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=3)
        compiled = grad.lower(hidden, weights, tokens, block_tokens).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    whole_batch_logits = batch * seq_len * vocab * 4
    assert temp_bytes(batch * seq_len) > whole_batch_logits  # one block: the whole batch
    assert temp_bytes(batch * 8) < whole_batch_logits / 2  # 8 blocks

