"""Tokenization at scale: the cache build's shard processes vs raw `encode_batch_fast`, per core.

    ./pants run benchmarks/tokenize_throughput.py -- [--gigabytes 1] [--shards 1 2 4]

Corpus: `--gigabytes` of document text as `jsonl.zst` files of `--file-megabytes` of text each
(DCLM ships its shards as such files), generated once into `--work` and reused: documents of 2-24
paragraphs drawn at random (seed 0) from the Python stdlib corpus (kiln.data.stdlib_corpus).

For each shard count n, in this order:
- "raw": n processes, each loads up to `--raw-megabytes` of the text shard i reads, then (all at
  once, behind a barrier) encodes it with the Rust tokenizer's `encode_batch_fast` in batches of
  1000 documents, as the pipeline does; timed inside each worker.
- "pipeline": the build's own shard processes, n at once: `python -m kiln.data.tokenize shard
  SPEC --index i --out DIR` (read zst -> decode JSON -> tokenize -> frame -> write the zarr3
  shard), timed from the first start to the last exit (interpreter start and imports included);
  then `merge` into a cache (full digests checked), timed on its own.
Every process is single-threaded (TOKENIZERS_PARALLELISM=false). The rate per core is tokens per
CPU-second those processes used (on a machine shared with other jobs a process gets less than a
core); pipeline/raw compares those rates (goal >= 0.8). Wall-clock tokens/s, "vs 1 shard" and the
average number of cores the shard processes kept busy show the scaling, which cannot pass the
CPUs present: 4 shards on 2 cores run 2 at a time.

The first cache built is read through the training mixture (benchmarks/mixture_read.py) before
the next shard count runs.
"""

from __future__ import annotations

import os

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before tokenizers loads, here and in workers
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import mixture_read  # noqa: E402
import zstandard  # noqa: E402
from report_table import markdown_table  # noqa: E402

from kiln.data import sources, stdlib_corpus  # noqa: E402
from kiln.data.cache_writer import read_shard_record  # noqa: E402
from kiln.data.spec import parse_cache_spec  # noqa: E402
from kiln.data.tokenize import ENCODE_BATCH_DOCUMENTS  # noqa: E402
from kiln.data.tokenizer import load_tokenizer  # noqa: E402
from kiln_contract.tokenize import shard_dir_name  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKENIZERS = {
    "gpt2": {"kind": "package", "name": "gpt2"},
    "stdlib-8k": {
        "kind": "local",
        "path": str(REPO_ROOT / "experiments/tokenizers/kiln-stdlib-8k"),
    },
}
CORPUS_SEED = 0
PARAGRAPHS_PER_DOCUMENT = (2, 24)
ZSTD_LEVEL = 3  # zstd's default; DCLM's files are zstd-compressed JSONL


# --- the corpus ----------------------------------------------------------------------------------


def corpus_files(work: Path, gigabytes: float, file_megabytes: int) -> list[Path]:
    """The generated corpus in work/corpus, written unless a corpus of these parameters is there."""
    folder = work / "corpus"
    manifest = {"gigabytes": gigabytes, "file_megabytes": file_megabytes, "seed": CORPUS_SEED,
                "python": platform.python_version()}  # fmt: skip
    manifest_file = folder / "corpus.json"
    if manifest_file.exists() and json.loads(manifest_file.read_text()) == manifest:
        return sorted(folder.glob("*.jsonl.zst"))
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    paragraphs = stdlib_paragraphs()
    rng = random.Random(CORPUS_SEED)
    file_bytes = file_megabytes * 1_000_000
    for index in range(max(1, round(gigabytes * 1000 / file_megabytes))):
        write_zst_file(folder / f"part-{index:05d}.jsonl.zst", paragraphs, rng, file_bytes)
    manifest_file.write_text(json.dumps(manifest))  # last: a complete corpus
    return sorted(folder.glob("*.jsonl.zst"))


def stdlib_paragraphs() -> list[str]:
    texts = (
        doc.text
        for unit in stdlib_corpus.units("all")
        for doc in stdlib_corpus.documents(unit.key, "train")
    )
    return [p for text in texts for p in text.split("\n\n") if p.strip()]


