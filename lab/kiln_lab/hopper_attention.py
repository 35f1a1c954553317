"""Kiln's flash attention with Mosaic GPU (Hopper) kernels in place of its Triton ones.

Same contract as kiln.kernels.flash_attention.flash_attention, plus `hopper`: which kernels run
as this package's Mosaic GPU kernels (flash_attention_hopper*.py: warp-specialised, TMA, wgmma),
for 16-bit inputs; fp32 inputs keep the Triton kernels. The rest is the product's: input checks,
padding, the Triton kernels and the backward's row delta, composed here under this module's own
`jax.custom_vjp` (the product knows nothing of the lab).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from kiln.kernels import flash_attention as product
from kiln.kernels import triton_attention
from kiln.kernels.block_sizes import BlockSizes, LaunchParams, default_block_sizes
from kiln.kernels.tiles import KernelConfig
from kiln_lab.flash_attention_hopper import (
    COMPUTE_WARPGROUPS,
    WGMMA_ROWS,
    HopperConfig,
    hopper_forward,
)
from kiln_lab.flash_attention_hopper_dkv import hopper_dkv
from kiln_lab.flash_attention_hopper_dq import hopper_dq


@dataclasses.dataclass(frozen=True)
class HopperKernels:
    """Which kernels run as Mosaic GPU kernels, with the BlockSizes and LaunchParams they read.

    forward: flash_attention_hopper.py. block_q is each compute warpgroup's rows (a program owns
    two q tiles), num_stages_fwd the K/V tiles in flight; num_warps_fwd is unused.
    dkv: flash_attention_hopper_dkv.py (block_kv_dkv rows per compute warpgroup, num_stages_dkv
    q/dO tiles of block_q_dkv in flight). With LaunchParams.fused_dq it also computes dQ, by TMA
    reduce-adds: FlashAttention-3's backward (head dim a multiple of 128).
    dq: flash_attention_hopper_dq.py (the forward's layout: block_q_dq rows per compute
    warpgroup, num_stages_dq K/V tiles in flight). Not with fused_dq (there is no dQ kernel).
    fused_fp32_probs: in the fused backward (dkv with fused_dq), pT stays fp32 through dsT, as
    in the other kernels; off, it is rounded to the inputs' dtype once computed, which frees
    registers.
    A switched kernel's tiles are multiples of 64 (a wgmma's rows) and its ring depth >= 2.
    """

    forward: bool = False
    dkv: bool = False
    dq: bool = False
    fused_fp32_probs: bool = False

    def check(self, block_sizes: BlockSizes, launch: LaunchParams) -> None:
        """Raises ValueError naming the field when the settings do not suit the switched kernels."""
        for switch, (tiles, stages) in _KERNEL_FIELDS.items():
            if not getattr(self, switch):
                continue
            for tile in tiles:
                size = getattr(block_sizes, tile)
                if size < WGMMA_ROWS:
                    raise ValueError(
                        f"BlockSizes.{tile}={size} must be >= {WGMMA_ROWS} with "
                        f"HopperKernels.{switch} (a Hopper kernel's tile)"
                    )
            if getattr(launch, stages) < 2:
                raise ValueError(f"LaunchParams.{stages} must be >= 2 with HopperKernels.{switch}")
        if self.dq and launch.fused_dq:
            raise ValueError("HopperKernels.dq and LaunchParams.fused_dq exclude each other")
        if self.fused_fp32_probs and not (self.dkv and launch.fused_dq):
            raise ValueError(
                "HopperKernels.fused_fp32_probs is a setting of the Hopper fused backward: set "
                "HopperKernels.dkv and LaunchParams.fused_dq with it, or leave it False"
            )



# Per switch: the tiles its kernel reads, and its ring depth.
_KERNEL_FIELDS = {
    "forward": (("block_q", "block_kv"), "num_stages_fwd"),
    "dkv": (("block_q_dkv", "block_kv_dkv"), "num_stages_dkv"),
    "dq": (("block_q_dq", "block_kv_dq"), "num_stages_dq"),
}


@dataclasses.dataclass(frozen=True)
class LabConfig:
    """Everything static about one call: the product's config for the Triton kernels, and each
    Hopper kernel's config where it runs instead."""

    triton: KernelConfig
    forward: HopperConfig | None = None
    dkv: HopperConfig | None = None
    dq: HopperConfig | None = None

    @property
    def runs_hopper(self) -> bool:
        return any(kernel is not None for kernel in (self.forward, self.dkv, self.dq))


@functools.partial(
    jax.jit, static_argnames=("causal", "sm_scale", "block_sizes", "launch", "hopper", "interpret")
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
    hopper: HopperKernels | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """kiln.kernels.flash_attention.flash_attention, with the kernels `hopper` switches on run
    as Mosaic GPU kernels (None: none). Compiled (not interpreted) they need a Hopper GPU (sm_90).
    """
    hopper = hopper or HopperKernels()
    product._check_inputs(q, k, v, segment_ids)
    seq_len, head_dim = q.shape[1], q.shape[3]
    platform, device_kind = product._target_device()
    table_blocks, table_launch = default_block_sizes(device_kind, head_dim)
    interpret = platform == "cpu" if interpret is None else interpret
    config = lab_config(
        seq_len,
        q.dtype,
        causal=causal,
        sm_scale=1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale),
        block_sizes=block_sizes or table_blocks,
        launch=launch or table_launch,
        hopper=hopper,
        interpret=interpret,
    )
    if config.runs_hopper and not interpret:
        _check_hopper_target(hopper, platform, device_kind)
    q, k, v, segment_ids = product._pad_inputs(q, k, v, segment_ids, config.triton.padded_len)
    return _attention(q, k, v, segment_ids, config)[:, :seq_len]


