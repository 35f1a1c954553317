"""Lower a jax function for an NVIDIA H200 on a machine without a GPU.

`jax.export` for platform 'cuda' inside an abstract mesh whose device is an H200: Pallas' Triton
lowering reads the compute capability from that abstract device, so kernels lower to Triton IR
exactly as they would on the device. It checks lowering only: no PTX is compiled, nothing runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax import export
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
# Pallas' Triton kernels lower to this custom call, which jax.export does not list as stable.
TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"


def export_for_h200(
    fn: Callable[..., Any], *args: Any, mesh_shape: dict[str, int] | None = None
) -> export.Exported:
    """Exports `fn(*args)` for CUDA as seen by an H200; args may be arrays or ShapeDtypeStructs.

    mesh_shape: axis name -> size of the abstract mesh (Auto axes), {"data": 1} by default.
    """
    mesh_shape = mesh_shape or {"data": 1}
    mesh = AbstractMesh(
        tuple(mesh_shape.values()),
        tuple(mesh_shape),
        axis_types=(AxisType.Auto,) * len(mesh_shape),
        abstract_device=H200,
    )
    with use_abstract_mesh(mesh):
        return export.export(
            jax.jit(fn),
            platforms=["cuda"],
            disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)],
        )(*args)
