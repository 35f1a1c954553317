"""A Ray head that answers but never starts a client session is one error line, in bounded time.

The stand-in head is a gRPC server that answers the runner's probe (an empty `ClusterInfo`) as a
Ray Client server does, and holds every call of Ray's own client (its PING first) unanswered: a
head whose client server cannot reach its own GCS behaves so, and Ray's `ray.init` waits on it
without limit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc  # pants: no-infer-dep (grpcio comes with ray[client], which the test imports)
import pytest
from kiln_testing.multihost import free_port

from kiln.cluster import connection

PROBE = "/ray.rpc.RayletDriver/ClusterInfo"


class StuckHead(grpc.GenericRpcHandler):
    def __init__(self) -> None:
        self.released = threading.Event()
        self.held = 0

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        return grpc.unary_unary_rpc_method_handler(self.answer)

    def answer(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        if request == b"":  # the probe's call: answered at once, as a Ray Client server does
            return b""
        self.held += 1
        self.released.wait(120)
        context.abort(grpc.StatusCode.UNAVAILABLE, "released")
        return b""


@pytest.fixture
def stuck_head() -> Iterator[tuple[str, StuckHead]]:
    head = StuckHead()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                         handlers=[head])  # fmt: skip
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
    with pytest.raises(connection.ClusterError) as raised:
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
