"""TPU slices and chips, as both halves read them.

A slice type is GENERATION-SIZE, as Google Cloud and Ray name it and `tpu(type)` takes it (v4-128,
v5litepod-16, v6e-8). SIZE counts TensorCores: two a chip on v4 and v5p, whose two cores JAX
drives as one device ("megacore"), so a v4-128 is 64 devices; one on v5e (`v5litepod`, also
written `v5e` where a fit check names a slice) and v6e, where it is the chip count. A BUILD file's
`tpu(...)` is checked when it loads (`tpu_slice_shape`), a cluster run places one trainer per
host, `plan` prices a chip by its generation, and `pants plan --fit` compiles a step for the
slice's topology as libtpu's compiler names it (`tpu_topology`: v4:4x4x4; kiln.fit,
docs/fitting.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kiln_contract.parsing import SpecError

TPU_CORES_PER_CHIP = {"v2": 2, "v3": 2, "v4": 2, "v5p": 2, "v7x": 2, "v5litepod": 1, "v6e": 1}
# Other spellings of a generation in a slice type.
GENERATION_ALIASES = {"v5e": "v5litepod", "v5lite": "v5litepod", "v6litepod": "v6e"}
# The generations libtpu's compiler has mock devices for, by their name in a topology.
TOPOLOGY_GENERATIONS = {"v4": "v4", "v5p": "v5p", "v5litepod": "v5e", "v6e": "v6e"}
# Generations whose chip has two TensorCores that jax runs as one device.
MEGACORE = frozenset({"v4", "v5p"})
# The chip's HBM, GiB, as Google Cloud lists it. The compiler's own limit, a little lower, is
# what an executable must fit in (kiln.fit reads it from the compiler: 30.75 GiB on v4, 15.75 on
# v5e, 95.73 on v5p, 31.24 on v6e with libtpu 0.0.48.1).
HBM_GIB = {"v4": 32, "v5p": 95, "v5litepod": 16, "v6e": 32}
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
_TOPOLOGY_NAME = re.compile(r"^(v4|v5p|v5e|v6e):(\d+)x(\d+)(?:x(\d+))?$")


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


@dataclass(frozen=True)
class TpuTopology:
    """A slice as the compiler's mock devices describe it."""

    slice_type: str  # as `tpu(...)` writes it: v4-128; or the topology name when given as one
    generation: str  # v4, v5p, v5litepod, v6e
    chips: int
    name: str  # libtpu's topology name: v4:4x4x4, v5e:4x4
    chip_config_name: str | None  # "megacore" where the chip's two cores are one device
    # libtpu wants the host's bounds for a one-chip topology; None: its default.
    chips_per_host_bounds: tuple[int, int, int] | None

    @property
    def hbm_gib(self) -> int:
        return HBM_GIB[self.generation]

    def describe(self) -> str:
        config = f", {self.chip_config_name}" if self.chip_config_name else ""
        return f"{self.name} ({self.chips} chip{'s' if self.chips != 1 else ''}{config})"

    def to_json(self) -> dict:
        return {
            "slice": self.slice_type,
            "generation": self.generation,
            "chips": self.chips,
            "topology": self.name,
            "chip_config_name": self.chip_config_name,
        }


class UnknownTpu(ValueError):
    """A name that is not a TPU slice or topology the compiler can mock (one line, for people)."""


def _known() -> str:
    return (
        "write a slice as `tpu(...)` takes it (v4-128, v5p-256, v5litepod-16 or v5e-16, "
        "v6e-16) or a libtpu topology (v4:4x4x4, v5e:4x4)"
    )


def tpu_topology(name: str) -> TpuTopology:
    """The topology a slice type (v4-128) or a topology name (v4:4x4x4) compiles for."""
    name = name.strip()
    match = _TOPOLOGY_NAME.match(name)
    if match:
        return _from_topology_name(name, match)
    generation, _, size = name.partition("-")
    generation = GENERATION_ALIASES.get(generation, generation)
    if generation not in TPU_CORES_PER_CHIP or not size.isdigit() or int(size) < 1:
        raise UnknownTpu(f"{name!r} is not a TPU slice: {_known()}")
    if generation not in TOPOLOGY_GENERATIONS:
        raise UnknownTpu(
            f"{name!r}: the compiler has no mock devices for {generation}; it has "
            f"{', '.join(sorted(TOPOLOGY_GENERATIONS))}"
        )
    cores = TPU_CORES_PER_CHIP[generation]
    if int(size) % cores:
        raise UnknownTpu(
            f"{name!r}: a {generation} slice's size counts TensorCores, {cores} a chip; "
            f"{size} is not a whole number of chips"
        )
    chips = int(size) // cores
    shape = _slice_shape(generation, chips)
    if shape is None:
        raise UnknownTpu(
            f"{name!r}: {chips} chips is not a {generation} slice shape Kiln knows; give its "
            f"topology instead, e.g. {TOPOLOGY_GENERATIONS[generation]}:"
            f"{'4x4x4' if generation in MEGACORE else '4x4'}"
        )
    topology = f"{TOPOLOGY_GENERATIONS[generation]}:{'x'.join(str(d) for d in shape)}"
    return _topology(name, generation, chips, topology)


def _from_topology_name(name: str, match: re.Match) -> TpuTopology:
    short, *dims = match.groups()
    generation = GENERATION_ALIASES.get(short, short)
    sizes = [int(d) for d in dims if d is not None]
    three_d = generation in MEGACORE
    if len(sizes) != (3 if three_d else 2) or min(sizes) < 1:
        example = f"{short}:2x2x1" if three_d else f"{short}:2x2"
        raise UnknownTpu(f"{name!r}: a {short} topology has {3 if three_d else 2} sizes, e.g. {example}")
    chips = 1
    for size in sizes:
        chips *= size
    return _topology(name, generation, chips, name)


def _topology(slice_type: str, generation: str, chips: int, topology: str) -> TpuTopology:
    return TpuTopology(
        slice_type=slice_type,
        generation=generation,
        chips=chips,
        name=topology,
        chip_config_name="megacore" if generation in MEGACORE else None,
        chips_per_host_bounds=(1, 1, 1) if chips == 1 else None,
    )


def _slice_shape(generation: str, chips: int) -> tuple[int, ...] | None:
    """The chips' shape of a slice as Google Cloud builds it, for power-of-two slices: v4 and
    v5p in 3D from 2x2x1 (4 chips: v4-8), each doubling the last of the shortest sides (2x2x2,
    2x2x4, 2x4x4, 4x4x4, ...); v5e and v6e in 2D, 1x1, then 2x2, 2x4, 4x4, ... 16x16."""
    if chips & (chips - 1):
        return None
    if generation in MEGACORE:
        if chips < 4:
            return None
        dims = [2, 2, 1]
        while dims[0] * dims[1] * dims[2] < chips:
            shortest = min(dims)
            last = max(i for i, d in enumerate(dims) if d == shortest)
            dims[last] *= 2
        return (dims[0], dims[1], dims[2])
    if chips == 1:
        return (1, 1)
    if chips < 4 or chips > 256:
        return None
    short = 2 ** ((chips.bit_length() - 1) // 2)
    return (short, chips // short)
