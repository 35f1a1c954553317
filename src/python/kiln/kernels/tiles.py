"""What both lowerings of the flash attention share, written once: which tile pairs a kernel
visits, the mask of a visited pair, and the online softmax in base 2.

The Triton kernels (GPU) call these inside their loops; the Mosaic kernels (TPU) call them inside
each grid step, and call the tile ranges from XLA to plan which pairs the grid visits. Every
function takes jnp values of whatever shape the caller holds (a column of positions and a row,
or two full iotas), so one definition serves both.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from kiln.kernels.block_sizes import BlockSizes, LaunchParams

# Finite on purpose: a row whose keys are all masked inside one tile gets exp2(0) = 1 instead of
# NaN, and the online softmax's correction erases it once a real key arrives (every query attends
# at least to itself, so one always does).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
LOG2_E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Everything static about one call: a custom_vjp non-differentiable argument."""

    lowering: str  # "triton" or "mosaic"
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
    def key_limit(self) -> int | None:
        """Where the padded keys start, for a mask that needs them masked; else None."""
        return self.seq_len if self.masks_padded_keys else None

    @property
    def logit_scale(self) -> float:
        # exp2 is cheaper than exp: fold log2(e) into the softmax scale once.
        return self.sm_scale * LOG2_E


# ----------------------------------------------------------------------------------------------
# Which tile pairs are visited.


def kv_tile_ranges(causal: bool, seq_len: int, q_start, block_q: int, block_kv: int):
    """[(first, stop, on_diagonal)] kv tiles a q tile starting at q_start visits: causal skips
    tiles in the future and masks only those straddling the diagonal; tiles made only of padding
    are never visited. q_start may be a scalar or an array of q tiles' starts."""
    real_tiles = -(-seq_len // block_kv)
    if not causal:
        return [(0, real_tiles, False)]
    stop = jnp.minimum(lax.div(q_start + block_q + block_kv - 1, block_kv), real_tiles)
    past = jnp.minimum(lax.div(q_start, block_kv), stop)  # Tiles that end before q_start.
    return [(0, past, False), (past, stop, True)]


def q_tile_ranges(causal: bool, seq_len: int, kv_start, block_q: int, block_kv: int):
    """[(first, stop, on_diagonal)] q tiles that see a kv tile (the mirror of kv_tile_ranges)."""
    real_tiles = -(-seq_len // block_q)
    if not causal:
        return [(0, real_tiles, False)]
    first = lax.div(kv_start, block_q)  # Earlier q tiles end before this kv tile starts.
    future = jnp.clip(lax.div(kv_start + block_kv + block_q - 1, block_q), first, real_tiles)
    return [(first, future, True), (future, real_tiles, False)]


def segment_ranges_meet(q_range, kv_range):
    """Whether a q tile and a kv tile whose segment ids span q_range and kv_range ((smallest,
    largest) each) can share a document. When they do not, every logit of the pair is masked and
    the pair adds exactly nothing, so kernels skip it. Any ids work (equal ids lie in both
    ranges); packed documents, numbered in order, skip most pairs."""
    return jnp.logical_and(q_range[0] <= kv_range[1], kv_range[0] <= q_range[1])


# ----------------------------------------------------------------------------------------------
# The mask of a visited pair.


def pair_mask(
    q_positions,
    kv_positions,
    q_segments=None,
    kv_segments=None,
    *,
    causal: bool,
    key_limit: int | None,
) -> jax.Array | None:
    """Bool mask (True = attend) of a q tile against a kv tile, from positions and segment ids
    that broadcast against each other; None when nothing is masked. causal: the pair straddles
    the diagonal (pairs wholly in the past need no causal mask). key_limit: keys at or past it
    are padding (non-causal calls on padded inputs)."""
    masks = []
    if causal:
        masks.append(q_positions >= kv_positions)
    if key_limit is not None:
        masks.append(kv_positions < key_limit)
    if q_segments is not None and kv_segments is not None:
        masks.append(q_segments == kv_segments)
    return functools.reduce(jnp.logical_and, masks) if masks else None


def masked(logits: jax.Array, mask: jax.Array | None) -> jax.Array:
    return logits if mask is None else jnp.where(mask, logits, MASK_VALUE)


# ----------------------------------------------------------------------------------------------
# The online softmax, in base 2 (logits already carry log2(e)).


@dataclasses.dataclass(frozen=True)
class RowStats:
    """How a kernel holds one statistic per query (running max and sum, lse, delta) beside a
    tile of logits whose queries run along its first axis.

    keepdims: statistics keep the reduced axis ([rows, 1]-like) rather than being vectors.
    lanes: statistics are replicated over this many lanes ([rows, 128] on a TPU, which keeps
    them in whole vector registers) and spread over wider tiles by tiling; None: they broadcast.
    """

    keepdims: bool = False
    lanes: int | None = None

    def max(self, x: jax.Array) -> jax.Array:
        return x.max(axis=-1, keepdims=self.keepdims)

    def sum(self, x: jax.Array) -> jax.Array:
        return x.sum(axis=-1, keepdims=self.keepdims)

    def spread(self, stat: jax.Array, columns: int) -> jax.Array:
        """stat laid over `columns` columns, ready to combine with a [rows, columns] tile."""
        if self.lanes is not None:
            return jnp.tile(stat, (1, -(-columns // self.lanes)))[:, :columns]
        return stat if self.keepdims else stat[:, None]


VECTOR_ROWS = RowStats()  # Triton: per-row vectors.
BROADCAST_ROWS = RowStats(keepdims=True)  # Mosaic: a [rows, 1] column or a [1, cols] row.
LANE_ROWS = RowStats(keepdims=True, lanes=128)  # Mosaic: [rows, 128] lane-replicated.


def online_softmax_step(rows: RowStats, logits: jax.Array, row_max, row_sum):
    """One kv tile of the online softmax: (probabilities against the new running max, the
    correction to apply to what was accumulated, the new max, the new sum)."""
    new_max = jnp.maximum(row_max, rows.max(logits))
    correction = jnp.exp2(row_max - new_max)
    probs = jnp.exp2(logits - rows.spread(new_max, logits.shape[-1]))
    return probs, correction, new_max, row_sum * correction + rows.sum(probs)


def row_lse(row_max, row_sum):
    """The base-2 log-sum-exp of each row, from the online softmax's final max and sum."""
    return row_max + jnp.log2(row_sum)


def recomputed_probs(rows: RowStats, logits: jax.Array, lse) -> jax.Array:
    """The forward's probabilities again, from its logits and lse: p = exp2(logits - lse)."""
    return jnp.exp2(logits - rows.spread(lse, logits.shape[-1]))


def logit_grads(rows: RowStats, probs: jax.Array, d_probs: jax.Array, delta) -> jax.Array:
    """dS = p * (dP - delta), delta_i = sum_d out_i * dout_i: the gradient of each logit."""
    return probs * (d_probs - rows.spread(delta, probs.shape[-1]))
