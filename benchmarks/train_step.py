"""Throughput of the jitted train step: tokens/s, step time and MFU per attention implementation
and segment layout.

    PYTHONPATH=src/python python3 benchmarks/train_step.py --model tiny            # CPU
    PYTHONPATH=src/python python3 benchmarks/train_step.py --model 1.4b            # GPU (H200)
    PYTHONPATH=src/python python3 benchmarks/train_step.py --model tiny --attention xla \
        --layouts docs --compile-cache /tmp/kiln-jax-cache

Segment layouts (benchmarks/segment_layouts.py): none (no segment ids), ones (one document per
row) and docs (the quickstart corpus's documents packed into windows, as training sees them).
MFU = tokens/s * flops_per_token(config, seq_len) / (devices * peak FLOP/s of the device), with
the peak from PEAK_BF16_FLOPS (dense bf16 spec sheets); n/a where the device is not listed (CPU).
It is printed in two conventions: attention at full length (PaLM's, Levanter's) and
causal-halved (the attention FLOPs a causal kernel does). Random tokens, one fixed batch; the
median of --steps timed steps after --warmup-steps. "1st step s" is the first call (trace,
compile, run); with --compile-cache, "warm 1st s" is the first call of a second, freshly traced
step in the same process, its executable read from jax's persistent compilation cache.

With --memory, each row also has the step's memory per device: "compiled GiB", the peak of the
executable XLA compiled (memory_analysis(): arguments + outputs - aliased + temporaries, what it
holds at once), and the device's own figures read as soon as the first step's outputs are ready:
"in use GiB" (peak_bytes_in_use: the buffers the runtime hands out, the state, the batch and the
outputs) and "reserved GiB" (peak_bytes_reserved: on a TPU, where an executable's temporaries
live, apart from the buffers in use). Their sum is the device's peak. A line under the row gives
the compiled parts, the state's own size (parameters and Adam's moments) and every memory_stats
value. "peak GiB" is peak_bytes_in_use read after the timed steps: the buffers, without the
temporaries.

With --profile DIR, each row is followed by where its step's time goes: --profile-steps more
steps (each waited for, as timed steps are) run under jax.profiler, the trace goes to
DIR/LAYOUT-ATTENTION, and benchmarks/step_profile.py splits the step by category (matmuls,
attention forward / recomputed forward / backward, lm head + loss, optimizer, collectives,
elementwise and other, host / idle) in ms and %; a profile that fails says why under its row and
the row stays. On a GPU, --profile turns XLA's command buffers (CUDA graphs) off for
the whole run, so that the trace names every kernel's HLO op.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from attention import load_block_sizes  # benchmarks/attention.py
from segment_layouts import LAYOUTS, describe, segment_ids  # benchmarks/segment_layouts.py
from step_profile import (  # benchmarks/step_profile.py
    capture,
    format_table,
    name_every_kernel,
    read_op_events,
    step_split,
    unnamed_note,
)

from kiln.kernels.block_sizes import TUNED_BLOCK_SIZES
from kiln.model.config import LlamaConfig, flops_per_token, num_parameters
from kiln.train.mesh import make_mesh
from kiln.train.optimizer import AdamConfig
from kiln.train.step import (
    ModelOptions,
    init_train_state,
    make_train_step,
    shard_batch,
    train_step_fn,
)

MODELS = {
    "tiny": LlamaConfig(
        max_seq_len=256,
        hidden_dim=128,
        intermediate_dim=512,
        num_heads=4,
        num_kv_heads=2,
        num_layers=2,
        vocab_size=1024,
    ),
    # GPT-2-small-shaped and medium-shaped Llamas with a 32k vocabulary: what one TPU v5e trains.
    "150m": LlamaConfig(
        max_seq_len=2048,
        hidden_dim=768,
        intermediate_dim=3072,
        num_heads=6,
        num_kv_heads=6,
        num_layers=12,
        vocab_size=32000,
    ),
    "470m": LlamaConfig(
        max_seq_len=2048,
        hidden_dim=1024,
        intermediate_dim=4096,
        num_heads=8,
        num_kv_heads=8,
        num_layers=24,
        vocab_size=32000,
    ),
    "1b": LlamaConfig(
        max_seq_len=2048,
        hidden_dim=1536,
        intermediate_dim=6144,
        num_heads=12,
        num_kv_heads=12,
        num_layers=24,
        vocab_size=32000,
    ),
    # The reference's 1.4B Llama with the Llama-3 vocabulary.
    "1.4b": LlamaConfig(
        max_seq_len=4096,
        hidden_dim=2048,
        intermediate_dim=8192,
        num_heads=16,
        num_kv_heads=16,
        num_layers=24,
        vocab_size=128256,
    ),
}
DEFAULTS = {  # model -> (batch size, seq len, remat)
    "tiny": (8, 128, "none"),
    "150m": (16, 2048, "save_dots"),
    "470m": (8, 2048, "save_dots"),
    "1b": (4, 2048, "full"),
    "1.4b": (4, 4096, "save_dots"),
}
PEAK_BF16_FLOPS = {  # dense, no sparsity
    "NVIDIA H200": 989e12,
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "TPU v5 lite": 197e12,  # v5e
}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = MODELS[args.model]
    if args.vocab_size:
        config = dataclasses.replace(config, vocab_size=args.vocab_size)
    batch_size, seq_len, remat = DEFAULTS[args.model]
    batch_size, seq_len = args.batch_size or batch_size, args.seq_len or seq_len
    remat = args.remat or remat
    if args.profile:
        name_every_kernel()  # before jax.devices() starts the backend
    device = jax.devices()[0]
    if args.block_sizes:
        TUNED_BLOCK_SIZES[device.device_kind] = load_block_sizes(args.block_sizes)
    if args.compile_cache is not None:
        use_compilation_cache(args.compile_cache or tempfile.mkdtemp(prefix="kiln-jax-cache-"))
    print(
        f"model {args.model}: {num_parameters(config) / 1e6:.1f}M params, batch {batch_size} x "
        f"{seq_len} in {args.microbatches} microbatch(es), remat {remat}, "
        f"compute {args.compute_dtype}, "
        f"{jax.device_count()} x {device.device_kind}"
    )
    for layout in args.layouts:
        print(f"  {layout}: {describe(segment_ids(layout, batch_size, seq_len))}")
    print_header(args.memory)
    for layout in args.layouts:
        for attention in args.attention.split(","):
            try:
                row = measure(config, attention, layout, batch_size, seq_len, remat, args)
            except Exception as error:  # report the failure in the table and go on
                row = {"attention": attention, "layout": layout}
                row["error"] = f"{type(error).__name__}: {error}"
            print_row(row)  # as each finishes: a run stopped by a timeout keeps its rows


def use_compilation_cache(directory: str) -> None:
    """jax's persistent compilation cache in `directory`, for every executable however small."""
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    print(f"compilation cache: {directory}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument(
        "--attention",
        default="xla,pallas",
        help="comma-separated: xla, pallas (interpret mode on CPU: slow), cudnn (GPU only)",
    )
    parser.add_argument(
        "--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS), help="segment layouts"
    )
    parser.add_argument(
        "--compile-cache",
        nargs="?",
        const="",
        metavar="DIR",
        help="use jax's persistent compilation cache in DIR (default: a new temporary directory) "
        "and print the first step's seconds cold and warm",
    )
    parser.add_argument("--batch-size", type=int, help="global batch (default per model)")
    parser.add_argument("--seq-len", type=int, help="default per model")
    parser.add_argument("--vocab-size", type=int, help="default per model (the quickstart: 8192)")
    parser.add_argument("--remat", choices=["none", "full", "save_dots", "offload"])
    parser.add_argument(
        "--microbatches",
        type=int,
        default=1,
        help="accumulate the gradient over this many slices of the batch (the trainer's "
        "per-device batch): one slice's activations in memory at a time",
    )
    parser.add_argument("--compute-dtype", default="bfloat16")
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="also trace --profile-steps steps per row into DIR/LAYOUT-ATTENTION and print the "
        "step's time by category",
    )
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument(
        "--memory",
        action="store_true",
        help="also compile the step's memory analysis and read the device's memory after the "
        "first step (columns compiled GiB, in use GiB, reserved GiB and a line of parts)",
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument(
        "--block-sizes",
        help="JSON {head_dim: BlockSizes and LaunchParams fields} (a tuner's --json): use it as "
        "this device's entry in the kernel's table",
    )
    return parser.parse_args(argv)


def measure(
    config: LlamaConfig,
    attention: str,
    layout: str,
    batch_size: int,
    seq_len: int,
    remat: str,
    args: argparse.Namespace,
) -> dict:
    mesh = make_mesh({"data": -1})
    adam = AdamConfig()
    num_train_steps = args.warmup_steps + args.steps + (args.profile_steps if args.profile else 0)
    state = init_train_state(
        config,
        adam,
        num_train_steps,
        seed=0,
        mesh=mesh,
        options=ModelOptions(compute_dtype=args.compute_dtype, attention=attention, remat=remat),
    )

    def new_train_step():
        return make_train_step(
            adam, num_train_steps, z_loss_weight=1e-4, mesh=mesh, microbatches=args.microbatches
        )

    batch = shard_batch(make_batch(config, layout, batch_size, seq_len), mesh)
    train_step = new_train_step()
    state, first_step_seconds = timed_step(train_step, state, batch)
    first_step_stats = jax.devices()[0].memory_stats() or {}  # before anything is freed
    warm_first_step_seconds = None
    if args.compile_cache is not None:  # a new jit: traced again, compiled from the cache
        train_step = new_train_step()
        state, warm_first_step_seconds = timed_step(train_step, state, batch)
    for _ in range(args.warmup_steps - 1):
        state, metrics = train_step(state, batch)
    step_times = []
    for _ in range(args.steps):
        state, seconds = timed_step(train_step, state, batch)
        step_times.append(seconds)
    profile = None
    if args.profile:
        trace_dir = Path(args.profile) / f"{layout}-{attention}"
        try:
            state, profile = profile_steps(train_step, state, batch, args.profile_steps, trace_dir)
        except Exception as error:  # the row's numbers stand without it
            profile = {"error": f"{type(error).__name__}: {error}"}
    state, metrics = train_step(state, batch)
    memory = None
    if args.memory:  # the same jit of the same step: with --compile-cache, read from the cache
        memory = {**compiled_memory(adam, num_train_steps, mesh, args, state, batch),
                  "first_step_stats": first_step_stats}  # fmt: skip
    step_time = statistics.median(step_times)
    tokens_per_second = batch_size * seq_len / step_time
    return {
        "attention": attention,
        "layout": layout,
        "tokens_per_second": tokens_per_second,
        "step_ms": step_time * 1e3,
        "mfu": mfu(config, seq_len, tokens_per_second, causal_halved=False),
        "mfu_causal": mfu(config, seq_len, tokens_per_second, causal_halved=True),
        "first_step_s": first_step_seconds,
        "peak_gib": peak_memory_gib(),
        "warm_first_step_s": warm_first_step_seconds,
        "loss": float(metrics["loss"]),
        "profile": profile,
        "memory": memory,
    }


def compiled_memory(adam, num_train_steps, mesh, args, state, batch) -> dict:
    """The step's executable as XLA compiles it for this device (make_train_step's jit): its
    memory_analysis() in GiB per device, its peak, and the state's own size."""
    step = train_step_fn(
        adam, num_train_steps, z_loss_weight=1e-4, mesh=mesh, microbatches=args.microbatches
    )
    with jax.set_mesh(mesh):
        analysis = jax.jit(step, donate_argnums=0).lower(state, batch).compile().memory_analysis()
    parts = {
        "arguments": analysis.argument_size_in_bytes / 2**30,
        "outputs": analysis.output_size_in_bytes / 2**30,
        "alias": analysis.alias_size_in_bytes / 2**30,
        "temp": analysis.temp_size_in_bytes / 2**30,
    }
    peak = parts["arguments"] + parts["outputs"] - parts["alias"] + parts["temp"]
    state_bytes = sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(state))
    return {**parts, "peak": peak, "state": state_bytes / 2**30}


