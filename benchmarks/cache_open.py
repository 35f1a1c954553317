"""Opening a token cache and reading a window, by document count: format 4 vs the format-3 layout.

    ./pants run benchmarks/cache_open.py -- [--documents 4 5 6 7 8] [--legacy-up-to 7]

For each count 10^k (`--documents k ...`) a one-shard cache of 10^k documents of 1-3 tokens
(uint16 ids drawn at random, seed 0; 2 tokens a document on average, so the offsets weigh as
much as they can against the tokens) is synthesised into `--work` by Kiln's own ShardWriter and
write_cache, twice:
- format 4 (this Kiln): tokens in chunks of 4K (1M a file), offsets in chunks of 1,024 (256
  chunks a file) with their index;
- format 3 (the baseline, built in the same run): tokens and offsets in chunks of 256K (4M a
  file), no index, so the reader loads every document's end when it opens the cache (up to
  10^`--legacy-up-to`).
Each cache is then opened in a fresh process, which reports:
- open: seconds of `TokenCache.open`, and the peak RSS it added (VmHWM, reset before the open);
- bytes read per 4,096-token window: what the process read (/proc/self/io rchar) over
  `--windows` windows at random, each read alone by a reader that keeps no decoded chunk (a
  cache pool of 0 bytes: every window reads all it needs, the files' chunk indexes included),
  over the window's own bytes (8 kB): the read amplification (goal <= 4x);
- read: tokens per second of batches of 64 random windows of 4,096 (segment ids included), the
  shape of the trainer's reads.
Goals (issue 43): open <= 1 s and <= 100 MB RSS at 10^8 documents; <= 4x read amplification.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from report_table import markdown_table

WINDOW = 4096
BATCH = 64
VOCAB = 50_257
BATCH_DOCUMENTS = 10_000_000  # documents generated and appended at a time


def _layout() -> tuple[int, int, int, int]:
    from kiln.data import cache_writer, document_ends

    return (cache_writer.INNER_CHUNK, cache_writer.OUTER_CHUNK, document_ends.OFFSETS_STRIDE,
            cache_writer.OFFSETS_CHUNKS_PER_FILE)  # fmt: skip


def synthesise(folder: Path, documents: int, legacy: bool) -> None:
    """A finished one-shard cache at `folder`; `legacy`: in the format-3 layout."""
    from kiln.artifacts.locations import open_store
    from kiln.data import document_ends
    from kiln.data.cache_writer import ShardWriter, write_cache
    from kiln.data.tokenizer import EncodedDocuments

    rng = np.random.default_rng(0)
    layout = (1 << 18, 1 << 22, 1 << 18, 16) if legacy else _layout()  # format 3: 4M-element files
    saved = _layout()
    _set_layout(*layout)
    shard_dir = folder / "staging" / "shard"
    try:
        with ShardWriter(shard_dir, np.dtype(np.uint16)) as writer:
            for start in range(0, documents, BATCH_DOCUMENTS):
                lengths = rng.integers(1, 4, size=min(BATCH_DOCUMENTS, documents - start))
                tokens = rng.integers(0, VOCAB, size=int(lengths.sum()), dtype=np.uint32)
                writer.append(EncodedDocuments(tokens, lengths.astype(np.int64)))
            record = writer.finish({"index": 0, "text_bytes": 0, "skipped_empty_documents": 0})
    finally:
        _set_layout(*saved)
    if legacy:  # as format 3 wrote it: no index
        (shard_dir / document_ends.OFFSETS_INDEX_FILE).unlink()
        del record["offsets_stride"]
        record["files"].pop(document_ends.OFFSETS_INDEX_FILE)
    write_cache(open_store(folder), [(open_store(shard_dir), record)], _cache_record(legacy),
                np.ones(VOCAB, np.int32))  # fmt: skip


def _set_layout(inner: int, outer: int, stride: int, offsets_chunks: int) -> None:
    from kiln.data import cache_writer, document_ends

    cache_writer.INNER_CHUNK, cache_writer.OUTER_CHUNK = inner, outer
    document_ends.OFFSETS_STRIDE, cache_writer.OFFSETS_CHUNKS_PER_FILE = stride, offsets_chunks


def _cache_record(legacy: bool) -> dict:
    tokenizer = {"name": "synthetic", "digest": "0" * 64, "vocab_size": VOCAB, "bos_id": None,
                 "eos_id": 0, "spec": {"kind": "package", "name": "synthetic"}}  # fmt: skip
    return {"format_version": 3 if legacy else 4, "name": "benchmarks/synthetic",
            "version": "1", "fingerprint": "0" * 16, "tokenizer": tokenizer}  # fmt: skip


def measure(folder: Path, windows: int) -> dict[str, float]:
    """In this (fresh) process: open the cache, then read windows; see the module's doc."""
    from kiln.data import cache as cache_module
    from kiln.data.cache import TokenCache

    rng = np.random.default_rng(1)
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM: the open's own peak
    before, started = _status("VmRSS"), time.perf_counter()
    cache = TokenCache.open(folder)
    opened, peak = time.perf_counter() - started, _status("VmHWM") - before
    count = cache.num_windows(WINDOW)
    pool, cache_module.READ_CACHE_BYTES = cache_module.READ_CACHE_BYTES, 0  # nothing kept
    uncached = TokenCache.open(folder)
    read_before = _rchar()
    for index in rng.integers(0, count, size=windows):
        uncached.windows([int(index)], WINDOW)
    per_window = (_rchar() - read_before) / windows
    cache_module.READ_CACHE_BYTES = pool
    batches, started = 5, time.perf_counter()
    for _ in range(batches):
        cache.windows(sorted(rng.integers(0, count, size=BATCH).tolist()), WINDOW)
    rate = batches * BATCH * WINDOW / (time.perf_counter() - started)
    return {"open_s": opened, "rss_mb": peak / 2**20, "bytes_per_window": per_window,
            "tokens_per_s": rate}  # fmt: skip


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise KeyError("rchar")


