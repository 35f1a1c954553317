"""Next-token cross-entropy with optional z-loss, computed in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def next_token_loss(
    logits: jax.Array,
    tokens: jax.Array,
    loss_mask: jax.Array,
    z_loss_weight: float | None,
    num_tokens: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Masked mean over positions t of CE(logits[t], tokens[t+1]) + w * logsumexp(logits[t])^2.

    logits [B, T, V]; tokens int [B, T]; loss_mask [B, T] with 1 where position t predicts
    tokens[t + 1] of the same document (the last position is never used).
    Returns (loss, {"cross_entropy", "z_loss"}); z_loss is the weighted term, so
    loss = cross_entropy + z_loss, and it is 0 when z_loss_weight is None.
    num_tokens: the divisor, by default this batch's masked positions (at least 1). A microbatch
    passes its whole batch's count (batch_loss_tokens), so microbatch losses sum to the batch's.
    """
    cross_entropy, log_normalizer = _cross_entropy_and_log_normalizer(logits, tokens)
    mask = loss_mask[:, :-1].astype(jnp.float32)
    if num_tokens is None:
        num_tokens = batch_loss_tokens(loss_mask)
    mean_cross_entropy = (cross_entropy * mask).sum() / num_tokens
    if z_loss_weight is None:
        mean_z_loss = jnp.zeros((), jnp.float32)
    else:
        mean_z_loss = z_loss_weight * (jnp.square(log_normalizer) * mask).sum() / num_tokens
    loss = mean_cross_entropy + mean_z_loss
    return loss, {"cross_entropy": mean_cross_entropy, "z_loss": mean_z_loss}


def batch_loss_tokens(loss_mask: jax.Array) -> jax.Array:
    """The number of positions next_token_loss averages over (at least 1)."""
    return jnp.maximum(loss_mask[:, :-1].astype(jnp.float32).sum(), 1.0)


def per_token_log_probs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """log p(tokens[:, t + 1] | tokens[:, :t + 1]) in float32, shape [B, T - 1]."""
    cross_entropy, _ = _cross_entropy_and_log_normalizer(logits, tokens)
    return -cross_entropy


def _cross_entropy_and_log_normalizer(
    logits: jax.Array, tokens: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Per position [B, T - 1]: -log softmax(logits[t])[tokens[t + 1]] and logsumexp(logits[t])."""
    logits = logits[:, :-1].astype(jnp.float32)
    targets = tokens[:, 1:]
    log_normalizer = jax.nn.logsumexp(logits, axis=-1)
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return log_normalizer - target_logits, log_normalizer
