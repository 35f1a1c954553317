"""The hub path for real: `python -m kiln.data.tokenize` reads Hugging Face datasets through the
real `huggingface_hub` client from a Hub API server on loopback (kiln_testing.hub_server),
pointed at by HF_ENDPOINT: the file list at a pinned revision, page after page; the files at
that revision; gated, missing and private datasets and unknown revisions as one line each; and
HF_TOKEN reaches the hub but no file of the cache.

Each command is a subprocess, as Pants runs it: huggingface_hub reads HF_ENDPOINT and the
offline switches once, at import, and this test process is offline (conftest.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from kiln_testing.data import STDLIB_TOKENIZER, sample_texts
from kiln_testing.hub_server import PAGE_SIZE, HubDataset, HubServer
from kiln_testing.processes import python_env

import kiln.data.tokenize  # noqa: F401 (the entry point the subprocesses run)
from kiln.data.cache import TokenCache

PINNED = "0a" * 20  # the revision the cache pins
NEWER = "0b" * 20  # main moved on: other files, other contents
GRANTED = "hf_granted_0123456789"
OTHER_GRANTED = "hf_also_granted_9876543210"


def jsonl(texts: list[str]) -> bytes:
    return "".join(json.dumps({"text": text}) + "\n" for text in texts).encode()


def pinned_files() -> dict[str, bytes]:
    files = {f"data/train-{i:05d}-of-00005.jsonl": jsonl(sample_texts(4 + i, seed=i)) for i in range(5)}
    return {**files, "data/validation-00000-of-00001.jsonl": jsonl(["held out"]), "README.md": b"# card\n"}


@pytest.fixture(scope="module")
def hub():
    with HubServer() as server:
        newer = {path: data + jsonl(["added later"]) for path, data in pinned_files().items()}
        server.add(HubDataset("kiln-test/prose", {PINNED: pinned_files(), NEWER: newer},
                              branches={"main": NEWER}))  # fmt: skip
        server.add(HubDataset("kiln-test/gated", {PINNED: pinned_files()},
                              granted_tokens=(GRANTED, OTHER_GRANTED)))  # fmt: skip
        yield server


def hub_spec(dataset: str, revision: str = PINNED, num_shards: int = 2) -> dict:
    return {
        "spec_version": 1, "kind": "tokenized_cache", "name": "tokenized/hub", "version": "2026.12.01",
        "fingerprint": "hubfp1",
        "config": {"source": {"kind": "hf", "id": dataset, "split": "train", "revision": revision},
                   "tokenizer": STDLIB_TOKENIZER, "num_shards": num_shards},
    }  # fmt: skip


def tokenize(
    hub: HubServer, tmp_path: Path, spec: dict, *args: str, token: str | None = None
) -> subprocess.CompletedProcess[str]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    env = python_env(HF_ENDPOINT=hub.endpoint, HF_HOME=str(tmp_path / "hf-home"))
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_TOKEN"):
        env.pop(name, None)
    if token is not None:
        env["HF_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "kiln.data.tokenize", args[0], str(spec_file), *args[1:]],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


def plan_error(result: subprocess.CompletedProcess[str]) -> str:
    """`plan --json` says why a spec has no plan in its line, `{"error": WHY}`, and goes on to
    the next spec (`pants plan` prints WHY under the cache)."""
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = result.stdout.splitlines()
    return str(json.loads(line)["error"])


def test_a_hub_dataset_is_read_at_its_pinned_revision_page_by_page(hub, tmp_path) -> None:
    plan = tokenize(hub, tmp_path, hub_spec("kiln-test/prose"), "plan", "--json")
    assert plan.returncode == 0, plan.stderr[-3000:]
    planned = {path: size for shard in json.loads(plan.stdout) for path, size in shard["files"].items()}
    train = {p: len(d) for p, d in pinned_files().items() if "train-" in p}
    assert planned == train  # the pinned files and sizes, not main's
    listings = [r.path for r in hub.requests if "/tree/" in r.path and PINNED in r.path]
    assert len(listings) >= -(-len(pinned_files()) // PAGE_SIZE)  # every page was read
    assert any("cursor=" in path for path in listings)
    built = tokenize(hub, tmp_path, hub_spec("kiln-test/prose"), "build", "--out", str(tmp_path / "c"))
    assert built.returncode == 0, built.stderr[-3000:]
    cache = TokenCache.open(tmp_path / "c")
    assert cache.num_documents == sum(4 + i for i in range(5))  # no "added later"
    downloads = {r.path for r in hub.requests if "/resolve/" in r.path}
    assert downloads and all(f"/resolve/{PINNED}/" in path for path in downloads)


def test_gated_missing_and_unknown_revisions_fail_in_one_line(hub, tmp_path) -> None:
    gated = hub_spec("kiln-test/gated")
    line = plan_error(tokenize(hub, tmp_path, gated, "plan", "--json"))
    assert "'kiln-test/gated' is gated: accept its terms" in line
    assert "set HF_TOKEN" in line and "(HF_TOKEN is not set)" in line
    line = plan_error(tokenize(hub, tmp_path, gated, "plan", "--json", token="hf_no_access"))
    assert "(HF_TOKEN is set, but that token has no access)" in line
    line = plan_error(tokenize(hub, tmp_path, hub_spec("kiln-test/absent"), "plan", "--json"))
    assert "'kiln-test/absent' does not exist, or is private: check the id" in line
    line = plan_error(tokenize(hub, tmp_path, hub_spec("kiln-test/prose", "0c" * 20), "plan", "--json"))
    assert f"has no revision '{'0c' * 20}': check the target's `revision` field" in line
    shard = ["shard", "--index", "0", "--out", str(tmp_path / "s")]
    assert "is gated" in error_line(tokenize(hub, tmp_path, gated, *shard))
    assert not (tmp_path / "s" / "STATUS").exists()


def test_hf_token_reaches_the_hub_and_no_file_of_the_cache(hub, tmp_path) -> None:
    outs = []
    for token in (GRANTED, OTHER_GRANTED):
        out = tmp_path / f"cache-{token[-4:]}"
        built = tokenize(hub, tmp_path / token[-4:], hub_spec("kiln-test/gated", num_shards=1),
                         "build", "--out", str(out), token=token)  # fmt: skip
        assert built.returncode == 0, built.stderr[-3000:]
        assert f"Bearer {token}" in {r.authorization for r in hub.requests}
        assert token not in built.stderr + built.stdout
        outs.append(out)
    files = [sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file()) for out in outs]
    assert files[0] == files[1]
    for path in files[0]:  # two tokens, the same cache byte for byte, and neither in it
        first, second = ((out / path).read_bytes() for out in outs)
        assert first == second, path
        assert GRANTED.encode() not in first and OTHER_GRANTED.encode() not in first
