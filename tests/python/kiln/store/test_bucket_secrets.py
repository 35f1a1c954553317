"""Credentials never enter what Kiln writes or says: with a planted AWS secret (and session
token), every object Kiln puts in the bucket, every log line, every error message and the
TensorStore specs it builds are searched for them."""

from __future__ import annotations

import logging
from pathlib import Path

import boto3
import pytest
from kiln_testing.buckets import BUCKET, PLANTED_SECRET, fresh_url
from kiln_testing.data import make_spec, write_corpus

from kiln.artifacts.content import copy_folder_into
from kiln.artifacts.lease import Lease, LeaseHeld, lease_key
from kiln.artifacts.locations import open_store
from kiln.artifacts.storage_errors import StorageError
from kiln.artifacts.store import PreconditionFailed
from kiln.data.cache import TokenCache
from kiln.data.tokenize import build_cache

PLANTED_TOKEN = "kiln-planted-session-token-5Zp"
PLANTED_KEY_ID = "AKIAKILNTEST"  # conftest's; not secret, but it need not appear either


def test_no_credential_reaches_objects_logs_or_messages(
    s3_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog, capsys
) -> None:
    monkeypatch.setenv("AWS_SESSION_TOKEN", PLANTED_TOKEN)
    url = fresh_url("s3")
    store = open_store(url)
    said: list[str] = []
    with caplog.at_level(logging.DEBUG, logger="kiln"):
        with Lease(store, lease_key("tokenized/x/v1"), what="build x@v1").acquire(wait=False):
            with pytest.raises(LeaseHeld) as held:
                Lease(store, lease_key("tokenized/x/v1"), what="another").acquire(wait=False)
            said.append(str(held.value))
        write_corpus(tmp_path / "corpus")
        source = {"kind": "files", "paths": [str(tmp_path / "corpus" / "*.jsonl")]}
        cache = build_cache(make_spec(source, num_shards=1), tmp_path / "cache")
        copy_folder_into(store, "tokenized/x/v1", cache)
        opened = TokenCache.open(f"{url}/tokenized/x/v1")
        opened.windows([0, 1], 16)
        said.append(repr(opened.store.kvstore("shards")))
        generation = store.write("k", b"1")
        store.write("k", b"2")
        with pytest.raises(PreconditionFailed) as stale:
            store.replace("k", b"3", generation=generation)
        said.append(str(stale.value))
        with pytest.raises(StorageError) as missing:
            open_store("s3://kiln-no-such-bucket/x").check()
        said.append(str(missing.value))
    objects = boto3.client("s3").list_objects_v2(Bucket=BUCKET, Prefix=url.split("/", 3)[3])
    keys = [item["Key"] for item in objects["Contents"]]
    assert len(keys) > 10  # the cache's records, arrays and STATUS
    stored = [boto3.client("s3").get_object(Bucket=BUCKET, Key=k)["Body"].read() for k in keys]
    printed = capsys.readouterr()
    outputs = [*said, caplog.text, printed.out, printed.err, *keys]
    for secret in (PLANTED_SECRET, PLANTED_TOKEN, PLANTED_KEY_ID):
        assert not [text for text in outputs if secret in text]
        assert not [data for data in stored if secret.encode() in data]
