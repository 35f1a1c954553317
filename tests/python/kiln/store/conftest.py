"""Stores to test against: a temp directory, and S3 and GCS buckets on servers on loopback."""

from __future__ import annotations

from pathlib import Path

import pytest
from kiln_testing.bucket_fixtures import gcs_server, s3_server
from kiln_testing.buckets import fresh_url

from kiln.artifacts.locations import open_store
from kiln.artifacts.store import ObjectStore

__all__ = ["gcs_server", "s3_server"]  # fixtures, for the tests of this folder


@pytest.fixture(params=["local", "s3", "gcs"])
def store_location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty store: a temp directory, or a path of its own in each bucket."""
    if request.param == "local":
        return str(tmp_path / "store")
    request.getfixturevalue(f"{request.param}_server")
    return fresh_url({"s3": "s3", "gcs": "gs"}[request.param])


@pytest.fixture
def store(store_location: str) -> ObjectStore:
    return open_store(store_location)
