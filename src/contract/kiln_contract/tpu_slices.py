"""TPU slice types, as Google Cloud and Ray name them and `tpu(type)` takes them: GENERATION-SIZE
(v4-128, v5litepod-16, v6e-8), SIZE counting TensorCores: two a chip, except on v5e
(`v5litepod`) and v6e, which have one. JAX drives each chip as one device (on v4 and v5p its two
cores as one megacore), so a v4-128 is 64 devices. Both halves read a type here: a BUILD file's
`tpu(...)` is checked when it loads, and a cluster run places one trainer per host."""

from __future__ import annotations

from dataclasses import dataclass

from kiln_contract.parsing import SpecError

TPU_CORES_PER_CHIP = {"v2": 2, "v3": 2, "v4": 2, "v5p": 2, "v7x": 2, "v5litepod": 1, "v6e": 1}
TPU_CHIPS_PER_HOST = 4  # a multi-host slice's VMs have 4 chips each
TPU_CHIPS_ON_ONE_HOST = {"v5litepod": 8, "v6e": 8}  # v5e/v6e slices of up to 8 chips: one VM
# A chip's dense bf16 peak FLOP/s (Google's spec sheets): what MFU is a share of.
TPU_PEAK_BF16_FLOPS = {
    "v2": 45e12, "v3": 123e12, "v4": 275e12, "v5litepod": 197e12, "v5p": 459e12, "v6e": 918e12,
}  # fmt: skip
# jax's device_kind of each generation's chip, matched as a substring, first match wins.
TPU_DEVICE_KINDS = (
    ("TPU v6 lite", "v6e"), ("TPU v5 lite", "v5litepod"), ("TPU v5p", "v5p"), ("TPU v5", "v5p"),
    ("TPU v4", "v4"), ("TPU v3", "v3"), ("TPU v2", "v2"),
)  # fmt: skip


def tpu_generation(slice_type: str) -> str:
    """'v4-128' -> 'v4': the chip a slice is made of."""
    return slice_type.partition("-")[0]


@dataclass(frozen=True)
class TpuSliceShape:
    chips: int  # JAX devices
    hosts: int  # TPU VMs
    chips_per_host: int


def tpu_slice_shape(slice_type: str) -> TpuSliceShape:
    """The chips and hosts of a slice type; SpecError (field "type") for one no slice has."""
    generation, size = tpu_generation(slice_type), slice_type.partition("-")[2]
    cores_per_chip = TPU_CORES_PER_CHIP.get(generation)
    if cores_per_chip is None or not size.isdigit() or int(size) % cores_per_chip:
        raise SpecError(
            "type",
            f"{slice_type!r} is not a TPU slice type Kiln knows; write GENERATION-SIZE with "
            f"GENERATION one of {', '.join(TPU_CORES_PER_CHIP)} and SIZE its TensorCores "
            "(v4-128, v5p-256) or, for v5litepod and v6e, chips (v6e-16)",
        )
    chips = int(size) // cores_per_chip
    if chips <= TPU_CHIPS_ON_ONE_HOST.get(generation, TPU_CHIPS_PER_HOST):
        return TpuSliceShape(chips, 1, chips)
    if chips % TPU_CHIPS_PER_HOST:
        raise SpecError(
            "type",
            f"{slice_type!r} has {chips} chips, which do not fill hosts of {TPU_CHIPS_PER_HOST}; "
            "no such slice exists",
        )
    return TpuSliceShape(chips, chips // TPU_CHIPS_PER_HOST, TPU_CHIPS_PER_HOST)
