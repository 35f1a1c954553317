"""The world the end-to-end tests share: one copy of this workspace and its Pants daemon.

Pants runs every file of tests/e2e in one pytest process (their BUILD's batch tag), so this
session fixture is made once: each test writes BUILD files of its own under `experiments/` and
its artifacts under names of its own, and tests that need a workspace of their own (one that
edits Kiln's code) copy one themselves. The daemon is stopped when the session ends, failed or
not.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.workspace import copy_workspace, stop_pantsd


@pytest.fixture(scope="session")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    repo = copy_workspace(tmp_path_factory.mktemp("workspace"))
    try:
        yield repo
    finally:
        stop_pantsd(repo)
