"""Flash attention lowered by Triton (Pallas GPU; interpret mode on CPU): forward, dK/dV and dQ
kernels.

Shaped like jax.experimental.pallas.ops.gpu.attention, with Kiln's tile logic
(kiln.kernels.tiles), grouped-query attention and packed documents:

- forward: grid (q blocks, batch, heads); each program keeps one q tile and loops over kv tiles
  with an online softmax in base 2, writing the output and the row log-sum-exp (lse, base 2).
- dK/dV: grid (kv blocks, batch, kv heads); each program loops over the q heads of its group and
  their q tiles, so GQA gradients are summed in the kernel without repeating K/V.
- dQ: grid (q blocks, batch, heads); each program loops over kv tiles. Or, with
  LaunchParams.fused_dq, no dQ kernel: the dK/dV kernel adds each tile's dQ into an fp32 buffer
  with atomics (5 matmuls instead of 7; dQ's summation order then varies between GPU runs).
- GQA: q head h reads kv head h // group in the BlockSpec index maps.
- Causal: loop bounds skip tiles fully in the future; only tiles on the diagonal build a mask.
- Segments (packed documents): a q tile and a kv tile whose segment id ranges do not overlap
  share no document, and the pair is skipped (lax.cond) in every kernel.

Arrays are [batch, seq, heads, dim], padded by kiln.kernels.flash_attention to a multiple of
every tile.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kiln.kernels.tiles import (
    VECTOR_ROWS,
    KernelConfig,
    kv_tile_ranges,
    logit_grads,
    masked,
    online_softmax_step,
    pair_mask,
    q_tile_ranges,
    recomputed_probs,
    row_lse,
    segment_ranges_meet,
)


def forward(q, k, v, segment_ids, config: KernelConfig) -> tuple[jax.Array, jax.Array]:
    """(out [batch, seq, heads, dim], lse [batch, heads, seq] in base 2)."""
    batch, padded_len, num_heads, _ = q.shape
    blocks, launch = config.block_sizes, config.launch
    q_tile, row_stats_tile, attention_specs = _q_major_specs(
        q.shape, k.shape[2], blocks.block_q, segment_ids
    )
    out, lse = pl.pallas_call(
        functools.partial(_forward_kernel, config=config),
        grid=(padded_len // blocks.block_q, batch, num_heads),
        in_specs=attention_specs,
        out_specs=[q_tile, row_stats_tile],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((batch, num_heads, padded_len), jnp.float32),
        ],
        compiler_params=_compiler_params(launch.num_warps_fwd, launch.num_stages_fwd),
        interpret=config.interpret,
        name="kiln_flash_attention_fwd",
    )(q, k, v, segment_ids)
    return out, lse


def backward(q, k, v, segment_ids, out, lse, d_out, config: KernelConfig):
    """(dq, dk, dv) of the forward's inputs."""
    delta = _row_delta(out, d_out)
    if config.launch.fused_dq:
        dq, dk, dv = _backward_dkv(q, k, v, segment_ids, d_out, lse, delta, config)
        return scaled_fused_dq(dq, config.sm_scale, q.dtype), dk, dv
    dk, dv = _backward_dkv(q, k, v, segment_ids, d_out, lse, delta, config)
    return _backward_dq(q, k, v, segment_ids, d_out, lse, delta, config), dk, dv


def _row_delta(out: jax.Array, d_out: jax.Array) -> jax.Array:
    """delta_i = sum_d out_i * dout_i = sum_j p_ij * dp_ij, fp32 [batch, heads, seq]: an
    elementwise product and row sum that XLA fuses well, so it needs no kernel of its own."""
    return jnp.einsum("bthd,bthd->bht", out.astype(jnp.float32), d_out.astype(jnp.float32))


def scaled_fused_dq(dq: jax.Array, sm_scale: float, dtype) -> jax.Array:
    """A fused backward's dQ (fp32, summed without sm_scale) in the inputs' dtype."""
    return (dq * sm_scale).astype(dtype)


