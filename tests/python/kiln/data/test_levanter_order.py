"""`data_order="levanter"` reads Levanter's windows, step for step: against Levanter's own
`LmDataConfig.train_mixture` (levanter_writer.py, marin-levanter from PyPI) on caches Levanter
wrote, for one cache and for a weighted mixture with a zero-weight entry, over several epochs
and mixture blocks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from kiln_testing.data import STDLIB_TOKENIZER, sample_texts, write_jsonl
from kiln_testing.levanter import import_spec, write_levanter_caches

from kiln.data.cache import TokenCache
from kiln.data.levanter_order import BlockShuffle, LevanterFeistel, levanter_keys
from kiln.data.mixture import MixtureDataset
from kiln.data.tokenize import build_cache

SEQ_LEN = 8
BATCH_SIZE = 32
STEPS = 100  # 3,200 sequences: two mixture blocks and part of a third, each cache read 3+ times
# Documents per cache: "a" holds several full blocks of 256 windows and a partial one, "b" one
# full block and a partial one (the block order is then the identity, the tail its own shuffle).
DOCUMENTS = {"a": 260, "b": 90}
MIXTURE = {"a": 0.7, "unread": 0.0, "b": 0.3}


def numbered_documents(count: int, seed: int) -> list[str]:
    """Documents that differ in their first words, so no two windows of the caches are alike."""
    return [f"{seed} {i} {text}" for i, text in enumerate(sample_texts(count, seed))]


@pytest.fixture(scope="module")
def levanter(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, TokenCache], Path]:
    """The caches as Kiln imports them, and the folder holding Levanter's windows."""
    root = tmp_path_factory.mktemp("levanter-order")
    tokenizer = STDLIB_TOKENIZER["path"]
    paths = {name: f"{root}/{name}/train" for name in DOCUMENTS}
    jobs: list[dict] = [
        {"kind": "consolidated", "tokenizer": tokenizer, "out": paths[name],
         "docs": [str(write_jsonl(root / f"{name}.jsonl", numbered_documents(n, seed)))]}
        for seed, (name, n) in enumerate(DOCUMENTS.items())
    ]  # fmt: skip
    runs = {
        "one": ({"a": paths["a"]}, {"a": 1.0}, 0),
        "mixture": ({**paths, "unread": paths["b"]}, MIXTURE, 3),
    }
    for run, (caches, weights, seed) in runs.items():
        jobs.append({
            "kind": "train_windows", "caches": {name: caches[name] for name in weights},
            "weights": weights, "tokenizer": tokenizer, "seq_len": SEQ_LEN, "seed": seed,
            "batch_size": BATCH_SIZE, "steps": STEPS, "out": f"{root}/{run}.npy",
        })  # fmt: skip
    write_levanter_caches(jobs, root)
    imported = {
        name: TokenCache.open(build_cache(import_spec(path), root / "kiln" / name))
        for name, path in paths.items()
    }
    return imported, root


def kiln_windows(components: list[tuple[TokenCache, float]], seed: int) -> np.ndarray:
    mixture = MixtureDataset(components, SEQ_LEN, seed, data_order="levanter")
    return np.stack([mixture.batch(step, BATCH_SIZE)["tokens"] for step in range(STEPS)])


def test_one_cache_reads_levanters_windows_every_epoch(levanter) -> None:
    caches, root = levanter
    blocks = {name: divmod(cache.num_windows(SEQ_LEN), 256) for name, cache in caches.items()}
    assert blocks["a"][0] >= 2 and blocks["b"][0] == 1 and blocks["a"][1] and blocks["b"][1]
    expected = np.load(root / "one.npy")
    assert expected.shape == (STEPS, BATCH_SIZE, SEQ_LEN)
    np.testing.assert_array_equal(kiln_windows([(caches["a"], 1.0)], seed=0), expected)


def test_a_weighted_mixture_reads_levanters_windows(levanter) -> None:
    caches, root = levanter
    components = [(caches["a"], MIXTURE["a"]), (caches["b"], 0.0), (caches["b"], MIXTURE["b"])]
    np.testing.assert_array_equal(kiln_windows(components, seed=3), np.load(root / "mixture.npy"))
    # Levanter's order is not Kiln's: the same seed reads other windows.
    kiln_order = MixtureDataset(components, SEQ_LEN, 3).batch(0, BATCH_SIZE)["tokens"]
    assert not np.array_equal(kiln_order, kiln_windows(components, seed=3)[0])


@pytest.mark.parametrize("length", [1, 2, 3, 255, 256, 257, 1000, 4099])
def test_levanters_permutations_are_bijections(length: int) -> None:
    (key,) = levanter_keys(seed=7, datasets=1)[1]
    indices = np.arange(length, dtype=np.int64)
    assert sorted(LevanterFeistel(length, key)(indices).tolist()) == list(range(length))
    assert sorted(BlockShuffle(length, key)(indices).tolist()) == list(range(length))
