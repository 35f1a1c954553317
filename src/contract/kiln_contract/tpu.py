"""TPU slices: by the names `tpu(...)` takes (Google Cloud's and Ray's, `v4-128`,
`v5litepod-16`), and as libtpu's compiler names their topologies (`v4:4x4x4`), which is what
`pants plan --fit` compiles a step for (kiln.fit, docs/fitting.md).

A slice type is GENERATION-SIZE. SIZE counts TensorCores: two per chip on v4 and v5p, whose two
cores run as one device ("megacore"), one on v5e (`v5litepod`, also written `v5e`) and v6e,
where it is the chip count.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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
_TOPOLOGY_NAME = re.compile(r"^(v4|v5p|v5e|v6e):(\d+)x(\d+)(?:x(\d+))?$")


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
