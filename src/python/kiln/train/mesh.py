"""The device mesh ("data", "fsdp", "tensor") and where parameters and batches live on it.

Parameters carry sharding annotations from the model (kiln.model.partitioning): hidden dims over
"fsdp", heads / MLP / vocab dimensions over "tensor"; everything else is replicated. Batches are
split over ("data", "fsdp") along their first dimension.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from kiln.model.partitioning import BATCH_AXES
from kiln.train.errors import TrainingError
from kiln_contract.vocabulary import MESH_AXES


def make_mesh(
    mesh_config: Mapping[str, int] | None = None, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A mesh over `devices` (default: all) from sizes like {"data": -1, "fsdp": 1, "tensor": 1}.

    Missing axes have size 1; at most one axis may be -1, meaning "all remaining devices".
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = _axis_sizes(dict(mesh_config or {"data": -1}), len(devices))
    # Auto axes: with jax's default (Explicit) axes, nnx.Embed's gather fails to shard.
    return jax.make_mesh(
        sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices
    )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def batch_parallelism(mesh: Mesh) -> int:
    """How many ways the batch dimension is split: data * fsdp."""
    return mesh.shape["data"] * mesh.shape["fsdp"]


def microbatch_count(batch_size: int, per_device_parallelism: int | None, ways: int) -> int:
    """Gradient-accumulation steps per optimizer step (Levanter's per_device_parallelism): each
    microbatch holds per_device_parallelism sequences on each of the `ways` batch shards."""
    if per_device_parallelism is None:
        return 1
    microbatch = per_device_parallelism * ways
    if batch_size % microbatch:
        raise TrainingError(
            f"runtime.per_device_parallelism={per_device_parallelism} on {ways} data-parallel "
            f"device(s) makes microbatches of {microbatch} sequences, which do not divide "
            f"batch_size={batch_size}; pick a per_device_parallelism that does"
        )
    return batch_size // microbatch


def state_shardings(tree: Any, mesh: Mesh) -> Any:
    """NamedShardings for a pytree of (abstract) arrays and nnx Variables.

    Variables use their "sharding" annotation; plain arrays (step counters) are replicated. An
    annotated dimension that the mesh axis does not divide is an error naming the parameter.
    """
    specs = nnx.get_partition_spec(tree)

    def to_sharding(path: tuple, spec: PartitionSpec, leaf: Any) -> NamedSharding:
        for dim, (size, axes) in enumerate(zip(np.shape(leaf), spec)):
            ways = _ways(mesh, axes)
            if size % ways:
                raise ValueError(
                    f"parameter {jax.tree_util.keystr(path)} has dimension {dim} of size {size}, "
                    f"which mesh axis {axes!r} of size {ways} does not divide; choose mesh sizes "
                    "that divide the model's dimensions"
                )
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(
        to_sharding, specs, tree, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


def _ways(mesh: Mesh, axes: str | tuple[str, ...] | None) -> int:
    if axes is None:
        return 1
    names = (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[name] for name in names)


def _axis_sizes(config: dict[str, int], num_devices: int) -> tuple[int, ...]:
    unknown = sorted(set(config) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"unknown mesh axis/axes {unknown}; the axes are {list(MESH_AXES)}")
    sizes = [config.get(axis, 1) for axis in MESH_AXES]
    for axis, size in zip(MESH_AXES, sizes):
        if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
            raise ValueError(f"mesh.{axis} must be a positive integer or -1, got {size!r}")
    if sizes.count(-1) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {config}")
    fixed = math.prod(size for size in sizes if size != -1)
    if num_devices % fixed:
        raise ValueError(
            f"mesh {config} needs a multiple of {fixed} devices, but there are {num_devices}"
        )
    sizes = [num_devices // fixed if size == -1 else size for size in sizes]
    if math.prod(sizes) != num_devices:
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, sizes))} covers {math.prod(sizes)} devices, but there "
            f"are {num_devices}; use -1 for one axis to take the rest"
        )
    return tuple(sizes)
