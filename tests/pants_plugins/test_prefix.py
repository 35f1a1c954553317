"""`[kiln] prefix`: local paths, and bucket URLs checked for their shape before anything runs."""

from __future__ import annotations

import pytest
from pants.engine.process import ProcessCacheScope

from kiln_pants.cache_layout import CacheLayout
from kiln_pants.subsystem import bucket_url, refuse_a_mistyped_url


@pytest.mark.parametrize(
    "url, normalized",
    [
        ("s3://kiln-artifacts/team/runs/", "s3://kiln-artifacts/team/runs"),
        ("gs://my.bucket_1", "gs://my.bucket_1"),
        ("s3://b12/date=2026-12-01", "s3://b12/date=2026-12-01"),
    ],
)
def test_bucket_urls_are_accepted(url: str, normalized: str) -> None:
    assert bucket_url(url) == normalized


@pytest.mark.parametrize(
    "url, message",
    [
        ("ftp://host/x", "Kiln stores artifacts in s3://BUCKET/PATH, gs://BUCKET/PATH or a local"),
        ("s3://", "'' is not a valid S3 bucket name"),
        ("gs://Big_Bucket/x", "'Big_Bucket' is not a valid Google Cloud Storage bucket name"),
        ("s3://bucket/a/../b", "the path part '..' is not allowed"),
        ("s3://bucket/a//b", "the path part '' is not allowed"),
        ("s3://bucket/a b", "the path part 'a b' is not allowed"),
    ],
)
def test_malformed_bucket_urls_are_refused_naming_the_problem(url: str, message: str) -> None:
    with pytest.raises(ValueError) as refused:
        bucket_url(url)
    assert str(refused.value).startswith(f"[kiln] prefix = {url!r}: ")
    assert message in str(refused.value)


@pytest.mark.parametrize(
    "path, meant", [("s3:/kiln-local/kiln", "s3://kiln-local/kiln"), ("gs:/bucket/x", "gs://bucket/x")]
)
def test_a_url_with_a_slash_missing_is_refused_with_the_url_it_means(path: str, meant: str) -> None:
    with pytest.raises(ValueError) as refused:
        refuse_a_mistyped_url(path)
    assert str(refused.value) == (
        f"[kiln] prefix = {path!r}: a URL needs '://' after its scheme; did you mean {meant}?"
    )
    refuse_a_mistyped_url("artifacts/s3:/x")  # a folder, however odd its name


def test_store_caches_under_a_bucket_prefix_are_built_at_their_final_keys() -> None:
    """A bucket has no rename: shards go to `shards/shard-NNNNN` inside the cache, where the
    runtime's `tokenize shard` requires them (kiln.data.tokenize, "in a bucket")."""
    cache = "s3://kiln-artifacts/team/tokenized/x/2026.11.29"
    layout = CacheLayout.for_storage("store", 2, cache, "s3://kiln-artifacts/team")
    assert layout.shards == (f"{cache}/shards/shard-00000", f"{cache}/shards/shard-00001")
    assert (layout.cache, layout.skip, layout.confined) == (cache, ("--unless-built", cache), ())
    assert layout.in_store and layout.cache_scope == ProcessCacheScope.PER_SESSION  # no outputs
    local = CacheLayout.for_storage("store", 1, "/store/tokenized/x/v1", "/store")
    assert local.shards == ("/store/tokenized/x/.v1.shards/shard-0",)
    assert local.confined == ("--root", "/store")
