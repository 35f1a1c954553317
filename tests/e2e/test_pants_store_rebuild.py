"""End to end: under a warm pantsd, a store-mode cache whose store was deleted is rebuilt in
order, every time: its shards first, then their merge.

Pants' daemon keeps each rule's result between sessions and, in a new session, "cleans" a rule
by requesting all of its previous dependencies at once: a merge requested that way started while
its shards were being tokenized again and failed (`no such shard folder`). The rules that run
store-mode processes in order are uncacheable (kiln_pants.tokenize_rules), and this test deletes
the cache's store and rebuilds five times through one daemon (the e2e tests' shared one,
conftest.py), with the smallest cache that has two shards. Without the uncacheable rules about
3 rebuilds in 11 fail: five find that race in four runs of five (1 - (8/11)^5).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

TINY = """
tokenized_cache(
    name="tiny",
    artifact_name="tokenized/tiny",
    sources=["texts/*.jsonl"],
    tokenizer="//experiments/tokenizers:kiln-stdlib-8k",
    version="2026.12.02",
    num_shards=2,
    storage="store",
)
"""
TARGET = "experiments/rebuild:tiny"
REBUILDS = 5


def pants(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["./pants", "--pantsd", *args], cwd=repo, capture_output=True, text=True, timeout=600
    )


@pytest.fixture()
def repo(workspace: Path) -> Path:
    folder = workspace / "experiments/rebuild"
    (folder / "texts").mkdir(parents=True)
    (folder / "BUILD").write_text(TINY)
    for name in ("a", "b"):
        lines = (json.dumps({"text": f"Text {i} of {name}."}) for i in range(3))
        (folder / f"texts/{name}.jsonl").write_text("\n".join(lines) + "\n")
    return workspace


def test_a_deleted_store_is_rebuilt_shards_first_under_a_warm_pantsd(repo: Path) -> None:
    cache = repo / "artifacts/tokenized/tiny/2026.12.02"
    for _ in range(3):  # a loaded machine can start pantsd slower than the client waits (60 s)
        if pants(repo, "list", TARGET).returncode == 0:
            break
    for attempt in range(1 + REBUILDS):
        built = pants(repo, "package", TARGET)
        assert built.returncode == 0, f"rebuild {attempt}:\n{built.stderr[-3000:]}"
        assert "Merging 2 shard(s) of tokenized/tiny@2026.12.02" in built.stderr, attempt
        assert (cache / "STATUS").read_text().strip() == "SUCCESS"
        assert json.loads((cache / "ledger.json").read_text())["documents"] == 6
        shutil.rmtree(repo / "artifacts/tokenized/tiny")  # the cache's whole store folder
