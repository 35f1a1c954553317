"""A real two-node Ray cluster on loopback whose nodes run Kiln from this environment (for
benchmarks/cluster_overhead.py): `ray start --head` plus a second node joining it, one CPU
each, custom resources standing in for accelerators. The tests use a cluster started the
documented way instead (scripts/one_machine_cluster.sh, from tests/e2e/ray_nodes.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kiln_testing.multihost import free_port
from kiln_testing.processes import command_lines, python_env

RAY = [sys.executable, "-m", "ray.scripts.scripts"]
OBJECT_STORE_BYTES = 200 * 2**20


@contextmanager
def ray_cluster(
    node_resources: dict[str, float],
    num_gpus: int = 0,
    devices: int = 1,
    node_env: dict[str, str] | None = None,
) -> Iterator[str]:
    """Starts the two nodes (each with `devices` jax CPU devices for its workers, and `node_env`
    in their environment) and yields the Ray Client address; at the end, stops every process
    the nodes started."""
    # Ray's socket paths must stay under 108 bytes: a short folder of the test's own.
    root = Path(tempfile.mkdtemp(prefix="kray", dir="/tmp"))
    env = python_env(
        RAY_TMPDIR=str(root),
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        RAY_USAGE_STATS_ENABLED="0",
        **(node_env or {}),
    )
    gcs_port, client_port = free_port(), free_port()
    node = ["--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--num-gpus", str(num_gpus),
            "--object-store-memory", str(OBJECT_STORE_BYTES), "--temp-dir", str(root),
            "--resources", json.dumps(node_resources), "--disable-usage-stats"]  # fmt: skip
    try:
        _ray(env, "start", "--head", "--port", str(gcs_port), "--ray-client-server-port",
             str(client_port), "--include-dashboard", "false", *node)  # fmt: skip
        _ray(env, "start", "--address", f"127.0.0.1:{gcs_port}", *node)
        yield f"ray://127.0.0.1:{client_port}"
    finally:
        _stop_processes_under(root)
        shutil.rmtree(root, ignore_errors=True)


def _ray(env: dict[str, str], *args: str) -> None:
    result = subprocess.run([*RAY, *args], env=env, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        output = f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
        raise RuntimeError(f"ray {args[0]} failed:\n{output}")


def _stop_processes_under(root: Path) -> None:
    """Ends the processes whose command line names `root` (the nodes, their workers and
    agents: the ones `ray_cluster` started), by process id: TERM, then KILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _pids_naming(str(root))
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while pids and time.monotonic() < deadline and _pids_naming(str(root)):
            time.sleep(0.2)


def _pids_naming(text: str) -> list[int]:
    return [pid for pid, line in command_lines() if text in line]
