"""The lockfiles agree with each other and with the plugin: what a gpu(...) or tpu(...) step layers
onto the runtime (kiln_pants.runtime.ACCELERATOR_PLUGINS) is locked, at the versions the runtime's
own jax asks for in its `cuda13` / `tpu` extras (jax refuses a plugin of another version at
start-up), and the CPU runtime pulls no accelerator wheels (every CPU run and CI would download
them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from packaging.requirements import Requirement  # pants: no-infer-dep (pantsbuild.pants brings it)
from packaging.utils import canonicalize_name  # pants: no-infer-dep

from kiln_pants.runtime import ACCELERATOR_PLUGINS

LOCKS = Path("3rdparty/python")
JAX_EXTRAS = {"cuda": "cuda13", "tpu": "tpu"}  # plugin resolve -> the jax extra it stands for


def locked(name: str) -> dict[str, dict]:
    text = (LOCKS / f"{name}.lock").read_text()
    lock = json.loads("".join(line for line in text.splitlines() if not line.startswith("//")))
    (resolve,) = lock["locked_resolves"]
    return {canonicalize_name(req["project_name"]): req for req in resolve["locked_requirements"]}


def jax_extra_requirements(extra: str) -> list[Requirement]:
    jax = locked("runtime")["jax"]
    requirements = [Requirement(text) for text in jax["requires_dists"]]
    return [r for r in requirements if r.marker and r.marker.evaluate({"extra": extra})]


@pytest.mark.parametrize("kind", sorted(ACCELERATOR_PLUGINS))
def test_accelerator_plugins_are_locked_at_the_versions_jax_wants(kind: str) -> None:
    plugins = ACCELERATOR_PLUGINS[kind]
    lock = locked(plugins.resolve)
    for name in plugins.requirements:
        assert canonicalize_name(name) in lock, f"{name} is not in {plugins.resolve}.lock"
    runtime = locked("runtime")
    wanted = jax_extra_requirements(JAX_EXTRAS[plugins.resolve])
    assert wanted, f"jax {runtime['jax']['version']} has no {JAX_EXTRAS[plugins.resolve]} extra"
    for requirement in wanted:
        name = canonicalize_name(requirement.name)
        version = (lock.get(name) or runtime.get(name) or {}).get("version")
        assert version is not None, f"{name} (jax[{JAX_EXTRAS[plugins.resolve]}]) is not locked"
        assert requirement.specifier.contains(version, prereleases=True), (
            f"{plugins.resolve}.lock has {name} {version}; jax {runtime['jax']['version']} wants "
            f"{requirement}. Fix 3rdparty/python/{plugins.resolve}-requirements.txt and run "
            f"./pants generate-lockfiles --resolve={plugins.resolve}"
        )


def test_cpu_runtime_pulls_no_accelerator_wheels() -> None:
    runtime = locked("runtime")
    assert not [n for n in runtime if n.startswith(("nvidia-", "jax-cuda", "libtpu"))]


def test_the_compile_only_resolve_matches_the_gpu_runtime() -> None:
    """lab:cuda-compiler compiles for the H200 with what a gpu(...) step runs: the same
    plugin and the same ptxas; nvdisasm, which only reads the cubins, is ptxas' release."""
    cuda, compile_only = locked("cuda"), locked("cuda-compile")
    assert {"jax-cuda13-plugin", "jax-cuda13-pjrt", "nvidia-cuda-nvcc"} <= set(compile_only)
    nvdisasm = compile_only.pop("nvidia-cuda-nvdisasm")
    assert nvdisasm["version"] == compile_only["nvidia-cuda-nvcc"]["version"]
    for name, requirement in compile_only.items():
        assert name in cuda, f"cuda-compile.lock has {name}, which cuda.lock does not"
        assert requirement["version"] == cuda[name]["version"], (
            f"cuda-compile.lock has {name} {requirement['version']}, cuda.lock "
            f"{cuda[name]['version']}: fix 3rdparty/python/cuda-compile-requirements.txt and run "
            "./pants generate-lockfiles --resolve=cuda-compile"
        )


def test_the_ray_node_requirements_are_the_runtime_locks() -> None:
    """A cluster node installs Ray from ray-node-requirements.txt: every pin and hash there is
    the runtime lock's, and Ray's own version is the one the runtime (and so the jobs) run."""
    runtime = locked("runtime")
    text = (LOCKS / "ray-node-requirements.txt").read_text()
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    tokens = " ".join(lines).replace("\\", " ").split()
    names = [token for token in tokens if "==" in token]
    hashes = [token.removeprefix("--hash=sha256:") for token in tokens if token.startswith("--hash=")]
    assert "ray==2.60.0" in names and runtime["ray"]["version"] == "2.60.0"
    locked_hashes = set()
    for name in names:
        project, version = name.split("==")
        requirement = runtime[canonicalize_name(project)]
        assert requirement["version"] == version, f"{name}: runtime.lock has {requirement['version']}"
        locked_hashes |= {artifact["hash"] for artifact in requirement["artifacts"]}
    assert hashes and set(hashes) <= locked_hashes
