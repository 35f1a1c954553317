"""Memory of the train step on one H200: the compiled executable's memory analysis per batch size
and remat policy, without a GPU.

    ./pants package lab:cuda-compiler      # jax's CUDA plugin and ptxas (~255 MB), once
    PYTHONPATH=src/python:src/contract python3 benchmarks/train_step_memory.py \
        [--batches 8 --policies save_dots,full]

The step is the product's, as training runs it (kiln.train.step.train_step_fn, jitted with the
state donated, on a one-device mesh): the 1.4B Llama of benchmarks/train_step.py, pallas
attention, bf16 compute, fp32 parameters and Adam state, z-loss, packed documents (segment ids).
Without a GPU, XLA compiles it deviceless for an H200 through jax's CUDA plugin
(kiln.kernels.h200_compile); where jax has a GPU of its own (a CUDA jax and a device), it
compiles for that device instead. Nothing runs. Each compile of the 1.4B step takes minutes on
2 cores; rows are printed as they finish.

Columns (GiB): arguments (state + batch), outputs (next state + metrics), alias (outputs written
into donated arguments), temp (activations, gradients, workspace); peak = arguments + outputs -
alias + temp, what the executable holds at once on the device; host temp is pinned host memory
(remat offload's saved activations). The device has 150,754,820,096 bytes
(140.4 GiB, the "141 GB"); jax's allocator takes 75% of it by default
(XLA_PYTHON_CLIENT_MEM_FRACTION), so a peak between the two columns' limits needs that raised.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path
from typing import Any

from kiln.kernels.h200_compile import (
    CUDA_COMPILER_PEX,
    cuda_compiler,
    h200_device,
    has_cuda_plugin,
)

GIB = 2**30
H200_BYTES = 150_754_820_096  # the device's memory, as H200_TARGET_CONFIG and the driver say
JAX_DEFAULT_FRACTION = 0.75  # XLA_PYTHON_CLIENT_MEM_FRACTION's default
POLICIES = ("save_dots", "full", "offload", "none")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if has_local_gpu_jax():
        compile_rows(args, device=None, label="")
        return
    pex = Path(args.cuda_compiler).resolve()
    if not has_cuda_plugin(pex):
        raise SystemExit(
            f"--cuda-compiler {args.cuda_compiler}: no jax CUDA plugin there; run "
            "`./pants package lab:cuda-compiler` (or run this where jax has a GPU)"
        )
    with cuda_compiler(pex):  # before jax loads
        compile_rows(args, device=h200_device(), label=" (deviceless compile)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "1.4b"), default="1.4b")
    parser.add_argument(
        "--batches", default="4,6,8", help="comma-separated batch sizes (default 4,6,8)"
    )
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument(
        "--policies",
        default="save_dots,full",
        help=f"comma-separated remat policies of {', '.join(POLICIES)} (default save_dots,full)",
    )
    parser.add_argument(
        "--cuda-compiler",
        default=str(CUDA_COMPILER_PEX),
        help="the PEX directory `./pants package lab:cuda-compiler` writes (without a GPU)",
    )
    args = parser.parse_args(argv)
    try:
        args.batches = [int(batch) for batch in args.batches.split(",")]
    except ValueError:
        parser.error(f"--batches {args.batches}: expected comma-separated integers, e.g. 4,6,8")
    args.policies = args.policies.split(",")
    unknown = sorted(set(args.policies) - set(POLICIES))
    if unknown:
        parser.error(f"--policies: unknown {unknown}; choose from {', '.join(POLICIES)}")
    return args


def has_local_gpu_jax() -> bool:
    """Whether jax here has a CUDA plugin of its own (a GPU machine's jax), asked before jax
    loads: the deviceless compiler must be on the path first."""
    return any(
        importlib.util.find_spec(plugin) is not None
        for plugin in ("jax_cuda13_plugin", "jax_cuda12_plugin")
    )


def compile_rows(args: argparse.Namespace, device: Any, label: str) -> None:
    """Compiles the step for each (batch, policy) on `device` (None: jax's first) and prints a
    row as each finishes."""
    import jax

    if device is None:
        device = jax.devices()[0]
        if device.platform != "gpu":
            raise SystemExit(f"jax has a CUDA plugin but its first device is {device}, not a GPU")
    print(
        f"{args.model} train step, seq {args.seq_len}, pallas attention, bf16, on "
        f"{device.device_kind}{label}"
    )
    print(HEADER)
    print("-" * len(HEADER), flush=True)
    for batch in args.batches:
        for policy in args.policies:
            start = time.perf_counter()
            try:
                stats = compile_step(
                    device, args.model, batch, args.seq_len, policy
                ).memory_analysis()
            except Exception as error:  # noqa: BLE001 - reported in its row; the others go on
                print(f"{batch:>5} {policy:<10} failed: {type(error).__name__}: {error}"[:400])
                continue
            print(row(batch, policy, stats, time.perf_counter() - start), flush=True)


def compile_step(device: Any, model: str, batch: int, seq_len: int, remat: str) -> Any:
    """The product's train step compiled for `device`: make_train_step's jit (state donated)
    on a one-device mesh, lowered with abstract arrays."""
    import jax
    import jax.numpy as jnp
    from train_step import MODELS  # benchmarks/train_step.py; imports jax

    from kiln.train.mesh import batch_sharding, make_mesh
    from kiln.train.optimizer import AdamConfig
    from kiln.train.step import BATCH_FIELDS, ModelOptions, abstract_train_state, train_step_fn

    mesh = make_mesh({"data": -1}, devices=[device])
    adam, num_train_steps = AdamConfig(), 1000
    state = abstract_train_state(
        MODELS[model],
        adam,
        num_train_steps,
        mesh=mesh,
        options=ModelOptions(compute_dtype=jnp.bfloat16, attention="pallas", remat=remat),
    )
    rows = batch_sharding(mesh)
    batch_shapes = {
        name: jax.ShapeDtypeStruct((batch, seq_len), dtype, sharding=rows)
        for name, dtype in BATCH_FIELDS.items()
    }
    step = train_step_fn(adam, num_train_steps, z_loss_weight=1e-4, mesh=mesh)
    with jax.set_mesh(mesh):
        return jax.jit(step, donate_argnums=0).lower(state, batch_shapes).compile()


HEADER = (
    f"{'batch':>5} {'remat':<10} {'args':>7} {'outputs':>8} {'alias':>7} {'temp':>7} {'peak':>7} "
    f"{'fits 140.4':>10} {'fits 75%':>9} {'host temp':>9} {'compile s':>10}"
)


def row(batch: int, policy: str, stats: Any, seconds: float) -> str:
    peak = peak_bytes(stats)
    return (
        f"{batch:>5} {policy:<10} {stats.argument_size_in_bytes / GIB:>7.2f} "
        f"{stats.output_size_in_bytes / GIB:>8.2f} {stats.alias_size_in_bytes / GIB:>7.2f} "
        f"{stats.temp_size_in_bytes / GIB:>7.2f} {peak / GIB:>7.2f} "
        f"{yes_no(peak <= H200_BYTES):>10} {yes_no(peak <= JAX_DEFAULT_FRACTION * H200_BYTES):>9} "
        f"{stats.host_temp_size_in_bytes / GIB:>9.2f} {seconds:>10.0f}"
    )


def peak_bytes(stats: Any) -> int:
    """What the executable holds at once: its arguments, its outputs not written into donated
    arguments, and its temporaries."""
    return (
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
        + stats.temp_size_in_bytes
    )


def yes_no(fits: bool) -> str:
    return "yes" if fits else "no"


if __name__ == "__main__":
    main()
