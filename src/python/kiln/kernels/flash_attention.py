"""Flash attention in Pallas: forward, dK/dV and dQ kernels joined by `jax.custom_vjp`.

Shaped like jax.experimental.pallas.ops.gpu.attention (Triton lowering on GPU, interpret mode on
CPU), plus grouped-query attention, padding of ragged lengths and per-device settings.
docs/attention-kernel.md describes the design; the short version:

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
- Lengths that are not a multiple of the block are padded here; padded keys are masked.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

# Interpret mode (CPU) loads Pallas' interpreter on its first call, and that adds a jax
# trace-context value: loaded during a step's first trace, it makes the next call trace and
# compile the whole step again. Importing it (through pallas.tpu) here prevents that.
from jax.experimental.pallas import tpu as _pallas_interpreter  # noqa: F401
from jax.experimental.pallas import triton as plgpu

from kiln.kernels.block_sizes import MIN_BLOCK, BlockSizes, LaunchParams, default_block_sizes

# Finite on purpose: a row whose keys are all masked inside one tile gets exp2(0) = 1 instead of
# NaN, and the online softmax's correction erases it once a real key arrives (every query attends
# at least to itself, so one always does).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
LOG2_E = math.log2(math.e)
# checkpoint_name()s of the forward's outputs that the backward reads: a remat policy that saves
# them (kiln.model.llama's save_dots) spares the backward a second run of the forward kernel.
ATTENTION_OUTPUT = "kiln_attention_output"
ATTENTION_LSE = "kiln_attention_lse"
ATTENTION_RESIDUALS = (ATTENTION_OUTPUT, ATTENTION_LSE)


@dataclasses.dataclass(frozen=True)
class _KernelConfig:
    """Everything static about one call; a custom_vjp non-differentiable argument."""

    causal: bool
    sm_scale: float
    seq_len: int  # Real length; arrays reaching the kernels are padded to padded_len.
    padded_len: int
    block_sizes: BlockSizes
    launch: LaunchParams
    interpret: bool

    @property
    def masks_padded_keys(self) -> bool:
        # With causal masking a real query never sees a padded (later) key; padded query rows
        # are sliced off and get zero gradients, so only non-causal calls need the length mask.
        return self.padded_len > self.seq_len and not self.causal

    @property
    def logit_scale(self) -> float:
        # exp2 is cheaper than exp on GPUs: fold log2(e) into the softmax scale once.
        return self.sm_scale * LOG2_E


@functools.partial(
    jax.jit, static_argnames=("causal", "sm_scale", "block_sizes", "launch", "interpret")
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
) -> jax.Array:
    """Softmax attention. q: [batch, seq, heads, dim]; k, v: [batch, seq, kv_heads, dim].

    segment_ids: int32 [batch, seq] or None; tokens attend only within their segment.
    Returns q's dtype and shape. sm_scale defaults to 1/sqrt(dim). block_sizes and launch each
    default to the table entry's for the target device. interpret defaults to True when
    lowering for CPU.
    """
    _check_inputs(q, k, v, segment_ids)
    seq_len, head_dim = q.shape[1], q.shape[3]
    platform, device_kind = _target_device()
    table_blocks, table_launch = default_block_sizes(device_kind, head_dim)
    config = _kernel_config(
        seq_len,
        causal=causal,
        sm_scale=1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale),
        block_sizes=block_sizes or table_blocks,
        launch=launch or table_launch,
        interpret=platform == "cpu" if interpret is None else interpret,
    )
    q, k, v, segment_ids = _pad_inputs(q, k, v, segment_ids, config.padded_len)
    return _flash_attention(q, k, v, segment_ids, config)[:, :seq_len]


def _kernel_config(
    seq_len: int,
    *,
    causal: bool,
    sm_scale: float,
    block_sizes: BlockSizes,
    launch: LaunchParams,
    interpret: bool,
) -> _KernelConfig:
    """Tiles fitted to the sequence, and the length to pad to (a multiple of every tile)."""
    block_sizes = block_sizes.fit_to(seq_len)
    unit = block_sizes.largest
    return _KernelConfig(
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
# custom_vjp glue: arrays here are padded to config.padded_len.


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash_attention(q, k, v, segment_ids, config: _KernelConfig):
    out, _ = _forward(q, k, v, segment_ids, config)
    return out


def _flash_attention_fwd(q, k, v, segment_ids, config: _KernelConfig):
    out, lse = _forward(q, k, v, segment_ids, config)
    return out, (q, k, v, segment_ids, out, lse)


def _flash_attention_bwd(config: _KernelConfig, residuals, d_out):
    q, k, v, segment_ids, out, lse = residuals
    delta = _row_delta(out, d_out)
    if config.launch.fused_dq:
        dq, dk, dv = _backward_dkv(q, k, v, segment_ids, d_out, lse, delta, config)
        dq = _scaled_fused_dq(dq, config.sm_scale, q.dtype)
    else:
        dk, dv = _backward_dkv(q, k, v, segment_ids, d_out, lse, delta, config)
        dq = _backward_dq(q, k, v, segment_ids, d_out, lse, delta, config)
    return dq, dk, dv, None


def _row_delta(out: jax.Array, d_out: jax.Array) -> jax.Array:
    """delta_i = sum_d out_i * dout_i = sum_j p_ij * dp_ij, fp32 [batch, heads, seq]: an
    elementwise product and row sum that XLA fuses well, so it needs no kernel of its own."""
    return jnp.einsum("bthd,bthd->bht", out.astype(jnp.float32), d_out.astype(jnp.float32))


def _scaled_fused_dq(dq: jax.Array, sm_scale: float, dtype) -> jax.Array:
    """A fused backward's dQ (fp32, summed without sm_scale) in the inputs' dtype."""
    return (dq * sm_scale).astype(dtype)


_flash_attention.defvjp(_flash_attention_fwd, _flash_attention_bwd)


# ----------------------------------------------------------------------------------------------
# Pieces shared by the kernels.


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


def _tile_mask(
    config: _KernelConfig, q_tile: _Tile, kv_tile: _Tile, on_diagonal: bool
) -> jax.Array | None:
    """[q tile, kv tile] bool mask (True = attend), or None when nothing is masked. Causal
    masking is only needed on tiles that straddle the diagonal."""
    masks = []
    if config.causal and on_diagonal:
        masks.append(q_tile.positions[:, None] >= kv_tile.positions[None, :])
    if config.masks_padded_keys:
        masks.append((kv_tile.positions < config.seq_len)[None, :])
    if q_tile.segments is not None and kv_tile.segments is not None:
        masks.append(q_tile.segments[:, None] == kv_tile.segments[None, :])
    return functools.reduce(jnp.logical_and, masks) if masks else None


def _scaled_logits(
    config: _KernelConfig,
    q: jax.Array,
    k: jax.Array,
    q_tile: _Tile,
    kv_tile: _Tile,
    on_diagonal: bool,
) -> jax.Array:
    """Masked q k^T * sm_scale * log2(e): fp32 [q tile, kv tile] logits in base 2."""
    logits = _dot(q, k.T) * config.logit_scale
    mask = _tile_mask(config, q_tile, kv_tile, on_diagonal)
    return logits if mask is None else jnp.where(mask, logits, MASK_VALUE)


def _kv_tile_ranges(config: _KernelConfig, q_start, block_q: int, block_kv: int):
    """[(first, stop, on_diagonal)] kv tiles a q tile visits: causal skips tiles in the future and
    masks only those straddling the diagonal; tiles made only of padding are never visited."""
    real_tiles = pl.cdiv(config.seq_len, block_kv)
    if not config.causal:
        return [(0, real_tiles, False)]
    stop = jnp.minimum(lax.div(q_start + block_q + block_kv - 1, block_kv), real_tiles)
    past = jnp.minimum(lax.div(q_start, block_kv), stop)  # Tiles that end before q_start.
    return [(0, past, False), (past, stop, True)]


def _q_tile_ranges(config: _KernelConfig, kv_start, block_q: int, block_kv: int):
    """[(first, stop, on_diagonal)] q tiles that see a kv tile (the mirror of _kv_tile_ranges)."""
    real_tiles = pl.cdiv(config.seq_len, block_q)
    if not config.causal:
        return [(0, real_tiles, False)]
    first = lax.div(kv_start, block_q)  # Earlier q tiles end before this kv tile starts.
    future = jnp.clip(lax.div(kv_start + block_kv + block_q - 1, block_q), first, real_tiles)
    return [(first, future, True), (future, real_tiles, False)]


def _loop_over_tiles(ranges, visit_tile, carry):
    """Runs visit_tile(tile, carry, on_diagonal=...) over each (first, stop, on_diagonal) range."""
    for first, stop, on_diagonal in ranges:
        carry = lax.fori_loop(
            first, stop, functools.partial(visit_tile, on_diagonal=on_diagonal), carry
        )
    return carry


def _unless_segments_apart(q_tile: _Tile, kv_tile: _Tile, visit, carry):
    """visit(carry), or carry unchanged when the q and kv tiles' segment id ranges do not overlap:
    then no query of the one shares a segment with a key of the other (a tile pair across
    document boundaries), every logit is masked and the tile adds exactly nothing. Any ids work
    (equal ids lie in both ranges); packed documents, numbered in order, skip most pairs."""
    q_range, kv_range = q_tile.segment_range, kv_tile.segment_range
    if q_range is None or kv_range is None:
        return visit(carry)
    meet = jnp.logical_and(q_range[0] <= kv_range[1], kv_range[0] <= q_range[1])
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
            k = k_ref[kv_tile.slice, :]
            logits = _scaled_logits(config, q, k, q_tile, kv_tile, on_diagonal)
            new_max = jnp.maximum(row_max, logits.max(axis=-1))
            correction = jnp.exp2(row_max - new_max)
            probs = jnp.exp2(logits - new_max[:, None])
            row_sum = row_sum * correction + probs.sum(axis=-1)
            v = v_ref[kv_tile.slice, :]
            acc = acc * correction[:, None] + _dot(probs.astype(v.dtype), v)
            return acc, new_max, row_sum

        return _unless_segments_apart(q_tile, kv_tile, visit, carry)

    init = (
        jnp.zeros(q.shape, jnp.float32),
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    ranges = _kv_tile_ranges(config, q_tile.start, block_q, block_kv)
    acc, row_max, row_sum = _loop_over_tiles(ranges, visit_kv_tile, init)
    out_ref[...] = (acc / row_sum[:, None]).astype(out_ref.dtype)
    lse_ref[...] = row_max + jnp.log2(row_sum)


def _forward(q, k, v, segment_ids, config: _KernelConfig) -> tuple[jax.Array, jax.Array]:
    """Returns the output [batch, seq, heads, dim] and the base-2 lse [batch, heads, seq], named
    for remat policies (ATTENTION_RESIDUALS)."""
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
    return checkpoint_name(out, ATTENTION_OUTPUT), checkpoint_name(lse, ATTENTION_LSE)


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
    ranges = _q_tile_ranges(config, kv_tile.start, block_q, block_kv)

    def visit_q_tile(index, carry, on_diagonal, head):
        q_tile = _tile(index, block_q, segment_ids_ref)
        q_slice = q_tile.slice

        def visit(carry):
            dk, dv = carry
            q = q_ref[q_slice, head, :]
            logits = _scaled_logits(config, q, k, q_tile, kv_tile, on_diagonal)
            probs = jnp.exp2(logits - lse_ref[head, q_slice][:, None])
            d_out = d_out_ref[q_slice, head, :]
            dv = dv + _dot(probs.astype(d_out.dtype).T, d_out)
            d_probs = _dot(d_out, v.T)
            d_logits = probs * (d_probs - delta_ref[head, q_slice][:, None])
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


def _backward_dkv(q, k, v, segment_ids, d_out, lse, delta, config: _KernelConfig):
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
            probs = jnp.exp2(logits - lse[:, None])
            d_probs = _dot(d_out, v_ref[kv_tile.slice, :].T)
            d_logits = probs * (d_probs - delta[:, None])
            return dq + _dot(d_logits.astype(k.dtype), k)

        return _unless_segments_apart(q_tile, kv_tile, visit, dq)

    ranges = _kv_tile_ranges(config, q_tile.start, block_q, block_kv)
    dq = _loop_over_tiles(ranges, visit_kv_tile, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * config.sm_scale).astype(dq_ref.dtype)


def _backward_dq(q, k, v, segment_ids, d_out, lse, delta, config: _KernelConfig):
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
