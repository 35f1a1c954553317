"""Connecting to a Ray cluster: the address a user gives (`ray://HOST:PORT` for Ray Client,
`HOST:PORT` for the cluster's GCS, `auto`, `local`), a probe that says within seconds what is
wrong with it, and a Ray Client session in Kiln's jobs namespace. Every failure is one
ClusterError line naming the address and what to do.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from kiln.cluster import driver, node_runtime
from kiln.cluster.errors import ClusterError

CONNECT_TIMEOUT_S = 5.0
CONNECT_ATTEMPTS = 3  # Ray Client may fail to start a session's server: ask again
# A head that answers but starts no session: Ray would wait forever. Ray Client tells a session
# still starting from one that never will by nothing, and a working head takes over 30 s when
# the session's server fails to start (Ray Client asks again after 30 s; docs/clusters.md,
# GRPC_ENABLE_FORK_SUPPORT).
SESSION_TIMEOUT_S = 180.0
# A session not started by then is said to be waited for, in one line: never a silent wait.
SESSION_NOTICE_S = 10.0
# A session's server says it cannot reach the GCS only when its GCS client gives up: about 40 s
# in with Ray's connect timeouts, about 7 s with these (node_runtime.GCS_CONNECT_TIMEOUTS).
SESSION_RUNTIME_ENV = {"env_vars": dict.fromkeys(node_runtime.GCS_CONNECT_TIMEOUTS, "2")}


def resolve_address(value: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The cluster to use: None for this machine (unset, empty or `local`); `auto` reads
    RAY_ADDRESS."""
    if value is None or value in ("", "local"):
        return None
    if value == "auto":
        address = environ.get("RAY_ADDRESS", "")
        if not address:
            raise ClusterError(
                "--cluster auto reads the cluster's address from RAY_ADDRESS, which is not set; "
                "set it, or give --cluster ray://HOST:PORT"
            )
        value = address
    scheme, separator, _ = value.partition("://")
    if separator and scheme != "ray":
        raise ClusterError(
            f"cluster address {value!r}: {scheme}:// is not a Ray address; give ray://HOST:PORT "
            "(Ray Client), HOST:PORT (the cluster's GCS), auto (RAY_ADDRESS) or local"
        )
    return value


def _host_port(address: str) -> tuple[str, int]:
    host_port = address.removeprefix("ray://")
    name, _, port = host_port.rpartition(":")
    if not name or not port.isdigit():
        raise ClusterError(
            f"cluster address {address!r}: expected ray://HOST:PORT (Ray Client), HOST:PORT, "
            "auto (RAY_ADDRESS) or local"
        )
    return name, int(port)


# One call each protocol answers: a port of the other kind answers UNIMPLEMENTED.
_RAY_CLIENT_CALL = "/ray.rpc.RayletDriver/ClusterInfo"
_GCS_CALL = "/ray.rpc.NodeInfoGcsService/GetClusterId"


def connect(address: str) -> Any:
    """`ray`, connected to the cluster at `address` in Kiln's namespace; ClusterError when it
    cannot be reached, is the other kind of port, or runs another Ray version."""
    _probe(address)
    import ray

    for attempt in range(CONNECT_ATTEMPTS):
        try:
            _init_within(ray, address, SESSION_TIMEOUT_S)
            break
        except ClusterError:
            raise
        except Exception as e:  # noqa: BLE001 - Ray raises many kinds; all mean "not connected"
            # Ray Client's server sometimes fails to start a session's server: ask again.
            if attempt + 1 < CONNECT_ATTEMPTS and "Initialization failure" in str(e):
                time.sleep(2.0)
                continue
            lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
            if any(line.startswith("Traceback") for line in lines):  # the server's: its cause
                lines = [lines[0], lines[-1]]
            reason = " ".join(lines[:3]) or type(e).__name__
            message = f"cannot connect to the Ray cluster at {address}: {reason}"
            raise ClusterError(message) from None
    for module in (driver, node_runtime):  # what runs on the nodes needs no Kiln there
        ray.cloudpickle.register_pickle_by_value(module)
    return ray


