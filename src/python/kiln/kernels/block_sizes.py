"""The flash-attention kernels' settings: tile sizes, Triton launch parameters, and the table of
the settings measured best per device."""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl

MIN_BLOCK = 16  # Triton's smallest dot operand dimension.


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the three kernels (powers of two, >= 16): jax's BlockSizes' fields.

    block_q, block_kv: forward (a program owns a q tile and loops over kv tiles).
    block_q_dkv, block_kv_dkv: dK/dV (a program owns a kv tile, loops over q tiles and heads).
    block_q_dq, block_kv_dq: dQ (a program owns a q tile and loops over kv tiles).
    """

    block_q: int = 64
    block_kv: int = 64
    block_q_dkv: int = 64
    block_kv_dkv: int = 64
    block_q_dq: int = 64
    block_kv_dq: int = 64

    def __post_init__(self) -> None:
        for name, size in dataclasses.asdict(self).items():
            if size < MIN_BLOCK or size & (size - 1):
                raise ValueError(f"BlockSizes.{name}={size} must be a power of two >= {MIN_BLOCK}")

    def fit_to(self, seq_len: int) -> BlockSizes:
        """Shrinks tiles longer than the (power-of-two rounded) sequence: no work on padding."""
        limit = max(MIN_BLOCK, pl.next_power_of_2(seq_len))
        tiles = dataclasses.asdict(self)
        return BlockSizes(**{name: min(size, limit) for name, size in tiles.items()})

    @property
    def largest(self) -> int:
        """What the padded length must be a multiple of: every kernel's grid divides it."""
        return max(dataclasses.asdict(self).values())


@dataclasses.dataclass(frozen=True)
class LaunchParams:
    """How the kernels launch: Triton's warps per program and software-pipelining depth, per
    kernel (each kernel has its own best setting on a device), and which backward runs.

    fused_dq: the dK/dV kernel also computes dQ and adds it into an fp32 buffer with atomics
    (FlashAttention-2's layout: 5 matmuls instead of 7, no dQ kernel; dQ's summation order then
    varies between runs on a GPU). Off: a separate dQ kernel recomputes what it needs.
    """

    num_warps_fwd: int = 4
    num_warps_dkv: int = 4
    num_warps_dq: int = 4
    num_stages_fwd: int = 2
    num_stages_dkv: int = 2
    num_stages_dq: int = 2
    fused_dq: bool = False

    def __post_init__(self) -> None:
        for name, value in dataclasses.asdict(self).items():
            if name.startswith("num_warps") and (value < 1 or value & (value - 1)):
                raise ValueError(f"LaunchParams.{name}={value} must be a power of two >= 1")
            if name.startswith("num_stages") and value < 1:
                raise ValueError(f"LaunchParams.{name}={value} must be >= 1")


# Measured best on an H200 on 2026-11-30, each kernel timed on its own over candidate settings
# (causal, seq 4096, bf16; numbers in benchmarks/RESULTS.md). The H100 shares the chip and uses
# them unmeasured.
_H200_SETTINGS = {
    64: (
        BlockSizes(
            block_q=64,
            block_kv=64,
            block_q_dkv=64,
            block_kv_dkv=64,
            block_q_dq=128,
            block_kv_dq=64,
        ),
        LaunchParams(
            num_warps_fwd=4,
            num_warps_dkv=4,
            num_warps_dq=8,
            num_stages_fwd=3,
            num_stages_dkv=2,
            num_stages_dq=3,
        ),
    ),
    128: (
        BlockSizes(
            block_q=128,
            block_kv=128,
            block_q_dkv=64,
            block_kv_dkv=64,
            block_q_dq=128,
            block_kv_dq=128,
        ),
        LaunchParams(
            num_warps_fwd=8,
            num_warps_dkv=4,
            num_warps_dq=8,
            num_stages_fwd=3,
            num_stages_dkv=2,
            num_stages_dq=2,
        ),
    ),
}
# device kind -> head dim -> the block sizes and launch parameters measured best on that device.
TUNED_BLOCK_SIZES: dict[str, dict[int, tuple[BlockSizes, LaunchParams]]] = {
    "NVIDIA H200": _H200_SETTINGS,
    "NVIDIA H100 80GB HBM3": _H200_SETTINGS,
}
# Any other device (CPU interpret mode included): jax's own kernel's kind of sizes.
GENERIC_BLOCK_SIZES = {
    64: (BlockSizes(), LaunchParams()),
    128: (BlockSizes(), LaunchParams(num_warps_fwd=8)),
}


def default_block_sizes(device_kind: str, head_dim: int) -> tuple[BlockSizes, LaunchParams]:
    """(BlockSizes, LaunchParams) for a jax `device_kind` and head dim; generic ones for unknown
    devices."""
    by_head_dim = TUNED_BLOCK_SIZES.get(device_kind, GENERIC_BLOCK_SIZES)
    return by_head_dim.get(head_dim, by_head_dim[max(by_head_dim)])


