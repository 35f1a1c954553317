"""The flash-attention kernels' settings: tile sizes, Triton launch parameters, and the table of
the settings measured best per device."""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl

MIN_BLOCK = 16  # Triton's smallest dot operand dimension.
COMPUTE_FIELDS = ("block_kv_compute", "block_kv_dkv_compute")  # sub-tiles; 0: the whole tile


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the three kernels (powers of two, >= 16): jax's BlockSizes' fields.

    block_q, block_kv: forward (a program owns a q tile and loops over kv tiles).
    block_q_dkv, block_kv_dkv: dK/dV (a program owns a kv tile, loops over q tiles and heads).
    block_q_dq, block_kv_dq: dQ (a program owns a q tile and loops over kv tiles).
    block_kv_compute, block_kv_dkv_compute (Mosaic only, as splash's): keys per product inside
    a forward or dK/dV kv tile, 0 for the whole tile; a tile is what one copy brings to VMEM.
    """

    block_q: int = 64
    block_kv: int = 64
    block_q_dkv: int = 64
    block_kv_dkv: int = 64
    block_q_dq: int = 64
    block_kv_dq: int = 64
    block_kv_compute: int = 0
    block_kv_dkv_compute: int = 0

    def __post_init__(self) -> None:
        for name, size in dataclasses.asdict(self).items():
            if name in COMPUTE_FIELDS and size == 0:
                continue
            if size < MIN_BLOCK or size & (size - 1):
                raise ValueError(f"BlockSizes.{name}={size} must be a power of two >= {MIN_BLOCK}")

    def fit_to(self, seq_len: int, smallest: int = MIN_BLOCK) -> BlockSizes:
        """Shrinks tiles longer than the (power-of-two rounded) sequence, down to `smallest`
        (a lowering's smallest tile): no work on padding."""
        limit = max(smallest, pl.next_power_of_2(seq_len))
        tiles = dataclasses.asdict(self)
        return BlockSizes(**{name: min(size, limit) for name, size in tiles.items()})

    def compute_tile(self, name: str) -> int:
        """Keys per product inside the tile `name` (block_kv or block_kv_dkv)."""
        tile = getattr(self, name)
        compute = getattr(self, name + "_compute")
        return min(compute, tile) if compute else tile

    @property
    def largest(self) -> int:
        """What the padded length must be a multiple of: every kernel's grid divides it."""
        return max(dataclasses.asdict(self).values())


@dataclasses.dataclass(frozen=True)
class LaunchParams:
    """How the kernels launch: Triton's warps per program and software-pipelining depth, per
    kernel (each kernel has its own best setting on a device), and which backward runs.

    fused_dq: the dK/dV kernel also computes dQ (5 matmuls per tile pair instead of 7, no dQ
    kernel). Triton adds it into an fp32 buffer with atomics (FlashAttention-2's layout; dQ's
    summation order then varies between runs on a GPU); Mosaic writes one dQ block per kv tile
    and XLA sums them (splash's fused backward; deterministic). Off: a separate dQ kernel
    recomputes what it needs. The only field the Mosaic kernels read.
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
# Measured best on a TPU v5e on 2026-12-06 (jax 0.10.2): forward tiles by the forward's time,
# then the backward's with it (split or fused dQ), causal, seq 4096, head dim 128, bf16, summed
# over no segment ids and packed documents (benchmarks/attention.py --tune; candidates in
# benchmarks/RESULTS.md). Head dim 64, tuned the same way, picks the same tiles.
_TPU_V5E_SETTINGS = {
    128: (
        BlockSizes(
            block_q=512,
            block_kv=1024,
            block_q_dkv=512,
            block_kv_dkv=1024,
            block_q_dq=512,  # no dQ kernel runs: the dK/dV kernel's tiles
            block_kv_dq=1024,
            block_kv_compute=512,
            block_kv_dkv_compute=512,
        ),
        LaunchParams(fused_dq=True),  # the only field Mosaic reads
    ),
}
# device kind -> head dim -> the block sizes and launch parameters measured best on that device.
TUNED_BLOCK_SIZES: dict[str, dict[int, tuple[BlockSizes, LaunchParams]]] = {
    "NVIDIA H200": _H200_SETTINGS,
    "NVIDIA H100 80GB HBM3": _H200_SETTINGS,
    "TPU v5 lite": _TPU_V5E_SETTINGS,
}
# Any other device (CPU interpret mode included), per lowering: for Triton jax's own kernel's
# kind of sizes; for Mosaic splash attention's kind (tiles of whole 128-lane rows, and large:
# a TPU grid step costs ~0.35 us however little it does).
GENERIC_BLOCK_SIZES = {
    64: (BlockSizes(), LaunchParams()),
    128: (BlockSizes(), LaunchParams(num_warps_fwd=8)),
}
GENERIC_MOSAIC_BLOCK_SIZES = {128: (BlockSizes(*[512] * 6), LaunchParams())}


def default_block_sizes(
    device_kind: str, head_dim: int, lowering: str = "triton"
) -> tuple[BlockSizes, LaunchParams]:
    """(BlockSizes, LaunchParams) for a jax `device_kind`, head dim and lowering; generic ones
    for devices not in the table."""
    generic = GENERIC_MOSAIC_BLOCK_SIZES if lowering == "mosaic" else GENERIC_BLOCK_SIZES
    by_head_dim = TUNED_BLOCK_SIZES.get(device_kind, generic)
    return by_head_dim.get(head_dim, by_head_dim[max(by_head_dim)])


