"""hopper_compile.py compiles the Hopper kernels for an H200 on this CPU machine (the whole table
is in lab/NOTES.md); its parts: reading ptxas' reports and the SASS from Mosaic GPU's
dump, and the message when the compiler PEX is missing."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kiln_lab import hopper_compile

# Where Pants puts lab:cuda-compiler for this test (BUILD: runtime_package_dependencies).
CUDA_COMPILER = Path("lab/cuda-compiler.pex")
# Local loads + stores each kernel's first candidate may run per pass of each tile loop (ptxas
# 13.5.37, lab/NOTES.md): none, but the fused backward, which reloads spilled loop
# invariants every tile (~28 in its masked tiles' loop, ~15 in the unmasked one's).
MAX_LOOP_SPILLS = {"hopper": 0, "hopper_dkv": 0, "hopper_dq": 0, "hopper_fused": 40}

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
# nvdisasm's form: a tile loop (7 instructions: wgmma, two spills reloaded, one stored) with a
# barrier spin-wait inside it, a loop without wgmma, the kernel's EXIT, and after it the
# out-of-line retry of a wait in the tile loop, which branches back into it (not a loop).
SASS = """\
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   STL [R1+0x4], R7 ;
.L_x_2:
        /*0020*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [R154+URZ], R23 ;
        /*0030*/              @!P2 BRA `(.L_x_2) ;
        /*0040*/                   HGMMA.64x64x16.F32.BF16 R152, gdesc[UR44], RZ, !UPT ;
        /*0050*/                   LDL R217, [R1+0x58] ;
        /*0060*/                   LDL.LU R218, [R1+0x5c] ;
        /*0070*/               @P0 BRA `(.L_x_1) ;
.L_x_3:
        /*0080*/                   LDL R3, [R1+0x4] ;
        /*0090*/               @P1 BRA `(.L_x_3) ;
        /*00a0*/                   EXIT ;
.L_x_4:
        /*00b0*/                   LDL R4, [R1+0x8] ;
        /*00c0*/                   BRA `(.L_x_2) ;
"""


def dump_kernel(directory, name: str, ptxas: str, smem: int) -> None:
    (directory / f"{name}.ptxas").write_text(ptxas)
    resources = RESOURCES.replace("131072", str(smem))
    (directory / f"{name}.resources.txt").write_text(resources)
    (directory / f"{name}.sass_ctrl").write_text(SASS)
    (directory / f"{name}.mlir-passes.log").write_text("...")


def test_counts_the_local_memory_traffic_and_instructions_of_each_tile_loop():
    assert hopper_compile.tile_loop_costs(SASS) == (hopper_compile.LoopCost(2, 1, 7),)
    assert hopper_compile.tile_loop_costs(SASS.replace("HGMMA", "FMUL")) == ()
    assert str(hopper_compile.LoopCost(2, 1, 7)) == "2/1/7"


def test_reads_why_ptxas_serialized_the_wgmmas(tmp_path):
    kernel = "kiln_flash_attention_bwd_hopper"
    note = (
        "ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are "
        "serialized due to insufficient register resources for the wgmma pipeline in the "
        f"function '{kernel}_mosaic_gpu_kernel'\n"
    )
    seen: set[str] = set()
    dump_kernel(tmp_path, f"{kernel}_0", PTXAS + note, 131072)
    report = hopper_compile.read_report(tmp_path, kernel, seen)
    assert report.wgmma_serialized == "insufficient register resources for the wgmma pipeline"
    dump_kernel(tmp_path, f"{kernel}_1", PTXAS, 131072)
    assert hopper_compile.read_report(tmp_path, kernel, seen).wgmma_serialized is None


def test_reads_the_latest_report_of_a_kernel_once(tmp_path):
    kernel = "kiln_flash_attention_dkv_hopper"
    no_spills = PTXAS.replace(
        "104 bytes stack frame, 100 bytes spill stores, 104 bytes spill loads",
        "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
    )
    dump_kernel(tmp_path, f"{kernel}_2", no_spills, 98304)
    dump_kernel(tmp_path, f"{kernel}_10", PTXAS, 131072)  # later: numbers, not names, order
    dump_kernel(tmp_path, "kiln_flash_attention_dq_hopper_11", no_spills, 65536)
    seen: set[str] = set()
    assert hopper_compile.read_report(tmp_path, kernel, seen) == hopper_compile.Report(
        stack_bytes=104,
        spill_stores=100,
        spill_loads=104,
        smem_bytes=131072,
        tile_loops=(hopper_compile.LoopCost(2, 1, 7),),
    )
    assert not list(tmp_path.glob(f"{kernel}_*"))  # read, then removed (the MLIR log is large)
    with pytest.raises(RuntimeError, match="no ptxas report for kiln_flash_attention_dkv_hopper"):
        hopper_compile.read_report(tmp_path, kernel, seen)  # both were read: nothing new


def test_names_the_package_command_when_the_compiler_is_missing(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        hopper_compile.main(["--cuda-compiler", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "./pants package lab:cuda-compiler" in capsys.readouterr().err


def test_the_hopper_kernels_compile_for_an_h200():
    """The GPU toolchain on a CPU: each Mosaic GPU kernel's first tuner candidate (the forward
    alone, the backward ones inside the gradient with Triton's other kernels), without and with
    segment ids, compiles to a cubin for the H200 within its tile-loop spill budget and with its
    wgmmas left asynchronous; then a whole bf16 train step with the split and with the fused
    Hopper backward. In a fresh process: jax must load after the plugin is on sys.path."""
    args = ["--cuda-compiler", str(CUDA_COMPILER), "--quick", "--train-step"]
    result = subprocess.run(
        [sys.executable, "-m", "kiln_lab.hopper_compile", *args],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("hopper")]
    assert [(row[0], row[2]) for row in rows] == [
        (kernel, segments) for kernel in MAX_LOOP_SPILLS for segments in ("False", "True")
    ], result.stdout
    for kernel, _, _, _, _, _, _, wgmma, *tile_loops in rows:
        assert wgmma == "async", result.stdout  # ptxas kept the wgmma pipeline
        assert tile_loops, result.stdout
        for loop in tile_loops:
            loads, stores, _ = map(int, loop.split("/"))
            assert loads + stores <= MAX_LOOP_SPILLS[kernel], result.stdout
    launches = re.findall(r"train step (\w+) .*: compiled in .* s, (\d+) Mosaic GPU", result.stdout)
    # Per layer (two): the forward, again for the backward (remat), and dK/dV + dQ or fused.
    assert launches == [("split", "8"), ("fused", "6")], result.stdout
