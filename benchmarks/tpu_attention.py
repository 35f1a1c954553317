"""The TPU side of benchmarks/attention.py: jax's own TPU kernels as anchors, and the tile sizes
tried for each kernel (ours and splash) before the sweep.

- splash: jax.experimental.pallas.ops.tpu.splash_attention (make_splash_mha, one kernel per
  (seq, heads, causal) mask, vmapped over the batch; q pre-scaled; GQA native; packed documents
  as SegmentIds). Block sizes: its BlockSizes, the best of SPLASH_CANDIDATES.
- jax_flash: jax.experimental.pallas.ops.tpu.flash_attention (no GQA: K/V repeated per q head).

Both take [batch, seq, heads, dim] here and transpose to head-major, as Kiln's kernel does
inside flash_attention, so every implementation pays the same layout changes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import flash_attention as jax_flash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

from kiln.kernels.block_sizes import BlockSizes, LaunchParams

# Ours: forward tiles (block_q, block_kv, block_kv_compute) first, then the backward's
# ((block_q_dkv, block_kv_dkv, block_kv_dkv_compute), (block_q_dq, block_kv_dq) or FUSED: dQ
# from the dK/dV kernel) with the best forward. 128-multiples that fit VMEM at head dim 128;
# 0: products over the whole tile.
OURS_FORWARD_CANDIDATES = [
    (512, 512, 0),
    (1024, 512, 0),
    (1024, 1024, 512),
    (512, 1024, 512),
    (2048, 1024, 512),
]
FUSED = None
OURS_BACKWARD_CANDIDATES = [
    ((512, 1024, 512), (1024, 1024)),  # the best split backward of an earlier sweep
    ((1024, 1024, 512), (1024, 512)),
    ((512, 1024, 512), FUSED),
    ((1024, 1024, 512), FUSED),
    ((1024, 512, 0), FUSED),
    ((2048, 1024, 512), FUSED),
]
# Splash: (block_q, block_kv, block_kv_compute, fused backward), forward and backward alike. The
# second is the best of an earlier sweep at seq 4096 (benchmarks/RESULTS.md).
SPLASH_CANDIDATES = [
    (512, 512, 512, False),
    (1024, 1024, 512, False),
    (1024, 1024, 512, True),
    (2048, 1024, 512, False),
]


def ours_candidates(
    best_forward: BlockSizes | None,
) -> list[tuple[BlockSizes, LaunchParams]]:
    """Forward candidates (backward tiles = forward tiles, split backward), or with the best
    forward fixed, the backward candidates."""
    if best_forward is None:
        return [
            (BlockSizes(q, kv, q, kv, q, kv, block_kv_compute=c, block_kv_dkv_compute=c),
             LaunchParams())
            for q, kv, c in OURS_FORWARD_CANDIDATES
        ]  # fmt: skip
    return [
        (
            dataclasses.replace(
                best_forward,
                block_q_dkv=dkv[0],
                block_kv_dkv=dkv[1],
                block_kv_dkv_compute=dkv[2],
                # A fused backward has no dQ kernel: its tiles stay the dK/dV kernel's.
                block_q_dq=dkv[0] if dq is FUSED else dq[0],
                block_kv_dq=dkv[1] if dq is FUSED else dq[1],
            ),
            LaunchParams(fused_dq=dq is FUSED),
        )
        for dkv, dq in OURS_BACKWARD_CANDIDATES
    ]


def describe(candidate) -> str:
    """A tuning candidate in a line: ours' tiles per kernel (and whether dQ is fused), or
    splash's tuple."""
    if not isinstance(candidate[0], BlockSizes):
        return str(candidate)
    blocks, launch = candidate
    dq = "fused" if launch.fused_dq else f"{blocks.block_q_dq}, {blocks.block_kv_dq}"
    return (
        f"fwd {blocks.block_q}, {blocks.block_kv}, {blocks.block_kv_compute}; dK/dV "
        f"{blocks.block_q_dkv}, {blocks.block_kv_dkv}, {blocks.block_kv_dkv_compute}; dQ {dq}"
    )


def splash_block_sizes(candidate: tuple, seq_len: int) -> splash.BlockSizes:
    """Splash's BlockSizes for a candidate, tiles no longer than the sequence."""
    block_q, block_kv, compute, fused = candidate
    block_q, block_kv = min(block_q, seq_len), min(block_kv, seq_len)
    compute = min(compute, block_kv)
    return splash.BlockSizes(
        block_q=block_q,
        block_kv=block_kv,
        block_kv_compute=compute,
        block_q_dkv=block_q,
        block_kv_dkv=block_kv,
        block_kv_dkv_compute=compute,
        block_q_dq=None if fused else block_q,
        block_kv_dq=None if fused else block_kv,
        use_fused_bwd_kernel=fused,
    )


@functools.cache
def _splash_kernel(seq_len: int, num_heads: int, causal: bool, block_sizes: splash.BlockSizes):
    mask = masks.CausalMask((seq_len, seq_len)) if causal else masks.FullMask((seq_len, seq_len))
    return splash.make_splash_mha(
        masks.MultiHeadMask([mask] * num_heads),
        block_sizes=block_sizes,
        head_shards=1,
        q_seq_shards=1,
    )


def splash_attention(causal: bool, candidate: tuple) -> Callable[..., jax.Array]:
    """splash_attention(q, k, v, segment_ids or None) on [batch, seq, heads, dim]."""

    def attend(q, k, v, ids):
        batch, seq_len, num_heads, head_dim = q.shape
        with jax.ensure_compile_time_eval():  # its mask tables are constants, not tracers
            blocks = splash_block_sizes(candidate, seq_len)
            kernel = _splash_kernel(seq_len, num_heads, causal, blocks)
        q = q * jnp.asarray(1.0 / math.sqrt(head_dim), q.dtype)
        q, k, v = (x.swapaxes(1, 2) for x in (q, k, v))
        if ids is None:
            out = jax.vmap(kernel)(q, k, v)
        else:
            out = jax.vmap(lambda q, k, v, i: kernel(q, k, v, splash.SegmentIds(i, i)))(
                q, k, v, ids
            )
        return out.swapaxes(1, 2)

    return attend


def jax_flash_attention(causal: bool) -> Callable[..., jax.Array]:
    """pallas.ops.tpu.flash_attention on [batch, seq, heads, dim], its default tiles at most
    512 (the largest its kernels take at seq 2k-8k)."""

    def attend(q, k, v, ids):
        batch, seq_len, num_heads, head_dim = q.shape
        group = num_heads // k.shape[2]
        q, k, v = (x.swapaxes(1, 2) for x in (q, k, v))
        k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
        block = min(512, seq_len)
        blocks = jax_flash.BlockSizes(
            block_q=block, block_k_major=block, block_k=block, block_b=1,
            block_q_major_dkv=block, block_k_major_dkv=block, block_k_dkv=block,
            block_q_dkv=block, block_k_major_dq=block, block_k_dq=block, block_q_dq=block,
        )  # fmt: skip
        segment_ids = None if ids is None else jax_flash.SegmentIds(ids, ids)
        out = jax_flash.flash_attention(
            q, k, v, segment_ids=segment_ids, causal=causal,
            sm_scale=1.0 / math.sqrt(head_dim), block_sizes=blocks,
        )  # fmt: skip
        return out.swapaxes(1, 2)

    return attend