def write_zst_file(path: Path, paragraphs: list[str], rng: random.Random, text_bytes: int) -> None:
    written = 0
    with zstandard.ZstdCompressor(level=ZSTD_LEVEL).stream_writer(open(path, "wb")) as out:
        while written < text_bytes:
            lines = []
            for _ in range(1000):
                text = "\n\n".join(rng.choices(paragraphs, k=rng.randint(*PARAGRAPHS_PER_DOCUMENT)))
                lines.append(json.dumps({"text": text}) + "\n")
                written += len(text.encode())
            out.write("".join(lines).encode())


# --- raw encode_batch_fast -----------------------------------------------------------------------


def raw_worker(spec_json: dict[str, Any], index: int, cap: int, barrier: Any, out: Any) -> None:
    spec = parse_cache_spec(spec_json)
    texts, size = [], 0
    for document in sources.shard_documents(spec.source, spec.text_key, spec.num_shards, index):
        texts.append(document.text)
        size += len(document.text)
        if size >= cap:
            break
    backend = load_tokenizer(spec.tokenizer).hf_tokenizer.backend_tokenizer
    barrier.wait()  # all workers encode at the same time, as the shards do
    started, cpu_started = time.perf_counter(), time.process_time()
    tokens = 0
    for start in range(0, len(texts), ENCODE_BATCH_DOCUMENTS):
        batch = texts[start : start + ENCODE_BATCH_DOCUMENTS]
        encoded = backend.encode_batch_fast(batch, add_special_tokens=False)
        tokens += sum(len(e.ids) for e in encoded)
    out.put((tokens, time.perf_counter() - started, time.process_time() - cpu_started))


@dataclass(frozen=True)
class Raw:
    tokens_per_second: float  # total tokens / the slowest worker's wall seconds
    tokens_per_cpu_second: float  # total tokens / the workers' CPU seconds: the per-core rate


def raw_encode(spec: dict[str, Any], raw_megabytes: int) -> Raw:
    """One process per shard, each on the start of the text its shard reads."""
    context = multiprocessing.get_context("spawn")
    processes = spec["config"]["num_shards"]
    barrier, results = context.Barrier(processes), context.Queue()
    workers = [
        context.Process(
            target=raw_worker, args=(spec, i, raw_megabytes * 1_000_000, barrier, results)
        )
        for i in range(processes)
    ]
    for worker in workers:
        worker.start()
    measured = [results.get() for _ in workers]
    for worker in workers:
        worker.join()
    tokens = sum(tokens for tokens, _, _ in measured)
    return Raw(
        tokens_per_second=tokens / max(seconds for _, seconds, _ in measured),
        tokens_per_cpu_second=tokens / sum(cpu for _, _, cpu in measured),
    )


# --- the build's shard and merge processes -------------------------------------------------------


@dataclass(frozen=True)
class Build:
    tokens: int
    documents: int
    text_bytes: int
    shard_seconds: float
    shard_cpu_seconds: float  # of the shard processes: interpreter start and imports included
    merge_seconds: float
    cache: Path


