"""`plan --fit`'s slices: `tpu(...)` names mapped to the topologies libtpu's compiler mocks
(kiln_contract.tpu), and which trainings are compiled for which slice (kiln_pants.fit_check)."""

from __future__ import annotations

import pytest

from kiln_contract.tpu import UnknownTpu, tpu_topology
from kiln_contract.train import Resources
from kiln_pants.fit_check import fit_target


@pytest.mark.parametrize(
    "name, topology, chips, megacore",
    [
        # v4 and v5p: sizes count TensorCores, two a chip, run as one device (megacore).
        ("v4-8", "v4:2x2x1", 4, True),
        ("v4-16", "v4:2x2x2", 8, True),
        ("v4-32", "v4:2x2x4", 16, True),
        ("v4-64", "v4:2x4x4", 32, True),
        ("v4-128", "v4:4x4x4", 64, True),
        ("v4-256", "v4:4x4x8", 128, True),
        ("v4-512", "v4:4x8x8", 256, True),
        ("v5p-128", "v5p:4x4x4", 64, True),
        # v5e (v5litepod, or v5e) and v6e: sizes count chips, one core each.
        ("v5litepod-1", "v5e:1x1", 1, False),
        ("v5litepod-4", "v5e:2x2", 4, False),
        ("v5e-8", "v5e:2x4", 8, False),
        ("v5e-16", "v5e:4x4", 16, False),
        ("v5litepod-64", "v5e:8x8", 64, False),
        ("v5litepod-256", "v5e:16x16", 256, False),
        ("v6e-16", "v6e:4x4", 16, False),
        # libtpu's own names pass through.
        ("v5e:2x2", "v5e:2x2", 4, False),
        ("v4:4x4x4", "v4:4x4x4", 64, True),
    ],
)
def test_slices_map_to_the_compilers_topologies(
    name: str, topology: str, chips: int, megacore: bool
) -> None:
    found = tpu_topology(name)
    assert (found.name, found.chips) == (topology, chips)
    assert found.chip_config_name == ("megacore" if megacore else None)
    # One chip needs its host's bounds given; a slice takes libtpu's default.
    assert found.chips_per_host_bounds == ((1, 1, 1) if chips == 1 else None)


@pytest.mark.parametrize(
    "name, words",
    [
        ("v4-7", "not a whole number of chips"),
        ("v3-8", "no mock devices for v3"),
        ("H100", "is not a TPU slice"),
        ("v4:2x2", "a v4 topology has 3 sizes"),
        ("v4-96", "give its topology instead"),
        ("v5e-2", "give its topology instead"),
    ],
)
def test_names_it_cannot_compile_for_say_why(name: str, words: str) -> None:
    with pytest.raises(UnknownTpu, match=words):
        tpu_topology(name)


def test_which_trainings_are_compiled_for_which_slice() -> None:
    assert fit_target(Resources("tpu", "v4-128"), None) == ("v4-128", "")
    # --plan-fit-target wins over the training's own slice, and checks a GPU run on a slice.
    assert fit_target(Resources("tpu", "v4-128"), "v5e-16") == ("v5e-16", "")
    assert fit_target(Resources("gpu", "H100", 8), "v4-128") == ("v4-128", "")
    target, why = fit_target(Resources("gpu", "H100", 8), None)
    assert target is None and "trains on gpu('H100')" in why and "--plan-fit-target" in why
    target, why = fit_target(Resources("cpu"), None)
    assert target is None and "trains on cpu()" in why
    target, why = fit_target(Resources("tpu", "v4-128"), "v9-1")
    assert target is None and "is not a TPU slice" in why
