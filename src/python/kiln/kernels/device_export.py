"""Lower a jax function for an accelerator this machine does not have: an NVIDIA H200 or a TPU
v5e.

`jax.export` for the device's platform inside an abstract mesh whose device is that accelerator:
Pallas reads the target from the abstract device (the H200's compute capability for Triton, the
TPU's generation for Mosaic), so kernels lower exactly as they would on the device. It checks
lowering only: nothing is compiled for the device, nothing runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax import export
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
TPU_V5E = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
# Pallas' Triton kernels lower to this custom call, which jax.export does not list as stable.
TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"
_EXPORT_PLATFORMS = {"gpu": "cuda", "tpu": "tpu"}


def export_for_device(
    device: AbstractDevice,
    fn: Callable[..., Any],
    *args: Any,
    mesh_shape: dict[str, int] | None = None,
) -> export.Exported:
    """Exports `fn(*args)` as seen by `device`; args may be arrays or ShapeDtypeStructs.

    mesh_shape: axis name -> size of the abstract mesh (Auto axes), {"data": 1} by default.
    """
    mesh_shape = mesh_shape or {"data": 1}
    mesh = AbstractMesh(
        tuple(mesh_shape.values()),
        tuple(mesh_shape),
        axis_types=(AxisType.Auto,) * len(mesh_shape),
        abstract_device=device,
    )
    with use_abstract_mesh(mesh):
        return export.export(
            jax.jit(fn),
            platforms=[_EXPORT_PLATFORMS[device.platform]],
            disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)],
        )(*args)


export_for_h200 = functools.partial(export_for_device, H200)
