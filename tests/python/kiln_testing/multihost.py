"""Running a multi-host job on one machine: one subprocess per "host", CPU devices each."""

from __future__ import annotations

import socket
import subprocess

from kiln_testing.processes import python_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_each(commands: list[list[str]], devices: int) -> list[subprocess.CompletedProcess]:
    """Starts every command at once (one process each, `devices` CPU devices in each), then waits
    for all of them."""
    env = python_env(
        JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}"
    )
    processes = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for command in commands
    ]
    results = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=300)
        results.append(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
    return results


def multihost_flags(num_processes: int) -> list[list[str]]:
    """Each process's --coordinator/--num-processes/--process-id, one free port for all."""
    coordinator = f"127.0.0.1:{free_port()}"
    return [
        ["--coordinator", coordinator, "--num-processes", str(num_processes), "--process-id", str(i)]
        for i in range(num_processes)
    ]
