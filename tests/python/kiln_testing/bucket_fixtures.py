"""The bucket servers as session fixtures, which a test folder's conftest.py (or a test module)
imports: `from kiln_testing.bucket_fixtures import s3_server, gcs_server`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kiln_testing.buckets import gcs_endpoint, s3_endpoint


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The S3 endpoint URL (`s3_endpoint`), for the test session."""
    with s3_endpoint(tmp_path_factory.mktemp("aws")) as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The GCS emulator's URL (`gcs_endpoint`), for the test session."""
    with gcs_endpoint(tmp_path_factory.mktemp("gcs")) as endpoint:
        yield endpoint
