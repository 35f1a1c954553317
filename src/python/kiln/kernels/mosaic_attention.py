"""Flash attention lowered by Mosaic (Pallas TPU): forward, dK/dV and dQ kernels.

Shaped like jax.experimental.pallas.ops.tpu.splash_attention, with Kiln's tile logic
(kiln.kernels.tiles) and one addition: tile pairs that share no document are skipped in every
kernel, not only those the causal mask empties. docs/attention-kernel.md describes the design;
the short version:

- Inputs are head-major [batch, heads, seq, dim] and q comes pre-scaled by sm_scale * log2(e)
  (flash_attention transposes and scales, which XLA fuses into the producers), so these kernels
  compute softmax2(q k^T) v and their gradients, with logits in base 2 and no scale.
- Each kernel's grid runs over (batch, heads, the tiles it owns, the tiles it visits), the last
  axis innermost and accumulating in VMEM scratch. Which pairs it visits is planned in XLA
  (`_Schedule`, from tiles.kv_tile_ranges / q_tile_ranges and each tile's range of segment ids)
  and prefetched into SMEM: a step outside its owner's [first, stop) maps its blocks to a tile
  already in VMEM, so Mosaic's pipeline issues no copy for it, and the step does no work.
- A visited pair builds a mask only where one is needed: on the causal diagonal, at padded
  keys, or where its tiles hold more than one document.
- forward: q-major tiles [block_q, block_kv]; running max and sum lane-replicated [rows, 128].
- dK/dV: kv-major tiles [block_kv, block_q] (logits transposed, so lse and delta are rows that
  broadcast), looping over the group's q heads and their q tiles: GQA gradients are summed in
  VMEM without repeating K/V.
- dQ: q-major tiles, looping over kv tiles. With LaunchParams.fused_dq there is no dQ kernel:
  the dK/dV kernel also writes each pair's dQ (one [bq, dim] block per kv tile, zeros for a
  pair it skips) and XLA sums the kv tiles' blocks, as splash's fused backward does: 5 products
  per pair instead of 7, for one more pass over dQ-sized memory per kv tile.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kiln.kernels.tiles import (
    BROADCAST_ROWS,
    LANE_ROWS,
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

NUM_LANES = 128
NUM_SUBLANES = 8
# The smallest tile: lse and segment ids travel as rows of a tile's length, which must fill lanes.
MIN_TILE = NUM_LANES
LN_2 = math.log(2.0)
# Logits in base 2: d(logits2)/d(logits) carries log2(e); the gradients carry ln(2) back.
NT_DIMS = (((1,), (1,)), ((), ()))  # a @ b^T
NN_DIMS = (((1,), (0,)), ((), ()))  # a @ b
VMEM_LIMIT_BYTES = 100 * 2**20  # v5e has 128 MiB of VMEM; the 1024-row tiles need ~30.


def check_block_sizes(block_sizes) -> None:
    """Mosaic's tiles are whole rows of lanes: every tile a multiple of MIN_TILE."""
    for name, size in dataclasses.asdict(block_sizes).items():
        if size % MIN_TILE:
            raise ValueError(
                f"BlockSizes.{name}={size}: the TPU (Mosaic) kernels need tiles that are "
                f"multiples of {MIN_TILE}"
            )


def forward(q, k, v, segment_ids, config: KernelConfig) -> tuple[jax.Array, jax.Array]:
    """(out [batch, heads, seq, dim], lse rows [batch, heads, 1, seq] in base 2) of q
    [batch, heads, seq, dim] (pre-scaled), k and v [batch, kv_heads, seq, dim]."""
    return _forward(q, k, v, segment_ids, config)


