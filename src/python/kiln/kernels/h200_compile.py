"""Compile jax functions for an NVIDIA H200 on a machine without a GPU.

XLA compiles deviceless for a GPU that a target config describes (H200_TARGET_CONFIG) through
jax's CUDA plugin: the same passes, Triton and Mosaic GPU lowerings, ptxas and cubins as on the
device, with no driver. Nothing runs. The executable's `memory_analysis()` is the H200's, so a
step's peak memory can be known before device time is spent on it (benchmarks/
train_step_memory.py). The plugin and ptxas come from `./pants package lab:cuda-compiler`, a
directory PEX; `cuda_compiler(pex)` puts them on this process' path before jax loads.

Where `kiln.kernels.device_export` lowers only (any machine, no toolchain), this compiles.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

# XLA's H100 SXM spec (xla/tools/hlo_opt/gpu_specs/h100_sxm.txtpb) with the H200's memory and
# name: the compiler reads the compute capability, shared memory and register limits.
H200_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150754820096
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
device_description_str: "NVIDIA H200"
"""
# What `./pants package lab:cuda-compiler` writes, relative to the repository root.
CUDA_COMPILER_PEX = Path("dist/lab/cuda-compiler.pex")


def has_cuda_plugin(pex: Path) -> bool:
    """Whether `pex` is the CUDA compiler PEX (it holds jax's CUDA PJRT plugin)."""
    return any(pex.glob(".deps/jax_cuda13_pjrt-*.whl/jax_plugins"))


@contextlib.contextmanager
def cuda_compiler(pex: Path) -> Iterator[None]:
    """jax's CUDA plugin and ptxas from the PEX, for this process: enter before jax loads (jax's
    own library then loads the plugin's Mosaic GPU runtime, which compiled host code links
    against)."""
    if not has_cuda_plugin(pex):
        raise FileNotFoundError(
            f"{pex}: no jax CUDA plugin there; run `./pants package lab:cuda-compiler`"
        )
    wheels = sorted(pex.glob(".deps/*.whl"))
    # Next to the PEX: the same file system, so the links cost no copies.
    with tempfile.TemporaryDirectory(prefix="kiln-cuda-compiler-", dir=pex.parent) as folder:
        site_packages = Path(folder)
        link_site_packages(wheels, site_packages)
        sys.path.append(str(site_packages))
        # Mosaic GPU looks for ptxas on PATH before /usr/local/cuda: use the pinned one.
        ptxas_folder = site_packages / "nvidia" / "cu13" / "bin"
        os.environ["PATH"] = os.pathsep.join([str(ptxas_folder), os.environ.get("PATH", "")])
        # The plugin's CUDA version check would look for a driver this machine does not have.
        os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
        yield


def link_site_packages(wheels: Sequence[Path], site_packages: Path) -> None:
    """One site-packages of the PEX's wheels, hard links (copies across file systems): the CUDA
    plugin looks for ptxas and libdevice beside its own file's real path (site-packages/nvidia/
    cu13, as in a venv), but the PEX's NVIDIA wheels each hold a part of that folder."""
    for wheel in wheels:
        for source in sorted(wheel.rglob("*")):
            target = site_packages / source.relative_to(wheel)
            if source.is_dir():
                target.mkdir(exist_ok=True)
            elif not target.exists():
                try:
                    os.link(source, target)
                except OSError:
                    shutil.copy2(source, target)


def h200_device() -> Any:
    """An H200 that exists only for the compiler (inside `cuda_compiler`)."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        topology_name="h200", platform="cuda", topology="1x1x1", target_config=H200_TARGET_CONFIG
    )
    return topology.devices[0]


def compile_on(device: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """Lowers fn(*args) for the H200 (args: ShapeDtypeStruct trees) and compiles it on
    `device`; returns the compiled executable."""
    import jax
    from jax.sharding import SingleDeviceSharding

    from kiln.kernels.device_export import export_for_h200

    exported = export_for_h200(fn, *args)
    on_device = SingleDeviceSharding(device)
    args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_device), args)
    return jax.jit(exported.call).lower(*args).compile()
