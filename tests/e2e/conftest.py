"""The worlds the end-to-end tests share: one copy of this workspace and its Pants daemon, an S3
server, and for the cluster's tests the one-machine Ray cluster of docs/clusters.md with its
bucket.

Pants runs the files of tests/e2e in two pytest processes (their BUILD's batch tags: the
cluster's files and the others), so each session fixture is made once per process, and only
where a test asks for it: each test writes BUILD files of its own under `experiments/` and its
artifacts under names of its own, and tests that need a workspace of their own (one that edits
Kiln's code) copy one themselves. Everything is stopped when the session ends, failed or not.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kiln_testing.bucket_fixtures import s3_server

from tests.e2e.ray_nodes import Cluster, make_node_venv, started_cluster
from tests.e2e.workspace import copy_workspace, stop_pantsd

__all__ = ["s3_server"]  # a fixture: one server for the session's tests


@pytest.fixture(scope="session")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    repo = copy_workspace(tmp_path_factory.mktemp("workspace"))
    try:
        yield repo
    finally:
        stop_pantsd(repo)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    home = tmp_path_factory.mktemp("cluster-home")  # the recipe's user: ~/kiln-node, ~/kiln-nodes
    make_node_venv(home / "kiln-node")
    yield from started_cluster(home)
