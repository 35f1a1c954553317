"""Attention dispatch against a float64 numpy reference written head by head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kiln.model.attention import attention, resolve_attention_impl
from kiln.train.mesh import make_mesh


def numpy_attention(q, k, v, segment_ids, causal: bool) -> np.ndarray:
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, seq_len, num_heads, head_dim = q.shape
    group = num_heads // k.shape[2]
    out = np.zeros_like(q)
    for b in range(batch):
        for h in range(num_heads):
            scores = q[b, :, h] @ k[b, :, h // group].T / np.sqrt(head_dim)
            allowed = np.ones((seq_len, seq_len), bool)
            if causal:
                allowed &= np.tril(allowed)
            if segment_ids is not None:
                seg = np.asarray(segment_ids[b])
                allowed &= seg[:, None] == seg[None, :]
            scores = np.where(allowed, scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            out[b, :, h] = probs @ v[b, :, h // group]
    return out


def random_qkv(seed: int, num_heads: int, num_kv_heads: int, seq_len=24, head_dim=16):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, seq_len, num_heads, head_dim), np.float32)
    k = rng.standard_normal((2, seq_len, num_kv_heads, head_dim), np.float32)
    v = rng.standard_normal((2, seq_len, num_kv_heads, head_dim), np.float32)
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)


def packed_segments(seq_len: int) -> jax.Array:
    # Row 0: three documents of uneven length; row 1: one document.
    first = np.repeat([1, 2, 3], [5, seq_len - 12, 7])
    return jnp.asarray(np.stack([first, np.ones(seq_len, int)]), jnp.int32)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "causal", "packed"),
    [
        (4, 4, True, True),
        (4, 2, True, True),
        (4, 1, False, True),
        (4, 2, True, False),
        (4, 2, False, False),
    ],
)
def test_xla_matches_numpy(num_heads: int, num_kv_heads: int, causal: bool, packed: bool) -> None:
    q, k, v = random_qkv(num_heads * 10 + num_kv_heads, num_heads, num_kv_heads)
    segment_ids = packed_segments(q.shape[1]) if packed else None
    out = attention(q, k, v, segment_ids, impl="xla", causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_allclose(
        out, numpy_attention(q, k, v, segment_ids, causal), atol=2e-5, rtol=2e-5
    )


def test_xla_keeps_bf16_and_stays_close() -> None:
    q, k, v = random_qkv(0, 4, 2)
    out = attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), None, impl="xla")
    assert out.dtype == jnp.bfloat16
    expected = numpy_attention(q, k, v, None, causal=True)
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, atol=5e-2)


def test_pallas_under_a_mesh_runs_per_shard_and_matches_xla() -> None:
    q, k, v = random_qkv(1, 4, 2, seq_len=32)
    segment_ids = packed_segments(32)

    def loss(impl):
        return lambda q, k, v: jnp.sum(jnp.sin(attention(q, k, v, segment_ids, impl=impl)))

    expected = jax.jit(jax.value_and_grad(loss("xla"), argnums=(0, 1, 2)))(q, k, v)
    pallas = jax.value_and_grad(loss("pallas"), argnums=(0, 1, 2))
    with jax.set_mesh(make_mesh()):
        assert "shard_map" in str(jax.make_jaxpr(pallas)(q, k, v))
        actual = jax.jit(pallas)(q, k, v)
    for got, want in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_auto_is_xla_on_cpu_and_bad_names_are_rejected() -> None:
    assert resolve_attention_impl("auto") == ("pallas" if jax.default_backend() == "gpu" else "xla")
    with pytest.raises(ValueError, match="attention must be one of"):
        resolve_attention_impl("flash")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the off-GPU error")
def test_cudnn_off_gpu_says_so() -> None:
    q, k, v = random_qkv(0, 4, 2)
    with pytest.raises(ValueError, match="attention='cudnn' needs a CUDA GPU"):
        attention(q, k, v, None, impl="cudnn")
