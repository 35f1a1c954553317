"""What `resources` asks of a Ray cluster, and the error when the cluster can never give it."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from kiln.cluster.connection import resolve_address
from kiln.cluster.dispatch import ClusterJob
from kiln.cluster.errors import ClusterError
from kiln.cluster.placement import (
    PlacementError,
    Stopped,
    TpuSlice,
    Waiting,
    bundle,
    check_capacity,
    describe,
    host_count,
    tpu_slice,
    wait_for_capacity,
)
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
    assert bundle(Resources("tpu", "v4-128")) == {"CPU": 1.0, "TPU": 4.0}
    assert bundle(Resources("tpu", "v6e-8")) == {"CPU": 1.0, "TPU": 8.0}


@pytest.mark.parametrize(
    ("type_", "hosts", "chips_per_host"),
    [
        ("v4-8", 1, 4), ("v4-16", 2, 4), ("v4-128", 16, 4), ("v5p-256", 32, 4),
        ("v2-32", 4, 4), ("v7x-16", 2, 4),
        ("v5litepod-1", 1, 1), ("v5litepod-8", 1, 8), ("v5litepod-16", 4, 4),
        ("v6e-4", 1, 4), ("v6e-8", 1, 8), ("v6e-256", 64, 4),
    ],
)  # fmt: skip
def test_a_tpu_slice_type_names_its_hosts(type_: str, hosts: int, chips_per_host: int) -> None:
    resources = Resources("tpu", type_)
    assert tpu_slice(resources) == TpuSlice(type_, hosts, chips_per_host)
    assert host_count(resources) == hosts
    assert tpu_slice(resources).head_resource == f"TPU-{type_}-head"


@pytest.mark.parametrize("type_", ["v4", "v4-x", "v4-7", "v5e-16", "h100-8", "v4-12"])
def test_an_unknown_tpu_slice_type_is_refused(type_: str) -> None:
    with pytest.raises(PlacementError, match=rf"resources=tpu\('{type_}'\): "):
        host_count(Resources("tpu", type_))


def test_a_tpu_slice_needs_a_head_of_its_type_and_enough_hosts() -> None:
    host = {"CPU": 200.0, "TPU": 4.0, "my-slice": 1.0}
    nodes = [node("10.0.0.1", **host, **{"TPU-v4-16-head": 1.0}), node("10.0.0.2", **host)]
    check_capacity(Resources("tpu", "v4-16"), nodes, "ray://head:10001")
    with pytest.raises(PlacementError) as raised:
        check_capacity(Resources("tpu", "v4-16"), nodes[1:] * 2, "ray://head:10001")
    assert str(raised.value) == (
        "resources=tpu('v4-16') asks for a v4-16 slice: 2 host(s) with CPU 1, TPU 4 each, host 0 "
        "carrying TPU-v4-16-head, and the Ray cluster at ray://head:10001 can never give it: 2 of "
        "its 2 node(s) fit, none of them a slice head (10.0.0.2: CPU 200, TPU 4, my-slice 1; "
        "10.0.0.2: CPU 200, TPU 4, my-slice 1). Change `resources` or use a bigger cluster; "
        "nothing was started."
    )
    with pytest.raises(PlacementError, match=r"asks for a v4-32 slice: 4 host\(s\) .* 2 of its 2"):
        check_capacity(Resources("tpu", "v4-32"), nodes, "ray://head:10001")


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


def test_a_retry_waits_for_a_lost_nodes_place_to_be_taken_within_its_own_budget() -> None:
    """After a lost host the next attempt waits for capacity (saying so once) instead of
    spending an attempt; past the budget it fails naming the shortfall."""
    two = Resources("gpu", "H100", 8, hosts=2)
    lost = [node("10.0.0.1", **H100_NODE), node("10.0.0.2", alive=False, **H100_NODE)]
    back = [lost[0], node("10.0.0.3", **H100_NODE)]
    answers = iter([lost, lost, back])
    said: list[str] = []
    waiting = Waiting(threading.Event(), said.append)
    wait_for_capacity(two, lambda: next(answers), "ray://head:10001", seconds=60,
                      waiting=waiting, poll=0.01)  # fmt: skip
    assert said == [
        "kiln: waiting up to 60 s for the Ray cluster at ray://head:10001 to hold "
        "gpu('H100', count=8, hosts=2) again (a lost node back, or another)"
    ]
    with pytest.raises(PlacementError) as raised:
        wait_for_capacity(two, lambda: lost, "ray://head:10001", seconds=0.05,
                          waiting=waiting, poll=0.01)  # fmt: skip
    assert str(raised.value).startswith(
        "the cluster did not hold the run again within 0 s (resources=gpu('H100', count=8, "
        "hosts=2) asks for 2 host(s)"
    )
    with pytest.raises(PlacementError, match=r"^resources=gpu"):  # no budget: one look
        wait_for_capacity(two, lambda: lost, "ray://head:10001", seconds=0, waiting=waiting)
    waiting.stopping.set()
    with pytest.raises(Stopped):  # at once: the job is being stopped
        wait_for_capacity(two, lambda: lost, "ray://head:10001", seconds=60, waiting=waiting)


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
    for wrong in ("http://head:8265", "https://head:10001", "grpc://head:6379"):
        with pytest.raises(ClusterError, match=r"is not a Ray address; give ray://HOST:PORT"):
            resolve_address(wrong)
    assert resolve_address("head:6379") == "head:6379"


def test_each_host_runs_the_multihost_runner() -> None:
    job = ClusterJob("tiny-1", "checkpoints/tiny@2026.11.29", "ray://h:1",
                     Resources("cpu", hosts=2), {}, "/store")  # fmt: skip
    assert job.runner_argv("10.0.0.1:4000", 1) == [
        "{inputs}/step.json", "--inputs", "{inputs}", "--prefix", "/store",
        "--job", "tiny-1", "--max-retries", "3",
        "--coordinator", "10.0.0.1:4000", "--num-processes", "2", "--process-id", "1",
    ]  # fmt: skip
    assert ClusterJob.from_json(job.to_json()) == job
    on_a_slice = ClusterJob("tiny-1", "x@1", "ray://h:1", Resources("tpu", "v4-16"), {}, "/s")
    assert on_a_slice.runner_argv("ignored", 1)[-2:] == ["--coordinator", "auto"]
