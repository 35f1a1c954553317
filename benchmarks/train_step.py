"""Throughput of the jitted train step: tokens/s, step time and MFU per attention implementation.

    PYTHONPATH=src/python python3 benchmarks/train_step.py --model tiny            # CPU
    PYTHONPATH=src/python python3 benchmarks/train_step.py --model 1.4b            # GPU (H200)
    PYTHONPATH=src/python python3 benchmarks/train_step.py --model tiny --attention xla

MFU = tokens/s * flops_per_token(config, seq_len) / (devices * peak FLOP/s of the device), with
the peak from PEAK_BF16_FLOPS (dense bf16 spec sheets); n/a where the device is not listed (CPU).
Random tokens, one fixed batch; the median of --steps timed steps after --warmup-steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
from attention import load_block_sizes  # benchmarks/attention.py

from kiln.kernels.block_sizes import TUNED_BLOCK_SIZES
from kiln.model.config import LlamaConfig, flops_per_token, num_parameters
from kiln.train.mesh import make_mesh
from kiln.train.optimizer import AdamConfig
from kiln.train.step import init_train_state, make_train_step, shard_batch

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
    "1.4b": (4, 4096, "save_dots"),
}
PEAK_BF16_FLOPS = {  # dense, no sparsity
    "NVIDIA H200": 989e12,
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
}


def main() -> None:
    args = parse_args()
    config = MODELS[args.model]
    batch_size, seq_len, remat = DEFAULTS[args.model]
    batch_size, seq_len = args.batch_size or batch_size, args.seq_len or seq_len
    remat = args.remat or remat
    device = jax.devices()[0]
    if args.block_sizes:
        TUNED_BLOCK_SIZES[device.device_kind] = load_block_sizes(args.block_sizes)
    print(
        f"model {args.model}: {num_parameters(config) / 1e6:.1f}M params, batch {batch_size} x "
        f"{seq_len}, remat {remat}, compute {args.compute_dtype}, "
        f"{jax.device_count()} x {device.device_kind}"
    )
    print_header()
    for attention in args.attention.split(","):
        try:
            row = measure(config, attention, batch_size, seq_len, remat, args)
        except Exception as error:  # report the failure in the table and go on
            row = {"attention": attention, "error": f"{type(error).__name__}: {error}"}
        print_row(row)  # as each finishes: a run stopped by a timeout keeps its rows


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument(
        "--attention",
        default="xla,pallas",
        help="comma-separated: xla, pallas (interpret mode on CPU: slow), cudnn (GPU only)",
    )
    parser.add_argument("--batch-size", type=int, help="global batch (default per model)")
    parser.add_argument("--seq-len", type=int, help="default per model")
    parser.add_argument("--remat", choices=["none", "full", "save_dots", "offload"])
    parser.add_argument("--compute-dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument(
        "--block-sizes",
        help="JSON {head_dim: BlockSizes and LaunchParams fields} (a tuner's --json): use it as "
        "this device's entry in the kernel's table",
    )
    return parser.parse_args()


def measure(
    config: LlamaConfig,
    attention: str,
    batch_size: int,
    seq_len: int,
    remat: str,
    args: argparse.Namespace,
) -> dict:
    mesh = make_mesh({"data": -1})
    adam = AdamConfig()
    num_train_steps = args.warmup_steps + args.steps
    state = init_train_state(
        config,
        adam,
        num_train_steps,
        seed=0,
        mesh=mesh,
        compute_dtype=args.compute_dtype,
        attention=attention,
        remat=remat,
    )
    train_step = make_train_step(adam, num_train_steps, z_loss_weight=1e-4, mesh=mesh)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, (batch_size, seq_len), dtype=np.int32)
    batch = shard_batch(
        {
            "tokens": tokens,
            "segment_ids": np.ones_like(tokens),
            "loss_mask": np.ones(tokens.shape, np.float32),
        },
        mesh,
    )
    start = time.perf_counter()
    state, metrics = train_step(state, batch)
    jax.block_until_ready(metrics)
    compile_seconds = time.perf_counter() - start
    for _ in range(args.warmup_steps - 1):
        state, metrics = train_step(state, batch)
    jax.block_until_ready(metrics)
    step_times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        state, metrics = train_step(state, batch)
        jax.block_until_ready(metrics)
        step_times.append(time.perf_counter() - start)
    step_time = statistics.median(step_times)
    tokens_per_second = batch_size * seq_len / step_time
    peak = PEAK_BF16_FLOPS.get(jax.devices()[0].device_kind)
    mfu = None
    if peak is not None:
        mfu = tokens_per_second * flops_per_token(config, seq_len) / (jax.device_count() * peak)
    return {
        "attention": attention,
        "tokens_per_second": tokens_per_second,
        "step_ms": step_time * 1e3,
        "mfu": mfu,
        "first_step_s": compile_seconds,
        "loss": float(metrics["loss"]),
    }


TABLE_HEADER = (
    f"{'attention':<10} {'tokens/s':>12} {'step ms':>10} {'MFU':>7} {'1st step s':>11} {'loss':>8}"
)


def print_header() -> None:
    print(TABLE_HEADER)
    print("-" * len(TABLE_HEADER), flush=True)


def print_row(row: dict) -> None:
    if "error" in row:
        print(f"{row['attention']:<10} failed: {row['error'][:200]}", flush=True)
        return
    mfu = "n/a" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
    print(
        f"{row['attention']:<10} {row['tokens_per_second']:>12,.0f} {row['step_ms']:>10.1f} "
        f"{mfu:>7} {row['first_step_s']:>11.1f} {row['loss']:>8.4f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
