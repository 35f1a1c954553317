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


@dataclass(frozen=True)
class TpuSliceShape:
    chips: int  # JAX devices
    hosts: int  # TPU VMs
    chips_per_host: int


def tpu_slice_shape(slice_type: str) -> TpuSliceShape:
    """The chips and hosts of a slice type; SpecError (field "type") for one no slice has."""
    generation, _, size = slice_type.partition("-")
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