def measured_elsewhere(folder: Path, windows: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    argv = [sys.executable, __file__, "--measure", str(folder), "--windows", str(windows)]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.splitlines()[-1])


def row(exponent: int, layout: str, found: dict[str, float], base: dict | None) -> list[str]:
    amplification = found["bytes_per_window"] / (WINDOW * 2)
    vs = (lambda key: f" ({found[key] / base[key]:.2f}x)" if base else "")  # noqa: E731
    return [f"10^{exponent}", layout, f"{found['open_s']:.3f}{vs('open_s')}",
            f"{found['rss_mb']:.1f}{vs('rss_mb')}", f"{found['bytes_per_window'] / 1e3:,.1f}",
            f"{amplification:.2f}x", f"{found['tokens_per_s'] / 1e6:.2f}{vs('tokens_per_s')}"]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--documents", type=int, nargs="+", default=[4, 5, 6, 7, 8])
    parser.add_argument("--legacy-up-to", type=int, default=7, help="the baseline's largest")
    parser.add_argument("--windows", type=int, default=300)
    parser.add_argument("--work", type=Path, default=Path("/tmp/kiln-cache-open"))
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure, args.windows)))
        return 0
    rows = []
    for exponent in args.documents:
        found = {}
        for layout in ("format 3", "format 4"):
            legacy = layout == "format 3"
            if legacy and exponent > args.legacy_up_to:
                continue
            folder = args.work / f"{layout.replace(' ', '')}-1e{exponent}"
            shutil.rmtree(folder, ignore_errors=True)
            started = time.perf_counter()
            synthesise(folder, 10**exponent, legacy)
            print(f"synthesised {folder} in {time.perf_counter() - started:.0f} s", file=sys.stderr)
            found[layout] = measured_elsewhere(folder, args.windows)
            rows.append(row(exponent, layout, found[layout], None if legacy else found.get("format 3")))
            shutil.rmtree(folder)
    print(f"{platform.node()}, {os.cpu_count()} CPUs; windows of {WINDOW} uint16 tokens "
          f"({WINDOW * 2 / 1e3:.1f} kB); format 4's ratios are against format 3 of the same count")  # fmt: skip
    print(markdown_table(["documents", "layout", "open s", "open peak RSS MB",
                          "kB read per window", "read amplification", "read M tokens/s"], rows))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
