"""Flash attention in Pallas: one public function, one custom_vjp, two lowerings.

- Triton (GPU; interpret mode on CPU): kiln.kernels.triton_attention, shaped like
  jax.experimental.pallas.ops.gpu.attention, on [batch, seq, heads, dim].
- Mosaic (TPU; TPU interpret mode on CPU): kiln.kernels.mosaic_attention, shaped like
  jax.experimental.pallas.ops.tpu.splash_attention, on head-major [batch, heads, seq, dim] with
  q pre-scaled; the transposes and the scaling happen here, outside the kernels, where XLA
  fuses them into whatever produced q, k and v.

Both share kiln.kernels.tiles (which tile pairs are visited, their masks, the online softmax)
and do the same work: causal tile skipping, packed documents (tile pairs without a shared
document skipped), grouped-query attention without repeating K/V, and ragged lengths (padded
here). docs/attention-kernel.md describes the design.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

# Interpret mode (CPU) loads Pallas' interpreter on its first call, and that adds a jax
# trace-context value: loaded during a step's first trace, it makes the next call trace and
# compile the whole step again. Importing it (through pallas.tpu) here prevents that.
from jax.experimental.pallas import tpu as _pallas_interpreter  # noqa: F401

from kiln.kernels import mosaic_attention, triton_attention
from kiln.kernels.block_sizes import MIN_BLOCK, BlockSizes, LaunchParams, default_block_sizes
from kiln.kernels.tiles import KernelConfig

# checkpoint_name()s of the forward's outputs that the backward reads: a remat policy that saves
# them (kiln.model.llama's save_dots) spares the backward a second run of the forward kernel.
ATTENTION_OUTPUT = "kiln_attention_output"
ATTENTION_LSE = "kiln_attention_lse"
ATTENTION_RESIDUALS = (ATTENTION_OUTPUT, ATTENTION_LSE)
LOWERINGS = {"triton": triton_attention, "mosaic": mosaic_attention}
# The lowering each platform compiles; CPU interprets the Triton kernels unless told otherwise.
PLATFORM_LOWERINGS = {"gpu": "triton", "cuda": "triton", "tpu": "mosaic", "cpu": "triton"}


@functools.partial(
    jax.jit,
    static_argnames=("causal", "sm_scale", "block_sizes", "launch", "interpret", "lowering"),
)
def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    launch: LaunchParams | None = None,
    interpret: bool | None = None,
    lowering: str | None = None,
) -> jax.Array:
    """Softmax attention. q: [batch, seq, heads, dim]; k, v: [batch, seq, kv_heads, dim].

    segment_ids: int32 [batch, seq] or None; tokens attend only within their segment.
    Returns q's dtype and shape. sm_scale defaults to 1/sqrt(dim). block_sizes and launch each
    default to the table entry's for the target device. lowering: "triton" or "mosaic"; by
    default the target platform's (Mosaic on TPU, Triton elsewhere). interpret defaults to True
    when lowering for CPU.
    """
    _check_inputs(q, k, v, segment_ids)
    seq_len, head_dim = q.shape[1], q.shape[3]
    platform, device_kind = _target_device()
    lowering = lowering or PLATFORM_LOWERINGS.get(platform, "triton")
    if lowering not in LOWERINGS:
        raise ValueError(f"lowering must be one of {sorted(LOWERINGS)}, got {lowering!r}")
    table_blocks, table_launch = default_block_sizes(device_kind, head_dim, lowering)
    config = _kernel_config(
        seq_len,
        lowering=lowering,
        causal=causal,
        sm_scale=1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale),
        block_sizes=block_sizes or table_blocks,
        launch=launch or table_launch,
        interpret=platform == "cpu" if interpret is None else interpret,
    )
    q, k, v, segment_ids = _pad_inputs(q, k, v, segment_ids, config.padded_len)
    if lowering == "mosaic":
        out = _head_major_attention(q, k, v, segment_ids, config)
    else:
        out = _flash_attention(q, k, v, segment_ids, config)
    return out[:, :seq_len]


def _head_major_attention(q, k, v, segment_ids, config: KernelConfig) -> jax.Array:
    """The Mosaic kernels' layout: q scaled by sm_scale * log2(e), every input head-major."""
    to_head_major = functools.partial(jnp.swapaxes, axis1=1, axis2=2)
    q = (q.astype(jnp.float32) * config.logit_scale).astype(q.dtype)
    out = _flash_attention(*map(to_head_major, (q, k, v)), segment_ids, config)
    return to_head_major(out)


