from __future__ import annotations

import os

# Before anything imports huggingface_hub / datasets (they read these once): tests never go online.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import pytest  # noqa: E402
from kiln_testing.data import STDLIB_TOKENIZER  # noqa: E402

from kiln.data.tokenizer import LoadedTokenizer, load_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer() -> LoadedTokenizer:
    return load_tokenizer(STDLIB_TOKENIZER)


from kiln_testing.bucket_fixtures import gcs_server, s3_server  # noqa: E402

__all__ = ["gcs_server", "s3_server"]  # fixtures: the bucket servers on loopback