def make_batch(config: LlamaConfig, layout: str, batch_size: int, seq_len: int) -> dict:
    """Random tokens, every position in the loss, and the layout's segment ids (if any)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, (batch_size, seq_len), dtype=np.int32)
    batch = {"tokens": tokens, "loss_mask": np.ones(tokens.shape, np.float32)}
    ids = segment_ids(layout, batch_size, seq_len)
    return batch if ids is None else {**batch, "segment_ids": ids}


def peak_memory_gib() -> float | None:
    """The device's peak bytes in use so far in this process (TPU and GPU report it)."""
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**30


def timed_step(train_step, state, batch) -> tuple[object, float]:
    """(next state, seconds from the call until its metrics are on the device)."""
    start = time.perf_counter()
    state, metrics = train_step(state, batch)
    jax.block_until_ready(metrics)
    return state, time.perf_counter() - start


def profile_steps(train_step, state, batch, steps: int, trace_dir: Path) -> tuple[object, dict]:
    """(next state, {"trace": its .xplane.pb, "split": ms per step by category}) of `steps`
    steps run under jax.profiler, each waited for."""

    def run() -> None:
        nonlocal state
        for _ in range(steps):
            state, metrics = train_step(state, batch)
            jax.block_until_ready(metrics)

    xplane, wall_ns = capture(run, trace_dir)
    events = read_op_events(xplane)
    split = step_split(events, steps, wall_ns)
    return state, {"trace": xplane, "split": split, "note": unnamed_note(events, steps)}


