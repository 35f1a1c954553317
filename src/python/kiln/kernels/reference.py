"""Plain-jnp attention: the numerical reference the Pallas kernel is checked against.

Same contract as `kiln.kernels.flash_attention.flash_attention`; the math runs in fp32 and
materialises the full [batch, heads, seq, seq] logits, so use it for checking and small runs.
The model's own "xla" attention path is kiln.model.attention's (grouped heads, the compute
dtype's inputs).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def _attention_mask(
    seq_len: int, segment_ids: jax.Array | None, *, causal: bool
) -> jax.Array | None:
    """Boolean [batch or 1, 1, seq, seq] mask (True = attend), or None when nothing is masked."""
    mask = None
    if causal:
        positions = jnp.arange(seq_len)
        mask = (positions[:, None] >= positions[None, :])[None, None]
    if segment_ids is not None:
        same_segment = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
        mask = same_segment if mask is None else jnp.logical_and(mask, same_segment)
    return mask


def reference_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
) -> jax.Array:
    """Softmax attention. q: [batch, seq, heads, dim]; k, v: [batch, seq, kv_heads, dim].

    Grouped-query attention repeats each kv head for `heads // kv_heads` consecutive q heads
    (q head h reads kv head h // group), the layout the kernel assumes too.
    """
    num_heads, num_kv_heads = q.shape[2], k.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    group = num_heads // num_kv_heads
    k = jnp.repeat(k.astype(jnp.float32), group, axis=2)
    v = jnp.repeat(v.astype(jnp.float32), group, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k) * sm_scale
    mask = _attention_mask(q.shape[1], segment_ids, causal=causal)
    if mask is not None:
        logits = jnp.where(mask, logits, -jnp.inf)
    weights = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v).astype(q.dtype)
