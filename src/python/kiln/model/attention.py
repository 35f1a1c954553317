"""Attention dispatch: one signature, three implementations (see docs/model.md).

Shapes: q [B, T, Hq, D], k and v [B, T, Hkv, D] with Hq % Hkv == 0 (grouped-query attention),
segment_ids int32 [B, T] or None (packed documents: a token attends only within its segment).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

# Imported with the model, not inside the first trace: loading the kernel adds a jax config
# value, and a step first traced before that import would be traced and compiled again.
from kiln.kernels.flash_attention import flash_attention
from kiln.model.partitioning import BATCH_AXES, batch_mesh
from kiln_contract.vocabulary import ATTENTION_IMPLS

# The jax.named_scope() of every attention call, so that a profile can attribute its time.
ATTENTION_SCOPE = "kiln_attention"
# The cuDNN path's packed layout holds seq_len / this many documents per row (its softmax
# statistics take that many [heads, seq] rows per sequence); more go through the mask.
CUDNN_MIN_MEAN_SEGMENT_TOKENS = 32


def resolve_attention_impl(impl: str, platform: str | None = None) -> str:
    """Validates `impl` and turns "auto" into pallas on GPU and TPU, xla elsewhere. `platform`:
    the one the step is compiled for (kiln.fit compiles for a TPU from a CPU); default jax's."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {impl!r}")
    if impl == "auto":
        platform = platform or jax.default_backend()
        return "pallas" if platform in ("gpu", "cuda", "tpu") else "xla"
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
    if segment_ids is None:
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    # Packed documents in cuDNN's own packed layout while they fit it (rows of at most
    # max_segments documents numbered in order); else the boolean mask, which is always right.
    max_segments = max(1, q.shape[1] // CUDNN_MIN_MEAN_SEGMENT_TOKENS)
    lengths, offsets, fits = cudnn_packed_layout(segment_ids, max_segments)
    return jax.lax.cond(
        fits,
        lambda: cudnn_packed_attention(q, k, v, lengths, offsets, causal=causal),
        lambda: _cudnn_masked_attention(q, k, v, segment_ids, causal=causal),
    )


def cudnn_packed_layout(
    segment_ids: jax.Array, max_segments: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """cuDNN's packed layout of a [B, T] batch of documents: (lengths int32 [B, max_segments],
    start offsets int32 [B, max_segments + 1], both padded with -1) for each run of equal ids, and
    whether that describes the batch exactly (a bool scalar): every row holds at most
    max_segments runs, and no id recurs after another (ids counting up, as the data numbers
    documents), so that runs are the segments."""
    batch, seq_len = segment_ids.shape
    starts_run = jnp.concatenate(
        [jnp.ones((batch, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )

    def run_starts(row: jax.Array) -> jax.Array:
        return jnp.nonzero(row, size=max_segments, fill_value=seq_len)[0]

    starts = jax.vmap(run_starts)(starts_run)  # seq_len where a row has fewer runs
    ends = jnp.concatenate([starts[:, 1:], jnp.full((batch, 1), seq_len, starts.dtype)], axis=1)
    present = starts < seq_len
    lengths = jnp.where(present, ends - starts, -1).astype(jnp.int32)
    offsets = jnp.where(present, starts, -1).astype(jnp.int32)
    offsets = jnp.concatenate([offsets, jnp.full((batch, 1), -1, jnp.int32)], axis=1)
    fits = jnp.logical_and(
        (starts_run.sum(axis=1) <= max_segments).all(),
        (segment_ids[:, 1:] >= segment_ids[:, :-1]).all(),
    )
    return lengths, offsets, fits


def cudnn_packed_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    offsets: jax.Array,
    *,
    causal: bool,
) -> jax.Array:
    """cuDNN flash attention over packed documents (cudnn_packed_layout): each document attends
    only to itself, causally from its own start. jax 0.11.2 reaches cuDNN's packed layout through
    jax._src.cudnn.fused_attention_stablehlo (q/kv offsets, Hopper or later); the public
    jax.nn.dot_product_attention takes one length per row only (padding, not packing)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    mask_type = cudnn.MaskType.PADDING_CAUSAL if causal else cudnn.MaskType.PADDING
    return cudnn.dot_product_attention(
        q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets,
        scale=q.shape[-1] ** -0.5, mask_type=mask_type, qkv_layout="BTNH",
    )  # fmt: skip


def _cudnn_masked_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, causal: bool
) -> jax.Array:
    # A boolean [B, 1, T, S] mask: jax turns it into an additive bias (and computes no dbias).
    mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=causal, implementation="cudnn"
    )
