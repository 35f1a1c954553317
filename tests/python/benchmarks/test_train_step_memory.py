"""The memory benchmark's step and table, on this machine's CPU (the deviceless H200 compile
needs lab:cuda-compiler, ~255 MB, and minutes: benchmarks/RESULTS.md has its numbers)."""

import jax
import pytest
import train_step_memory


def test_full_remat_holds_less_than_save_dots():
    device = jax.devices()[0]
    peaks = {
        policy: train_step_memory.peak_bytes(
            train_step_memory.compile_step(device, "tiny", 8, 256, policy).memory_analysis()
        )
        for policy in ("save_dots", "full")
    }
    assert 0 < peaks["full"] < peaks["save_dots"], peaks


def test_names_the_package_command_when_the_compiler_is_missing(tmp_path):
    with pytest.raises(SystemExit, match=r"\./pants package lab:cuda-compiler"):
        train_step_memory.main(["--cuda-compiler", str(tmp_path), "--model", "tiny"])
