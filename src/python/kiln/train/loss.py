"""Next-token cross-entropy with optional z-loss, computed in float32.

The training and validation losses never hold the logits of the whole batch: `token_losses` runs
the lm head and the log-softmax over blocks of positions (a `lax.scan`), and its backward
(a `custom_vjp`) recomputes each block's logits instead of keeping them. For a 128k vocabulary the
fp32 logits of a batch are 16 GB at 8 x 4096 tokens, and autodiff would keep them and their
gradient; here one block's logits exist at a time. docs/model.md ("Loss") has the numbers.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from kiln.model.partitioning import batch_mesh

# Tokens per block of the lm head + loss on one device: its fp32 logits are
# LOSS_BLOCK_TOKENS * vocab * 4 bytes (2.1 GB for a 128k vocabulary), live one block at a time.
LOSS_BLOCK_TOKENS = 4096


def next_token_loss(
    hidden: jax.Array,
    output_weights: jax.Array,
    tokens: jax.Array,
    loss_mask: jax.Array,
    z_loss_weight: float | None,
    num_tokens: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Masked mean over positions t of CE(logits[t], tokens[t+1]) + w * logsumexp(logits[t])^2,
    where logits = hidden @ output_weights (Llama.hidden_states, Llama.output_weights).

    hidden [B, T, D] (compute dtype); output_weights [D, V]; tokens int [B, T]; loss_mask [B, T]
    with 1 where position t predicts tokens[t + 1] of the same document (the last position is
    never used). Returns (loss, {"cross_entropy", "z_loss"}); z_loss is the weighted term, so
    loss = cross_entropy + z_loss, and it is 0 when z_loss_weight is None.
    num_tokens: the divisor, by default this batch's masked positions (at least 1). A microbatch
    passes its whole batch's count (batch_loss_tokens), so microbatch losses sum to the batch's.
    """
    cross_entropy, log_normalizer = token_losses(hidden, output_weights, tokens)
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


def token_losses(
    hidden: jax.Array, output_weights: jax.Array, tokens: jax.Array, block_tokens: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """Per position t < T - 1, float32 [B, T - 1]: the cross-entropy of tokens[t + 1] under
    logits[t] = hidden[t] @ output_weights, and logsumexp(logits[t]).

    The lm head's matmuls take hidden's dtype with float32 accumulation (output_weights is cast),
    as the model's own logits do; the softmax is float32. block_tokens: tokens per block on one
    device (LOSS_BLOCK_TOKENS by default).
    """
    batch, seq_len, _ = hidden.shape
    block_len = _block_len(batch, seq_len, block_tokens or LOSS_BLOCK_TOKENS)
    padded_len = -(-seq_len // block_len) * block_len
    # Position t's target is tokens[t + 1]; the last position (and any padding) gets token 0 and
    # is sliced off, so its gradient is zero.
    targets = jnp.pad(tokens[:, 1:], ((0, 0), (0, padded_len - seq_len + 1)))
    hidden = jnp.pad(hidden, ((0, 0), (0, padded_len - seq_len), (0, 0)))
    cross_entropy, log_normalizer = _blockwise_losses(hidden, output_weights, targets, block_len)
    return cross_entropy[:, : seq_len - 1], log_normalizer[:, : seq_len - 1]


def _block_len(batch: int, seq_len: int, block_tokens: int) -> int:
    """Positions per block: block_tokens over the rows one device holds (the batch is split over
    the mesh's batch axes), at least 1 and at most seq_len."""
    mesh = batch_mesh()
    ways = 1 if mesh is None else math.prod(mesh.shape[axis] for axis in ("data", "fsdp"))
    local_rows = max(1, batch // ways)
    return max(1, min(seq_len, block_tokens // local_rows))


# ----------------------------------------------------------------------------------------------
# The blockwise lm head + log-softmax and its backward. Arrays here are padded: positions are a
# multiple of block_len.


def _blocks(x: jax.Array, block_len: int) -> jax.Array:
    """[B, P, ...] -> [P / block_len, B, block_len, ...]: blocks of positions, all rows each (the
    batch dimension keeps its sharding)."""
    batch, positions = x.shape[:2]
    x = x.reshape(batch, positions // block_len, block_len, *x.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def _unblocks(x: jax.Array) -> jax.Array:
    """The inverse of _blocks."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _block_logits(hidden: jax.Array, weights: jax.Array) -> jax.Array:
    """float32 [B, block, V] logits: hidden's dtype into the matmul, float32 out."""
    return jnp.einsum(
        "btd,dv->btv", hidden, weights.astype(hidden.dtype), preferred_element_type=jnp.float32
    )


def _block_losses(
    hidden: jax.Array, weights: jax.Array, targets: jax.Array
) -> tuple[jax.Array, jax.Array]:
    logits = _block_logits(hidden, weights)
    log_normalizer = jax.nn.logsumexp(logits, axis=-1)
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return log_normalizer - target_logits, log_normalizer


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _blockwise_losses(hidden, weights, targets, block_len: int):
    def block(_, xs):
        block_hidden, block_targets = xs
        return None, _block_losses(block_hidden, weights, block_targets)

    _, (cross_entropy, log_normalizer) = lax.scan(
        block, None, (_blocks(hidden, block_len), _blocks(targets, block_len))
    )
    return _unblocks(cross_entropy), _unblocks(log_normalizer)


def _blockwise_losses_fwd(hidden, weights, targets, block_len: int):
    cross_entropy, log_normalizer = _blockwise_losses(hidden, weights, targets, block_len)
    return (cross_entropy, log_normalizer), (hidden, weights, targets, log_normalizer)


def _blockwise_losses_bwd(block_len: int, residuals, cotangents):
    """With p = softmax(logits): d logits = (g_ce + g_lse) p - g_ce onehot(target). Each block's
    logits are recomputed; dW sums over blocks in float32."""
    hidden, weights, targets, log_normalizer = residuals
    d_cross_entropy, d_log_normalizer = cotangents
    compute_weights = weights.astype(hidden.dtype)

    def block(d_weights, xs):
        hidden, targets, log_normalizer, d_cross_entropy, d_log_normalizer = xs
        probs = jnp.exp(_block_logits(hidden, weights) - log_normalizer[..., None])
        d_logits = (d_cross_entropy + d_log_normalizer)[..., None] * probs
        one_hot = jax.nn.one_hot(targets, probs.shape[-1], dtype=jnp.bool_)
        d_logits = jnp.where(one_hot, d_logits - d_cross_entropy[..., None], d_logits)
        # As autodiff and flash attention do: the gradient's matmuls take the compute dtype.
        d_logits = d_logits.astype(hidden.dtype)
        d_hidden = jnp.einsum(
            "btv,dv->btd", d_logits, compute_weights, preferred_element_type=jnp.float32
        )
        d_weights = d_weights + jnp.einsum(
            "btd,btv->dv", hidden, d_logits, preferred_element_type=jnp.float32
        )
        return d_weights, d_hidden.astype(hidden.dtype)

    blocked = (hidden, targets, log_normalizer, d_cross_entropy, d_log_normalizer)
    d_weights, d_hidden = lax.scan(
        block,
        jnp.zeros(weights.shape, jnp.float32),
        tuple(_blocks(x, block_len) for x in blocked),
    )
    return _unblocks(d_hidden), d_weights.astype(weights.dtype), None


_blockwise_losses.defvjp(_blockwise_losses_fwd, _blockwise_losses_bwd)