def mfu(
    config: LlamaConfig, seq_len: int, tokens_per_second: float, *, causal_halved: bool
) -> float | None:
    peak = PEAK_BF16_FLOPS.get(jax.devices()[0].device_kind)
    if peak is None:
        return None
    flops = flops_per_token(config, seq_len, causal_halved=causal_halved)
    return tokens_per_second * flops / (jax.device_count() * peak)


TABLE_HEADER = (
    f"{'layout':<6} {'attention':<10} {'tokens/s':>12} {'step ms':>10} {'MFU full':>9} "
    f"{'MFU causal':>10} {'peak GiB':>9} {'1st step s':>11} {'warm 1st s':>11} {'loss':>8}"
)


MEMORY_HEADER = f" {'compiled GiB':>12} {'in use GiB':>10} {'reserved GiB':>12}"


def print_header(memory: bool = False) -> None:
    header = TABLE_HEADER + (MEMORY_HEADER if memory else "")
    print(header)
    print("-" * len(header), flush=True)


def print_row(row: dict) -> None:
    if "error" in row:
        print(f"{row['layout']:<6} {row['attention']:<10} failed: {row['error'][:200]}", flush=True)
        return
    warm = row["warm_first_step_s"]
    print(
        f"{row['layout']:<6} {row['attention']:<10} {row['tokens_per_second']:>12,.0f} "
        f"{row['step_ms']:>10.1f} {percent(row['mfu']):>9} {percent(row['mfu_causal']):>10} "
        f"{'-' if row['peak_gib'] is None else format(row['peak_gib'], '.2f'):>9} "
        f"{row['first_step_s']:>11.2f} {'-' if warm is None else f'{warm:.2f}':>11} "
        f"{row['loss']:>8.4f}{memory_columns(row['memory'])}",
        flush=True,
    )
    if row["memory"] is not None:
        print_memory(row["memory"])
    if row["profile"] is not None:
        print_profile(row["profile"])


