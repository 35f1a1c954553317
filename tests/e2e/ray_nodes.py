"""The end-to-end tests' Ray cluster, started as docs/clusters.md's "Start a cluster" says: a venv
with only ray-node-requirements.txt installed, `ray start` on loopback, each node with a HOME
and a temp folder of its own and nothing of the repo. Kiln ships its runtime to them.

Each node also carries stand-ins for what Ray registers on a host of a 2-host v4-16 TPU slice
(its chips, the slice's name and the head resource; TPU_NAME), and a resource naming it, so that
its raylet can be found and killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kiln_testing.multihost import free_port
from kiln_testing.ray_cluster import stop_processes_under

NODE_REQUIREMENTS = Path("3rdparty/python/ray-node-requirements.txt")
NODE_PYTHON = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
SLICE = "kiln-test-slice"
STAND_INS = {"TPU": 4.0, "TPU-v4-16-head": 1.0, SLICE: 1.0}


def make_node_venv(venv: Path) -> Path:
    """A node's Python, as "Start a cluster" makes it: CPython and the pinned Ray, nothing else."""
    subprocess.run([str(NODE_PYTHON), "-m", "venv", str(venv)], check=True, timeout=300)
    pip = [str(venv / "bin/pip"), "install", "--quiet", "--no-deps", "--require-hashes", "-r",
           str(NODE_REQUIREMENTS.absolute())]  # fmt: skip
    environment = {**os.environ, "PIP_CONFIG_FILE": "/dev/null"}
    subprocess.run(pip, check=True, timeout=900, env=environment, cwd=venv.parent)
    return venv


class Cluster:
    """Ray nodes on loopback, each started by `ray start` with a HOME and TMPDIR of its own."""

    def __init__(self, venv: Path, root: Path) -> None:
        self.venv, self.root = venv, root
        self.gcs_port, self.client_port = free_port(), free_port()
        self.ray_root = Path(tempfile.mkdtemp(prefix="kray", dir="/tmp"))  # short socket paths

    @property
    def address(self) -> str:
        return f"ray://127.0.0.1:{self.client_port}"

    def start(self, name: str, *, head: bool = False) -> None:
        home, tmp = self.root / name / "home", self.root / name / "tmp"
        home.mkdir(parents=True, exist_ok=True)
        tmp.mkdir(parents=True, exist_ok=True)
        role = (["--head", "--port", str(self.gcs_port), "--ray-client-server-port",
                 str(self.client_port), "--include-dashboard", "false"] if head
                else ["--address", f"127.0.0.1:{self.gcs_port}"])  # fmt: skip
        resources = json.dumps({**STAND_INS, f"node-{name}": 1})
        command = [str(self.venv / "bin/ray"), "start", *role, "--node-ip-address", "127.0.0.1",
                   "--num-cpus", "1", "--temp-dir", str(self.ray_root),
                   "--resources", resources, "--object-store-memory", str(300 << 20),
                   "--disable-usage-stats"]  # fmt: skip
        environment = {
            "PATH": "/usr/bin:/bin", "HOME": str(home), "TMPDIR": str(tmp),
            "RAY_TMPDIR": str(self.ray_root), "RAY_USAGE_STATS_ENABLED": "0",
            "JAX_PLATFORMS": "cpu", "TPU_NAME": SLICE,
            **({"GRPC_ENABLE_FORK_SUPPORT": "0"} if head else {}),
        }  # fmt: skip
        result = subprocess.run(command, env=environment, cwd=home, capture_output=True,
                                text=True, timeout=180)  # fmt: skip
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]

    def kill_raylet(self, name: str) -> None:
        os.kill(_pid_naming("raylet", f"node-{name}"), signal.SIGKILL)

    @contextlib.contextmanager
    def gcs_paused(self) -> Iterator[None]:
        """The head's GCS stopped (SIGSTOP) while the block runs: its Ray Client server answers,
        and the sessions it starts cannot reach the GCS."""
        pid = _pid_naming("gcs_server", str(self.ray_root))
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    def stop(self) -> None:
        # The nodes' processes name their temp folder; Ray Client's servers name only the venv.
        for root in (self.ray_root, self.venv):
            stop_processes_under(root)
        shutil.rmtree(self.ray_root, ignore_errors=True)


def started_cluster(venv: Path, root: Path) -> Iterator[Cluster]:
    """A head and a second node, stopped at the end (failed or not)."""
    nodes = Cluster(venv, root)
    try:
        nodes.start("a", head=True)
        nodes.start("b")
        yield nodes
    finally:
        nodes.stop()


def _pid_naming(*words: str) -> int:
    """The one process whose command line has every word."""
    [pid] = [pid for pid, line in processes() if all(word in line for word in words)]
    return pid


def processes() -> Iterator[tuple[int, str]]:
    """(pid, command line) of every process."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            yield int(entry.name), line
