"""The tuner's search space: each kernel it times, the candidate settings it tries, the layout
switches each runs under, and the flat dict of fields (`Fields`) a layout is written as.

Kernels: the product's Triton forward, dK/dV, dQ and fused-dQ backward ("fwd", "dkv", "dq",
"fused"), and the lab's Mosaic GPU ones ("hopper", "hopper_dkv", "hopper_dq", "hopper_fused").
"""

from __future__ import annotations

import dataclasses
from typing import Any

from attention import settings_from_fields  # benchmarks/attention.py

from kiln.kernels.block_sizes import BlockSizes, LaunchParams
from kiln_lab.hopper_attention import HopperKernels

# A kernel layout: BlockSizes and LaunchParams fields, and HopperKernels' switches as
# "hopper_" + their name, in one flat dict (the tuner's JSON, one per head dim).
Fields = dict[str, Any]

# Per kernel, the fields of FIELDS; the current table entry is added first. The Triton lists keep
# the candidates that came within ~30% of the best on the H200 (benchmarks/RESULTS.md).
CANDIDATES = {
    "fwd": [
        (128, 128, 8, 3),
        (128, 64, 8, 3),
        (64, 64, 4, 3),
        (128, 64, 8, 4),
        (64, 128, 4, 3),
        (128, 128, 8, 4),
    ],
    # The Mosaic GPU forward: (rows per compute warpgroup, K/V tile, K/V tiles in flight). At
    # d=128 a ring of 3 tiles of 128 does not fit beside the q tiles.
    "hopper": [
        (64, 128, 2),
        (64, 64, 3),
        (64, 64, 4),
        (64, 64, 2),
    ],
    "dkv": [
        (64, 64, 4, 2),
        (64, 64, 4, 3),
        (128, 128, 8, 2),
        (64, 64, 8, 2),
        (128, 64, 4, 2),
        (32, 128, 4, 3),
    ],
    "dq": [
        (128, 128, 8, 2),
        (128, 64, 8, 3),
        (64, 64, 4, 2),
        (64, 128, 4, 2),
        (128, 128, 8, 3),
        (64, 64, 4, 3),
    ],
    # The Mosaic GPU dK/dV: (q tile, rows per compute warpgroup, q/dO tiles in flight). At d=128
    # 128-row K/V tiles would need 256 accumulator registers per thread, and 128-row q tiles
    # spill ~1 KiB (benchmarks/hopper_compile.py).
    "hopper_dkv": [
        (64, 64, 2),
        (64, 64, 3),
        (64, 64, 4),
    ],
    # The Mosaic GPU dQ: (rows per compute warpgroup, K/V tile, K/V tiles in flight). 128-row
    # K/V tiles hold s and dp (64 registers each) at once with dQ's 64: ptxas spills 13-48 local
    # loads per tile (benchmarks/hopper_compile.py).
    "hopper_dq": [
        (64, 64, 2),
        (64, 64, 3),
        (64, 64, 4),
    ],
    # FlashAttention-3's backward: the Mosaic GPU dK/dV kernel adding dQ by TMA reduce-adds
    # (fused_dq; head dim a multiple of 128). Fields as hopper_dkv's, and whether pT stays fp32
    # (more spills, fewer instructions: RESULTS.md); at d=128 a ring of 4 does not fit beside the
    # dQ staging tiles.
    "hopper_fused": [
        (64, 64, 2, False),
        (64, 64, 2, True),
        (64, 64, 3, False),
        (64, 64, 3, True),
    ],
    # The dK/dV kernel with dQ accumulated by atomics (fused_dq): against dK/dV + dQ.
    "fused": [
        (64, 64, 4, 2),
        (64, 64, 8, 2),
        (64, 128, 8, 2),
        (128, 64, 8, 2),
        (32, 128, 4, 2),
        (128, 128, 8, 2),
    ],
}
# Matmuls of seq x seq x dim each kernel does (the split backward recomputes q k^T and dout v^T).
MATMULS = {
    "fwd": 2,
    "hopper": 2,
    "dkv": 4,
    "hopper_dkv": 4,
    "dq": 3,
    "hopper_dq": 3,
    "fused": 5,
    "hopper_fused": 5,
}
# What each kernel returns, in order (the fused ones' dQ unscaled).
OUTPUTS = {
    "fwd": ("out",),
    "hopper": ("out",),
    "dkv": ("dK", "dV"),
    "hopper_dkv": ("dK", "dV"),
    "dq": ("dQ",),
    "hopper_dq": ("dQ",),
    "fused": ("dQ", "dK", "dV"),
    "hopper_fused": ("dQ", "dK", "dV"),
}
FIELDS = {
    "fwd": ("block_q", "block_kv", "num_warps_fwd", "num_stages_fwd"),
    "hopper": ("block_q", "block_kv", "num_stages_fwd"),
    "dkv": ("block_q_dkv", "block_kv_dkv", "num_warps_dkv", "num_stages_dkv"),
    "hopper_dkv": ("block_q_dkv", "block_kv_dkv", "num_stages_dkv"),
    "dq": ("block_q_dq", "block_kv_dq", "num_warps_dq", "num_stages_dq"),
    "hopper_dq": ("block_q_dq", "block_kv_dq", "num_stages_dq"),
    "fused": ("block_q_dkv", "block_kv_dkv", "num_warps_dkv", "num_stages_dkv"),
    "hopper_fused": ("block_q_dkv", "block_kv_dkv", "num_stages_dkv", "hopper_fused_fp32_probs"),
}
# The layout switch each kernel runs under.
_NOT_HOPPER_FUSED = {"hopper_fused_fp32_probs": False}  # That kernel's own setting.
LAYOUT = {
    "fwd": {"hopper_forward": False},
    "hopper": {"hopper_forward": True},
    "dkv": {"fused_dq": False, "hopper_dkv": False, **_NOT_HOPPER_FUSED},
    "hopper_dkv": {"fused_dq": False, "hopper_dkv": True, **_NOT_HOPPER_FUSED},
    "dq": {"fused_dq": False, "hopper_dq": False, **_NOT_HOPPER_FUSED},
    "hopper_dq": {"fused_dq": False, "hopper_dq": True, **_NOT_HOPPER_FUSED},
    "fused": {"fused_dq": True, "hopper_dkv": False, "hopper_dq": False, **_NOT_HOPPER_FUSED},
    "hopper_fused": {"fused_dq": True, "hopper_dkv": True, "hopper_dq": False},
}
TRITON_KERNELS = ("fwd", "dkv", "dq", "fused")
# Per Triton kernel: its Hopper alternative, in the order the tuner tries them (the fused
# backward first: the one the goal needs most, see lab/NOTES.md; so the script's
# time limit cannot cost its numbers), and the fields choosing between them sets.
HOPPER_ALTERNATIVE = {
    "fused": "hopper_fused",
    "fwd": "hopper",
    "dkv": "hopper_dkv",
    "dq": "hopper_dq",
}
CHOSEN_FIELDS = {
    "fwd": (*FIELDS["fwd"], "hopper_forward"),
    "dkv": (*FIELDS["dkv"], "hopper_dkv", "fused_dq", "hopper_fused_fp32_probs"),
    "dq": (*FIELDS["dq"], "hopper_dq"),
    "fused": (*FIELDS["dkv"], "hopper_dkv", "fused_dq", "hopper_dq", "hopper_fused_fp32_probs"),
}


def settings(fields: Fields) -> tuple[BlockSizes, LaunchParams, HopperKernels]:
    """The dataclasses a layout's fields set; a name none of them has is a ValueError."""
    hopper = {
        name.removeprefix("hopper_"): value
        for name, value in fields.items()
        if name.startswith("hopper_")
    }
    block_sizes, launch = settings_from_fields(
        {name: value for name, value in fields.items() if not name.startswith("hopper_")}
    )
    return block_sizes, launch, HopperKernels(**hopper)


def fields_of(
    block_sizes: BlockSizes, launch: LaunchParams, hopper: HopperKernels | None = None
) -> Fields:
    switches = dataclasses.asdict(hopper or HopperKernels())
    hopper_fields = {f"hopper_{name}": on for name, on in switches.items()}
    return {**dataclasses.asdict(block_sizes), **dataclasses.asdict(launch), **hopper_fields}


def switched_on(fields: Fields) -> Fields:
    """fields without the Hopper switches that are off: with none on, a settings file that
    benchmarks/attention.py --block-sizes reads."""
    return {
        name: value for name, value in fields.items() if value or not name.startswith("hopper_")
    }
