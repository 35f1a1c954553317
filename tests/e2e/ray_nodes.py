"""The end-to-end tests' Ray cluster: docs/clusters.md's "A cluster on one machine" as written, in
a HOME of its own. The node venv is made as "Start a cluster" says (only
ray-node-requirements.txt); `scripts/one_machine_cluster.sh start` starts moto's S3 server with
the bucket, the head and a second node, each node with a HOME and a temp folder of its own and
nothing of the repo; Kiln ships its runtime to them. Only the ports (free ones) and the bucket's
name are the tests' own.

Each node also carries stand-ins for what Ray registers on a host of a 2-host v4-16 TPU slice
(its chips, the slice's name and the head resource; TPU_NAME).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from kiln_testing.buckets import BUCKET, s3_environment
from kiln_testing.multihost import free_port
from kiln_testing.processes import command_lines, environment, python_env

SCRIPT = Path("scripts/one_machine_cluster.sh").absolute()
NODE_REQUIREMENTS = Path("3rdparty/python/ray-node-requirements.txt")
NODE_PYTHON = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
SLICE = "kiln-test-slice"
STAND_INS = {"TPU": 4.0, "TPU-v4-16-head": 1.0, SLICE: 1.0}
OBJECT_STORE_BYTES = 300 << 20


def make_node_venv(venv: Path) -> Path:
    """A node's Python, as "Start a cluster" makes it: CPython and the pinned Ray, nothing else.
    Then moto's server, which the one-machine recipe pip-installs: here the tests' own moto (the
    runtime lock's version, as the recipe pins it), through a launcher in the venv's bin."""
    subprocess.run([str(NODE_PYTHON), "-m", "venv", str(venv)], check=True, timeout=300)
    pip = [str(venv / "bin/pip"), "install", "--quiet", "--no-deps", "--require-hashes", "-r",
           str(NODE_REQUIREMENTS.absolute())]  # fmt: skip
    environment = {**os.environ, "PIP_CONFIG_FILE": "/dev/null"}
    subprocess.run(pip, check=True, timeout=900, env=environment, cwd=venv.parent)
    launcher = venv / "bin/moto_server"
    launcher.write_text(
        f"#!/bin/sh\nPYTHONPATH='{python_env()['PYTHONPATH']}' "
        f'exec {sys.executable} -m moto.server "$@"\n'
    )
    launcher.chmod(0o755)
    return venv


class Cluster:
    """The recipe's cluster in `home` (the venv at ~/kiln-node, the nodes under ~/kiln-nodes)."""

    def __init__(self, home: Path) -> None:
        self.home, self.root = home, home / "kiln-nodes"
        self.gcs_port, self.client_port, self.s3_port = free_port(), free_port(), free_port()

    @property
    def address(self) -> str:
        return f"ray://127.0.0.1:{self.client_port}"

    @property
    def s3_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    @property
    def ray_root(self) -> Path:
        """The nodes' Ray folder (their sockets, sessions and logs)."""
        return Path((self.root / "ray-temp-dir").read_text().strip())

    def script(self, *args: str) -> str:
        """`scripts/one_machine_cluster.sh ARGS` with this cluster's settings; its output."""
        resources = json.dumps(STAND_INS, separators=(",", ":"))
        environment = {
            "PATH": "/usr/bin:/bin", "HOME": str(self.home), "JAX_PLATFORMS": "cpu",
            "TPU_NAME": SLICE, "KILN_GCS_PORT": str(self.gcs_port),
            "KILN_CLIENT_PORT": str(self.client_port), "KILN_S3_PORT": str(self.s3_port),
            "KILN_BUCKET": BUCKET,
            "KILN_RAY_ARGS": f"--resources {resources} --object-store-memory {OBJECT_STORE_BYTES}",
        }  # fmt: skip
        result = subprocess.run(["bash", str(SCRIPT), *args], env=environment, cwd=self.home,
                                capture_output=True, text=True, timeout=180)  # fmt: skip
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        return result.stdout

    def kill_raylet(self, name: str) -> None:
        """SIGKILLs node `name`'s raylet (the one whose HOME is the node's)."""
        home = str(self.root / name / "home")
        [pid] = [pid for pid, line in command_lines() if "raylet" in line.split(" ")[0]
                 and environment(pid).get("HOME") == home]  # fmt: skip
        os.kill(pid, signal.SIGKILL)

    @contextlib.contextmanager
    def gcs_paused(self) -> Iterator[None]:
        """The head's GCS stopped (SIGSTOP) while the block runs: its Ray Client server answers,
        and the sessions it starts cannot reach the GCS."""
        [pid] = [pid for pid, line in command_lines() if "gcs_server" in line
                 and str(self.ray_root) in line]  # fmt: skip
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)


def started_cluster(home: Path) -> Iterator[Cluster]:
    """The recipe's bucket, head and second node, with AWS_* set for its S3 server here; all
    stopped at the end (failed or not)."""
    nodes = Cluster(home)
    try:
        nodes.script("start")
        with s3_environment(nodes.s3_endpoint, home):
            yield nodes
    finally:
        if (nodes.root / "ray-temp-dir").exists():
            nodes.script("stop")
