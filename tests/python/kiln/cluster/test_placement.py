"""What `resources` asks of a Ray cluster, and the error when the cluster can never give it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kiln.cluster.dispatch import ClusterError, ClusterJob, resolve_address
from kiln.cluster.placement import PlacementError, bundle, check_capacity, describe, host_count
from kiln_contract.train import Resources


def node(address: str, alive: bool = True, **resources: float) -> dict[str, Any]:
    """A `ray.nodes()` entry (the fields Kiln reads)."""
    return {"NodeManagerAddress": address, "Alive": alive,
            "Resources": {"node:" + address: 1.0, "memory": 1e9, **resources}}  # fmt: skip


H100_NODE = {"CPU": 96.0, "GPU": 8.0, "accelerator_type:H100": 1.0}


def test_bundles_ask_for_exactly_what_resources_names() -> None:
    assert bundle(Resources("cpu", hosts=2)) == {"CPU": 1.0}
    assert bundle(Resources("gpu", "H100", 8, hosts=2)) == {
        "CPU": 1.0, "GPU": 8.0, "accelerator_type:H100": 0.001,
    }  # fmt: skip
    assert host_count(Resources("cpu")) == 1 and host_count(Resources("gpu", "A100", 4, 3)) == 3
    with pytest.raises(PlacementError, match=r"resources=tpu\('v4-128'\): TPU slices do not run"):
        bundle(Resources("tpu", "v4-128"))


def test_describe_writes_resources_as_the_build_file_does() -> None:
    assert describe(Resources("gpu", "H100", 8, hosts=2)) == "gpu('H100', count=8, hosts=2)"
    assert describe(Resources("cpu")) == "cpu()"


def test_capacity_counts_distinct_alive_nodes_that_fit() -> None:
    nodes = [node("10.0.0.1", **H100_NODE), node("10.0.0.2", **H100_NODE)]
    check_capacity(Resources("gpu", "H100", 8, hosts=2), nodes, "ray://head:10001")
    nodes[1]["Alive"] = False
    with pytest.raises(PlacementError) as raised:
        check_capacity(Resources("gpu", "H100", 8, hosts=2), nodes, "ray://head:10001")
    assert str(raised.value) == (
        "resources=gpu('H100', count=8, hosts=2) asks for 2 host(s) with CPU 1, GPU 8, "
        "accelerator_type:H100 each, and the Ray cluster at ray://head:10001 can never give it: "
        "1 of its 1 node(s) fit (10.0.0.1: CPU 96, GPU 8, accelerator_type:H100). Change "
        "`resources` or use a bigger cluster; nothing was started."
    )


def test_another_accelerator_model_does_not_fit() -> None:
    nodes = [node("10.0.0.1", CPU=32.0, GPU=8.0, **{"accelerator_type:A100": 1.0})]
    offered = r"0 of its 1 node\(s\) fit \(10.0.0.1: CPU 32, GPU 8, accelerator_type:A100\)"
    with pytest.raises(PlacementError, match=offered):
        check_capacity(Resources("gpu", "H100", 8), nodes, "10.0.0.1:6379")


def test_cluster_addresses() -> None:
    assert resolve_address(None) is None and resolve_address("") is None
    assert resolve_address("local") is None
    assert resolve_address("ray://head:10001") == "ray://head:10001"
    assert resolve_address("auto", {"RAY_ADDRESS": "ray://h:1"}) == "ray://h:1"
    with pytest.raises(ClusterError, match="--cluster auto reads the cluster's address from RAY"):
        resolve_address("auto", {})


def test_each_host_runs_the_multihost_runner() -> None:
    job = ClusterJob("tiny-1", "checkpoints/tiny@2026.11.29", "ray://h:1",
                     Resources("cpu", hosts=2), {}, Path("/store"))  # fmt: skip
    assert job.runner_argv("10.0.0.1:4000", 1) == [
        "{inputs}/step.json", "--inputs", "{inputs}", "--prefix", "/store",
        "--job", "tiny-1", "--max-retries", "3",
        "--coordinator", "10.0.0.1:4000", "--num-processes", "2", "--process-id", "1",
    ]  # fmt: skip
    assert ClusterJob.from_json(job.to_json()) == job
