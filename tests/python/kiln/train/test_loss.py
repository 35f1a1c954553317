from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kiln.train.loss import next_token_loss, per_token_log_probs


def numpy_terms(logits: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per position t < T-1, float64: cross-entropy against tokens[t+1], and logsumexp."""
    logits = np.asarray(logits, np.float64)[:, :-1]
    top = logits.max(-1, keepdims=True)
    lse = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[..., 0]
    target = np.take_along_axis(logits, np.asarray(tokens)[:, 1:, None], -1)[..., 0]
    return lse - target, lse


@pytest.fixture
def example():
    logits = 3 * jax.random.normal(jax.random.key(0), (2, 6, 9))
    tokens = jax.random.randint(jax.random.key(1), (2, 6), 0, 9)
    # Row 0: a document boundary after position 2 (position 2 does not predict position 3).
    loss_mask = jnp.asarray([[1, 1, 0, 1, 1, 0], [1, 1, 1, 1, 1, 0]], jnp.float32)
    return logits, tokens, loss_mask


def test_cross_entropy_and_z_loss_are_masked_means(example) -> None:
    logits, tokens, loss_mask = example
    ce, lse = numpy_terms(logits, tokens)
    mask = np.asarray(loss_mask)[:, :-1]
    loss, metrics = next_token_loss(logits, tokens, loss_mask, z_loss_weight=1e-2)
    expected_ce = (ce * mask).sum() / mask.sum()
    expected_z = 1e-2 * (lse**2 * mask).sum() / mask.sum()
    assert float(metrics["cross_entropy"]) == pytest.approx(expected_ce, rel=1e-5)
    assert float(metrics["z_loss"]) == pytest.approx(expected_z, rel=1e-5)
    assert float(loss) == pytest.approx(expected_ce + expected_z, rel=1e-5)


def test_no_z_loss_weight_omits_it(example) -> None:
    logits, tokens, loss_mask = example
    loss, metrics = next_token_loss(logits, tokens, loss_mask, z_loss_weight=None)
    assert float(metrics["z_loss"]) == 0.0
    assert float(loss) == float(metrics["cross_entropy"])


def test_bf16_logits_are_upcast(example) -> None:
    logits, tokens, loss_mask = example
    loss_bf16, _ = next_token_loss(logits.astype(jnp.bfloat16), tokens, loss_mask, None)
    assert loss_bf16.dtype == jnp.float32
    ce, _ = numpy_terms(np.asarray(logits.astype(jnp.bfloat16), np.float32), tokens)
    mask = np.asarray(loss_mask)[:, :-1]
    assert float(loss_bf16) == pytest.approx((ce * mask).sum() / mask.sum(), rel=1e-5)


def test_masked_positions_get_no_gradient(example) -> None:
    logits, tokens, loss_mask = example
    grads = jax.grad(lambda x: next_token_loss(x, tokens, loss_mask, 1e-4)[0])(logits)
    assert float(jnp.abs(grads[0, 2]).max()) == 0.0  # masked boundary
    assert float(jnp.abs(grads[:, -1]).max()) == 0.0  # last position predicts nothing
    assert float(jnp.abs(grads[0, 1]).max()) > 0.0


def test_per_token_log_probs(example) -> None:
    logits, tokens, _ = example
    log_probs = per_token_log_probs(logits, tokens)
    ce, _ = numpy_terms(logits, tokens)
    assert log_probs.shape == (2, 5) and log_probs.dtype == jnp.float32
    np.testing.assert_allclose(log_probs, -ce, rtol=1e-5)
