"""What a step's `resources` asks of a Ray cluster, and whether the cluster can ever give it.

Ray waits forever for a placement group it cannot place, so Kiln checks the request against the
cluster's nodes first and fails in seconds, naming what was asked and what the cluster has.

TPU slices follow Ray's TPU VM resources (ray/_private/accelerators/tpu.py): every host of a
slice registers `TPU: <chips on the host>` and the slice's name as a resource of 1, and host 0
also registers `TPU-<type>-head: 1`. A run reserves a slice by its head, learns the slice's name
there, then places one bundle per host of that slice (`reserve_slice`, then `reserve`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.cluster import host, node_runtime
from kiln.cluster.errors import ClusterError
from kiln_contract.parsing import SpecError
from kiln_contract.tpu import tpu_slice_shape
from kiln_contract.train import Resources

# Ray labels each GPU node with its accelerator model (`accelerator_type:H100`); asking for a
# sliver of it places a bundle on such nodes only (Ray's own `accelerator_type=` does the same).
ACCELERATOR_LABEL = "accelerator_type:"
_LABEL_SHARE = 0.001


class PlacementError(RuntimeError):
    """The cluster can never satisfy the request, or did not within the wait (one paragraph,
    no traceback)."""


class Stopped(Exception):
    """A stop was asked for while the run waited for the cluster."""


@dataclass(frozen=True)
class Waiting:
    """What a wait for the cluster watches and tells: `stopping` ends it at once (Stopped), and
    `say` reports what it waits for, every BUSY_REPORT_S."""

    stopping: threading.Event
    say: Callable[[str], None]


def describe(resources: Resources) -> str:
    """`resources` as the BUILD file writes it, e.g. gpu('H100', count=8, hosts=2)."""
    arguments = [repr(resources.type)] if resources.type else []
    if resources.count is not None:
        arguments.append(f"count={resources.count}")
    if resources.hosts is not None:
        arguments.append(f"hosts={resources.hosts}")
    return f"{resources.kind}({', '.join(arguments)})"


@dataclass(frozen=True)
class TpuSlice:
    type: str  # v4-128
    hosts: int  # TPU VMs, one trainer process each
    chips_per_host: int

    @property
    def head_resource(self) -> str:
        """The resource Ray registers on the slice's host 0 only."""
        return f"TPU-{self.type}-head"


def tpu_slice(resources: Resources) -> TpuSlice:
    """The hosts of the slice `tpu(type)` names; PlacementError for a type Kiln cannot read."""
    try:
        shape = tpu_slice_shape(resources.type or "")
    except SpecError as e:
        raise PlacementError(f"resources={describe(resources)}: {e.problem}") from None
    return TpuSlice(resources.type or "", shape.hosts, shape.chips_per_host)


def host_count(resources: Resources) -> int:
    if resources.kind == "tpu":
        return tpu_slice(resources).hosts
    return resources.hosts or 1


def bundle(resources: Resources) -> dict[str, float]:
    """The Ray resources one host's trainer process needs (for a TPU slice, on any slice of its
    type: dispatch adds the name of the slice it reserved)."""
    if resources.kind == "gpu":
        assert resources.type is not None  # gpu() requires its model
        return {
            "CPU": 1.0,
            "GPU": float(resources.count or 1),
            f"{ACCELERATOR_LABEL}{resources.type}": _LABEL_SHARE,
        }
    if resources.kind == "tpu":
        return {"CPU": 1.0, "TPU": float(tpu_slice(resources).chips_per_host)}
    return {"CPU": 1.0}


def fits(node_resources: Mapping[str, float], wanted: Mapping[str, float]) -> bool:
    return all(node_resources.get(name, 0.0) >= amount for name, amount in wanted.items())


def check_capacity(resources: Resources, nodes: Sequence[Mapping[str, Any]], address: str) -> None:
    """Raises PlacementError unless `host_count` distinct alive nodes can each hold one bundle
    (STRICT_SPREAD) and, for a TPU slice, one of them is a slice head of its type. `nodes` are
    `ray.nodes()` entries."""
    wanted = bundle(resources)
    alive = [node for node in nodes if node.get("Alive")]
    fitting = [node for node in alive if fits(node.get("Resources", {}), wanted)]
    hosts = host_count(resources)
    asked = f"{hosts} host(s) with {_amounts(wanted)} each"
    heads = 1
    if resources.kind == "tpu":
        head = tpu_slice(resources).head_resource
        asked = f"a {resources.type} slice: {asked}, host 0 carrying {head}"
        heads = sum(1 for node in fitting if node.get("Resources", {}).get(head, 0.0) >= 1.0)
    if len(fitting) >= hosts and heads:
        return
    offered = "; ".join(_describe_node(node) for node in alive) or "no alive nodes"
    raise PlacementError(
        f"resources={describe(resources)} asks for {asked}, and the Ray cluster at {address} "
        f"can never give it: {len(fitting)} of its {len(alive)} node(s) fit"
        f"{'' if heads else ', none of them a slice head'} ({offered}). Change `resources` or "
        "use a bigger cluster; nothing was started."
    )


# After a lost host, how long the next attempt waits for the cluster to hold the run again (the
# node back, or another in its place: an autoscaler takes minutes), apart from `--max-retries`.
CAPACITY_WAIT_S = 600.0
CAPACITY_POLL_S = 5.0
PLACEMENT_TIMEOUT_S = 120.0  # the cluster has the nodes but they are busy: give up then
PLACEMENT_POLL_S = 1.0  # how often a placement wait looks for a stop
BUSY_REPORT_S = 10.0  # how often a placement wait says what it waits for


