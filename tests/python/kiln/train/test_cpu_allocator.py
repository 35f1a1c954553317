"""The allocator setting of CPU training processes: what it asks of glibc, glibc does.

A process allocates, touches and frees a 64 MiB buffer (the size of the quickstart's lm-head
logits) a few times on a worker thread, as XLA's CPU executables do at every step, and counts
the page faults of the later rounds: by default glibc gives such a buffer back when it is freed
and every round faults it in again; with Resources("cpu").process_env() the memory is kept.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from kiln_contract.train import Resources

_ROUNDS = """
import ctypes, resource, threading
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
SIZE = 64 << 20

def round_trip():
    buffer = libc.malloc(SIZE)
    ctypes.memset(buffer, 1, SIZE)  # touched, as a computation's output is
    libc.free(buffer)

def on_a_thread():
    thread = threading.Thread(target=round_trip)
    thread.start()
    thread.join()

on_a_thread()  # the first round faults the memory in either way
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    on_a_thread()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults_of_later_rounds(env: dict[str, str]) -> int:
    clean = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    result = subprocess.run(
        [sys.executable, "-c", _ROUNDS], env={**clean, **env}, capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    return int(result.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a glibc setting")
def test_a_cpu_trainer_keeps_its_large_buffers_between_steps():
    pages = 3 * (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert _faults_of_later_rounds({}) > pages // 2  # the default: faulted in every round
    assert _faults_of_later_rounds(Resources("cpu").process_env()) < pages // 20


def test_only_cpu_trainers_get_the_setting():
    assert set(Resources("cpu").process_env()) == {"GLIBC_TUNABLES"}
    assert Resources("gpu", "H100", 8).process_env() == {}
    assert Resources("tpu", "v4-8").process_env() == {}