# ----------------------------------------------------------------------------------------------
# Pieces of every kernel.


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b with fp32 accumulation; fp32 operands stay fp32 (Triton would use TF32 by default)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return plgpu.dot(a, b, precision=precision)


@dataclasses.dataclass(frozen=True)
class _Tile:
    """`size` rows of the sequence from `start`: their slice, positions, segment ids and the
    ids' (smallest, largest) (None without segment ids)."""

    start: jax.Array
    slice: pl.Slice
    positions: jax.Array
    segments: jax.Array | None
    segment_range: tuple[jax.Array, jax.Array] | None


def _tile(index, size: int, segment_ids_ref) -> _Tile:
    """The `index`-th tile of `size` rows."""
    start = index * size
    segments = None if segment_ids_ref is None else segment_ids_ref[pl.ds(start, size)]
    segment_range = None if segments is None else (segments.min(), segments.max())
    return _Tile(start, pl.ds(start, size), start + jnp.arange(size), segments, segment_range)


def _scaled_logits(
    config: KernelConfig,
    q: jax.Array,
    k: jax.Array,
    q_tile: _Tile,
    kv_tile: _Tile,
    on_diagonal: bool,
) -> jax.Array:
    """Masked q k^T * sm_scale * log2(e): fp32 [q tile, kv tile] logits in base 2."""
    logits = _dot(q, k.T) * config.logit_scale
    mask = pair_mask(
        q_tile.positions[:, None],
        kv_tile.positions[None, :],
        None if q_tile.segments is None else q_tile.segments[:, None],
        None if kv_tile.segments is None else kv_tile.segments[None, :],
        causal=config.causal and on_diagonal,
        key_limit=config.key_limit,
    )
    return masked(logits, mask)


def _loop_over_tiles(ranges, visit_tile, carry):
    """Runs visit_tile(tile, carry, on_diagonal=...) over each (first, stop, on_diagonal) range."""
    for first, stop, on_diagonal in ranges:
        carry = lax.fori_loop(
            first, stop, functools.partial(visit_tile, on_diagonal=on_diagonal), carry
        )
    return carry


def _unless_segments_apart(q_tile: _Tile, kv_tile: _Tile, visit, carry):
    """visit(carry), or carry unchanged when the tiles share no document (tiles.py)."""
    q_range, kv_range = q_tile.segment_range, kv_tile.segment_range
    if q_range is None or kv_range is None:
        return visit(carry)
    meet = segment_ranges_meet(q_range, kv_range)
    return lax.cond(meet, visit, lambda unchanged: unchanged, carry)


def _segment_spec(padded_len: int) -> pl.BlockSpec:
    return pl.BlockSpec((None, padded_len), lambda _, b, __: (b, 0))


def _q_major_specs(
    q_shape, num_kv_heads: int, block_q: int, segment_ids: jax.Array | None
) -> tuple[pl.BlockSpec, pl.BlockSpec, list[pl.BlockSpec | None]]:
    """BlockSpecs of the kernels whose grid is (q tiles, batch, heads): the program's q-shaped
    tile, its row-stats tile, and those of (q, k, v, segment_ids): the q tile, its kv head's
    whole K and V (q head h reads kv head h // group), the batch row's segment ids."""
    _, padded_len, num_heads, head_dim = q_shape
    group = num_heads // num_kv_heads
    q_tile = pl.BlockSpec((None, block_q, None, head_dim), lambda i, b, h: (b, i, h, 0))
    kv_whole = pl.BlockSpec(
        (None, padded_len, None, head_dim), lambda _, b, h: (b, 0, h // group, 0)
    )
    row_stats_tile = pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))
    segments = None if segment_ids is None else _segment_spec(padded_len)
    return q_tile, row_stats_tile, [q_tile, kv_whole, kv_whole, segments]


def _compiler_params(num_warps: int, num_stages: int) -> plgpu.CompilerParams:
    # Pins the Triton lowering (jax 0.11 warns it is deprecated in favour of Mosaic GPU, which
    # cannot run in interpret mode with these BlockSpecs).
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _kv_tiles_of(config: KernelConfig, q_start, block_q: int, block_kv: int):
    return kv_tile_ranges(config.causal, config.seq_len, q_start, block_q, block_kv)


