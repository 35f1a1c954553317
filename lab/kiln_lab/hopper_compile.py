"""Compiles the Hopper (Mosaic GPU) attention kernels for an H200 on a machine without a GPU, and
prints what ptxas reports for each tuner candidate: registers spilled, shared memory, failures.

    ./pants package lab:cuda-compiler    # jax's CUDA plugin, ptxas, nvdisasm (~255 MB)
    ./pants run lab/kiln_lab/hopper_compile.py [-- --kernels hopper_dkv --head-dim 128]

XLA compiles deviceless for a GPU its target config describes (kiln.kernels.h200_compile): jax's
CUDA plugin then runs the toolchain a GPU run does (Pallas -> Mosaic GPU -> PTX -> ptxas -> cubin, and
Triton for the other kernels) with no driver, and Mosaic GPU's dump keeps ptxas' report and the
SASS of each kernel. Nothing runs: this checks that a layout compiles and what it costs in
registers, not that it is right (the CPU tests) or fast (attention_tune.py on a device).
Registers spilled to local memory cost time where the kernel reloads them every tile, so besides
ptxas' byte counts the table lists, for one pass of each tile loop of the SASS (causal: one
for the tiles the diagonal crosses, masked, and one for the others, most of the tiles), its
local loads and stores (LDL/STL) and its instructions: a candidate with spills in its loops is
worth fixing before device time is spent on it, and the instructions are what recomputing
instead costs. It also says whether ptxas kept the wgmmas asynchronous: where it cannot
(registers, a wgmma operand touched in flight) it serializes them, waiting after each one, and
says why.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import re
import sys
import tempfile
import time
from pathlib import Path

# The deviceless compiler is the product's (kiln.kernels.h200_compile, which does not load jax);
# jax and the rest of kiln are imported inside the functions: jax must load after main() has put
# the plugin on sys.path.
from kiln.kernels.h200_compile import compile_on, cuda_compiler, h200_device, has_cuda_plugin

# Tuner kernel -> the Mosaic GPU kernel's name (what ncu and the dump call it).
HOPPER_KERNELS = {
    "hopper": "kiln_flash_attention_fwd_hopper",
    "hopper_dkv": "kiln_flash_attention_dkv_hopper",
    "hopper_dq": "kiln_flash_attention_dq_hopper",
    "hopper_fused": "kiln_flash_attention_bwd_hopper",
}
SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
# ptxas' "Potential Performance Loss" note, e.g. "... serialized due to insufficient register
# resources for the wgmma pipeline in the function '...'".
SERIALIZED = re.compile(
    r"wgmma\.mma_async instructions are serialized due to (.*?)(?: in the function|$)", re.M
)
# nvdisasm's SASS: a label line, or an instruction after its /*address*/.
SASS_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
SASS_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;?\s*$")
SASS_BRANCH = re.compile(r"\bBRA\b.*\((\.L_x_\d+)\)")


@dataclasses.dataclass(frozen=True)
class LoopCost:
    """One pass of a tile loop on the SASS: local-memory loads and stores (registers spilled and
    reloaded every tile), and its instructions (what recomputing instead of spilling costs)."""

    loads: int
    stores: int
    instructions: int

    def __str__(self) -> str:
        return f"{self.loads}/{self.stores}/{self.instructions}"


@dataclasses.dataclass(frozen=True)
class Report:
    """ptxas' report on one compiled Mosaic GPU kernel, and what its SASS does per tile."""

    stack_bytes: int
    spill_stores: int
    spill_loads: int
    smem_bytes: int
    # Each tile loop, in code order: causal, one for the masked tiles on the diagonal and one for
    # the others, in the kernel's order; with segment ids one, all tiles masked. ptxas' byte
    # counts also cover spills outside the loops, which cost little.
    tile_loops: tuple[LoopCost, ...]
    # Why ptxas ran the wgmmas one at a time (each waited for before the next), or None.
    wgmma_serialized: str | None = None

    @property
    def loop_spills(self) -> int:
        """Local loads + stores per pass of the tile loop that has the most."""
        return max((loop.loads + loop.stores for loop in self.tile_loops), default=0)


