"""What the submitting machine ships to a cluster's nodes for a job (kiln.cluster.node_runtime):
Kiln's sources, the runtime PEX that Pants built for the run, and for an accelerator the
plugin lockfile's pinned requirements, which the nodes install themselves.

The Pants backend names the PEX and the plugin lockfile in the runner's environment
(KILN_RUNTIME_PEX, KILN_PLUGIN_LOCK). Without KILN_RUNTIME_PEX (a runner started by hand) the
nodes run Kiln's sources with their own Python, which must then hold the runtime's packages.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kiln.cluster import node_runtime
from kiln_contract.shipping import PLUGIN_LOCK_VARIABLE, RUNTIME_PEX_VARIABLE
from kiln_contract.train import Resources


def ship_runtime(ray: Any, resources: Resources) -> node_runtime.NodeRuntime:
    """Ships the job's runtime into depots on the cluster (each once per digest)."""
    code = node_runtime.ship(ray, "code", *_code_files())
    pex = os.environ.get(RUNTIME_PEX_VARIABLE)
    runtime, name = None, ""
    if pex:
        folder = Path(pex)
        name = folder.name
        files = node_runtime.folder_files(folder, name)
        runtime = node_runtime.ship(ray, "runtime", node_runtime.pex_digest(folder), files)
    lock = os.environ.get(PLUGIN_LOCK_VARIABLE)
    plugins = ""
    if lock and resources.kind in ("gpu", "tpu"):
        plugins = locked_requirements(Path(lock).read_text())
    return node_runtime.NodeRuntime(code, runtime, name, plugins)


def _code_files() -> tuple[str, list[tuple[str, Path]]]:
    """The digest and files of the `kiln` and `kiln_contract` packages this process runs."""
    import kiln
    import kiln_contract

    files = []
    for package in (kiln, kiln_contract):
        assert package.__file__ is not None  # regular packages, not namespaces
        root = Path(package.__file__).parent
        files += node_runtime.folder_files(root, root.name)
    return node_runtime.digest_of(files), files


def locked_requirements(lock_text: str) -> str:
    """Every requirement of a Pants (pex) lockfile as pip's hash-checked lines
    (`name==version --hash=sha256:...`), for a node to install with `--require-hashes`."""
    lock = json.loads("\n".join(line for line in lock_text.splitlines()
                                 if not line.startswith("//")))  # fmt: skip
    lines = []
    for resolve in lock["locked_resolves"]:
        for requirement in resolve["locked_requirements"]:
            hashes = " ".join(
                f"--hash={artifact['algorithm']}:{artifact['hash']}"
                for artifact in requirement["artifacts"]
            )
            lines.append(f"{requirement['project_name']}=={requirement['version']} {hashes}")
    return "\n".join(sorted(lines)) + "\n"
