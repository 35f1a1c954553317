"""hopper_compile.py's parts that run without jax's CUDA plugin (CI has none): reading ptxas'
reports from Mosaic GPU's dump, and the message when the plugin's venv is missing. The compile
itself needs `./pants export --resolve=cuda` (~3 GB of wheels); its table is in RESULTS.md."""

import hopper_compile
import pytest

# What ptxas wrote for the dK/dV kernel at 64,64,2 (2026-11-30), and Mosaic GPU's resources line.
PTXAS = """\
ptxas warning : Registers are spilled to local memory in function 'kiln_flash_attention_dkv_hopper_mosaic_gpu_kernel', 100 bytes spill stores, 104 bytes spill loads
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'kiln_flash_attention_dkv_hopper_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for kiln_flash_attention_dkv_hopper_mosaic_gpu_kernel
    104 bytes stack frame, 100 bytes spill stores, 104 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 104 bytes cumulative stack size, 1 bytes smem
"""
RESOURCES = "Resources(smem_scratch_bytes=131072, tmem_scratch_cols=0, barrier_counts=Counter())"


def dump_kernel(directory, name: str, ptxas: str, smem: int) -> None:
    (directory / f"{name}.ptxas").write_text(ptxas)
    resources = RESOURCES.replace("131072", str(smem))
    (directory / f"{name}.resources.txt").write_text(resources)


def test_reads_the_latest_report_of_a_kernel_once(tmp_path):
    kernel = "kiln_flash_attention_dkv_hopper"
    no_spills = PTXAS.replace("104 bytes stack frame, 100 bytes spill stores, 104 bytes spill loads",
                              "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads")
    dump_kernel(tmp_path, f"{kernel}_2", no_spills, 98304)
    dump_kernel(tmp_path, f"{kernel}_10", PTXAS, 131072)  # later: numbers, not names, order
    dump_kernel(tmp_path, "kiln_flash_attention_dq_hopper_11", no_spills, 65536)
    seen: set[str] = set()
    assert hopper_compile.read_report(tmp_path, kernel, seen) == hopper_compile.Report(
        stack_bytes=104, spill_stores=100, spill_loads=104, smem_bytes=131072
    )
    with pytest.raises(RuntimeError, match="no ptxas report for kiln_flash_attention_dkv_hopper"):
        hopper_compile.read_report(tmp_path, kernel, seen)  # both were read: nothing new


def test_names_the_export_command_when_the_plugin_is_missing(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        hopper_compile.main(["--cuda-plugins", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "./pants export --resolve=cuda" in capsys.readouterr().err