def run_tokenize(argv: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    with open(log, "ab") as output:
        return subprocess.Popen(
            [sys.executable, "-m", "kiln.data.tokenize", *argv], env=env, stderr=output
        )


def wait_all(processes: list[subprocess.Popen], log: Path) -> None:
    for process in processes:
        if process.wait() != 0:
            raise SystemExit(f"{process.args} exited {process.returncode}; see {log}")


def children_cpu_seconds() -> float:
    """User + system CPU seconds of this process's finished (waited-for) children."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def build_with_shard_processes(spec: dict[str, Any], folder: Path) -> Build:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    spec_file, log = folder / "spec.json", folder / "tokenize.log"
    spec_file.write_text(json.dumps(spec))
    shards = [folder / "shards" / shard_dir_name(i) for i in range(spec["config"]["num_shards"])]
    cpu_started, started = children_cpu_seconds(), time.perf_counter()
    command = ["shard", str(spec_file), "--index"]
    wait_all([run_tokenize([*command, str(i), "--out", str(s)], log) for i, s in enumerate(shards)],
             log)  # fmt: skip
    sharded, shard_cpu = time.perf_counter(), children_cpu_seconds() - cpu_started
    records = [read_shard_record(s) for s in shards]
    cache = folder / "cache"
    merge = ["merge", str(spec_file), "--shards", *map(str, shards), "--out", str(cache)]
    wait_all([run_tokenize(merge, log)], log)
    return Build(
        tokens=sum(r["tokens"] for r in records),
        documents=sum(r["documents"] for r in records),
        text_bytes=sum(r["text_bytes"] for r in records),
        shard_seconds=sharded - started,
        shard_cpu_seconds=shard_cpu,
        merge_seconds=time.perf_counter() - sharded,
        cache=cache,
    )


# --- the run -------------------------------------------------------------------------------------


def cache_spec(files: list[Path], tokenizer: str, num_shards: int) -> dict[str, Any]:
    return {
        "spec_version": 1,
        "kind": "tokenized_cache",
        "name": "tokbench",
        "version": "dev",
        "fingerprint": f"tokbench-{num_shards}",
        "config": {
            "source": {"kind": "files", "paths": [str(f) for f in files]},
            "tokenizer": TOKENIZERS[tokenizer],
            "num_shards": num_shards,
        },
    }


def throughput_table(measured: list[tuple[int, Raw, Build]]) -> str:
    """One row per shard count, in order. Per core: tokens per CPU-second (a shared machine
    gives each process less than a core); "vs 1 shard": wall tokens/s over the 1-shard row's."""
    single = {n: build.tokens / build.shard_seconds for n, _, build in measured}.get(1)
    rows = []
    for num_shards, raw, build in sorted(measured, key=lambda m: m[0]):
        per_core = build.tokens / build.shard_cpu_seconds
        pipeline = build.tokens / build.shard_seconds
        rows.append([num_shards, f"{build.tokens / 1e6:,.0f}M",
                     f"{raw.tokens_per_cpu_second / 1e3:,.0f}k", f"{per_core / 1e3:,.0f}k",
                     f"{per_core / raw.tokens_per_cpu_second:.2f}",
                     f"{raw.tokens_per_second / 1e3:,.0f}k", f"{pipeline / 1e3:,.0f}k",
                     f"{pipeline / single:.2f}" if single else "-",
                     f"{build.shard_cpu_seconds / build.shard_seconds:.2f}",
                     f"{build.shard_seconds:,.0f}", f"{build.merge_seconds:,.0f}"])  # fmt: skip
    header = ["shards (processes)", "tokens", "raw tok/CPU-s", "pipeline tok/CPU-s",
              "pipeline / raw", "raw tok/s", "pipeline tok/s", "vs 1 shard", "cores busy",
              "shard s", "merge s"]  # fmt: skip
    return markdown_table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gigabytes", type=float, default=1.0, help="of document text")
    parser.add_argument("--file-megabytes", type=int, default=64, help="of text per file")
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--raw-megabytes", type=int, default=48, help="of text per raw worker")
    parser.add_argument("--tokenizer", choices=sorted(TOKENIZERS), default="gpt2")
    parser.add_argument("--work", type=Path, default=Path("/tmp/kiln-tokbench"))
    mixture_read.add_arguments(parser)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    started = time.perf_counter()
    files = corpus_files(args.work, args.gigabytes, args.file_megabytes)
    stored = sum(f.stat().st_size for f in files) / 1e9
    print(f"corpus: {len(files)} files, {args.gigabytes:g} GB of text, {stored:.2f} GB as "
          f"jsonl.zst, made or found in {time.perf_counter() - started:.0f} s; "
          f"{args.tokenizer}; CPython {platform.python_version()}; {cores} CPUs; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    measured: list[tuple[int, Raw, Build]] = []
    for num_shards in args.shards:
        spec = cache_spec(files, args.tokenizer, num_shards)
        raw = raw_encode(spec, args.raw_megabytes)
        build = build_with_shard_processes(spec, args.work / f"build-{num_shards}")
        measured.append((num_shards, raw, build))
        print(f"{num_shards} shards done: {build.documents:,} documents, "
              f"{build.text_bytes / build.tokens:.2f} text bytes per token; load average "
              f"{os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
        print(throughput_table(measured), flush=True)
        if len(measured) == 1:  # read while the other builds wait: a short run still reads
            print(f"\nreading {build.cache} through the training mixture", flush=True)
            print(mixture_read.report(build.cache, args), flush=True)
    print(f"\ntotal {time.perf_counter() - started:,.0f} s; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")  # fmt: skip


if __name__ == "__main__":
    main()
