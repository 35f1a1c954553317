"""How long a Ray Client session takes to start on a head with gRPC's fork handlers on (their
default) and off (`GRPC_ENABLE_FORK_SUPPORT=0`, as docs/clusters.md starts the head).

    ./pants run benchmarks/ray_client_sessions.py -- [--sessions 16]

Ray Client's server on the head starts a server of its own for each session by fork and exec.
With gRPC's fork handlers on, the child now and then dies before it execs when other threads of
the parent are in gRPC (the sessions before it closing); Ray Client then waits 30 s for the
server before it tries again. Each session here is a process of its own that connects through
Kiln's `connect` and ends, one after the other, on a two-node loopback cluster
(kiln_testing.ray_cluster): either closing its session as a Kiln command does, or cut off (as a
killed command or a dropped connection leaves it, `os._exit`). A start over 10 s is slow.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import statistics
import time

from kiln_testing.ray_cluster import ray_cluster

from kiln.cluster.connection import connect

SLOW_S = 10.0


def _session(address: str, cut_off: bool) -> None:
    connect(address)
    if cut_off:
        os._exit(0)


def session_seconds(address: str, sessions: int, cut_off: bool) -> list[float]:
    """Seconds per session, each in a process of its own (spawned: no Ray state inherited)."""
    spawn = multiprocessing.get_context("spawn")
    seconds = []
    for _ in range(sessions):
        began = time.monotonic()
        session = spawn.Process(target=_session, args=(address, cut_off))
        session.start()
        session.join(timeout=300)
        if session.exitcode != 0:
            raise SystemExit(f"a session to {address} failed (exit code {session.exitcode})")
        seconds.append(time.monotonic() - began)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=16)
    args = parser.parse_args()
    heads = {"fork handlers on (gRPC's default)": {},
             "GRPC_ENABLE_FORK_SUPPORT=0": {"GRPC_ENABLE_FORK_SUPPORT": "0"}}  # fmt: skip
    results = {}
    for name, node_env in heads.items():
        for cut_off in (False, True):
            with ray_cluster({"kiln-bench": 1.0}, node_env=node_env) as address:
                results[name, cut_off] = session_seconds(address, args.sessions, cut_off)
    print(f"{args.sessions} sessions per row, one after the other, on a fresh cluster; "
          f"{platform.machine()}, Python {platform.python_version()}\n")  # fmt: skip
    print("| head | sessions end | median s | max s | slow (> 10 s) | total s | total vs fork "
          "handlers on |")
    print("|---|---|---|---|---|---|---|")
    for (name, cut_off), seconds in results.items():
        baseline = sum(results[next(iter(heads)), cut_off])
        slow = sum(1 for s in seconds if s > SLOW_S)
        print(f"| {name} | {'cut off' if cut_off else 'closed'} | "
              f"{statistics.median(seconds):.1f} | {max(seconds):.1f} | {slow} of {len(seconds)} "
              f"| {sum(seconds):.0f} | {sum(seconds) / baseline:.2f} |")


if __name__ == "__main__":
    main()
