"""Flash attention's dQ for Hopper in Pallas Mosaic GPU: the Hopper forward's layout, three wgmma.

A program owns two q tiles of one head, one per compute warpgroup, and the memory warpgroup
streams the kv head's K/V tiles through the same SMEM ring as the forward
(flash_attention_hopper.stream_kv_tiles). Per K/V tile a compute warpgroup recomputes
p = exp2(q kᵀ · scale - lse), takes dp = dO vᵀ, forms ds = p (dp - delta) and adds ds k to its
dQ accumulator: three matmuls on the tensor cores, where the Triton dQ kernel runs them through
Triton's mma. Per K/V tile the three go out as one group with one wait: this tile's q kᵀ and dO vᵀ,
then the previous tile's ds k (the loop rotated as in the forward; the last tile's ds k follows
the loop), so the tensor cores do not drain between them. Same inputs and output as that kernel
(kiln.kernels.flash_attention._backward_dq), so either forward feeds it; masked logits are -inf,
so a row with lse +inf (the Hopper forward's padded rows that see no key) or a finite lse (the
Triton forward's) gets probability 0 for them.

On the GPU ds goes to its wgmma from registers and dQ accumulates in place, as in
FlashAttention-3; jax's GPU interpret mode (the CPU tests) takes wgmma operands from memory only
and has no rule for in-place accumulation, so there ds is staged through SMEM and each product
gets a fresh accumulator (flash_attention_hopper.lhs_operand, wgmma_group). No ping-pong between
the two compute warpgroups yet: each runs its tiles at its own pace.
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
    kv_tile_counts,
    launch,
    lhs_operand,
    load_segments,
    next_slot,
    program_position,
    row_vector,
    split_warpgroups,
    staging_smem,
    stream_kv_tiles,
    tile_mask,
    wgmma_group,
    wgmma_zeros,
)


def hopper_dq(q, k, v, segment_ids, d_out, lse, delta, config: HopperConfig) -> jax.Array:
    """dQ [batch, seq, heads, dim] in q's dtype. lse and delta: fp32 [batch, heads, seq]."""
    batch, padded_len, num_heads, head_dim = q.shape
    config = config.fit_to(q, "dQ")
    transforms = WGMMA_TRANSFORMS
    q_tiles = (COMPUTE_WARPGROUPS, config.block_q, head_dim)
    ring = (config.stages, config.block_kv, head_dim)
    scratch = (
        plgpu.SMEM(q_tiles, q.dtype, transforms=transforms),  # q, then dQ on its way out
        plgpu.SMEM(q_tiles, q.dtype, transforms=transforms),  # dO
        plgpu.SMEM(ring, q.dtype, transforms=transforms),  # K
        plgpu.SMEM(ring, q.dtype, transforms=transforms),  # V
        # ds on its way to the ds k wgmma, in the interpreter
        *staging_smem((COMPUTE_WARPGROUPS, config.block_q, config.block_kv), q.dtype, config),
    )
    barriers = (
        # A slot's K and V tiles landed: one arrival per copy, one wait per tile.
        plgpu.Barrier(num_arrivals=2, num_barriers=config.stages),
        plgpu.Barrier(num_barriers=COMPUTE_WARPGROUPS),  # q tile landed
        plgpu.Barrier(num_barriers=COMPUTE_WARPGROUPS),  # dO tile landed
        plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=config.stages),  # K slot free
        plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=config.stages),  # V slot free
    )

    return launch(
        "kiln_flash_attention_dq_hopper",
        _kernel,
        (q, k, v, segment_ids, d_out, lse, delta),
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(num_heads, padded_len // config.program_rows, batch),
        grid_names=("heads", "q_seq", "batch"),
        scratch=scratch,
        barriers=barriers,
        config=config,
    )


def _kernel(gmem_refs, smem, barriers, config: HopperConfig):
    q_ref, k_ref, v_ref, segment_ids_ref, d_out_ref, lse_ref, delta_ref, dq_ref = gmem_refs
    q_smem, d_out_smem, k_smem, v_smem, *staging = smem
    kv_landed, q_landed, d_out_landed, k_free, v_free = barriers
    program_row, program_kv_tiles = program_position(q_ref.shape[1], config)
    batch, head = lax.axis_index("batch"), lax.axis_index("heads")

    def compute(wg):
        _compute_warpgroup(
            q_ref.at[batch, :, head],
            d_out_ref.at[batch, :, head],
            lse_ref.at[batch, head],
            delta_ref.at[batch, head],
            segment_ids_ref if segment_ids_ref is None else segment_ids_ref.at[batch],
            dq_ref.at[batch, :, head],
            (
                q_smem.at[wg],
                d_out_smem.at[wg],
                k_smem,
                v_smem,
                staging[0].at[wg] if staging else None,
            ),
            (kv_landed, q_landed.at[wg], d_out_landed.at[wg], k_free, v_free),
            q_start=program_row + wg * config.block_q,
            program_kv_tiles=program_kv_tiles,
            config=config,
        )

    def memory():
        # K and V land on one barrier (the forward's own ring waits for them apart).
        ring_barriers = (kv_landed, kv_landed, k_free, v_free)
        group = q_ref.shape[2] // k_ref.shape[2]
        stream_kv_tiles(
            k_ref, v_ref, k_smem, v_smem, ring_barriers, program_kv_tiles, group, config
        )

    # Each compute warpgroup's code on its own: its q rows, tile bounds and addresses fold
    # (fewer instructions per masked tile; lab/NOTES.md).
    split_warpgroups(compute, memory, static_index=True)


def _compute_warpgroup(
    q_ref,
    d_out_ref,
    lse_ref,
    delta_ref,
    segment_ids_ref,
    dq_ref,
    smem,
    barriers,
    *,
    q_start,
    program_kv_tiles,
    config: HopperConfig,
):
    """One q tile: dQ summed over its K/V tiles, then back to GMEM via TMA."""
    q_smem, d_out_smem, k_smem, v_smem, ds_staging = smem
    kv_landed, q_landed, d_out_landed, k_free, v_free = barriers
    block_q, block_kv, stages = config.block_q, config.block_kv, config.stages
    head_dim = q_smem.shape[-1]
    q_rows = pl.ds(q_start, block_q)
    plgpu.copy_gmem_to_smem(q_ref.at[q_rows], q_smem, q_landed)
    plgpu.copy_gmem_to_smem(d_out_ref.at[q_rows], d_out_smem, d_out_landed)
    row_stats = plgpu.Layout.WGMMA.reduce(1)
    lse = plgpu.load(lse_ref.at[q_rows], layout=row_stats, optimized=False)
    delta = plgpu.load(delta_ref.at[q_rows], layout=row_stats, optimized=False)
    has_segments = segment_ids_ref is not None
    num_tiles, unmasked_tiles = kv_tile_counts(q_start, program_kv_tiles, has_segments, config)
    q_segments = load_segments(segment_ids_ref, q_start, block_q, 1) if has_segments else None
    plgpu.barrier_wait(q_landed)
    plgpu.barrier_wait(d_out_landed)

    def visit_tile(tile, carry, masked):
        dq, ds_prev, previous_slot = carry
        slot = next_slot(previous_slot, stages)
        kv_start = tile * block_kv
        if masked and has_segments:
            kv_segments = load_segments(segment_ids_ref, kv_start, block_kv, 0)
        else:
            kv_segments = None
        tile_shape = (block_q, block_kv)
        plgpu.barrier_wait(kv_landed.at[slot])

        def gemms(dq_ref, logits_ref, d_probs_ref):
            # The fresh accumulators first: their zeros fold into the wgmmas (wgmma_group).
            plgpu.wgmma(logits_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
            plgpu.wgmma(d_probs_ref, d_out_smem, v_smem.at[slot].transpose((1, 0)))

            @pl.when(tile > 0)
            def _():
                ds_operand = lhs_operand(ds_prev, q_smem.dtype, ds_staging)
                plgpu.wgmma(dq_ref, ds_operand, k_smem.at[previous_slot])

        dq, logits, d_probs = wgmma_group(gemms, [dq], config, fresh=[tile_shape] * 2)
        pl.when(tile > 0)(lambda: plgpu.barrier_arrive(k_free.at[previous_slot]))
        plgpu.barrier_arrive(v_free.at[slot])
        if masked:
            mask = tile_mask(q_start, kv_start, q_segments, kv_segments, config)
            logits = jnp.where(mask, logits, -jnp.inf)
        probs = jnp.exp2(logits * config.logit_scale - row_vector(lse, tile_shape))
        ds = probs * (d_probs - row_vector(delta, tile_shape))
        return dq, ds.astype(q_smem.dtype), slot

    def skip_tile(_, previous_slot):
        # Tiles the other warpgroup still needs: take and release them so the ring keeps moving.
        slot = next_slot(previous_slot, stages)
        plgpu.barrier_wait(kv_landed.at[slot])
        plgpu.barrier_arrive(k_free.at[slot])
        plgpu.barrier_arrive(v_free.at[slot])
        return slot

    carry = (
        wgmma_zeros((block_q, head_dim)),
        wgmma_zeros((block_q, block_kv), q_smem.dtype),  # ds of tile -1: never used
        jnp.int32(stages - 1),  # the slot of tile -1
    )
    carry = lax.fori_loop(0, unmasked_tiles, functools.partial(visit_tile, masked=False), carry)
    carry = lax.fori_loop(
        unmasked_tiles, num_tiles, functools.partial(visit_tile, masked=True), carry
    )
    dq, ds, last_slot = carry
    # The last tile's ds k, before the skipped tiles: their ring slots wait for its K's.
    dq = accumulate(dq, lhs_operand(ds, q_smem.dtype, ds_staging), k_smem.at[last_slot], config)
    plgpu.barrier_arrive(k_free.at[last_slot])
    lax.fori_loop(num_tiles, program_kv_tiles, skip_tile, last_slot)

    q_smem[...] = (dq * config.sm_scale).astype(q_smem.dtype)  # q's tile is free now
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[q_rows])
    plgpu.wait_smem_to_gmem(0)
