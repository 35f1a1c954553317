"""Sampling continuations from a Llama: a few illustrative samples, not a serving engine.

The whole decode runs in one jitted function over a fixed [B, P + N] token buffer: each of the N
steps runs the model over the full buffer (causal attention makes the not-yet-written positions
irrelevant) and writes one token. There is no KV cache: for a few dozen tokens from a small model
recomputing the prefix is cheaper than the code a cache needs, and it compiles once per buffer
shape instead of once per generated token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def generate(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    prompt_tokens: np.ndarray,
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    max_seq_len: int,
) -> np.ndarray:
    """int32 [B, P + max_new_tokens]: each prompt row followed by its sampled continuation.

    temperature 0 is greedy (argmax); otherwise tokens are drawn from softmax(logits / T) with a
    PRNG seeded by `seed`, so a call is reproducible.
    """
    prompt = np.asarray(prompt_tokens, np.int32)
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise ValueError(f"prompt_tokens must be [batch, length >= 1], got shape {prompt.shape}")
    if max_new_tokens < 0 or temperature < 0:
        raise ValueError(
            f"max_new_tokens and temperature must be >= 0, got {max_new_tokens}, {temperature}"
        )
    length = prompt.shape[1] + max_new_tokens
    if length > max_seq_len:
        raise ValueError(
            f"prompt ({prompt.shape[1]}) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"model's max_seq_len {max_seq_len}"
        )
    buffer = np.zeros((prompt.shape[0], length), np.int32)
    buffer[:, : prompt.shape[1]] = prompt
    out = _decode(
        graphdef,
        params,
        jnp.asarray(buffer),
        jnp.int32(prompt.shape[1]),
        jnp.float32(temperature),
        jax.random.key(seed),
    )
    return np.asarray(jax.device_get(out))


@functools.partial(jax.jit, static_argnums=0)
def _decode(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    buffer: jax.Array,
    prompt_length: jax.Array,
    temperature: jax.Array,
    key: jax.Array,
) -> jax.Array:
    """Fills buffer[:, prompt_length:] one position at a time. The prompt length and temperature
    are traced, so prompts of another length with the same buffer size reuse the compilation."""
    model = nnx.merge(graphdef, params)

    def write_next(position: jax.Array, tokens: jax.Array) -> jax.Array:
        logits = jax.lax.dynamic_index_in_dim(model(tokens), position - 1, 1, keepdims=False)
        step_key = jax.random.fold_in(key, position)
        # Divide by a floor, not by 0: at temperature 0 the sample is discarded for the argmax.
        sampled = jax.random.categorical(step_key, logits / jnp.maximum(temperature, 1e-6))
        chosen = jnp.where(temperature > 0, sampled, jnp.argmax(logits, axis=-1))
        return jax.lax.dynamic_update_index_in_dim(tokens, chosen.astype(jnp.int32), position, 1)

    return jax.lax.fori_loop(prompt_length, buffer.shape[1], write_next, buffer)
