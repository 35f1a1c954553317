"""Attention dispatch: one signature, three implementations (see docs/model.md).

Shapes: q [B, T, Hq, D], k and v [B, T, Hkv, D] with Hq % Hkv == 0 (grouped-query attention),
segment_ids int32 [B, T] or None (packed documents: a token attends only within its segment).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from kiln.model.partitioning import BATCH_AXES, batch_mesh
from kiln_contract.vocabulary import ATTENTION_IMPLS

# The jax.named_scope() of every attention call, so that a profile can attribute its time.
ATTENTION_SCOPE = "kiln_attention"


def resolve_attention_impl(impl: str) -> str:
    """Validates `impl` and turns "auto" into pallas on GPU, xla elsewhere."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {impl!r}")
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return impl


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None,
    *,
    impl: str,
    causal: bool = True,
) -> jax.Array:
    """Softmax attention with scale 1/sqrt(D); returns q's shape and dtype."""
    implementation = {
        "xla": _xla_attention,
        "pallas": _pallas_attention,
        "cudnn": _cudnn_attention,
    }[resolve_attention_impl(impl)]
    with jax.named_scope(ATTENTION_SCOPE):
        return implementation(q, k, v, segment_ids, causal=causal)


def _pallas_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, *, causal: bool
) -> jax.Array:
    # Imported here so the model works where the kernel package is absent or unused.
    from kiln.kernels.flash_attention import flash_attention

    def kernel(q, k, v, segment_ids=None):
        return flash_attention(q, k, v, segment_ids, causal=causal)

    mesh = batch_mesh()
    if mesh is None:
        return kernel(q, k, v, segment_ids)
    # XLA cannot partition a Pallas call (it would gather whole inputs onto every device), so
    # run the kernel per shard: batch over the batch axes, heads over "tensor" when they divide.
    tensor = mesh.shape.get("tensor", 1)
    heads = "tensor" if q.shape[2] % tensor == 0 and k.shape[2] % tensor == 0 else None
    qkv_spec = PartitionSpec(BATCH_AXES, None, heads, None)
    args: tuple[jax.Array, ...] = (q, k, v)
    in_specs: tuple[PartitionSpec, ...] = (qkv_spec,) * 3
    if segment_ids is not None:
        args, in_specs = (*args, segment_ids), (*in_specs, PartitionSpec(BATCH_AXES, None))
    sharded = jax.shard_map(
        kernel, mesh=mesh, in_specs=in_specs, out_specs=qkv_spec, check_vma=False
    )
    return sharded(*args)


def _xla_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, *, causal: bool
) -> jax.Array:
    batch, seq_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    # GQA: group the query heads that share a K/V head instead of repeating K and V.
    grouped_q = q.reshape(batch, seq_len, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", grouped_q, k, preferred_element_type=jnp.float32)
    scores = scores * (head_dim**-0.5)
    mask = _attention_mask(segment_ids, seq_len, causal)
    if mask is not None:
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(q.shape).astype(q.dtype)


def _attention_mask(segment_ids: jax.Array | None, seq_len: int, causal: bool) -> jax.Array | None:
    """Boolean [B or 1, 1, 1, T, S]: True where query t may attend to key s."""
    mask = None
    if causal:
        mask = jnp.tril(jnp.ones((seq_len, seq_len), dtype=bool))[None, None, None]
    if segment_ids is not None:
        same_segment = segment_ids[:, None, None, :, None] == segment_ids[:, None, None, None, :]
        mask = same_segment if mask is None else mask & same_segment
    return mask


def _cudnn_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, *, causal: bool
) -> jax.Array:
    if jax.default_backend() != "gpu":
        raise ValueError(
            f"attention='cudnn' needs a CUDA GPU, but JAX's backend is "
            f"{jax.default_backend()!r}; use attention='xla' (or 'pallas')"
        )
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(
            f"attention='cudnn' supports bfloat16/float16 only, got {q.dtype}; "
            "use compute_dtype=bfloat16 or attention='xla'"
        )
    # Packed documents: cuDNN takes a boolean [B, 1, T, S] mask (it becomes an additive bias).
    mask = None
    if segment_ids is not None:
        mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=causal, implementation="cudnn"
    )