def memory_columns(memory: dict | None) -> str:
    if memory is None:
        return ""
    stats = memory["first_step_stats"]
    in_use, reserved = (stats.get(key) for key in ("peak_bytes_in_use", "peak_bytes_reserved"))
    in_use_text = "-" if in_use is None else f"{in_use / 2**30:.2f}"
    reserved_text = "-" if reserved is None else f"{reserved / 2**30:.2f}"
    return f" {memory['peak']:>12.2f} {in_use_text:>10} {reserved_text:>12}"


def print_memory(memory: dict) -> None:
    print(
        f"  compiled: arguments {memory['arguments']:.2f} + outputs {memory['outputs']:.2f} - "
        f"aliased {memory['alias']:.2f} + temporaries {memory['temp']:.2f} = "
        f"{memory['peak']:.2f} GiB; the state (parameters, Adam's moments) {memory['state']:.2f} "
        f"GiB; the device's memory_stats after the 1st step: {memory['first_step_stats']}",
        flush=True,
    )


def print_profile(profile: dict) -> None:
    if "error" in profile:
        print(f"  profile failed: {profile['error'][:300]}", flush=True)
        return
    print(f"  where the step goes (trace: {profile['trace']}):")
    print("\n".join("  " + line for line in format_table(profile["split"]).splitlines()))
    if profile["note"]:
        print(f"  {profile['note']}")
    print(flush=True)


def percent(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{100 * fraction:.1f}%"


if __name__ == "__main__":
    main()
