"""A Ray head that answers but never starts a client session is one error line, in bounded time.

The stand-in head is a gRPC server that answers the runner's probe (an empty `ClusterInfo`) and
Ray's PING as a Ray Client proxy does, and holds every other call of Ray's own client (its
session's start) unanswered: a head whose client server cannot reach its own GCS behaves so, and
Ray's `ray.init` waits on it without limit. Its log stream is Ray's own (`LogstreamServicer`,
which streams the server's `ray` loggers to the client): such a server logs, every 40 s or so,
that it cannot reach the GCS.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc  # pants: no-infer-dep (grpcio comes with ray[client], which the test imports)
import pytest
from kiln_testing.multihost import free_port
from kiln_testing.processes import python_env
from ray.core.generated import ray_client_pb2_grpc
from ray.core.generated.ray_client_pb2 import (
    ClusterInfoRequest,
    ClusterInfoResponse,
    ClusterInfoType,
)
from ray.util.client.server.logservicer import LogstreamServicer

from kiln.cluster import connection
from kiln.cluster.errors import ClusterError

PROBE = "/ray.rpc.RayletDriver/ClusterInfo"
LOGSTREAM = "/ray.rpc.RayletLogStreamer/Logstream"
GCS = "127.0.0.1:26379"  # where the stand-in's server "cannot reach" the GCS


class StuckHead(grpc.GenericRpcHandler):
    def __init__(self) -> None:
        self.released = threading.Event()
        self.held = 0

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if details.method == LOGSTREAM:
            return None  # Ray's own servicer's
        if details.method == PROBE:
            return grpc.unary_unary_rpc_method_handler(self.cluster_info)
        return grpc.unary_unary_rpc_method_handler(self.hold)

    def cluster_info(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """The runner's probe (empty) and Ray's PING are answered at once, as a Ray Client
        proxy answers them without a session's server."""
        if request == b"":
            return b""
        if ClusterInfoRequest.FromString(request).type == ClusterInfoType.PING:
            return ClusterInfoResponse(json="{}").SerializeToString()
        return self.hold(request, context)

    def hold(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self.held += 1
        self.released.wait(120)
        context.abort(grpc.StatusCode.UNAVAILABLE, "released")
        return b""


@pytest.fixture
def stuck_head() -> Iterator[tuple[str, StuckHead]]:
    head = StuckHead()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                         handlers=[head])  # fmt: skip
    ray_client_pb2_grpc.add_RayletLogStreamerServicer_to_server(LogstreamServicer(), server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        yield f"ray://127.0.0.1:{port}", head
    finally:
        head.released.set()
        server.stop(grace=None)


def test_a_head_that_starts_no_session_is_one_line_within_the_limit(
    stuck_head: tuple[str, StuckHead],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    address, head = stuck_head
    monkeypatch.setattr(connection, "SESSION_TIMEOUT_S", 3.0)
    monkeypatch.setattr(connection, "SESSION_NOTICE_S", 1.0)
    began = time.monotonic()
    with pytest.raises(ClusterError) as raised:
        connection.connect(address)
    assert time.monotonic() - began < 20
    assert head.held >= 1  # Ray's own client got through the probe and was held
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(
        f"the Ray cluster at {address} answers but started no session within 3 s; "
    )
    assert "ray_client_server" in message
    # Said while it waited, in one line: the wait is never silent.
    [notice] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("kiln:")]
    assert notice.startswith(
        f"kiln: the Ray cluster at {address} answers but has started no session in 1 s; "
        "waiting up to 3 s ("
    ), notice


# A client of its own: Ray Client holds one session per process, and this one's never started.
CONNECT_SCRIPT = """
import sys
from kiln.cluster import connection
from kiln.cluster.errors import ClusterError
try:
    connection.connect(sys.argv[1])
except ClusterError as e:
    print(e)
"""


def test_a_head_whose_server_cannot_reach_its_gcs_is_named_as_soon_as_it_says_so(
    stuck_head: tuple[str, StuckHead],
) -> None:
    """The line Ray's client server logs (ray.util.client.server.server, each pass of its health
    check) reaches the client through the log stream and ends its wait at once."""
    address, _ = stuck_head
    env = python_env()
    client = subprocess.Popen([sys.executable, "-c", CONNECT_SCRIPT, address], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    began = time.monotonic()
    try:
        while client.poll() is None:  # as the server's health check logs, until it is heard
            assert time.monotonic() - began < 60, "no error within 60 s"
            logging.getLogger("ray.util.client.server.server").error(
                f"[specific-server] Failed to put health check on {GCS}"
            )
            time.sleep(0.5)
    finally:
        client.kill()
    stdout, stderr = client.communicate()
    message = stdout.strip()
    assert message.startswith(
        f"the Ray cluster at {address} answers, but its Ray Client server cannot reach the "
        f"cluster's GCS at {GCS}: "
    ), stdout + stderr[-3000:]
    assert "\n" not in message