def lab_config(
    seq_len: int,
    dtype,
    *,
    causal: bool,
    sm_scale: float,
    block_sizes: BlockSizes,
    launch: LaunchParams,
    hopper: HopperKernels,
    interpret: bool,
) -> LabConfig:
    """Tiles fitted to the sequence (a Hopper kernel's no shorter than 64), the padded length
    (a Hopper kernel's program owns two tiles), and the Hopper kernels' configs."""
    hopper.check(block_sizes, launch)
    block_sizes = _fit(block_sizes, seq_len, hopper)
    unit = max([block_sizes.largest, *_program_rows(block_sizes, hopper)])
    triton = KernelConfig(
        lowering="triton",
        causal=causal,
        sm_scale=sm_scale,
        seq_len=seq_len,
        padded_len=-(-seq_len // unit) * unit,
        block_sizes=block_sizes,
        launch=launch,
        interpret=interpret,
    )
    if jnp.dtype(dtype).itemsize != 2:  # wgmma takes 16-bit operands: fp32 stays on Triton.
        return LabConfig(triton)
    kernels = {
        switch: HopperConfig(
            causal=causal,
            sm_scale=sm_scale,
            seq_len=seq_len,
            block_q=getattr(block_sizes, block_q),
            block_kv=getattr(block_sizes, block_kv),
            stages=getattr(launch, stages),
            interpret=interpret,
            kv_programs=switch == "dkv",
            fused_dq=switch == "dkv" and launch.fused_dq,
            fp32_probs=switch == "dkv" and hopper.fused_fp32_probs,
        )
        for switch, ((block_q, block_kv), stages) in _KERNEL_FIELDS.items()
        if getattr(hopper, switch)
    }
    return LabConfig(triton, **kernels)


def _fit(block_sizes: BlockSizes, seq_len: int, hopper: HopperKernels) -> BlockSizes:
    fitted = block_sizes.fit_to(seq_len)
    hopper_tiles = [
        tile for switch, (tiles, _) in _KERNEL_FIELDS.items() if getattr(hopper, switch)
        for tile in tiles
    ]
    return dataclasses.replace(
        fitted, **{tile: max(WGMMA_ROWS, getattr(fitted, tile)) for tile in hopper_tiles}
    )


def _program_rows(block_sizes: BlockSizes, hopper: HopperKernels) -> list[int]:
    """The rows a Hopper kernel's program owns: one tile per compute warpgroup."""
    rows = [block_sizes.block_q] if hopper.forward else []
    rows += [block_sizes.block_kv_dkv] if hopper.dkv else []
    rows += [block_sizes.block_q_dq] if hopper.dq else []
    return [COMPUTE_WARPGROUPS * row for row in rows]


def _check_hopper_target(hopper: HopperKernels, platform: str, device_kind: str) -> None:
    """The Mosaic GPU kernels compile for Hopper only (wgmma, sm_90). An abstract mesh's device
    (jax.export from a CPU machine) has no compute capability: a GPU one passes."""
    capability = None
    if getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None) is None:
        capability = getattr(jax.devices()[0], "compute_capability", None)
    on_hopper = platform in ("gpu", "cuda") and (capability is None or capability.startswith("9."))
    if not on_hopper:
        switches = [name for name in _KERNEL_FIELDS if getattr(hopper, name)]
        raise ValueError(
            f"HopperKernels {', '.join(switches)} run Mosaic GPU kernels for Hopper (sm_90: H100, "
            f"H200), not {device_kind!r} ({platform}, compute capability {capability}): switch "
            "them off for this device, or run in interpret mode"
        )


# ----------------------------------------------------------------------------------------------
# custom_vjp glue: arrays here are padded to config.triton.padded_len.


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, segment_ids, config: LabConfig):
    out, _ = _forward(q, k, v, segment_ids, config)
    return out


def _forward(q, k, v, segment_ids, config: LabConfig) -> tuple[jax.Array, jax.Array]:
    if config.forward is not None:
        return hopper_forward(q, k, v, segment_ids, config.forward)
    return triton_attention.forward(q, k, v, segment_ids, config.triton)


def _attention_fwd(q, k, v, segment_ids, config: LabConfig):
    out, lse = _forward(q, k, v, segment_ids, config)
    return out, (q, k, v, segment_ids, out, lse)


def _attention_bwd(config: LabConfig, residuals, d_out):
    q, k, v, segment_ids, out, lse = residuals
    delta = triton_attention._row_delta(out, d_out)
    args = (q, k, v, segment_ids, d_out, lse, delta)
    if config.dkv is not None:
        dkv = hopper_dkv(*args, config.dkv)
    else:
        dkv = triton_attention._backward_dkv(*args, config.triton)
    if config.triton.launch.fused_dq:  # dQ came with dK/dV: fp32, not yet scaled
        dq, dk, dv = dkv
        dq = triton_attention.scaled_fused_dq(dq, config.triton.sm_scale, q.dtype)
    else:
        dk, dv = dkv
        if config.dq is not None:
            dq = hopper_dq(*args, config.dq)
        else:
            dq = triton_attention._backward_dq(*args, config.triton)
    return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)
