"""The Ray actor each host of a cluster run is: it starts that host's `python -m kiln.runner`.

Standard library only at import (and Ray, present on every worker): the driver ships this module
by value, so a host needs no Kiln installed to run it; the runner it starts, and the actor's own
later imports, get Kiln's runtime from kiln.cluster.node_runtime.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from kiln.cluster import node_runtime

INPUTS = "{inputs}"  # replaced in the runner's argv by this host's inputs folder
_PR_SET_PDEATHSIG = 1
FLUSH_LINES = 200  # a host sends its trainer's output to the driver in batches of at most this
FLUSH_SECONDS = 0.25  # ... or of what came within this long
# kiln.artifacts.gcs's variable for a GCS emulator, which takes no credentials: restated, as
# this module imports no Kiln at import and that one would bring requests into every host.
EMULATOR_VARIABLE = "STORAGE_EMULATOR_HOST"
# TensorStore's error line when it finds no Google credentials (it then sends none), on every
# host's first GCS request.
NO_CREDENTIALS_LINE = "Could not find the credentials file in the standard gcloud location"
# A stopped trainer's exit code (a shell's for SIGTERM), and a host's whose stop came before its
# trainer started: a job stopped anywhere never reads as a success.
STOPPED_EXIT = 128 + signal.SIGTERM


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
    """One host of a run: reports where a coordinator can listen, then runs the runner in a
    folder of its own; on process 0's host, it also finds and mints for the run's control
    endpoint."""

    def __init__(self, run_dir: str) -> None:
        self._run_dir = run_dir  # where the runner builds (INPUTS: in this host's folder)
        self._process: subprocess.Popen[str] | None = None
        self._code = ""  # Kiln's sources on this node, once `run` has them
        # `stop` may come while `run` still fetches the runtime: the trainer then never starts.
        self._stop_asked = False
        self._starting = threading.Lock()

    def node(self) -> str:
        """This host's node, for people: its address and the start of its Ray node id."""
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        return f"{ray.util.get_node_ip_address()} ({node_id[:8]})"

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
        runtime: dict[str, Any],
        environment: dict[str, str],
        driver: Any,
        index: int,
    ) -> int:
        """Writes `files` (the step and its eval tasks) into a fresh folder and runs
        `python -m kiln.runner` there, with Kiln's runtime (node_runtime) and `environment` (the
        trainer's settings and the submitter's secrets) added to its own; each line of its output
        goes to the job's `driver`, in order. Returns its exit code (STOPPED_EXIT, without
        starting it, when a stop came first)."""
        if self._stop_asked:
            return STOPPED_EXIT
        import ray

        node = node_runtime.NodeRuntime.from_json(runtime)
        command, runtime_env = node_runtime.python_command(ray, node, "kiln.runner")
        self._code = str(node_runtime.fetch(ray, node.code))
        sys.path.insert(0, self._code)
        from kiln.control.redact import is_secret_name
        from kiln.control.tokens import hide_tokens  # the job's output is no place for them

        # A trainer that prints a key by mistake does not put it in the job's output either.
        secrets = [value for name, value in environment.items() if is_secret_name(name)]
        emulated = bool({**os.environ, **environment}.get(EMULATOR_VARIABLE))

        with tempfile.TemporaryDirectory(prefix="kiln-host-") as inputs:
            _write(files, Path(inputs))
            self._run_dir = self._run_dir.replace(INPUTS, inputs)
            env = {
                **os.environ,
                **environment,
                **runtime_env,
                "PYTHONUNBUFFERED": "1",  # each line reaches the job's output as it is printed
            }
            # Ray caps a 1-CPU actor at one thread (OMP_NUM_THREADS=1); the trainer is its
            # host's one process and may use every core (benchmarks/RESULTS.md).
            env.pop("OMP_NUM_THREADS", None)
            # lm-eval task files name their data relative to the step's folder: cwd=inputs.
            with self._starting:
                if self._stop_asked:
                    return STOPPED_EXIT
                self._process = subprocess.Popen(
                    command + [arg.replace(INPUTS, inputs) for arg in argv],
                    cwd=inputs,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    errors="replace",
                    preexec_fn=_die_with_parent,
                )
            assert self._process.stdout is not None
            with _OrderedOutput(ray, driver, index) as output:
                for line in self._process.stdout:
                    if is_noise(line, emulated):
                        continue
                    line = hide_tokens(line.rstrip())
                    for secret in secrets:
                        line = line.replace(secret, "[hidden]")
                    output.add(f"(host {index}) {line}")
            return self._process.wait()

    def endpoint(self, ttl_minutes: float | None) -> dict[str, Any] | None:
        """The control endpoint this host's trainer serves, if it serves one now (with a
        capability URL when `ttl_minutes`): kiln.cluster.endpoints.endpoint, on its node."""
        import ray

        process = self._process
        if process is None or process.poll() is not None or not self._code:
            return None
        if self._code not in sys.path:
            sys.path.insert(0, self._code)
        from kiln.cluster.endpoints import endpoint

        node = ray.util.get_node_ip_address()
        return endpoint(Path(self._run_dir), process.pid, node, ttl_minutes)

    def stop(self) -> None:
        """Asks the trainer to save a checkpoint and stop (SIGTERM), as Ctrl-C would locally;
        one not started yet never starts."""
        with self._starting:
            self._stop_asked = True
            if self._process is not None and self._process.poll() is None:
                self._process.send_signal(signal.SIGTERM)

    def abandon(self) -> None:
        """Ends the trainer at once (SIGKILL): its attempt is over (a host was lost elsewhere).
        `run` then returns and removes this host's folder, which a killed actor leaves."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()


def is_noise(line: str, emulated: bool) -> bool:
    """Whether a trainer's line stays out of the job's output: TensorStore's "no credentials"
    when the store is an emulator (no credentials is how one is used; against GCS it says why
    requests are refused, and shows)."""
    return emulated and NO_CREDENTIALS_LINE in line


def _write(files: dict[str, bytes], folder: Path) -> None:
    for name, content in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)


class _OrderedOutput:
    """Sends lines to the driver in batches, each batch once the previous one arrived: a host's
    lines reach the job's output in the order they were printed."""

    def __init__(self, ray: Any, driver: Any, index: int) -> None:
        self._ray, self._driver, self._index = ray, driver, index
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sender = threading.Thread(target=self._send_until_stopped, daemon=True)

    def __enter__(self) -> _OrderedOutput:
        self._sender.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._sender.join()
        self._flush()

    def add(self, line: str) -> None:
        with self._lock:
            self._lines.append(line)
            full = len(self._lines) >= FLUSH_LINES
        if full:
            self._flush()

    def _send_until_stopped(self) -> None:
        while not self._stop.wait(FLUSH_SECONDS):
            self._flush()

    def _flush(self) -> None:
        with self._lock:  # one batch in flight at a time, in order
            lines, self._lines = self._lines, []
            if lines:
                self._ray.get(self._driver.write.remote(lines))
