"""Reading a token cache through the training mixture at the 1.4B run's shapes, vs what it consumes.

    ./pants run benchmarks/mixture_read.py -- CACHE_DIR [--batch-size 256] [--seq-lens 4096 2048]

The trainer's own path: `MixtureDataset.batch(step, batch_size)` (kiln.data.mixture: block layout,
Feistel-shuffled windows, TensorStore reads, segment ids and loss mask) on the trainer's
background thread (`kiln.train.setup.prefetched`, PREFETCH_BATCHES ahead), the cache freshly
opened. The consumer takes each batch as soon as it is ready, so the wait per step is what a device
infinitely faster than the loader would wait: the time the loader needs per batch. Goal: 10x what
one H200 consumes at the 1.4B step, 35k tokens/s (benchmarks/RESULTS.md, "1.4B train step").
Batch 256 is experiments:dclm_1b's (256 x 2048); 4096 is the 1.4B step's benchmark length.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from report_table import markdown_table

H200_TOKENS_PER_SECOND = 35_000  # the 1.4B train step on one H200
GOAL = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=256, help="experiments:dclm_1b's")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 2048])
    parser.add_argument("--read-steps", type=int, default=100, help="batches read per row")


def data_waits(cache_dir: Path, seq_len: int, batch_size: int, steps: int) -> list[float]:
    """Seconds the training loop waits in next(batches) at each step, the consumer doing nothing."""
    from kiln.data.cache import TokenCache
    from kiln.data.mixture import MixtureDataset, mixture_block_size
    from kiln.train.setup import PREFETCH_BATCHES, prefetched

    cache = TokenCache.open(cache_dir)
    block = mixture_block_size(batch_size, num_train_steps=1_000_000)
    mixture = MixtureDataset([(cache, 1.0)], seq_len, seed=0, block_size=block)
    batches = prefetched(lambda s: mixture.batch(s, batch_size), range(steps), PREFETCH_BATCHES)
    waits = []
    for _ in range(steps):
        began = time.monotonic()
        batch = next(batches)
        waits.append(time.monotonic() - began)
        assert batch["tokens"].shape == (batch_size, seq_len)
    return waits


def report(cache_dir: Path, args: argparse.Namespace) -> str:
    header = ["batch x seq_len", "steps", "tokens/s", "x one H200 (35k tok/s)",
              "data wait p50 ms", "data wait p99 ms", "H200 step ms"]  # fmt: skip
    rows = []
    for seq_len in args.seq_lens:
        waits = np.array(data_waits(cache_dir, seq_len, args.batch_size, args.read_steps))
        tokens = args.batch_size * seq_len
        rate = tokens * len(waits) / waits.sum()
        rows.append([f"{args.batch_size} x {seq_len}", len(waits), f"{rate / 1e6:.2f}M",
                     f"{rate / H200_TOKENS_PER_SECOND:.0f}x",
                     f"{np.percentile(waits, 50) * 1e3:.0f}", f"{np.percentile(waits, 99) * 1e3:.0f}",
                     f"{tokens / H200_TOKENS_PER_SECOND * 1e3:,.0f}"])  # fmt: skip
    return markdown_table(header, rows) + f"\n(goal: >= {GOAL}x)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("cache", type=Path, help="a finished token cache folder")
    add_arguments(parser)
    args = parser.parse_args()
    print(report(args.cache, args))


if __name__ == "__main__":
    main()
