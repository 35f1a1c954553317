"""Token caches in S3 and GCS buckets (servers on loopback): records through the object store,
arrays through TensorStore's s3 / gcs kvstore drivers; read back equal to the local cache.
Store-mode caches built straight into a bucket by `python -m kiln.data.tokenize shard` / `merge`
as the Pants backend runs them: equal to the local build, resumed shard by shard."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from kiln_testing.buckets import ENDPOINT_VARIABLES, BucketGate, fresh_url
from kiln_testing.data import make_spec, write_corpus

from kiln.artifacts.content import copy_folder_into
from kiln.artifacts.locations import open_store
from kiln.data import tokenize
from kiln.data.cache import CacheNotReady, TokenCache
from kiln.data.errors import CacheDamaged
from kiln.data.tokenize import build_cache

RECORD = {"kind": "tokenized_cache", "name": "tokenized/test", "version": "2026.11.29"}


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("spec")
    write_corpus(folder / "corpus")
    source = {"kind": "files", "paths": [str(folder / "corpus" / "*.jsonl")]}
    (folder / "spec.json").write_text(json.dumps(make_spec(source, num_shards=2)))
    (folder / "artifact.json").write_text(json.dumps(RECORD))
    return folder / "spec.json"


@pytest.fixture(scope="module")
def local_cache(spec_file: Path) -> Path:
    return build_cache(json.loads(spec_file.read_text()), spec_file.parent / "cache")


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_a_cache_in_a_bucket_reads_as_the_local_one(
    scheme: str, local_cache: Path, request: pytest.FixtureRequest
) -> None:
    request.getfixturevalue({"s3": "s3_server", "gs": "gcs_server"}[scheme])
    url = fresh_url(scheme)
    copy_folder_into(open_store(url), "", local_cache)
    local, remote = TokenCache.open(local_cache), TokenCache.open(url)
    assert remote.store.kvstore("shards")["driver"] == {"s3": "s3", "gs": "gcs"}[scheme]
    assert (remote.num_documents, remote.num_tokens) == (local.num_documents, local.num_tokens)
    seq_len = 37  # windows that straddle documents and the shard boundary
    indices = list(range(local.num_windows(seq_len)))
    for field in ("tokens", "segment_ids", "loss_mask"):
        expected = getattr(local.windows(indices, seq_len), field)
        assert np.array_equal(getattr(remote.windows(indices, seq_len), field), expected)
    assert remote.document(3).tolist() == local.document(3).tolist()
    assert np.array_equal(remote.token_byte_lengths, local.token_byte_lengths)


def test_a_bucket_cache_is_checked_like_a_local_one(s3_server: str, local_cache: Path) -> None:
    url = fresh_url("s3")
    store = open_store(url)
    with pytest.raises(CacheNotReady, match=rf"^{url} is not a finished token cache"):
        TokenCache.open(url)
    copy_folder_into(store, "", local_cache)
    chunk = next(
        p.relative_to(local_cache).as_posix()
        for p in sorted((local_cache / "shards").rglob("*"))
        if p.is_file() and "/data/c/" in p.as_posix()
    )
    store.delete(chunk, generation=store.read(chunk).generation)
    with pytest.raises(
        CacheDamaged, match=rf"at {url}: shard shard-0000\d, file data/c/\S+ is missing"
    ):
        TokenCache.open(url)


def shard(spec_file: Path, url: str, index: int) -> int:
    """A shard process as the Pants backend runs it for a bucket prefix (kiln_pants.tokenize_rules)."""
    out = f"{url}/shards/shard-{index:05d}"
    return tokenize.main(["shard", str(spec_file), "--index", str(index), "--out", out,
                          "--unless-built", url])  # fmt: skip


def merge(spec_file: Path, url: str) -> int:
    shards = [f"{url}/shards/shard-{index:05d}" for index in range(2)]
    record = spec_file.parent / "artifact.json"
    return tokenize.main(["merge", str(spec_file), "--shards", *shards, "--out", url,
                          "--record", str(record)])  # fmt: skip


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_a_store_cache_is_built_in_a_bucket_shard_by_shard(
    scheme: str, spec_file: Path, local_cache: Path, request: pytest.FixtureRequest, capsys
) -> None:
    request.getfixturevalue({"s3": "s3_server", "gs": "gcs_server"}[scheme])
    url = fresh_url(scheme)
    store = open_store(url)
    assert [shard(spec_file, url, index) for index in range(2)] == [0, 0]
    # An upload cut off before its STATUS: the shard is incomplete, with a stale object.
    store.remove("shards/shard-00001/STATUS")
    store.write("shards/shard-00001/data/c/9", b"left by a killed upload")
    assert merge(spec_file, url) == 2
    assert f"{url}/shards/shard-00001: the shard is incomplete" in capsys.readouterr().err
    assert [shard(spec_file, url, index) for index in range(2)] == [0, 0]  # resumes
    resumed = capsys.readouterr().err
    assert f"shard 0 is already at {url}/shards/shard-00000" in resumed
    assert f"shard 1 written to {url}/shards/shard-00001" in resumed
    assert "shards/shard-00001/data/c/9" not in store.keys("")
    assert merge(spec_file, url) == 0
    assert [shard(spec_file, url, 0), merge(spec_file, url)] == [0, 0]  # a rerun: no work
    assert capsys.readouterr().err.count(f"already built at {url}") == 2

    assert not [key for key in store.keys("") if key.endswith(".lease")]
    assert store.read("STATUS").data == b"SUCCESS\n"
    assert json.loads(store.read("artifact.json").data) == RECORD
    for name in ("ledger.json", "cache.json", "stats.json", "token_byte_lengths.npy"):
        assert store.read(name).data == (local_cache / name).read_bytes(), name
    local, remote = TokenCache.open(local_cache), TokenCache.open(url)
    seq_len = 37
    indices = list(range(local.num_windows(seq_len)))
    expected, got = local.windows(indices, seq_len), remote.windows(indices, seq_len)
    assert np.array_equal(got.tokens, expected.tokens)
    assert np.array_equal(got.segment_ids, expected.segment_ids)


def test_a_denied_or_missing_bucket_fails_before_tokenizing(
    s3_server: str, spec_file: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    url = fresh_url("s3")
    gate = BucketGate(s3_server, deny_writes=True)
    monkeypatch.setenv(ENDPOINT_VARIABLES["s3"], gate.endpoint)
    try:
        assert shard(spec_file, url, 0) == 4
    finally:
        gate.close()
    lines = capsys.readouterr().err.strip().splitlines()
    parent, _, version = url.rpartition("/")
    # The first write: the cache's lease, under which the shard leaves its build hold.
    assert lines[-1].startswith(f"error: {parent}/.{version}.lease: access denied")
    assert not [line for line in lines if " documents, " in line]  # nothing tokenized
    monkeypatch.setenv(ENDPOINT_VARIABLES["s3"], s3_server)
    assert open_store(url).keys("") == []
    missing = "s3://kiln-no-such-bucket/tokenized/test/2026.11.29"
    assert merge(spec_file, missing) == 4
    error = capsys.readouterr().err
    assert f"error: {missing}: the bucket kiln-no-such-bucket does not exist" in error