def tile_loop_costs(sass: str) -> tuple[LoopCost, ...]:
    """Each tile loop's cost, in code order. Tile loops are the innermost loops (a branch back to
    an earlier label) that run wgmma (HGMMA). Barrier spin-waits are loops too, but run none;
    ptxas puts their retries after the kernel's last EXIT, whose branches back into the main
    code are not loops."""
    instructions: list[str] = []
    labels: dict[str, int] = {}
    for line in sass.splitlines():
        if label := SASS_LABEL.match(line):
            labels[label.group(1)] = len(instructions)
        elif instruction := SASS_INSTRUCTION.search(line):
            instructions.append(instruction.group(1))
    exits = [end for end, instruction in enumerate(instructions) if "EXIT" in instruction]
    last_exit = max(exits, default=len(instructions))
    loops = []
    for end, instruction in enumerate(instructions[:last_exit]):
        branch = SASS_BRANCH.search(instruction)
        if branch and labels.get(branch.group(1), end + 1) <= end:
            start = labels[branch.group(1)]
            if any("HGMMA" in i for i in instructions[start:end]):
                loops.append((start, end))
    innermost = [
        (start, end)
        for start, end in loops
        if not any(start <= s and e <= end and (s, e) != (start, end) for s, e in loops)
    ]
    return tuple(
        LoopCost(
            sum("LDL" in i for i in instructions[start : end + 1]),
            sum("STL" in i for i in instructions[start : end + 1]),
            end + 1 - start,
        )
        for start, end in sorted(innermost)
    )


def compile_for(device, fields, *, seq_len: int, head_dim: int, segments: bool, grad: bool):
    """Lowers causal attention (or its gradient) with a layout's fields for the H200 and
    compiles it on `device`."""
    import jax
    import jax.numpy as jnp

    from kiln_lab.hopper_attention import flash_attention
    from kiln_lab.layouts import settings

    block_sizes, launch, hopper = settings(fields)

    q = jax.ShapeDtypeStruct((2, seq_len, 8, head_dim), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((2, seq_len), jnp.int32)

    def attention(q, k, v, segment_ids):
        segment_ids = segment_ids if segments else None
        return flash_attention(
            q, k, v, segment_ids, block_sizes=block_sizes, launch=launch, hopper=hopper
        )

    def loss(q, k, v, segment_ids):
        return attention(q, k, v, segment_ids).astype(jnp.float32).sum()

    compile_on(device, jax.grad(loss, argnums=(0, 1, 2)) if grad else attention, q, q, q, ids)


@contextlib.contextmanager
def stderr_to(path: Path):
    """The toolchain's own messages (e.g. that it found no nvdisasm for the SASS dump) go to a
    log, not between the table's rows; Python's exceptions still reach the caller."""
    sys.stderr.flush()
    saved = os.dup(2)
    with path.open("ab") as log:
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def read_report(dump: Path, kernel_name: str, seen: set[str]) -> Report:
    """The report of the kernel's latest dump not in `seen` (files `{name}_{n}.ptxas`,
    `.resources.txt` and `.sass_ctrl`, n counting the process' Mosaic GPU kernels)."""
    new = sorted(
        (p for p in dump.glob(f"{kernel_name}_*.ptxas") if p.name not in seen),
        key=lambda p: int(p.stem.rsplit("_", 1)[1]),
    )
    if not new:
        raise RuntimeError(f"no ptxas report for {kernel_name} in {dump}")
    seen.update(p.name for p in new)
    ptxas = new[-1].read_text()
    stack, stores, loads = map(int, SPILLS.search(ptxas).groups())
    serialized = SERIALIZED.search(ptxas)
    resources = new[-1].with_suffix(".resources.txt").read_text()
    smem = int(re.search(r"smem_scratch_bytes=(\d+)", resources).group(1))
    tile_loops = tile_loop_costs(new[-1].with_suffix(".sass_ctrl").read_text())
    for path in dump.glob(f"{kernel_name}_*.*"):  # Read: its MLIR pass log alone is ~80 MB.
        path.unlink()
    reason = serialized.group(1) if serialized else None
    return Report(stack, stores, loads, smem, tile_loops, reason)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cuda-compiler",
        default="dist/lab/cuda-compiler.pex",
        help="the PEX directory `./pants package lab:cuda-compiler` writes",
    )
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--kernels", default=",".join(HOPPER_KERNELS))
    parser.add_argument(
        "--quick", action="store_true", help="each kernel's first tuner candidate only"
    )
    parser.add_argument(
        "--train-step",
        action="store_true",
        help="then compile a small bf16 train step with all three Hopper kernels",
    )
    parser.add_argument(
        "--max-loop-spills",
        type=int,
        default=None,
        help="exit 1 when a kernel's tile loop has more local loads + stores than this",
    )
    options = parser.parse_args(argv)

    pex = Path(options.cuda_compiler).resolve()
    if not has_cuda_plugin(pex):
        parser.error(
            f"--cuda-compiler {options.cuda_compiler}: no jax CUDA plugin there; run "
            "`./pants package lab:cuda-compiler`"
        )
    with cuda_compiler(pex):
        return compile_all(options)