def _init_within(ray: Any, address: str, seconds: float) -> None:
    """`ray.init` of the cluster, or ClusterError after `seconds`. Ray Client waits without
    limit for a session whose server never starts (a head whose client server cannot reach its
    own GCS), printing only the server's retries; such a server says so in Ray Client's log
    stream when its GCS client gives up (SESSION_RUNTIME_ENV), which ends the wait at once. The
    waiting thread is left behind."""
    done, failures = threading.Event(), []

    def init() -> None:
        try:
            ray.init(
                address=address,
                namespace=driver.JOB_NAMESPACE,
                logging_level=logging.ERROR,
                log_to_driver=False,  # a job's output comes through its driver (jobs.follow)
                runtime_env=SESSION_RUNTIME_ENV,
            )
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            failures.append(e)
        finally:
            done.set()

    with _GcsUnreachable.watching() as unreachable:
        threading.Thread(target=init, name="kiln-ray-connect", daemon=True).start()
        _wait_for_session(done, unreachable, address, seconds)
    if failures:
        raise failures[0]


def _wait_for_session(
    done: threading.Event, unreachable: _GcsUnreachable, address: str, seconds: float
) -> None:
    """Until `done`: ClusterError once the session's server says it cannot reach the GCS, or
    after `seconds`; the wait said in one line after SESSION_NOTICE_S."""
    began, notice, noticed = time.monotonic(), min(SESSION_NOTICE_S, seconds), False
    while not done.wait(0.25):
        waited = time.monotonic() - began
        if unreachable.gcs is not None:
            raise ClusterError(
                f"the Ray cluster at {address} answers, but its Ray Client server cannot "
                f"reach the cluster's GCS at {unreachable.gcs}: check that the head's GCS "
                "is up and reachable from the head at that address (the head's "
                "ray start --node-ip-address)"
            )
        if waited >= seconds:
            raise ClusterError(
                f"the Ray cluster at {address} answers but started no session within "
                f"{seconds:.0f} s; its head's ray_client_server logs (in its session's "
                "logs folder) say why: often the head cannot reach its own GCS at the "
                "address it advertises (ray start --node-ip-address)"
            )
        if not noticed and waited >= notice:
            noticed = True
            print(
                f"kiln: the Ray cluster at {address} answers but has started no session in "
                f"{notice:.0f} s; waiting up to {seconds:.0f} s (Ray Client asks again 30 s "
                "after a session's server fails to start)",
                file=sys.stderr,
                flush=True,
            )


class _GcsUnreachable(logging.Handler):
    """Watches Ray Client's log stream (the session's server's own log lines, on the
    `ray.util.client.logsclient` logger) for the line Ray's client server logs when it cannot
    reach the cluster's GCS; `gcs` is the address it tried."""

    LINE = re.compile(r"Failed to put health check on (\S+)")
    LOGGER = "ray.util.client.logsclient"

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.gcs: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        found = self.LINE.search(record.getMessage())
        if found:
            self.gcs = found.group(1)

    @classmethod
    @contextlib.contextmanager
    def watching(cls) -> Iterator[_GcsUnreachable]:
        handler, logger = cls(), logging.getLogger(cls.LOGGER)
        logger.addHandler(handler)
        try:
            yield handler
        finally:
            logger.removeHandler(handler)


def _probe(address: str) -> None:
    """Within CONNECT_TIMEOUT_S: something listens at `address` and speaks the protocol its form
    names (Ray Client for ray://HOST:PORT, the cluster's GCS for HOST:PORT); else ClusterError
    saying which, before Ray itself would wait for a minute or more."""
    import grpc  # pants: no-infer-dep (Ray's own dependency)

    where = _host_port(address)
    try:
        socket.create_connection(where, timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise ClusterError(
            f"cannot reach the Ray cluster at {address} ({e.strerror or e}); check the address "
            "([kiln] cluster in pants.toml, or --cluster) and that the cluster is up"
        ) from None
    client = address.startswith("ray://")
    with grpc.insecure_channel(f"{where[0]}:{where[1]}") as channel:
        call = channel.unary_unary(_RAY_CLIENT_CALL if client else _GCS_CALL)
        try:
            call(b"", timeout=CONNECT_TIMEOUT_S)
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.UNIMPLEMENTED:
                raise ClusterError(_other_port(address, client)) from None
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise ClusterError(
                    f"{address} does not answer as a Ray cluster within "
                    f"{CONNECT_TIMEOUT_S:.0f} s ({code.name}); check the address and its port"
                ) from None


def _other_port(address: str, client: bool) -> str:
    host_port = address.removeprefix("ray://")
    if client:
        return (
            f"{address} is the cluster's GCS port, not its Ray Client port: give "
            f"ray://HOST:10001 (the head's --ray-client-server-port), or {host_port} on a node "
            "of the cluster"
        )
    return (
        f"{address} is a Ray Client port, not the cluster's GCS port: give ray://{host_port}"
    )