def backward(q, k, v, segment_ids, out, lse, d_out, config: KernelConfig):
    """(dq, dk, dv) of the forward's inputs."""
    # delta_i = sum_d out_i * dout_i, as rows [batch, heads, 1, seq]: XLA fuses it in one pass.
    delta = jnp.einsum("bhtd,bhtd->bht", out.astype(jnp.float32), d_out.astype(jnp.float32))
    delta = delta[:, :, None, :]
    if config.launch.fused_dq:
        dk, dv, dq_per_kv_tile = _backward_dkv(q, k, v, segment_ids, d_out, lse, delta, config)
        return dq_per_kv_tile.sum(axis=0, dtype=jnp.float32).astype(q.dtype), dk, dv
    dk, dv = _backward_dkv(q, k, v, segment_ids, d_out, lse, delta, config)
    dq = _backward_dq(q, k, v, segment_ids, d_out, lse, delta, config)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# Which tile pairs each kernel visits, planned in XLA and prefetched into SMEM.


@dataclasses.dataclass(frozen=True)
class _Schedule:
    """Which tile pairs a kernel visits, when its programs own tiles of one axis (q or kv) and
    visit tiles of the other. Its operands, int32 vectors prefetched into SMEM:
    first, stop [batch * num_owned]: each owned tile's visited range (causality and, with
    segment ids, the hull of the tiles sharing a document); diagonal_first, diagonal_stop
    [num_owned]: the visited tiles on the causal diagonal; with segment ids, each owned and
    each visited tile's smallest and largest id ([batch * num_owned], [batch * num_visited])."""

    num_owned: int
    num_visited: int
    operands: tuple[jax.Array, ...]

    @property
    def has_segments(self) -> bool:
        return len(self.operands) == 8

    def read(self, refs: Sequence[Any]) -> _Visits:
        """The schedule as a kernel or an index map reads it: its prefetched refs."""
        return _Visits(self, tuple(refs[: len(self.operands)]))


@dataclasses.dataclass(frozen=True)
class _Visits:
    schedule: _Schedule
    refs: tuple[Any, ...]

    def tile(self, b, owned, step):
        """The visited tile whose blocks a grid step reads: its own inside [first, stop), else
        the nearest inside, already in VMEM, so that the pipeline copies nothing for it."""
        index = b * self.schedule.num_owned + owned
        first, stop = self.refs[0][index], self.refs[1][index]
        return jnp.clip(step, first, jnp.maximum(stop - 1, first))

    def step_kind(self, config: KernelConfig, b, owned, visited, *, kv_end):
        """(whether the step computes, whether its pair needs a mask); kv_end: where the pair's
        kv tile ends."""
        first, stop, diagonal_first, diagonal_stop = self.refs[:4]
        index = b * self.schedule.num_owned + owned
        visit = jnp.logical_and(first[index] <= visited, visited < stop[index])
        needs_mask = jnp.bool_(False)
        if config.causal:
            needs_mask = jnp.logical_and(
                diagonal_first[owned] <= visited, visited < diagonal_stop[owned]
            )
        if config.masks_padded_keys:
            needs_mask = jnp.logical_or(needs_mask, kv_end > config.seq_len)
        if self.schedule.has_segments:
            owned_lo, owned_hi, visited_lo, visited_hi = self.refs[4:]
            other = b * self.schedule.num_visited + visited
            mine, theirs = (owned_lo[index], owned_hi[index]), (visited_lo[other], visited_hi[other])
            visit = jnp.logical_and(visit, segment_ranges_meet(mine, theirs))
            one_document = (mine[0] == mine[1]) & (theirs[0] == theirs[1]) & (mine[0] == theirs[0])
            needs_mask = jnp.logical_or(needs_mask, jnp.logical_not(one_document))
        return visit, needs_mask