def _kernel_config(
    seq_len: int,
    *,
    lowering: str,
    causal: bool,
    sm_scale: float,
    block_sizes: BlockSizes,
    launch: LaunchParams,
    interpret: bool,
) -> KernelConfig:
    """Tiles fitted to the sequence, and the length to pad to (a multiple of every tile)."""
    smallest = mosaic_attention.MIN_TILE if lowering == "mosaic" else MIN_BLOCK
    block_sizes = block_sizes.fit_to(seq_len, smallest)
    if lowering == "mosaic":
        mosaic_attention.check_block_sizes(block_sizes)
    unit = block_sizes.largest
    return KernelConfig(
        lowering=lowering,
        causal=causal,
        sm_scale=sm_scale,
        seq_len=seq_len,
        padded_len=-(-seq_len // unit) * unit,
        block_sizes=block_sizes,
        launch=launch,
        interpret=interpret,
    )


def _check_inputs(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None) -> None:
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(
            "flash_attention wants q [batch, seq, heads, dim] and k, v of equal shape "
            f"[batch, seq, kv_heads, dim]; got q={q.shape}, k={k.shape}, v={v.shape}"
        )
    (batch, seq_len, num_heads, head_dim), num_kv_heads = q.shape, k.shape[2]
    if k.shape[:2] != (batch, seq_len) or k.shape[3] != head_dim:
        raise ValueError(
            f"k/v {k.shape} must share batch, seq and dim with q {q.shape} (self-attention)"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"q heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})")
    if head_dim < MIN_BLOCK or head_dim & (head_dim - 1):
        raise ValueError(f"head dim {head_dim} must be a power of two >= {MIN_BLOCK} (64, 128)")
    if not (q.dtype == k.dtype == v.dtype) or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q, k, v must share one float dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if segment_ids is not None and (
        segment_ids.shape != (batch, seq_len) or not jnp.issubdtype(segment_ids.dtype, jnp.integer)
    ):
        raise ValueError(
            f"segment_ids must be integer [batch, seq] = {(batch, seq_len)}; "
            f"got {segment_ids.dtype}{list(segment_ids.shape)}"
        )


def _target_device() -> tuple[str, str]:
    """(platform, device_kind) being lowered for. An abstract mesh's device (jax.export for a GPU
    from a CPU machine) wins over the local default device."""
    abstract_device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if abstract_device is not None:
        return abstract_device.platform, abstract_device.device_kind
    device = jax.devices()[0]
    return device.platform, device.device_kind


def _pad_inputs(q, k, v, segment_ids, padded_len: int):
    """q, k, v zero-padded along the sequence to padded_len; segment ids padded with -1."""
    q, k, v = (_pad_seq(x, padded_len, 0) for x in (q, k, v))
    if segment_ids is not None:
        segment_ids = _pad_seq(segment_ids.astype(jnp.int32), padded_len, -1)
    return q, k, v, segment_ids


def _pad_seq(x: jax.Array, padded_len: int, value: int) -> jax.Array:
    padding = [(0, 0)] * x.ndim
    padding[1] = (0, padded_len - x.shape[1])
    return jnp.pad(x, padding, constant_values=value)


# ----------------------------------------------------------------------------------------------
# custom_vjp glue: arrays here are padded to config.padded_len, in the lowering's layout.


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash_attention(q, k, v, segment_ids, config: KernelConfig):
    out, _ = _flash_attention_fwd(q, k, v, segment_ids, config)
    return out


def _flash_attention_fwd(q, k, v, segment_ids, config: KernelConfig):
    out, lse = LOWERINGS[config.lowering].forward(q, k, v, segment_ids, config)
    out, lse = checkpoint_name(out, ATTENTION_OUTPUT), checkpoint_name(lse, ATTENTION_LSE)
    return out, (q, k, v, segment_ids, out, lse)


def _flash_attention_bwd(config: KernelConfig, residuals, d_out):
    dq, dk, dv = LOWERINGS[config.lowering].backward(*residuals, d_out, config)
    return dq, dk, dv, None


_flash_attention.defvjp(_flash_attention_fwd, _flash_attention_bwd)
