"""The reference side of the Levanter import tests: caches written, and read back, by Levanter's
own code (marin-levanter from PyPI, the `levanter-tests` resolve), never by an imitation.

Runs as its own process, the entry point of a PEX that the tests run: `python levanter.pex
JOBS.json`. JOBS.json is a list; each job is one of

  {"kind": "consolidated", "docs": [JSONL, ...], "tokenizer": DIR, "out": SPLIT_DIR,
   "enforce_eos": true}
      Levanter's `build_lm_dataset_cache` over `UrlDatasetSourceConfig(train_urls=docs)`: the
      consolidated layout (shard_ledger.json beside input_ids/), as `build_or_load_cache` writes
      it, tokenizer metadata in the ledger.
  {"kind": "sharded", "docs": [JSONL, ...], "tokenizer": DIR, "out": SPLIT_DIR}
      The sharded layout as Marin's `tokenize` step writes it (marin/processing/tokenize:
      store_builder.build_from_datasets): each JSONL file one part, its documents framed by
      Levanter's BatchTokenizer with the long-string workaround Marin turns on
      (_core.text_preprocessor), written by Levanter's `write_levanter_cache` to
      `part-NNNNN-of-MMMMM/`, then `consolidate_shard_cache_ledgers` writes the split's ledger
      (`layout: sharded`, no tokenizer metadata). marin-core itself installs only with
      `--no-deps`, which a lockfile cannot express; these are the Levanter functions it calls.

Every job then reads its cache back with Levanter's reader (`TreeCache.load`) into
`{out}.ids.npz` (`ids`: every row's ids concatenated, `lengths`: each row's length) and prints
one JSON line: the ledger and the arrays' dtype.

A chat job runs Levanter's chat processor and reads a Kiln chat cache with Levanter's reader:

  {"kind": "chat", "docs": JSONL, "tokenizer": DIR, "chat_template": TEMPLATE,
   "kiln_shard": SHARD_DIR, "out": PREFIX}
      Levanter's `ChatProcessor` (ChatLmDatasetFormat's, mask_user_turns) over the documents'
      `messages` into `{out}.levanter.npz`; Kiln's shard folder read by Levanter's
      `JaggedArrayStore` (its ids, and its `assistant_masks` field) into `{out}.kiln.npz`. Each
      npz: `input_ids` and `assistant_masks` concatenated, `lengths` per row.

A job may also read caches written before it, as training does:

  {"kind": "train_windows", "caches": {NAME: SPLIT_DIR, ...}, "weights": {NAME: W, ...},
   "tokenizer": DIR, "seq_len": L, "seed": S, "batch_size": B, "steps": N, "out": NPY}
      The token windows of each step's batch, [N, B, L] into NPY: the data key as
      `levanter.main.train_lm` derives it from `trainer.seed`, then `LmDataConfig.train_mixture`
      with Levanter's data defaults (block shuffle, mixture blocks, restart at the end), step s
      reading the indices its `BatchSchedule` gives.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import haliax  # pants: no-infer-dep (haliax and jax come with marin-levanter)
import jax  # pants: no-infer-dep
import numpy as np  # pants: no-infer-dep (numpy comes with marin-levanter)
from levanter.data.text._batch_tokenizer import BatchTokenizer
from levanter.data.text.cache import build_lm_dataset_cache
from levanter.data.text.datasets import DatasetComponent, LmDataConfig, UrlDatasetSourceConfig
from levanter.data.text.formats import ChatProcessor, TextLmDatasetFormat
from levanter.schedule import BatchSchedule
from levanter.store.cache import TreeCache, consolidate_shard_cache_ledgers, write_levanter_cache
from levanter.store.jagged_array import JaggedArrayStore
from levanter.tokenizers import load_tokenizer

EXEMPLAR = {"input_ids": np.zeros(1, np.int64)}


def consolidated(job: dict[str, Any]) -> None:
    tokenizer = load_tokenizer(job["tokenizer"])
    source = UrlDatasetSourceConfig(train_urls=job["docs"], validation_urls=[])
    build_lm_dataset_cache(
        job["out"],
        source.get_shard_source("train"),
        TextLmDatasetFormat(),
        tokenizer,
        enforce_eos=job.get("enforce_eos", True),
    )


def sharded(job: dict[str, Any]) -> None:
    tokenizer = load_tokenizer(job["tokenizer"])
    processor = BatchTokenizer(tokenizer, enforce_bos=True, enforce_eos=True)
    processor._long_string_workaround = True  # as Marin's text_preprocessor sets it
    parts = []
    for index, docs in enumerate(job["docs"]):
        texts = [json.loads(line) for line in Path(docs).read_text().splitlines() if line.strip()]
        part = f"{job['out']}/part-{index:05d}-of-{len(job['docs']):05d}"
        write_levanter_cache(iter(processor(texts)), part, metadata={})
        parts.append(part)
    consolidate_shard_cache_ledgers(parts, job["out"], exemplar=EXEMPLAR)


def train_windows(job: dict[str, Any]) -> None:
    jax.config.update("jax_threefry_partitionable", True)  # levanter.trainer.DEFAULT_JAX_CONFIG
    # levanter.main.train_lm: data_key, loader_key, model_key, training_key = split(PRNGKey(seed), 4)
    data_key = jax.random.split(jax.random.PRNGKey(job["seed"]), 4)[0]
    components = {
        name: DatasetComponent(cache_dir=path, flat_cache=True, format=TextLmDatasetFormat())
        for name, path in job["caches"].items()
    }
    config = LmDataConfig(
        tokenizer=job["tokenizer"], components=components, train_weights=job["weights"],
        auto_build_caches=False,
    )  # fmt: skip
    schedule = BatchSchedule(job["batch_size"])
    position = haliax.Axis("position", job["seq_len"])
    mixture = config.train_mixture(position, schedule, key=data_key).as_sync_dataset()
    steps = [
        np.stack([np.asarray(example.tokens) for example in
                  mixture.get_batch(list(schedule.batch_indices_at_step(step)))])
        for step in range(job["steps"])
    ]  # fmt: skip
    np.save(job["out"], np.stack(steps))


def chat(job: dict[str, Any]) -> None:
    tokenizer = load_tokenizer(job["tokenizer"])
    processor = ChatProcessor(tokenizer, chat_template=job["chat_template"], system_prompt_field=None)
    records = [json.loads(line) for line in Path(job["docs"]).read_text().splitlines() if line.strip()]
    rows = processor(records)
    save_rows(f"{job['out']}.levanter.npz", [r["input_ids"] for r in rows],
              [r["assistant_masks"] for r in rows])  # fmt: skip
    ids = JaggedArrayStore.open(job["kiln_shard"], mode="r", dtype=np.uint16)
    masks = JaggedArrayStore.open(f"{job['kiln_shard']}/assistant_masks", mode="r", dtype=np.uint8)
    every = list(range(ids.num_rows))
    save_rows(f"{job['out']}.kiln.npz", ids.get_batch_sync(every), masks.get_batch_sync(every))


def save_rows(path: str, ids: list[np.ndarray], masks: list[np.ndarray]) -> None:
    np.savez(
        path,
        input_ids=np.concatenate(ids).astype(np.int64),
        assistant_masks=np.concatenate(masks).astype(np.int64),
        lengths=np.array([len(row) for row in ids], np.int64),
    )


def read_back(job: dict[str, Any]) -> dict[str, Any]:
    cache = TreeCache.load(job["out"], EXEMPLAR)
    rows = cache.get_batch_sync(list(range(len(cache))))
    ids = [np.asarray(row["input_ids"]) for row in rows]
    np.savez(
        f"{job['out']}.ids.npz",
        ids=np.concatenate(ids),
        lengths=np.array([len(row) for row in ids], np.int64),
    )
    ledger = json.loads(Path(job["out"], "shard_ledger.json").read_text())
    return {"out": job["out"], "ledger": ledger, "dtype": str(ids[0].dtype)}


def main(jobs_file: str) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    writers = {"consolidated": consolidated, "sharded": sharded}
    for job in json.loads(Path(jobs_file).read_text()):
        if job["kind"] in ("train_windows", "chat"):
            {"train_windows": train_windows, "chat": chat}[job["kind"]](job)
            continue
        writers[job["kind"]](job)
        print(json.dumps(read_back(job)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