def _tile_segment_ranges(segment_ids: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    tiles = segment_ids.reshape(segment_ids.shape[0], -1, size)
    return tiles.min(axis=-1), tiles.max(axis=-1)


def _schedule(
    config: KernelConfig,
    segment_ids: jax.Array | None,
    batch: int,
    *,
    q_major: bool,
    bq: int,
    bkv: int,
) -> _Schedule:
    """The visits of a kernel owning q tiles (q_major) or kv tiles, with tiles bq and bkv."""
    owned_size, visited_size = (bq, bkv) if q_major else (bkv, bq)
    num_owned, num_visited = config.padded_len // owned_size, config.padded_len // visited_size
    starts = jnp.arange(num_owned, dtype=jnp.int32) * owned_size
    tile_ranges = kv_tile_ranges if q_major else q_tile_ranges
    ranges = tile_ranges(config.causal, config.seq_len, starts, bq, bkv)

    def per_owned(x) -> jax.Array:
        return jnp.broadcast_to(jnp.asarray(x, jnp.int32), (num_owned,))

    first = jnp.broadcast_to(per_owned(ranges[0][0]), (batch, num_owned))
    stop = jnp.broadcast_to(per_owned(ranges[-1][1]), (batch, num_owned))
    diagonal = next(((lo, hi) for lo, hi, on_diagonal in ranges if on_diagonal), (0, 0))
    segments: tuple[jax.Array, ...] = ()
    if segment_ids is not None:
        owned_lo, owned_hi = _tile_segment_ranges(segment_ids, owned_size)
        visited_lo, visited_hi = _tile_segment_ranges(segment_ids, visited_size)
        first, stop = _segment_hull(
            first, stop, (owned_lo, owned_hi), (visited_lo, visited_hi), num_visited
        )
        segments = (owned_lo, owned_hi, visited_lo, visited_hi)
    operands = (first, stop, per_owned(diagonal[0]), per_owned(diagonal[1]), *segments)
    return _Schedule(
        num_owned=num_owned,
        num_visited=num_visited,
        operands=tuple(x.reshape(-1).astype(jnp.int32) for x in operands),
    )


def _segment_hull(first, stop, owned_ranges, visited_ranges, num_visited: int):
    """[first, stop) narrowed, per batch row and owned tile, to the hull of the visited tiles it
    shares segment ids with (empty: [0, 0))."""
    visited = jnp.arange(num_visited, dtype=jnp.int32)
    useful = segment_ranges_meet(
        (owned_ranges[0][:, :, None], owned_ranges[1][:, :, None]),
        (visited_ranges[0][:, None, :], visited_ranges[1][:, None, :]),
    )
    useful &= (first[:, :, None] <= visited) & (visited < stop[:, :, None])
    any_useful = useful.any(axis=-1)
    first = jnp.where(any_useful, jnp.argmax(useful, axis=-1), 0)
    last = num_visited - 1 - jnp.argmax(useful[..., ::-1], axis=-1)
    return first, jnp.where(any_useful, last + 1, 0)


def _segment_layouts(segment_ids: jax.Array | None) -> tuple[jax.Array, ...]:
    """Segment ids as columns [batch, seq, 128] (lane-replicated, for tiles whose rows are
    these tokens) and as rows [batch, 8, seq] (for tiles whose columns are); () without ids."""
    if segment_ids is None:
        return ()
    batch, padded_len = segment_ids.shape
    column = lax.broadcast_in_dim(segment_ids, (batch, padded_len, NUM_LANES), (0, 1))
    row = lax.broadcast_in_dim(segment_ids, (batch, NUM_SUBLANES, padded_len), (0, 2))
    return column, row


# ----------------------------------------------------------------------------------------------
# Pieces of every kernel.


def _dot(a: jax.Array, b: jax.Array, dims) -> jax.Array:
    """fp32-accumulated product; fp32 operands keep fp32 precision on the MXU."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32, precision=precision)


def _pair_mask(config: KernelConfig, shape, q_axis: int, q_start, kv_start, q_ids, kv_ids):
    """The mask of a [rows, cols] tile pair whose queries run along q_axis."""
    q_positions = q_start + lax.broadcasted_iota(jnp.int32, shape, q_axis)
    kv_positions = kv_start + lax.broadcasted_iota(jnp.int32, shape, 1 - q_axis)
    return pair_mask(
        q_positions, kv_positions, q_ids, kv_ids, causal=config.causal, key_limit=config.key_limit
    )


def _lane_tiled(column_ids: jax.Array, columns: int) -> jax.Array:
    """[rows, 128] lane-replicated ids spread over `columns` columns."""
    return jnp.tile(column_ids, (1, columns // NUM_LANES))


def _when_visited(visit, needs_mask, config: KernelConfig, tile, chunk, q_stop, kv_start, compute):
    """On a visited step, compute(start, size, needs_mask) over the kv tile's chunks of `chunk`
    keys (splash's compute blocks: one copy brings the tile, each product takes a chunk), with
    the mask only where the pair needs one. On a masked causal pair, chunks starting at or past
    q_stop (the end of the q tile) lie in the future and are skipped."""

    def over_chunks(needs_mask: bool) -> None:
        for start in range(0, tile, chunk):
            run = functools.partial(compute, start, chunk, needs_mask)
            if config.causal and needs_mask and chunk < tile:
                pl.when(kv_start + start < q_stop)(run)
            else:
                run()

    pl.when(jnp.logical_and(visit, needs_mask))(lambda: over_chunks(True))
    pl.when(jnp.logical_and(visit, jnp.logical_not(needs_mask)))(lambda: over_chunks(False))


def _q_major_ids(ids_refs, start: int, size: int) -> tuple[jax.Array | None, jax.Array | None]:
    """(q ids [bq, size], kv ids [1, size]) of a q-major pair's keys from `start`, or (None,
    None) without ids: from the q tile's lane-replicated columns and the kv tile's rows."""
    if not ids_refs:
        return None, None
    q_columns, kv_rows = ids_refs
    return _lane_tiled(q_columns[...], size), kv_rows[:1, pl.ds(start, size)]


def _q_major_specs(schedule: _Schedule, bq: int, bkv: int, head_dim: int, group: int):
    """BlockSpecs of a kernel whose grid is (batch, heads, q tiles, kv tiles): (the q tile, the
    visited kv tile of q head h's kv head h // group, the q tile's row of lse or delta, [the q
    tile's ids as columns, the kv tile's as rows])."""

    def kv_tile(b, h, i, j, *refs):
        return schedule.read(refs).tile(b, i, j)

    return (
        pl.BlockSpec((None, None, bq, head_dim), lambda b, h, i, j, *_: (b, h, i, 0)),
        pl.BlockSpec(
            (None, None, bkv, head_dim),
            lambda b, h, i, j, *refs: (b, h // group, kv_tile(b, h, i, j, *refs), 0),
        ),
        pl.BlockSpec((None, None, 1, bq), lambda b, h, i, j, *_: (b, h, 0, i)),
        [
            pl.BlockSpec((None, bq, NUM_LANES), lambda b, h, i, j, *_: (b, i, 0)),
            pl.BlockSpec(
                (None, NUM_SUBLANES, bkv),
                lambda b, h, i, j, *refs: (b, 0, kv_tile(b, h, i, j, *refs)),
            ),
        ],
    )


def _split_refs(refs: Sequence[Any], *counts: int) -> list[tuple[Any, ...]]:
    """A kernel's refs in groups of `counts` (prefetched, inputs, outputs, scratch)."""
    groups, start = [], 0
    for count in counts:
        groups.append(tuple(refs[start : start + count]))
        start += count
    return groups


def _pallas_call(kernel, *, name, grid, schedule, in_specs, out_specs, out_shape, scratch, config):
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(schedule.operands),
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=VMEM_LIMIT_BYTES,
        ),
        interpret=config.interpret,
        name=name,
    )