def wait_for_capacity(
    resources: Resources,
    nodes: Callable[[], Sequence[Mapping[str, Any]]],
    address: str,
    *,
    seconds: float,
    waiting: Waiting,
    poll: float = CAPACITY_POLL_S,
) -> None:
    """Returns once `nodes()` (`ray.nodes`) can hold `resources`; says once that it waits.
    Stopped as soon as a stop is asked for; PlacementError, naming the shortfall, after
    `seconds`."""
    deadline = time.monotonic() + seconds
    said = False
    while True:
        try:
            check_capacity(resources, nodes(), address)
            return
        except PlacementError as e:
            if time.monotonic() >= deadline:
                if not said:
                    raise
                raise PlacementError(
                    f"the cluster did not hold the run again within {seconds:.0f} s ({e})"
                ) from None
            if not said:
                waiting.say(
                    f"kiln: waiting up to {seconds:.0f} s for the Ray cluster at {address} to "
                    f"hold {describe(resources)} again (a lost node back, or another)"
                )
                said = True
        if waiting.stopping.wait(poll):
            raise Stopped()


def reserve_slice(
    ray: Any, resources: Resources, address: str, groups: list[Any], waiting: Waiting
) -> tuple[str, str]:
    """Reserves a slice of `resources`' TPU type by its head resource (held until the run ends,
    so no other run takes the same slice); returns the slice's name and its head's node id."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    head = tpu_slice(resources).head_resource
    group = reserve(ray, address, [{head: 1.0}], "PACK", groups, waiting)
    on_head = PlacementGroupSchedulingStrategy(group, 0)
    probe = ray.remote(host.slice_of_node).options(
        num_cpus=0, scheduling_strategy=on_head, runtime_env=node_runtime.worker_env()
    )
    name, node = ray.get(probe.remote())
    if not name:
        raise ClusterError(
            f"the Ray node {node} carries {head} but names no TPU slice (Ray reads it from "
            "TPU_NAME or the TPU VM's metadata server); start the slice's Ray nodes on the TPU "
            "VMs themselves, or set TPU_NAME to the slice's name for their `ray start`"
        )
    return name, node


def bundle_order(group: Any, first_node: str | None) -> list[int]:
    """The group's bundle indexes, the one on `first_node` (a TPU slice's head) first: its host
    becomes host 0."""
    from ray.util import placement_group_table

    indexes = list(range(len(group.bundle_specs)))
    if first_node is None:
        return indexes
    nodes = placement_group_table(group)["bundles_to_node_id"]
    return sorted(indexes, key=lambda index: nodes[index] != first_node)


def reserve(
    ray: Any,
    address: str,
    bundles: list[dict[str, float]],
    strategy: str,
    groups: list[Any],
    waiting: Waiting,
) -> Any:
    """A placement group of `bundles`, once Ray has placed it (added to `groups` at once, so it
    is released even when it never gets placed). While the cluster's nodes are busy it says what
    it waits for, every BUSY_REPORT_S; Stopped as soon as a stop is asked for;
    PlacementError (busy) after PLACEMENT_TIMEOUT_S."""
    from ray.util.placement_group import placement_group

    group = placement_group(bundles, strategy=strategy)
    groups.append(group)
    placed = group.ready()
    start = time.monotonic()
    reported = start  # a placement within BUSY_REPORT_S says nothing
    while not ray.wait([placed], timeout=PLACEMENT_POLL_S)[0]:
        if waiting.stopping.is_set():
            raise Stopped()
        now = time.monotonic()
        if now - start >= PLACEMENT_TIMEOUT_S:
            raise PlacementError(
                f"the Ray cluster at {address} has nodes for this run, but they stayed busy "
                f"for {PLACEMENT_TIMEOUT_S:.0f} s ({_free(ray, bundles)}); rerun when they are "
                "free"
            )
        if now - reported >= BUSY_REPORT_S:
            reported = now
            waiting.say(
                f"kiln: waiting for the Ray cluster at {address} to place {len(bundles)} "
                f"host(s) of {_amounts(bundles[0])} ({strategy}): {_free(ray, bundles)}; "
                f"{now - start:.0f} of {PLACEMENT_TIMEOUT_S:.0f} s"
            )
    return group


def _free(ray: Any, bundles: list[dict[str, float]]) -> str:
    """What the cluster has free of what the bundles ask for, node by node."""
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    try:  # Ray's per-node availability (its `ray status` reads it the same way)
        from ray._private.state import available_resources_per_node

        free = available_resources_per_node()
    except Exception:  # noqa: BLE001 - a developer API: without it, every node reads as busy
        free = {}
    asked = {name for bundle in bundles for name in bundle}
    parts = []
    for node in nodes:
        available = free.get(node["NodeID"], {})
        have = {name: available.get(name, 0.0) for name in asked}
        total = {name: node.get("Resources", {}).get(name, 0.0) for name in asked}
        busy = "busy" if any(have[n] < bundles[0].get(n, 0.0) for n in asked) else "free"
        held = ", ".join(f"{name} {have[name]:g} of {total[name]:g}" for name in sorted(asked))
        parts.append(f"{node.get('NodeManagerAddress', '?')} {busy} ({held} free)")
    return "; ".join(parts) or "no alive nodes"


def _describe_node(node: Mapping[str, Any]) -> str:
    interesting = {
        name: amount
        for name, amount in node.get("Resources", {}).items()
        if not name.startswith(("node:", "memory", "object_store_memory"))
    }
    return f"{node.get('NodeManagerAddress', '?')}: {_amounts(interesting) or 'nothing'}"


def _amounts(values: Mapping[str, float]) -> str:
    return ", ".join(
        f"{name} {amount:g}" if not name.startswith(ACCELERATOR_LABEL) else name
        for name, amount in sorted(values.items())
    )
