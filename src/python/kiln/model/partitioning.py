"""How the model names the device mesh's axes ("data", "fsdp", "tensor") and uses them.

Parameters are annotated here; kiln.train.mesh builds the mesh and places them. Inside a traced
step, `batch_mesh()` is the context mesh (jax.set_mesh) when it has the batch axes, else None:
without a mesh (tests, evals, jax.export for one device) the model runs unpartitioned.
"""

from __future__ import annotations

import jax
from jax.sharding import AbstractMesh, PartitionSpec

BATCH_AXES = ("data", "fsdp")  # the batch dimension is split over both


def param_sharding(*axes: str | None) -> dict:
    """nnx Variable metadata: one mesh axis (or None) per dimension."""
    # Annotate only (no eager placement): init_train_state places parameters on the mesh, so a
    # model can also be built with no mesh at all.
    return {"out_sharding": axes, "eager_sharding": False}


def batch_mesh() -> AbstractMesh | None:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(BATCH_AXES) <= set(mesh.axis_names):
        return None
    return mesh


def constrain_batch_sharding(x: jax.Array) -> jax.Array:
    """Keeps activations split over the batch axes (FSDP gathers weights, not activations)."""
    if batch_mesh() is None:
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec(BATCH_AXES))
