"""End to end: a Hugging Face dataset through real ./pants, from a Hub API server on loopback
(kiln_testing.hub_server) that HF_ENDPOINT points at. HF_ENDPOINT and HF_TOKEN, set where
./pants runs, reach the tokenize process and never its cache key: a gated dataset builds with
one token and, with another, is served from Pants' cache. (Its refusals without a token are
tested on the tokenize command itself: tests/python/kiln/data/test_hub_sources.py.) Both calls go
through one pantsd (the e2e tests' shared one, conftest.py), as a user's do: the settings it
hands the processes follow each call's environment."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from pathlib import Path

from kiln_testing.hub_server import HubDataset, HubServer

# A commit of this run's own: Pants' cache on this machine may hold an earlier run's process.
PINNED = secrets.token_hex(20)
TOKENS = ("hf_e2e_first_token_0123", "hf_e2e_second_token_4567")
TOKENIZING = "Tokenizing tokenized/hub_prose@2026.12.01"
BUILD = f"""
tokenized_cache(
    name="prose",
    artifact_name="tokenized/hub_prose",
    source="kiln-test/prose",
    revision="{PINNED}",
    split="train",
    tokenizer="//experiments/tokenizers:kiln-stdlib-8k",
    version="2026.12.01",
)
"""


def jsonl(texts: list[str]) -> bytes:
    return "".join(json.dumps({"text": text}) + "\n" for text in texts).encode()


def pants(repo: Path, endpoint: str, token: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env["HF_ENDPOINT"] = endpoint
    if token is not None:
        env["HF_TOKEN"] = token
    return subprocess.run(
        ["./pants", "package", "hubdata:prose"],
        cwd=repo, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip


def test_a_gated_hub_cache_built_with_one_token_is_served_with_another(workspace: Path) -> None:
    repo = workspace
    (repo / "hubdata").mkdir()
    (repo / "hubdata/BUILD").write_text(BUILD)
    files = {f"data/train-{i:05d}-of-00002.jsonl": jsonl([f"document {i}.{j} of the hub" for j in range(5)])
             for i in range(2)}  # fmt: skip
    with HubServer() as hub:
        hub.add(HubDataset("kiln-test/prose", {PINNED: files}, granted_tokens=TOKENS))
        first = pants(repo, hub.endpoint, TOKENS[0])
        assert first.returncode == 0, first.stderr[-3000:]
        assert TOKENIZING in first.stderr
        assert f"Bearer {TOKENS[0]}" in {r.authorization for r in hub.requests}

        second = pants(repo, hub.endpoint, TOKENS[1])
        assert second.returncode == 0, second.stderr[-3000:]
        # The same processes (a token in one would make it another, run again): served.
        assert TOKENIZING not in second.stderr and "Merging" not in second.stderr
    cache = repo / "dist/tokenized/hub_prose/2026.12.01"
    assert (cache / "STATUS").read_text().strip() == "SUCCESS"
    for path in cache.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert not any(token.encode() in data for token in TOKENS), path
