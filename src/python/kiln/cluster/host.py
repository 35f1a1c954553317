"""The Ray actor each host of a cluster run is: it starts that host's `python -m kiln.runner`.

Standard library only at import (and Ray, present on every worker): the driver ships this module
by value, so a host needs no Kiln installed to run it; the runner it starts, and the actor's own
later imports, find Kiln's sources in the shared store (`PYTHONPATH`, see dispatch.ship_code).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

INPUTS = "{inputs}"  # replaced in the runner's argv by this host's inputs folder
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the trainer process: a killed host actor takes its trainer with it (Linux)."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def slice_of_node() -> tuple[str | None, str]:
    """A Ray task on a TPU slice's host 0: the slice's name (the resource every host of the
    slice carries; None off TPU VMs) and this node's id."""
    import ray
    from ray.util.tpu import get_current_pod_name

    return get_current_pod_name(), ray.get_runtime_context().get_node_id()


class TrainerHost:
    """One host of a run: reports where a coordinator can listen, then runs the runner; on
    process 0's host, it also finds and mints for the run's control endpoint."""

    def __init__(self, run_dir: str) -> None:
        self._run_dir = run_dir  # the run's folder in the store: process 0 records its endpoint
        self._process: subprocess.Popen[str] | None = None
        self._code = ""  # Kiln's sources in the store, once `run` has them

    def coordinator_address(self) -> str:
        """This node's address and a port free on it now, for jax.distributed's coordinator."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def run(
        self,
        files: dict[str, bytes],
        argv: list[str],
        pythonpath: str,
        environment: dict[str, str],
        driver: Any,
        index: int,
    ) -> int:
        """Writes `files` (the step and its eval tasks) to a fresh folder and runs
        `python -m kiln.runner` there with `environment` (the submitter's secrets) added to its
        own, each line of its output sent to the job's `driver`; returns its exit code."""
        self._code = pythonpath
        self._find_kiln()
        from kiln.control.redact import is_secret_name
        from kiln.control.tokens import hide_tokens  # the job's output is no place for them

        # A trainer that prints a key by mistake does not put it in the job's output either.
        secrets = [value for name, value in environment.items() if is_secret_name(name)]

        with tempfile.TemporaryDirectory(prefix="kiln-host-") as inputs:
            for name, content in files.items():
                path = Path(inputs, name)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(content)
            paths = [pythonpath, os.environ.get("PYTHONPATH", "")]
            env = {
                **os.environ,
                **environment,
                "PYTHONPATH": os.pathsep.join(p for p in paths if p),
                "PYTHONUNBUFFERED": "1",  # each line reaches the job's output as it is printed
            }
            # Ray caps a 1-CPU actor at one thread (OMP_NUM_THREADS=1); the trainer is its
            # host's one process and may use every core (benchmarks/RESULTS.md).
            env.pop("OMP_NUM_THREADS", None)
            command = [sys.executable, "-m", "kiln.runner"]
            command += [arg.replace(INPUTS, inputs) for arg in argv]
            self._process = subprocess.Popen(
                command,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                preexec_fn=_die_with_parent,
            )
            assert self._process.stdout is not None
            for line in self._process.stdout:
                line = hide_tokens(line.rstrip())
                for secret in secrets:
                    line = line.replace(secret, "[hidden]")
                driver.write.remote(f"(host {index}) {line}")
            return self._process.wait()

    def endpoint(self, ttl_minutes: float | None) -> dict[str, Any] | None:
        """The control endpoint this host's trainer serves, if it serves one now (with a
        capability URL when `ttl_minutes`): kiln.cluster.endpoints.endpoint, on its node."""
        import ray

        process = self._process
        if process is None or process.poll() is not None:
            return None
        self._find_kiln()
        from kiln.cluster.endpoints import endpoint

        node = ray.util.get_node_ip_address()
        return endpoint(Path(self._run_dir), process.pid, node, ttl_minutes)

    def _find_kiln(self) -> None:
        """Puts Kiln's sources in the store on this worker's path (it is shipped without
        them)."""
        if self._code not in sys.path:
            sys.path.insert(0, self._code)

    def stop(self) -> None:
        """Asks the trainer to save a checkpoint and stop (SIGTERM), as Ctrl-C would locally."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
