"""Flash attention's dK/dV for Hopper in Pallas Mosaic GPU: warp-specialised, four wgmma per tile.

FlashAttention-3's dK/dV layout. A program owns two K/V tiles of one kv head, one per compute
warpgroup (block_kv rows each); the memory warpgroup streams q and dO tiles of every q head in
the kv head's group through a ring of SMEM slots with TMA, so GQA gradients are summed in the
accumulators without repeating K/V. Per q tile a compute warpgroup works on the transposed
problem, rows = its keys:
    sT = k qᵀ,  pT = exp2(sT · scale - lse),  dV += pT dO,
    dpT = v dOᵀ, dsT = pT (dpT - delta),       dK += dsT q
then writes dK · sm_scale and dV through its K/V SMEM tiles by TMA. Same inputs and outputs as
the product's Triton dK/dV kernel (kiln.kernels.flash_attention._backward_dkv), so either forward
feeds it: masked logits are -inf, probability 0 whether lse is finite or +inf.

Causal: a K/V tile sees only q tiles from its own start on; those that straddle the diagonal
are masked, later ones are not. Programs run first to last, so the longest start first. lse and
delta ride the ring with their q tile (256 bytes each) and are read from SMEM just before use:
held in registers for the whole tile, as plain loads from global memory had them, their 32
registers (the WGMMA column layout) made ptxas spill (lab/NOTES.md). On the GPU pT
and dsT go to their wgmma from registers and dK/dV accumulate in place (FlashAttention-3's form);
in the interpreter, which takes wgmma operands from memory only and cannot accumulate in place,
they are staged through SMEM into fresh accumulators (flash_attention_hopper.lhs_operand,
wgmma_group).

With config.fused_dq the kernel is FlashAttention-3's whole backward: 5 matmuls per tile pair
where dK/dV + dQ take 7, and no dQ kernel. Both warpgroups put dsT in SMEM and meet at a
barrier (_FusedDq), dK's wgmma already running; then warpgroup w takes dQ's columns w·d/2.. of
the q tile over both K/V tiles (its wgmmas issued behind dK's, one wait for the three),
    dQ[:, cols_w] = ds₀ k₀[:, cols_w] + ds₁ k₁[:, cols_w]   (ds_j = dsT_jᵀ, from SMEM)
and TMA adds it (`cp.reduce.async.bulk.tensor` add, FlashAttention-3's reduce-add) into a zeroed
fp32 dQ buffer, a jax Ref the kernel writes in place. Each program adds one block_q x d tile
per q tile it visits, so dQ's summation order, and its last bits, vary between GPU runs. Under
causal masking both warpgroups visit the program's q tiles from its first row on (the dQ split
needs both), so the second one computes one masked tile more than alone. jax's GPU interpreter
has no TMA reductions: there a warpgroup reads, adds and writes back its columns, which is right
because the interpreter runs programs one at a time and the warpgroups' columns are disjoint.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kiln_lab.flash_attention_hopper import (
    COMPUTE_WARPGROUPS,
    WGMMA_TRANSFORMS,
    HopperConfig,
    accumulate,
    fill_ring,
    launch,
    lhs_operand,
    load_segments,
    matmul,
    next_slot,
    split_warpgroups,
    staging_smem,
    tile_mask,
    wgmma_group,
    wgmma_zeros,
)

# fp32 SMEM tiles stored from registers: 128-byte swizzled rows (32 floats), fewer bank conflicts.
FP32_TRANSFORMS = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))  # type: ignore[abstract]


def hopper_dkv(q, k, v, segment_ids, d_out, lse, delta, config: HopperConfig):
    """(dK, dV) [batch, seq, kv_heads, dim] in k's dtype; with config.fused_dq (unscaled fp32
    dQ [batch, seq, heads, dim], dK, dV). lse, delta: fp32 [batch, heads, seq]."""
    assert config.kv_programs, "the dK/dV kernel's programs own K/V tiles"
    batch, padded_len, num_kv_heads, _ = k.shape
    config = config.fit_to(q, "dK/dV")
    dq = jax.new_ref(jnp.zeros(q.shape, jnp.float32)) if config.fused_dq else None
    kv_shape = jax.ShapeDtypeStruct(k.shape, k.dtype)
    dk, dv = launch(
        "kiln_flash_attention_bwd_hopper" if dq is not None else "kiln_flash_attention_dkv_hopper",
        _kernel,
        (q, k, v, segment_ids, d_out, lse, delta, dq),
        out_type=(kv_shape, kv_shape),
        grid=(num_kv_heads, padded_len // config.program_rows, batch),
        grid_names=("heads", "kv_seq", "batch"),
        scratch=_scratch(q.dtype, q.shape[-1], config),
        barriers=_barriers(config),
        config=config,
    )
    return (dk, dv) if dq is None else (dq[...], dk, dv)


def _scratch(dtype, head_dim: int, config: HopperConfig) -> tuple:
    block_q, block_kv, stages = config.block_q, config.block_kv, config.stages
    kv_tiles = (COMPUTE_WARPGROUPS, block_kv, head_dim)
    ring = (stages, block_q, head_dim)
    ds_tiles = (COMPUTE_WARPGROUPS, block_kv, block_q)
    dq_tiles = (COMPUTE_WARPGROUPS, block_q, head_dim // COMPUTE_WARPGROUPS)
    return (
        plgpu.SMEM(kv_tiles, dtype, transforms=WGMMA_TRANSFORMS),  # K, then dK on its way out
        plgpu.SMEM(kv_tiles, dtype, transforms=WGMMA_TRANSFORMS),  # V, then dV
        plgpu.SMEM(ring, dtype, transforms=WGMMA_TRANSFORMS),  # q
        plgpu.SMEM(ring, dtype, transforms=WGMMA_TRANSFORMS),  # dO
        plgpu.SMEM((stages, block_q), jnp.float32),  # lse
        plgpu.SMEM((stages, block_q), jnp.float32),  # delta
        # pT, then dsT, on their way to the dV and dK wgmma, in the interpreter
        *staging_smem(ds_tiles, dtype, config),
        *(  # fused: dsT for the dQ wgmma (and dK's), dQ on its way to the reduce-add
            [
                plgpu.SMEM(ds_tiles, dtype, transforms=WGMMA_TRANSFORMS),
                plgpu.SMEM(dq_tiles, jnp.float32, transforms=FP32_TRANSFORMS),
            ]
            if config.fused_dq
            else []
        ),
    )


def _barriers(config: HopperConfig) -> tuple:
    stages = config.stages
    return (
        plgpu.Barrier(num_barriers=COMPUTE_WARPGROUPS),  # K tile landed
        plgpu.Barrier(num_barriers=COMPUTE_WARPGROUPS),  # V tile landed
        # A slot's q, dO, lse and delta tiles landed: one arrival per copy, one wait per tile.
        plgpu.Barrier(num_arrivals=4, num_barriers=stages),
        # q slot free (and its lse and delta: read before q's last use)
        plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=stages),
        plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=stages),  # dO slot free
        # fused: both dsT tiles written; both read by the dQ wgmmas. Two barriers, not one pair:
        # an indexed barrier waited on inside run_state (wgmma_group) fails to lower (jax 0.11.2).
        *([plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS)] * 2 if config.fused_dq else []),
    )


def _kernel(gmem_refs, smem, barriers, config: HopperConfig):
    q_ref, k_ref, v_ref, segment_ids_ref, d_out_ref, lse_ref, delta_ref, dq_ref, dk_ref, dv_ref = (
        gmem_refs
    )
    k_smem, v_smem, q_smem, d_out_smem, lse_smem, delta_smem, *tiles = smem
    staging = tiles.pop(0) if config.interpret else None
    k_landed, v_landed, streamed_landed, q_free, d_out_free = barriers[:5]
    ds_barriers = barriers[5:] if config.fused_dq else None
    batch, kv_head = lax.axis_index("batch"), lax.axis_index("heads")
    group = q_ref.shape[2] // k_ref.shape[2]
    program_row = lax.axis_index("kv_seq") * config.program_rows
    real_q_tiles = pl.cdiv(config.seq_len, config.block_q)
    # Causal: earlier q tiles end before any of the program's keys; clamped for programs made
    # only of padding, which visit nothing and write zeros.
    first_q_tile = lax.div(program_row, config.block_q) if config.causal else 0
    first_q_tile = jnp.minimum(first_q_tile, real_q_tiles)

    def compute(wg):
        fused_dq = None
        if config.fused_dq:  # Both warpgroups' tiles, and this one's dQ columns.
            ds_tiles, dq_tiles = tiles
            columns = pl.ds(wg * dq_tiles.shape[-1], dq_tiles.shape[-1])
            fused_dq = _FusedDq(
                wg,
                dq_ref.at[batch, :, pl.ds(kv_head * group, group), columns],
                k_smem.at[:, :, columns],
                ds_tiles,
                dq_tiles.at[wg],
                ds_barriers,
            )
        _compute_warpgroup(
            (k_ref.at[batch, :, kv_head], v_ref.at[batch, :, kv_head]),
            segment_ids_ref if segment_ids_ref is None else segment_ids_ref.at[batch],
            (dk_ref.at[batch, :, kv_head], dv_ref.at[batch, :, kv_head]),
            (
                k_smem.at[wg],
                v_smem.at[wg],
                (q_smem, d_out_smem, lse_smem, delta_smem),
                None if staging is None else staging.at[wg],
            ),
            (k_landed.at[wg], v_landed.at[wg], streamed_landed, q_free, d_out_free),
            fused_dq,
            kv_start=program_row + wg * config.block_kv,
            # Fused, both warpgroups visit the same q tiles: the program's.
            visited_kv_rows=(program_row, config.program_rows) if config.fused_dq else None,
            q_tiles=(first_q_tile, real_q_tiles),
            group=group,
            config=config,
        )

    def memory():
        per_head = real_q_tiles - first_q_tile

        def load(tile, slot):  # Streamed tile t: q head t // per_head of the group.
            head = kv_head * group + lax.div(tile, per_head)
            rows = pl.ds((first_q_tile + lax.rem(tile, per_head)) * config.block_q, config.block_q)
            sources = (
                q_ref.at[batch, rows, head],
                d_out_ref.at[batch, rows, head],
                lse_ref.at[batch, head, rows],
                delta_ref.at[batch, head, rows],
            )
            destinations = (q_smem, d_out_smem, lse_smem, delta_smem)
            for source, destination in zip(sources, destinations, strict=True):
                plgpu.copy_gmem_to_smem(source, destination.at[slot], streamed_landed.at[slot])

        fill_ring(load, (q_free, d_out_free), group * per_head, config.stages)

    # Each compute warpgroup's code on its own: its K/V rows, and so the causal tile bounds and
    # its SMEM tiles' wgmma descriptors, are constants (unmasked loops ~40% fewer instructions,
    # no spills; lab/NOTES.md). Not fused: there it saves ~2% of the unmasked loop's
    # instructions, and two copies of a ~9 KiB loop per SM scheduler risk the instruction cache
    # more than two of ~5 KiB (ncu's stall reasons will tell).
    split_warpgroups(compute, memory, static_index=not config.fused_dq)


class _FusedDq:
    """A compute warpgroup's share of the fused dQ: its columns of the group's dQ
    [seq, group, d/2] and of both K tiles, both warpgroups' dsT tiles, its fp32 staging tile,
    and the barriers the warpgroups meet at: both dsT tiles written, both read by the dQ
    wgmmas. A warpgroup waits for the last "read" only when it writes its next dsT, so the
    faster one runs ahead by up to a tile; one arrival before the first tile stands for a tile
    -1, and finish() takes the last phase."""

    def __init__(self, wg, dq_ref, k_columns, ds_tiles, stage, barriers):
        self.wg, self.dq_ref, self.k_columns, self.ds_tiles = wg, dq_ref, k_columns, ds_tiles
        self.stage, (self.written, self.read) = stage, barriers

    def start(self) -> None:
        plgpu.barrier_arrive(self.read)

    def accumulate(self, dk, ds, q_tile, q_start, head, config: HopperConfig) -> jax.Array:
        """dk + dsT q, and dQ[q tile, columns] += Σ_j ds_j k_j[:, columns] by a reduce-add:
        dsT (fp32, WGMMA layout) goes to this warpgroup's SMEM tile once the other warpgroup's
        dQ wgmmas have read the last one; dK's wgmma runs while the warpgroups meet (both dsT
        tiles written) and through their dQ wgmmas."""
        own = self.ds_tiles.at[self.wg]
        plgpu.barrier_wait(self.read)
        ds = ds.astype(own.dtype)
        own[...] = ds
        plgpu.commit_smem()
        ds_operand = own if config.interpret else ds

        def dk_and_dq(dk_ref, dq_ref):
            plgpu.wgmma(dk_ref, ds_operand, q_tile)
            _meet(self.written)
            for j in range(COMPUTE_WARPGROUPS):
                plgpu.wgmma(dq_ref, self.ds_tiles.at[j].transpose((1, 0)), self.k_columns.at[j])

        dk, dq = wgmma_group(dk_and_dq, [dk], config, fresh=[self.stage.shape])
        plgpu.barrier_arrive(self.read)
        q_rows = pl.ds(q_start, self.stage.shape[0])
        _add_to_gmem(dq, self.stage, self.dq_ref.at[q_rows, head], config)
        return dk

    def finish(self) -> None:
        """After the last tile: the other warpgroup's dQ wgmmas are done with K too."""
        plgpu.barrier_wait(self.read)


