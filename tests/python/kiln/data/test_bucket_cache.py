"""Token caches in S3 and GCS buckets (servers on loopback): records through the object store,
arrays through TensorStore's s3 / gcs kvstore drivers; read back equal to the local cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from kiln_testing.buckets import fresh_url
from kiln_testing.data import make_spec, write_corpus

from kiln.artifacts.store import copy_folder_into, open_store
from kiln.data.cache import CacheNotReady, TokenCache
from kiln.data.errors import CacheDamaged
from kiln.data.tokenize import build_cache


@pytest.fixture(scope="module")
def local_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("cache")
    write_corpus(folder / "corpus")
    source = {"kind": "files", "paths": [str(folder / "corpus" / "*.jsonl")]}
    return build_cache(make_spec(source, num_shards=2), folder / "cache")


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
