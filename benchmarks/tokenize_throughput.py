"""Tokenization throughput: the whole cache pipeline vs raw `tokenizers` encode_batch, per core.

    PYTHONPATH=src/python python benchmarks/tokenize.py [--tokenizer gpt2 stdlib-8k] [--repeat 2]

Text: the Python stdlib corpus (docstrings + pydoc topics, train split), written as 8 jsonl files.
"raw" encodes those texts with the Rust tokenizer's encode_batch (batches of 1000); "pipeline" is
`tokenize_shard` (read jsonl -> tokenize -> frame -> write zarr3 shard). Both run in 1 and in 2
parallel processes (each on its share: a 1/n slice of the texts, or one of n shards), timed inside
each worker; every process is single-threaded (TOKENIZERS_PARALLELISM=false), so pipeline/raw at
equal process counts is the per-core ratio, with the same CPU contention on both sides.
The goal is pipeline/raw >= 0.8.
"""

from __future__ import annotations

import os

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before tokenizers loads, here and in workers
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import platform  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from kiln.data import stdlib_corpus  # noqa: E402
from kiln.data.spec import parse_cache_spec  # noqa: E402
from kiln.data.tokenize import ENCODE_BATCH_DOCUMENTS, tokenize_shard  # noqa: E402
from kiln.data.tokenizer import load_tokenizer  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKENIZERS = {
    "gpt2": {"kind": "package", "name": "gpt2"},
    "stdlib-8k": {
        "kind": "local",
        "path": str(REPO_ROOT / "experiments/tokenizers/kiln-stdlib-8k"),
    },
}
CORPUS_FILES = 8


def write_corpus(folder: Path) -> list[str]:
    texts = [
        doc.text
        for unit in stdlib_corpus.units("all")
        for doc in stdlib_corpus.documents(unit.key, "train")
    ]
    for index in range(CORPUS_FILES):
        lines = (json.dumps({"text": t}) + "\n" for t in texts[index::CORPUS_FILES])
        (folder / f"part-{index}.jsonl").write_text("".join(lines))
    return texts


def timed_raw(tokenizer_spec: dict[str, Any], texts: list[str]) -> tuple[int, float]:
    backend = load_tokenizer(tokenizer_spec).hf_tokenizer.backend_tokenizer
    started = time.perf_counter()
    tokens = 0
    for start in range(0, len(texts), ENCODE_BATCH_DOCUMENTS):
        batch = texts[start : start + ENCODE_BATCH_DOCUMENTS]
        tokens += sum(len(e.ids) for e in backend.encode_batch(batch, add_special_tokens=False))
    return tokens, time.perf_counter() - started


def timed_shard(spec: dict[str, Any], index: int, out_dir: str) -> tuple[int, float]:
    parsed = parse_cache_spec(spec)
    tokenizer = load_tokenizer(parsed.tokenizer)  # loading is set-up, not throughput
    started = time.perf_counter()
    record = tokenize_shard(parsed, index, Path(out_dir), tokenizer)
    return record["tokens"], time.perf_counter() - started


def in_parallel(function, jobs: list[tuple]) -> float:
    """Total tokens / slowest worker's seconds, one spawned process per job."""
    with multiprocessing.get_context("spawn").Pool(len(jobs)) as pool:
        results = pool.starmap(function, jobs)
    return sum(tokens for tokens, _ in results) / max(seconds for _, seconds in results)


def measure(
    spec: dict[str, Any], texts: list[str], processes: int, work: Path
) -> tuple[float, float]:
    """(raw, pipeline) tokens/s with `processes` workers, each on its share of the same text."""
    tokenizer = spec["config"]["tokenizer"]
    raw = in_parallel(timed_raw, [(tokenizer, texts[i::processes]) for i in range(processes)])
    spec = {**spec, "config": {**spec["config"], "num_shards": processes}}
    shards = [(spec, i, str(work / f"p{processes}-s{i}")) for i in range(processes)]
    return raw, in_parallel(timed_shard, shards)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--tokenizer", nargs="+", choices=sorted(TOKENIZERS), default=sorted(TOKENIZERS)
    )
    parser.add_argument("--repeat", type=int, default=2, help="best of N runs per cell")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as folder:
        work = Path(folder)
        texts = write_corpus(work)
        megabytes = sum(len(t.encode()) for t in texts) / 1e6
        print(
            f"corpus: {len(texts)} documents, {megabytes:.1f} MB; CPython {platform.python_version()}, "
            f"{os.cpu_count()} CPUs"
        )
        print(
            f"{'tokenizer':<10} {'processes':>9} {'raw tok/s':>11} {'pipeline tok/s':>15} "
            f"{'pipeline/raw':>14}"
        )
        for name in args.tokenizer:
            spec = {
                "spec_version": 1,
                "kind": "tokenized_cache",
                "name": "bench",
                "version": "dev",
                "fingerprint": "bench",
                "config": {
                    "source": {"kind": "files", "paths": [str(work / "*.jsonl")]},
                    "tokenizer": TOKENIZERS[name],
                },
            }
            for processes in (1, 2):
                runs = [
                    measure(spec, texts, processes, work / f"{name}-{r}")
                    for r in range(args.repeat)
                ]
                raw, pipeline = max(r for r, _ in runs), max(p for _, p in runs)
                ratio = pipeline / raw
                print(f"{name:<10} {processes:>9} {raw:>11,.0f} {pipeline:>15,.0f} {ratio:>14.2f}")


if __name__ == "__main__":
    main()