def _meet(barrier) -> None:
    """Both compute warpgroups reach this point before either goes on."""
    plgpu.barrier_arrive(barrier)
    plgpu.barrier_wait(barrier)


def _add_to_gmem(x: jax.Array, stage, target, config: HopperConfig) -> None:
    """target += x (fp32, WGMMA layout) through the SMEM tile `stage`. On the GPU a TMA
    reduce-add, left in flight: the next call (or the kernel's final wait) waits until it has
    read the stage. The interpreter has no TMA reductions: there it reads, adds and writes back
    (right only where nothing else writes `target` meanwhile)."""
    if config.interpret:
        stage[...] = x + plgpu.load(target, layout=plgpu.Layout.WGMMA, optimized=False)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(stage, target)
        plgpu.wait_smem_to_gmem(0)
        return
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    stage[...] = x
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(stage, target, reduction_op="add")


def _compute_warpgroup(
    kv_refs,
    segment_ids_ref,
    out_refs,
    smem,
    barriers,
    fused_dq: _FusedDq | None,
    *,
    kv_start,
    visited_kv_rows,
    q_tiles,
    group,
    config,
):
    """One K/V tile: dK and dV summed over the q tiles of every head in the group (and, fused,
    this warpgroup's share of each q tile's dQ)."""
    k_ref, v_ref = kv_refs
    k_smem, v_smem, (q_smem, d_out_smem, lse_smem, delta_smem), staging = smem
    k_landed, v_landed, streamed_landed, q_free, d_out_free = barriers
    first_q_tile, real_q_tiles = q_tiles
    block_q, block_kv, stages = config.block_q, config.block_kv, config.stages
    head_dim = k_smem.shape[-1]
    kv_rows = pl.ds(kv_start, block_kv)
    plgpu.copy_gmem_to_smem(k_ref.at[kv_rows], k_smem, k_landed)
    plgpu.copy_gmem_to_smem(v_ref.at[kv_rows], v_smem, v_landed)
    has_segments = segment_ids_ref is not None
    kv_segments = load_segments(segment_ids_ref, kv_start, block_kv, 1) if has_segments else None
    own_first, masked_stop = _q_tile_bounds(
        visited_kv_rows or (kv_start, block_kv), first_q_tile, real_q_tiles, has_segments, config
    )
    tile_shape = (block_kv, block_q)
    column_stats = plgpu.Layout.WGMMA.reduce(0)  # [block_q], broadcast down the rows

    def column_vector(x):
        return lax.broadcast_in_dim(x, tile_shape, [1])

    def wait_landed(slot):
        # The slot's four tiles at once (one barrier): waiting on lse and delta where they are
        # used kept their barriers' state live across the tile, and ptxas spilled again.
        plgpu.barrier_wait(streamed_landed.at[slot])

    def visit_tile(q_tile, carry, masked, head):
        previous_slot, (dk, dv) = carry
        slot = next_slot(previous_slot, stages)
        q_start = q_tile * block_q
        if masked and has_segments:
            q_segments = load_segments(segment_ids_ref, q_start, block_q, 0)
        else:
            q_segments = None
        wait_landed(slot)
        q_tile, d_out_tile = q_smem.at[slot], d_out_smem.at[slot]
        logits = matmul(k_smem, q_tile.transpose((1, 0)), tile_shape)
        if masked:
            mask = tile_mask(q_start, kv_start, q_segments, kv_segments, config, q_dim=1)
            logits = jnp.where(mask, logits, -jnp.inf)
        lse = plgpu.load(lse_smem.at[slot], layout=column_stats)
        probs = jnp.exp2(logits * config.logit_scale - column_vector(lse))
        if fused_dq is not None and not config.fp32_probs:
            # Fused, the registers run short: pT is kept in the inputs' dtype only (dV's operand,
            # and dsT's factor; dsT is rounded to it too), so its fp32 tile is free before dpT.
            # On the SASS: 15 local loads/stores per unmasked tile instead of 56, at 24
            # instructions more (lab/NOTES.md); the tuner times both forms.
            probs = probs.astype(k_smem.dtype)
        # dV's and dpT's wgmmas apart: issued together (one wait, as in jax's attention_mgpu)
        # they kept pT, dpT and dV's operands live at once, and ptxas spilled 13-16 more local
        # loads per tile (hopper_compile.py).
        p_operand = lhs_operand(probs, k_smem.dtype, staging)
        dv = accumulate(dv, p_operand, d_out_tile, config)
        d_probs = matmul(v_smem, d_out_tile.transpose((1, 0)), tile_shape)
        plgpu.barrier_arrive(d_out_free.at[slot])
        delta = plgpu.load(delta_smem.at[slot], layout=column_stats)
        ds = probs.astype(jnp.float32) * (d_probs - column_vector(delta))
        if fused_dq is None:
            ds = lhs_operand(ds, k_smem.dtype, staging)
            dk = accumulate(dk, ds, q_tile, config)
        else:
            dk = fused_dq.accumulate(dk, ds, q_tile, q_start, head, config)
        plgpu.barrier_arrive(q_free.at[slot])
        return slot, (dk, dv)

    def skip_tile(_, previous_slot):
        # Tiles the other warpgroup still needs: take and release them so the ring keeps moving.
        slot = next_slot(previous_slot, stages)
        wait_landed(slot)
        plgpu.barrier_arrive(q_free.at[slot])
        plgpu.barrier_arrive(d_out_free.at[slot])
        return slot

    def visit_head(index, carry):  # The streamed tiles of the group's index-th q head.
        slot, grads = carry
        slot = lax.fori_loop(first_q_tile, own_first, skip_tile, slot)
        visit = functools.partial(visit_tile, head=index)
        carry = lax.fori_loop(
            own_first, masked_stop, functools.partial(visit, masked=True), (slot, grads)
        )
        return lax.fori_loop(
            masked_stop, real_q_tiles, functools.partial(visit, masked=False), carry
        )

    zeros = wgmma_zeros((block_kv, head_dim))
    plgpu.barrier_wait(k_landed)
    plgpu.barrier_wait(v_landed)
    if fused_dq is not None:
        fused_dq.start()
    # The carried slot is the last tile's, so -1's at first (as in the forward and dQ kernels).
    _, (dk, dv) = lax.fori_loop(0, group, visit_head, (jnp.int32(stages - 1), (zeros, zeros)))
    if fused_dq is not None:
        fused_dq.finish()

    # K and V's tiles are free now (fused: the other warpgroup's dQ wgmmas are done with K).
    dk_ref, dv_ref = out_refs
    k_smem[...] = (dk * config.sm_scale).astype(k_smem.dtype)
    v_smem[...] = dv.astype(v_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[kv_rows])
    plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[kv_rows])
    plgpu.wait_smem_to_gmem(0)


def _q_tile_bounds(kv_rows, first_q_tile, real_q_tiles, has_segments: bool, config: HopperConfig):
    """(first q tile the K/V rows (start, count) visit, end of the masked ones). Causal: from
    the tile holding their start, masked while the tile straddles the diagonal. Not causal:
    all, masked only where the rows hold padded keys. Segment ids mask every tile."""
    kv_start, kv_count = kv_rows
    if config.causal:
        own_first = jnp.clip(lax.div(kv_start, config.block_q), first_q_tile, real_q_tiles)
        diagonal_stop = pl.cdiv(kv_start + kv_count, config.block_q)
    else:
        own_first = first_q_tile
        has_padding = kv_start + kv_count > config.seq_len
        diagonal_stop = jnp.where(has_padding, real_q_tiles, own_first)
    masked_stop = jnp.int32(real_q_tiles) if has_segments else diagonal_stop
    return own_first, jnp.clip(masked_stop, own_first, real_q_tiles)
