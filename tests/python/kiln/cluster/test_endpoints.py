"""A cluster job's control endpoint without Ray: found where process 0 records it, minted with
that process's key, listed and printed as `python -m kiln.cluster endpoints / mint` do."""

from __future__ import annotations

import http.client
import json
import os
import time
from pathlib import Path
from urllib.parse import urlsplit

from kiln.cluster.dispatch import STEP_FILE, ClusterJob
from kiln.cluster.endpoints import endpoint, job_of, listing, minted, reach
from kiln.control.server import ControlServer
from kiln_contract.train import Resources

HEADER = {"X-Levanter-Training-Control": "request-checkpoint"}


def post(url: str, headers: dict[str, str]) -> int:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        connection.request("POST", parts.path, headers=headers)
        return connection.getresponse().status
    finally:
        connection.close()


def test_the_url_minted_where_process_0_records_its_endpoint_requests_a_checkpoint(
    tmp_path: Path,
) -> None:
    assert endpoint(tmp_path, os.getpid(), "10.0.0.5", 5.0) is None  # not serving yet
    server = ControlServer(tmp_path, {"name": "tiny"}, {})
    port = urlsplit(server.start()).port
    try:
        listed = endpoint(tmp_path, os.getpid(), "10.0.0.5")
        assert listed == {"host": "127.0.0.1", "port": port, "node": "10.0.0.5"}
        found = endpoint(tmp_path, os.getpid(), "10.0.0.5", 5.0)
        assert found is not None and found["url"].startswith(f"http://127.0.0.1:{port}/c/")
        assert 0 < found["expires_at"] - time.time() <= 5 * 60
        assert post(found["url"] + "checkpoint", {}) == 403  # the header is still required
        assert post(found["url"] + "checkpoint", HEADER) == 202
        assert server.take_checkpoint_request()
        # Another process's record (an earlier attempt's trainer, killed) is not this job's.
        assert endpoint(tmp_path, os.getpid() + 1, "10.0.0.5", 5.0) is None
    finally:
        server.stop()
    assert endpoint(tmp_path, os.getpid(), "10.0.0.5") is None


def test_listing_and_minted_lines_follow_the_reference_and_say_how_to_reach_it() -> None:
    job = "tiny-20261201-103000-3fa2"
    found = {"host": "127.0.0.1", "port": 41234, "node": "10.0.0.5"}
    line = listing(job, found)
    assert line == (
        f"{job}/training-control  127.0.0.1:41234  node 10.0.0.5  "
        "GET / (control page), GET healthz, POST checkpoint"
    )
    assert line.split()[0].endswith("training-control")  # awk '$1 ~ /training-control$/'
    assert job_of(line.split()[0]) == job and job_of(job) == job
    assert "ssh -N -L 41234:127.0.0.1:41234 10.0.0.5" in reach(found)
    direct = {**found, "host": "node7.example.com"}
    assert reach(direct) == "it listens on node7.example.com:41234: reachable directly where " \
                            "that address is"  # fmt: skip
    url = "http://127.0.0.1:41234/c/TOKEN/"
    expires_at = int(time.mktime((2026, 12, 1, 22, 0, 0, 0, 0, -1)))
    printed = minted({**found, "url": url, "expires_at": expires_at})
    assert printed == f"url {url}\nexpires 2026-12-01 22:00:00"


def test_a_cluster_job_knows_the_run_folder_process_0_records_its_endpoint_in() -> None:
    step = {"name": "checkpoints/tiny", "version": "2026.11.29"}
    job = ClusterJob("j", "checkpoints/tiny@2026.11.29", "ray://h:1", Resources("cpu"),
                     {STEP_FILE: json.dumps(step).encode()}, "/store")  # fmt: skip
    assert job.run_dir("/inputs") == "/store/checkpoints/tiny/2026.11.29"