# ----------------------------------------------------------------------------------------------
# Forward.


def _forward_kernel(q_ref, k_ref, v_ref, segment_ids_ref, out_ref, lse_ref, *, config):
    block_q, block_kv = config.block_sizes.block_q, config.block_sizes.block_kv
    q_tile = _tile(pl.program_id(0), block_q, segment_ids_ref)
    q = q_ref[...]

    def visit_kv_tile(index, carry, on_diagonal):
        kv_tile = _tile(index, block_kv, segment_ids_ref)

        def visit(carry):
            acc, row_max, row_sum = carry
            logits = _scaled_logits(
                config, q, k_ref[kv_tile.slice, :], q_tile, kv_tile, on_diagonal
            )
            probs, correction, row_max, row_sum = online_softmax_step(
                VECTOR_ROWS, logits, row_max, row_sum
            )
            v = v_ref[kv_tile.slice, :]
            acc = acc * correction[:, None] + _dot(probs.astype(v.dtype), v)
            return acc, row_max, row_sum

        return _unless_segments_apart(q_tile, kv_tile, visit, carry)

    init = (
        jnp.zeros(q.shape, jnp.float32),
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    ranges = _kv_tiles_of(config, q_tile.start, block_q, block_kv)
    acc, row_max, row_sum = _loop_over_tiles(ranges, visit_kv_tile, init)
    out_ref[...] = (acc / row_sum[:, None]).astype(out_ref.dtype)
    lse_ref[...] = row_lse(row_max, row_sum)


# ----------------------------------------------------------------------------------------------
# Backward. With p = exp2(logits - lse), dp = dout v^T and ds = p * (dp - delta):
#   dV = p^T dout,  dK = sm_scale * ds^T q,  dQ = sm_scale * ds k.


def _backward_dkv_kernel(
    q_ref, k_ref, v_ref, segment_ids_ref, d_out_ref, lse_ref, delta_ref, *out_refs, config
):
    # Fused: (zeroed dQ input, the dQ accumulator aliasing it, dK, dV); else (dK, dV).
    dq_ref = out_refs[1] if config.launch.fused_dq else None
    dk_ref, dv_ref = out_refs[-2:]
    block_q, block_kv = config.block_sizes.block_q_dkv, config.block_sizes.block_kv_dkv
    kv_tile = _tile(pl.program_id(0), block_kv, segment_ids_ref)
    k, v = k_ref[...], v_ref[...]
    group = q_ref.shape[1]
    ranges = q_tile_ranges(config.causal, config.seq_len, kv_tile.start, block_q, block_kv)

    def visit_q_tile(index, carry, on_diagonal, head):
        q_tile = _tile(index, block_q, segment_ids_ref)
        q_slice = q_tile.slice

        def visit(carry):
            dk, dv = carry
            q = q_ref[q_slice, head, :]
            logits = _scaled_logits(config, q, k, q_tile, kv_tile, on_diagonal)
            probs = recomputed_probs(VECTOR_ROWS, logits, lse_ref[head, q_slice])
            d_out = d_out_ref[q_slice, head, :]
            dv = dv + _dot(probs.astype(d_out.dtype).T, d_out)
            d_probs = _dot(d_out, v.T)
            d_logits = logit_grads(VECTOR_ROWS, probs, d_probs, delta_ref[head, q_slice])
            dk = dk + _dot(d_logits.astype(q.dtype).T, q)
            if dq_ref is not None:  # sm_scale is applied once, outside the kernel
                plgpu.atomic_add(
                    dq_ref, (q_slice, head, slice(None)), _dot(d_logits.astype(k.dtype), k)
                )
            return dk, dv

        return _unless_segments_apart(q_tile, kv_tile, visit, carry)

    def visit_head(head, carry):
        # The q heads of this kv head's group: GQA gradients are summed here, in registers.
        return _loop_over_tiles(ranges, functools.partial(visit_q_tile, head=head), carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, group, visit_head, (zeros, zeros))
    dk_ref[...] = (dk * config.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _backward_dkv(q, k, v, segment_ids, d_out, lse, delta, config: KernelConfig):
    """(dK, dV), or (unscaled fp32 dQ, dK, dV) with fused_dq."""
    batch, padded_len, num_kv_heads, head_dim = k.shape
    group = q.shape[2] // num_kv_heads
    blocks, launch = config.block_sizes, config.launch
    block_kv = blocks.block_kv_dkv
    q_group = pl.BlockSpec((None, padded_len, group, head_dim), lambda _, b, h: (b, 0, h, 0))
    row_stats_group = pl.BlockSpec((None, group, padded_len), lambda _, b, h: (b, h, 0))
    kv_tile = pl.BlockSpec((None, block_kv, None, head_dim), lambda j, b, h: (b, j, h, 0))
    inputs = [q, k, v, segment_ids, d_out, lse, delta]
    in_specs = [
        q_group,
        kv_tile,
        kv_tile,
        None if segment_ids is None else _segment_spec(padded_len),
        q_group,
        row_stats_group,
        row_stats_group,
    ]
    out_specs = [kv_tile, kv_tile]
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    aliases = {}
    if launch.fused_dq:
        inputs.append(jnp.zeros(q.shape, jnp.float32))
        in_specs.append(q_group)
        out_specs.insert(0, q_group)
        out_shape.insert(0, jax.ShapeDtypeStruct(q.shape, jnp.float32))
        aliases = {len(jax.tree.leaves(inputs)) - 1: 0}  # None (no segment ids) is no input
    return pl.pallas_call(
        functools.partial(_backward_dkv_kernel, config=config),
        grid=(padded_len // block_kv, batch, num_kv_heads),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=_compiler_params(launch.num_warps_dkv, launch.num_stages_dkv),
        interpret=config.interpret,
        name="kiln_flash_attention_dkv",
    )(*inputs)


def _backward_dq_kernel(
    q_ref, k_ref, v_ref, segment_ids_ref, d_out_ref, lse_ref, delta_ref, dq_ref, *, config
):
    block_q, block_kv = config.block_sizes.block_q_dq, config.block_sizes.block_kv_dq
    q_tile = _tile(pl.program_id(0), block_q, segment_ids_ref)
    q, d_out = q_ref[...], d_out_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]

    def visit_kv_tile(index, dq, on_diagonal):
        kv_tile = _tile(index, block_kv, segment_ids_ref)

        def visit(dq):
            k = k_ref[kv_tile.slice, :]
            logits = _scaled_logits(config, q, k, q_tile, kv_tile, on_diagonal)
            probs = recomputed_probs(VECTOR_ROWS, logits, lse)
            d_probs = _dot(d_out, v_ref[kv_tile.slice, :].T)
            d_logits = logit_grads(VECTOR_ROWS, probs, d_probs, delta)
            return dq + _dot(d_logits.astype(k.dtype), k)

        return _unless_segments_apart(q_tile, kv_tile, visit, dq)

    ranges = _kv_tiles_of(config, q_tile.start, block_q, block_kv)
    dq = _loop_over_tiles(ranges, visit_kv_tile, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * config.sm_scale).astype(dq_ref.dtype)


def _backward_dq(q, k, v, segment_ids, d_out, lse, delta, config: KernelConfig):
    batch, padded_len, num_heads, _ = q.shape
    blocks, launch = config.block_sizes, config.launch
    q_tile, row_stats_tile, attention_specs = _q_major_specs(
        q.shape, k.shape[2], blocks.block_q_dq, segment_ids
    )
    return pl.pallas_call(
        functools.partial(_backward_dq_kernel, config=config),
        grid=(padded_len // blocks.block_q_dq, batch, num_heads),
        in_specs=[*attention_specs, q_tile, row_stats_tile, row_stats_tile],  # + dout, lse, delta
        out_specs=q_tile,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_compiler_params(launch.num_warps_dq, launch.num_stages_dq),
        interpret=config.interpret,
        name="kiln_flash_attention_dq",
    )(q, k, v, segment_ids, d_out, lse, delta)