def compile_all(options) -> int:
    """Compiles what the options ask for and prints a row each; 1 if anything failed."""
    from kiln.kernels.block_sizes import default_block_sizes
    from kiln_lab.layouts import fields_of

    descriptor, log_name = tempfile.mkstemp(prefix="kiln-toolchain-", suffix=".log")
    os.close(descriptor)  # stderr_to opens it by name
    log = Path(log_name)
    with tempfile.TemporaryDirectory(prefix="kiln-mosaic-dump-") as folder:
        dump = Path(folder)
        os.environ["MOSAIC_GPU_DUMP_TO"] = folder  # ptxas' report of each Mosaic GPU kernel
        os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
        os.environ["MOSAIC_GPU_DUMP_SASS"] = "1"  # and its SASS (nvdisasm, beside ptxas)
        device = h200_device()
        base = fields_of(*default_block_sizes("NVIDIA H200", options.head_dim))
        with stderr_to(log):
            failures = compile_candidates(device, base, dump, options)
            if options.train_step:
                failures += compile_step(device, base, options)
    print(f"toolchain messages: {log}")
    return 1 if failures else 0


def compile_candidates(device, base, dump: Path, options) -> int:
    """One row per kernel candidate, without and with segment ids; returns the failed rows."""
    from kiln_lab.layouts import CANDIDATES, FIELDS, LAYOUT

    print(f"H200 (deviceless), head dim {options.head_dim}, seq {options.seq_len}, causal, bf16")
    print(
        f"{'kernel':<12} {'candidate':<14} {'segments':<9} {'spill st/ld B':>14} "
        f"{'stack B':>8} {'smem KiB':>9} {'compile s':>10} {'wgmma':<6} tile loops LDL/STL/instr"
    )
    seen: set[str] = set()
    failures = 0
    for kernel in options.kernels.split(","):
        for candidate in CANDIDATES[kernel][: 1 if options.quick else None]:
            fields = dict(zip(FIELDS[kernel], candidate), **LAYOUT[kernel])
            layout = {**base, **fields}
            for segments in (False, True):
                row = f"{kernel:<12} {','.join(map(str, candidate)):<14} {str(segments):<9}"
                start = time.perf_counter()
                try:
                    compile_for(
                        device,
                        layout,
                        seq_len=options.seq_len,
                        head_dim=options.head_dim,
                        segments=segments,
                        grad=kernel != "hopper",
                    )
                    report = read_report(dump, HOPPER_KERNELS[kernel], seen)
                except Exception as exc:  # noqa: BLE001 - a candidate that does not compile
                    failures += 1
                    print(f"{row} failed: {type(exc).__name__}: {exc}"[:300], flush=True)
                    continue
                spills = f"{report.spill_stores}/{report.spill_loads}"
                limit = options.max_loop_spills
                over = limit is not None and report.loop_spills > limit
                failures += over
                wgmma, notes = "async", ""
                if report.wgmma_serialized:
                    wgmma, notes = "serial", f"  (due to {report.wgmma_serialized})"
                if over:
                    notes += "  over --max-loop-spills"
                loops = " ".join(map(str, report.tile_loops)) or "-"
                print(
                    f"{row} {spills:>14} {report.stack_bytes:>8} {report.smem_bytes / 1024:>9.1f} "
                    f"{time.perf_counter() - start:>10.1f} {wgmma:<6} {loops}{notes}",
                    flush=True,
                )
    return failures


