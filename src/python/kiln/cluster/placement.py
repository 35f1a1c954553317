"""What a step's `resources` asks of a Ray cluster, and whether the cluster can ever give it.

Ray waits forever for a placement group it cannot place, so Kiln checks the request against the
cluster's nodes first and fails in seconds, naming what was asked and what the cluster has.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kiln_contract.train import Resources

# Ray labels each GPU node with its accelerator model (`accelerator_type:H100`); asking for a
# sliver of it places a bundle on such nodes only (Ray's own `accelerator_type=` does the same).
ACCELERATOR_LABEL = "accelerator_type:"
_LABEL_SHARE = 0.001


class PlacementError(RuntimeError):
    """The cluster can never satisfy the request (one paragraph, no traceback)."""


def describe(resources: Resources) -> str:
    """`resources` as the BUILD file writes it, e.g. gpu('H100', count=8, hosts=2)."""
    arguments = [repr(resources.type)] if resources.type else []
    if resources.count is not None:
        arguments.append(f"count={resources.count}")
    if resources.hosts is not None:
        arguments.append(f"hosts={resources.hosts}")
    return f"{resources.kind}({', '.join(arguments)})"


def host_count(resources: Resources) -> int:
    return resources.hosts or 1


def bundle(resources: Resources) -> dict[str, float]:
    """The Ray resources one host's trainer process needs."""
    if resources.kind == "cpu":
        return {"CPU": 1.0}
    if resources.kind == "gpu":
        assert resources.type is not None  # gpu() requires its model
        return {
            "CPU": 1.0,
            "GPU": float(resources.count or 1),
            f"{ACCELERATOR_LABEL}{resources.type}": _LABEL_SHARE,
        }
    raise PlacementError(
        f"resources={describe(resources)}: TPU slices do not run on Ray clusters in Kiln; start "
        "the slice's hosts with --coordinator auto (docs/training.md, 'Multi-host runs')"
    )


def fits(node_resources: Mapping[str, float], wanted: Mapping[str, float]) -> bool:
    return all(node_resources.get(name, 0.0) >= amount for name, amount in wanted.items())


def check_capacity(resources: Resources, nodes: Sequence[Mapping[str, Any]], address: str) -> None:
    """Raises PlacementError unless `host_count` distinct alive nodes can each hold one bundle
    (STRICT_SPREAD). `nodes` are `ray.nodes()` entries."""
    wanted = bundle(resources)
    alive = [node for node in nodes if node.get("Alive")]
    fitting = [node for node in alive if fits(node.get("Resources", {}), wanted)]
    hosts = host_count(resources)
    if len(fitting) >= hosts:
        return
    offered = "; ".join(_describe_node(node) for node in alive) or "no alive nodes"
    raise PlacementError(
        f"resources={describe(resources)} asks for {hosts} host(s) with {_amounts(wanted)} "
        f"each, and the Ray cluster at {address} can never give it: {len(fitting)} of its "
        f"{len(alive)} node(s) fit ({offered}). Change `resources` or use a bigger cluster; "
        "nothing was started."
    )


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