# ----------------------------------------------------------------------------------------------
# Forward: grid (batch, heads, q tiles, kv tiles); q-major tiles [bq, keys].


def _forward_kernel(*refs, config: KernelConfig, schedule: _Schedule):
    prefetched, inputs, (out_ref, lse_ref), (max_ref, sum_ref, acc_ref) = _split_refs(
        refs, len(schedule.operands), 3 + 2 * schedule.has_segments, 2, 3
    )
    q_ref, k_ref, v_ref, *ids_refs = inputs
    bq, bkv = q_ref.shape[0], k_ref.shape[0]
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        max_ref[...] = jnp.full(max_ref.shape, -jnp.inf, jnp.float32)
        sum_ref[...] = jnp.zeros(sum_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def compute_chunk(start: int, size: int, needs_mask: bool):
        keys = pl.ds(start, size)
        logits = _dot(q_ref[...], k_ref[keys, :], NT_DIMS)
        if needs_mask:
            q_ids, kv_ids = _q_major_ids(ids_refs, start, size)
            mask = _pair_mask(config, logits.shape, 0, i * bq, j * bkv + start, q_ids, kv_ids)
            logits = masked(logits, mask)
        probs, correction, row_max, row_sum = online_softmax_step(
            LANE_ROWS, logits, max_ref[...], sum_ref[...]
        )
        max_ref[...], sum_ref[...] = row_max, row_sum
        v = v_ref[keys, :]
        acc = acc_ref[...] * LANE_ROWS.spread(correction, v.shape[-1])
        acc_ref[...] = acc + _dot(probs.astype(v.dtype), v, NN_DIMS)

    visit, needs_mask = schedule.read(prefetched).step_kind(config, b, i, j, kv_end=(j + 1) * bkv)
    chunk = config.block_sizes.compute_tile("block_kv")
    _when_visited(visit, needs_mask, config, bkv, chunk, (i + 1) * bq, j * bkv, compute_chunk)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        # Rows of tiles made only of padding visit nothing: keep them finite (they are sliced
        # off and never read by the backward).
        row_sum = sum_ref[...]
        row_sum = jnp.where(row_sum > 0, row_sum, 1.0)
        head_dim = acc_ref.shape[-1]
        out_ref[...] = (acc_ref[...] / LANE_ROWS.spread(row_sum, head_dim)).astype(out_ref.dtype)
        lse_ref[...] = row_lse(max_ref[...], row_sum).T[:1, :]  # [bq, 128] columns -> a row


def _forward(q, k, v, segment_ids, config: KernelConfig):
    batch, num_heads, padded_len, head_dim = q.shape
    bq, bkv = config.block_sizes.block_q, config.block_sizes.block_kv
    schedule = _schedule(config, segment_ids, batch, q_major=True, bq=bq, bkv=bkv)
    q_spec, kv_spec, row_spec, ids_specs = _q_major_specs(
        schedule, bq, bkv, head_dim, num_heads // k.shape[1]
    )
    out, lse = _pallas_call(
        functools.partial(_forward_kernel, config=config, schedule=schedule),
        name="kiln_flash_attention_fwd",
        grid=(batch, num_heads, padded_len // bq, padded_len // bkv),
        schedule=schedule,
        in_specs=[q_spec, kv_spec, kv_spec, *(ids_specs if schedule.has_segments else ())],
        out_specs=[q_spec, row_spec],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((batch, num_heads, 1, padded_len), jnp.float32),
        ],
        scratch=[
            pltpu.VMEM((bq, NUM_LANES), jnp.float32),
            pltpu.VMEM((bq, NUM_LANES), jnp.float32),
            pltpu.VMEM((bq, head_dim), jnp.float32),
        ],
        config=config,
    )(*schedule.operands, q, k, v, *_segment_layouts(segment_ids))
    return out, lse


# ----------------------------------------------------------------------------------------------
# Backward. With p = exp2(logits - lse), dp = dout v^T and ds = p * (dp - delta):
#   dV = p^T dout,  dK = ln2 * ds^T q,  dQ = ln2 * ds k   (q, k as the kernels see them).


def _backward_dkv_kernel(*refs, config: KernelConfig, schedule: _Schedule):
    fused = config.launch.fused_dq
    prefetched, inputs, outputs, scratch = _split_refs(
        refs, len(schedule.operands), 6 + 2 * schedule.has_segments, 2 + fused, 2 + fused
    )
    q_ref, k_ref, v_ref, d_out_ref, lse_ref, delta_ref, *ids_refs = inputs
    (dk_ref, dv_ref, *dq_ref), (dk_acc, dv_acc, *dq_acc) = outputs, scratch
    bq, bkv = q_ref.shape[0], k_ref.shape[0]
    b, j, step = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    i = step % schedule.num_visited  # the q tile; step // num_visited is the head in the group

    @pl.when(step == 0)
    def _init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    if fused:  # this pair's dQ, summed over the tile's chunks; zeros where it is skipped
        dq_acc[0][...] = jnp.zeros(dq_acc[0].shape, jnp.float32)

    def compute_chunk(start: int, size: int, needs_mask: bool):
        keys = pl.ds(start, size)
        q, k, v, d_out = q_ref[...], k_ref[keys, :], v_ref[keys, :], d_out_ref[...]
        logits = _dot(k, q, NT_DIMS)  # [keys, bq]: keys down, queries across
        if needs_mask:
            q_ids, kv_ids = None, None
            if ids_refs:  # (q ids as rows, kv ids as columns)
                q_ids, kv_ids = ids_refs[0][:1, :], _lane_tiled(ids_refs[1][keys, :], bq)
            mask = _pair_mask(config, logits.shape, 1, i * bq, j * bkv + start, q_ids, kv_ids)
            logits = masked(logits, mask)
        probs = recomputed_probs(BROADCAST_ROWS, logits, lse_ref[...])
        dv_acc[keys, :] += _dot(probs.astype(d_out.dtype), d_out, NN_DIMS)
        d_probs = _dot(v, d_out, NT_DIMS)
        d_logits = logit_grads(BROADCAST_ROWS, probs, d_probs, delta_ref[...])
        dk_acc[keys, :] += _dot(d_logits.astype(q.dtype), q, NN_DIMS)
        if fused:  # transposed in fp32, as splash does (Mosaic's 32-bit transposes)
            dq_acc[0][...] += _dot(d_logits.T.astype(k.dtype), k, NN_DIMS)

    visit, needs_mask = schedule.read(prefetched).step_kind(config, b, j, i, kv_end=(j + 1) * bkv)
    chunk = config.block_sizes.compute_tile("block_kv_dkv")
    _when_visited(visit, needs_mask, config, bkv, chunk, (i + 1) * bq, j * bkv, compute_chunk)
    if fused:
        dq_ref[0][...] = (dq_acc[0][...] * LN_2).astype(dq_ref[0].dtype)

    @pl.when(step == pl.num_programs(3) - 1)
    def _finish():
        dk_ref[...] = (dk_acc[...] * LN_2).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _backward_dkv(q, k, v, segment_ids, d_out, lse, delta, config: KernelConfig):
    """Grid (batch, kv heads, kv tiles, the group's q heads x q tiles). (dk, dv), or with
    fused_dq (dk, dv, dq per kv tile [kv tiles, batch, heads, seq, dim])."""
    batch, num_heads, padded_len, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    bq, bkv = config.block_sizes.block_q_dkv, config.block_sizes.block_kv_dkv
    schedule = _schedule(config, segment_ids, batch, q_major=False, bq=bq, bkv=bkv)
    num_q_tiles = schedule.num_visited

    def q_tile(b, h, j, step, *refs):
        """(batch, q head, q tile) of a step."""
        i = schedule.read(refs).tile(b, j, step % num_q_tiles)
        return b, h * group + step // num_q_tiles, i

    q_spec = pl.BlockSpec((None, None, bq, head_dim), lambda *a: (*q_tile(*a), 0))
    row_spec = pl.BlockSpec((None, None, 1, bq), lambda *a: (*q_tile(*a)[:2], 0, q_tile(*a)[2]))
    kv_spec = pl.BlockSpec((None, None, bkv, head_dim), lambda b, h, j, step, *_: (b, h, j, 0))
    ids_specs = [  # q ids as rows, kv ids as columns
        pl.BlockSpec((None, NUM_SUBLANES, bq), lambda *a: (a[0], 0, q_tile(*a)[2])),
        pl.BlockSpec((None, bkv, NUM_LANES), lambda b, h, j, step, *_: (b, j, 0)),
    ]
    out_specs = [kv_spec, kv_spec]
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    scratch = [pltpu.VMEM((bkv, head_dim), jnp.float32)] * 2
    if config.launch.fused_dq:  # every step writes its own block: the q tile it would visit
        out_specs.append(
            pl.BlockSpec(
                (None, None, None, bq, head_dim),
                lambda b, h, j, step, *_: (
                    j, b, h * group + step // num_q_tiles, step % num_q_tiles, 0
                ),
            )
        )
        out_shape.append(jax.ShapeDtypeStruct((padded_len // bkv, *q.shape), q.dtype))
        scratch.append(pltpu.VMEM((bq, head_dim), jnp.float32))
    return _pallas_call(
        functools.partial(_backward_dkv_kernel, config=config, schedule=schedule),
        name="kiln_flash_attention_dkv",
        grid=(batch, num_kv_heads, padded_len // bkv, group * num_q_tiles),
        schedule=schedule,
        in_specs=[
            q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec,
            *(ids_specs if schedule.has_segments else ()),
        ],  # fmt: skip
        out_specs=out_specs,
        out_shape=out_shape,
        scratch=scratch,
        config=config,
    )(*schedule.operands, q, k, v, d_out, lse, delta, *_segment_layouts(segment_ids)[::-1])


def _backward_dq_kernel(*refs, config: KernelConfig, schedule: _Schedule):
    prefetched, inputs, (dq_ref,), (dq_acc,) = _split_refs(
        refs, len(schedule.operands), 6 + 2 * schedule.has_segments, 1, 1
    )
    q_ref, k_ref, v_ref, d_out_ref, lse_ref, delta_ref, *ids_refs = inputs
    bq, bkv = q_ref.shape[0], k_ref.shape[0]
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

    def compute(start: int, size: int, needs_mask: bool):
        q, k, d_out = q_ref[...], k_ref[...], d_out_ref[...]
        logits = _dot(q, k, NT_DIMS)  # [bq, bkv]
        if needs_mask:
            q_ids, kv_ids = _q_major_ids(ids_refs, 0, bkv)
            mask = _pair_mask(config, logits.shape, 0, i * bq, j * bkv, q_ids, kv_ids)
            logits = masked(logits, mask)
        lse, delta = lse_ref[0][:, None], delta_ref[0][:, None]  # rows -> [bq, 1] columns
        probs = recomputed_probs(BROADCAST_ROWS, logits, lse)
        d_probs = _dot(d_out, v_ref[...], NT_DIMS)
        d_logits = logit_grads(BROADCAST_ROWS, probs, d_probs, delta)
        dq_acc[...] += _dot(d_logits.astype(k.dtype), k, NN_DIMS)

    visit, needs_mask = schedule.read(prefetched).step_kind(config, b, i, j, kv_end=(j + 1) * bkv)
    _when_visited(visit, needs_mask, config, bkv, bkv, (i + 1) * bq, j * bkv, compute)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = (dq_acc[...] * LN_2).astype(dq_ref.dtype)


def _backward_dq(q, k, v, segment_ids, d_out, lse, delta, config: KernelConfig):
    """Grid (batch, heads, q tiles, kv tiles), as the forward's."""
    batch, num_heads, padded_len, head_dim = q.shape
    bq, bkv = config.block_sizes.block_q_dq, config.block_sizes.block_kv_dq
    schedule = _schedule(config, segment_ids, batch, q_major=True, bq=bq, bkv=bkv)
    q_spec, kv_spec, row_spec, ids_specs = _q_major_specs(
        schedule, bq, bkv, head_dim, num_heads // k.shape[1]
    )
    return _pallas_call(
        functools.partial(_backward_dq_kernel, config=config, schedule=schedule),
        name="kiln_flash_attention_dq",
        grid=(batch, num_heads, padded_len // bq, padded_len // bkv),
        schedule=schedule,
        in_specs=[
            q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec,
            *(ids_specs if schedule.has_segments else ()),
        ],  # fmt: skip
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch=[pltpu.VMEM((bq, head_dim), jnp.float32)],
        config=config,
    )(*schedule.operands, q, k, v, d_out, lse, delta, *_segment_layouts(segment_ids))
