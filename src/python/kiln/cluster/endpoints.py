"""A cluster job's training-control endpoint (docs/clusters.md, "The control endpoint").

Process 0's trainer records its endpoint and key under the run's folder in the store
(kiln.control.tokens); the job finds them through the host actor that started process 0, on that
process's node (`endpoint`). Minting happens there too, with the key of the process that serves,
and the URL travels back to the one caller of `python -m kiln.cluster mint`: the token is never
printed into the job's output (`kiln.control.tokens.hide_tokens`), its records or its status.
"""

from __future__ import annotations

import ipaddress
import time
from pathlib import Path
from typing import Any

from kiln.control.tokens import EndpointError, mint_token, read_endpoint

KIND = "training-control"  # the endpoint's name within its job: JOB/training-control
SERVES = "GET / (control page), GET healthz, POST checkpoint"


def endpoint_name(job_id: str) -> str:
    return f"{job_id}/{KIND}"


def job_of(name: str) -> str:
    """The job id in `JOB` or `JOB/training-control` (what `endpoints` lists)."""
    return name.removesuffix(f"/{KIND}")


def endpoint(
    run_dir: Path, pid: int, node: str, ttl_minutes: float | None = None
) -> dict[str, Any] | None:
    """On process 0's node: the endpoint that process `pid` serves for the run in `run_dir`
    (host, port, node), with a capability URL and its expiry when `ttl_minutes` is given; None
    while it serves none (starting, or control disabled). `ttl_minutes` is checked by the
    caller (kiln_contract.vocabulary.check_token_ttl)."""
    try:
        recorded, key = read_endpoint(run_dir)
    except EndpointError:
        return None
    if recorded.pid != pid:  # an earlier attempt's record: a killed trainer leaves it behind
        return None
    found: dict[str, Any] = {"host": recorded.host, "port": recorded.port, "node": node}
    if ttl_minutes is not None:
        expires_at = int(time.time() + ttl_minutes * 60)
        found.update(url=recorded.url(mint_token(key, expires_at)), expires_at=expires_at)
    return found


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def listing(job_id: str, found: dict[str, Any]) -> str:
    """`endpoints`' line: name, where it listens, process 0's node, what it serves."""
    return (
        f"{endpoint_name(job_id)}  {found['host']}:{found['port']}  node {found['node']}  "
        f"{SERVES}"
    )


def reach(found: dict[str, Any]) -> str:
    """How another machine reaches the endpoint."""
    host, port, node = found["host"], found["port"], found["node"]
    if is_loopback(host):
        return (
            f"it listens on loopback on node {node}: from another machine, open a tunnel "
            f"first (ssh -N -L {port}:{host}:{port} {node}), then use the URL as it is"
        )
    return f"it listens on {host}:{port}: reachable directly where that address is"


def minted(found: dict[str, Any]) -> str:
    """`mint`'s output, in the reference's `KEY VALUE` lines (awk '$1 == "url" {print $2}')."""
    expires = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(found["expires_at"]))
    return f"url {found['url']}\nexpires {expires}"
