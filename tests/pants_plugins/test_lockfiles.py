"""The lockfiles agree with each other: the CUDA plugin that gpu(...) steps layer onto the runtime
must be built for the runtime's jaxlib (jax refuses a plugin of another version at start-up), and
the CPU runtime must not pull CUDA wheels (every CPU run and CI would download them)."""

from __future__ import annotations

import json
from pathlib import Path

LOCKS = Path("3rdparty/python")


def locked_versions(name: str) -> dict[str, str]:
    text = (LOCKS / name).read_text()
    lock = json.loads("".join(line for line in text.splitlines() if not line.startswith("//")))
    (resolve,) = lock["locked_resolves"]
    return {req["project_name"]: req["version"] for req in resolve["locked_requirements"]}


def test_cuda_plugin_is_built_for_the_runtime_jaxlib() -> None:
    runtime, cuda = locked_versions("runtime.lock"), locked_versions("cuda.lock")
    assert runtime["jax"] == runtime["jaxlib"]
    assert cuda["jax-cuda13-plugin"] == cuda["jax-cuda13-pjrt"] == runtime["jaxlib"], (
        "3rdparty/python/cuda-requirements.txt must pin jax's CUDA plugin to the runtime's jaxlib "
        f"({runtime['jaxlib']}); regenerate with ./pants generate-lockfiles --resolve=cuda"
    )
    assert any(name.startswith("nvidia-cudnn") for name in cuda)


def test_cpu_runtime_pulls_no_cuda_wheels() -> None:
    runtime = locked_versions("runtime.lock")
    assert not [name for name in runtime if name.startswith(("nvidia-", "jax-cuda"))]