# Train-step layouts: the Hopper kernels each compiles (with their first tuner candidates).
STEP_LAYOUTS = {
    "split": ("hopper", "hopper_dkv", "hopper_dq"),
    "fused": ("hopper", "hopper_fused"),
}


def compile_step(device, base, options) -> int:
    """The train step with the Hopper forward and each Hopper backward (dK/dV + dQ kernels, and
    the fused one where the head dim allows); returns the failed layouts."""
    from kiln_lab.layouts import CANDIDATES, FIELDS, LAYOUT

    failures = 0
    for name, kernels in STEP_LAYOUTS.items():
        if name == "fused" and options.head_dim % 128:
            continue
        fields = {}
        for kernel in kernels:
            fields.update(zip(FIELDS[kernel], CANDIDATES[kernel][0]), **LAYOUT[kernel])
        layout = {**base, **fields}
        label = f"train step {name} (bf16, save_dots, {', '.join(kernels)})"
        start = time.perf_counter()
        try:
            launches = compile_train_step(device, layout, options.head_dim)
        except Exception as exc:  # noqa: BLE001 - reported, and the exit status says so
            failures += 1
            print(f"{label} failed: {type(exc).__name__}: {exc}"[:600], flush=True)
            continue
        print(
            f"{label}: compiled in {time.perf_counter() - start:.1f} s, {launches} Mosaic GPU "
            "kernel launches",
            flush=True,
        )
    return failures


def compile_train_step(device, fields, head_dim: int) -> int:
    """Compiles a small Llama's bf16 train step (the lab's attention with a layout's fields,
    segment ids, remat save_dots) for the H200; returns how many Mosaic GPU kernels the
    executable runs. The model's "pallas" attention calls the product's flash_attention, which
    knows nothing of the lab: for this compile the lab's stands in for it."""
    from unittest import mock

    from kiln.kernels import flash_attention as product
    from kiln_lab.hopper_attention import flash_attention
    from kiln_lab.layouts import settings

    block_sizes, launch, hopper = settings(fields)
    lab_attention = functools.partial(
        flash_attention, block_sizes=block_sizes, launch=launch, hopper=hopper
    )
    with mock.patch.object(product, "flash_attention", lab_attention):
        return _compile_small_train_step(device, head_dim)


def _compile_small_train_step(device, head_dim: int) -> int:
    import jax
    import jax.numpy as jnp

    from kiln.model.config import LlamaConfig
    from kiln.train.mesh import make_mesh
    from kiln.train.optimizer import AdamConfig
    from kiln.train.step import ModelOptions, abstract_train_state, train_step_fn

    seq_len, adam = 256, AdamConfig()
    model = LlamaConfig(
        max_seq_len=seq_len,
        hidden_dim=2 * head_dim,
        intermediate_dim=4 * head_dim,
        num_heads=2,
        num_kv_heads=1,
        num_layers=2,
        vocab_size=256,
    )
    state = abstract_train_state(
        model,
        adam,
        100,
        mesh=make_mesh(),
        options=ModelOptions(compute_dtype="bfloat16", attention="pallas", remat="save_dots"),
    )
    batch = {
        "tokens": jax.ShapeDtypeStruct((2, seq_len), jnp.int32),
        "segment_ids": jax.ShapeDtypeStruct((2, seq_len), jnp.int32),
        "loss_mask": jax.ShapeDtypeStruct((2, seq_len), jnp.float32),
    }
    state = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), state)
    step = train_step_fn(adam, 100, z_loss_weight=1e-4, mesh=None)
    compiled = compile_on(device, step, state, batch)
    return compiled.as_text().count('custom_call_target="mosaic_gpu_v2"')


if __name__ == "__main__":
    sys.exit(main())
