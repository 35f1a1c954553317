"""kiln.artifacts.lease: one holder at a time, renewed, released, taken over only when stale."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kiln.artifacts.lease import Lease, LeaseHeld, LeaseRecord, lease_key
from kiln.artifacts.local import LocalStore

HOLDER = Path(__file__).with_name("lease_holder.py")


def foreign_lease(folder: Path, *, host: str, pid: int, expires_in: float) -> None:
    """A lease written by another process, as it would have written it."""
    now = time.time()
    record = LeaseRecord(
        owner="elsewhere", host=host, pid=pid, pid_started=None, what="train x@v",
        created=now - 60, expires=now + expires_in,
    )  # fmt: skip
    LocalStore(folder.parent).create(lease_key(folder.name), record.to_bytes())


def lease_file(folder: Path) -> Path:
    return folder.parent / f".{folder.name}.lease"


def test_lease_keys_sit_beside_their_folder() -> None:
    assert lease_key("tokenized/x/v1") == "tokenized/x/.v1.lease"
    assert lease_key("v1") == ".v1.lease"


def test_the_lease_records_its_holder_and_is_released(tmp_path: Path) -> None:
    folder = tmp_path / "artifact"
    with Lease.beside(folder, what="train x@v").acquire(wait=False):
        held = json.loads(lease_file(folder).read_text())
        assert held["host"] == socket.gethostname() and held["pid"] == os.getpid()
        assert held["what"] == "train x@v"
        assert 119 < held["expires"] - held["created"] <= 120
        assert not folder.exists()  # the lease exists before its folder does
    assert not lease_file(folder).exists()


def test_a_second_taker_is_told_who_holds_it(tmp_path: Path) -> None:
    folder = tmp_path / "artifact"
    with Lease.beside(folder, what="train x@v").acquire(wait=False):
        with pytest.raises(LeaseHeld) as held:
            Lease.beside(folder, what="another run").acquire(wait=False)
    message = str(held.value)
    assert f"held by train x@v (host {socket.gethostname()}, pid {os.getpid()}, since " in message
    assert str(lease_file(folder)) in message


def test_a_waiter_gets_the_lease_when_it_is_released(tmp_path: Path, caplog) -> None:
    folder = tmp_path / "artifact"
    first = Lease.beside(folder, what="merge x@v").acquire(wait=False)
    threading.Timer(0.5, first.release).start()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="kiln.artifacts.lease"):
        with Lease.beside(folder, what="merge x@v (second)").acquire(wait=True):
            waited = time.monotonic() - started
    assert 0.4 < waited < 5
    assert "waiting for merge x@v (second): merge x@v (host" in caplog.text


def test_the_heartbeat_renews_the_lease(tmp_path: Path) -> None:
    folder = tmp_path / "artifact"
    with Lease.beside(folder, what="train x@v", ttl=1.0, heartbeat=0.1).acquire(wait=False):
        first = json.loads(lease_file(folder).read_text())
        time.sleep(1.5)  # past the first expiry: renewals keep it alive
        renewed = json.loads(lease_file(folder).read_text())
        assert renewed["expires"] > first["expires"] and renewed["created"] == first["created"]
        with pytest.raises(LeaseHeld):
            Lease.beside(folder, what="another run").acquire(wait=False)


def test_a_holder_whose_lease_was_taken_over_knows_it(tmp_path: Path) -> None:
    folder = tmp_path / "artifact"
    stalled = Lease.beside(folder, what="train x@v", ttl=0.3, heartbeat=0.2).acquire(wait=False)
    lease_file(folder).unlink()  # as if it expired and another run broke it
    foreign_lease(folder, host="elsewhere", pid=1, expires_in=60)
    time.sleep(0.5)
    assert stalled.lost is not None and "another process took it over" in stalled.lost
    stalled.release()
    assert json.loads(lease_file(folder).read_text())["owner"] == "elsewhere"  # not deleted


def test_a_killed_holder_on_this_host_is_taken_over_at_once(tmp_path: Path) -> None:
    folder = tmp_path / "artifact"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    holder = subprocess.Popen(
        [sys.executable, str(HOLDER), str(folder)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "holding\n"
        with pytest.raises(LeaseHeld, match=f"pid {holder.pid}"):
            Lease.beside(folder, what="resume").acquire(wait=False)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert json.loads(lease_file(folder).read_text())["pid"] == holder.pid  # left behind
    started = time.monotonic()
    with Lease.beside(folder, what="resume").acquire(wait=False):
        assert json.loads(lease_file(folder).read_text())["pid"] == os.getpid()
    assert time.monotonic() - started < 1  # no waiting for the expiry


def test_a_reused_pid_does_not_keep_a_dead_holders_lease(tmp_path: Path) -> None:
    folder = tmp_path / "artifact"
    # This process's pid, but "started" at another time: the holder was an earlier process.
    now = time.time()
    record = LeaseRecord("old", socket.gethostname(), os.getpid(), 1, "train", now, now + 60)
    LocalStore(tmp_path).create(lease_key(folder.name), record.to_bytes())
    with Lease.beside(folder, what="resume").acquire(wait=False):
        pass


def test_a_holder_on_another_host_is_taken_over_after_expiry(tmp_path: Path) -> None:
    folder = tmp_path / "artifact"
    foreign_lease(folder, host="other-host", pid=os.getpid(), expires_in=1.0)
    with pytest.raises(LeaseHeld, match=r"held by train x@v \(host other-host, pid"):
        Lease.beside(folder, what="resume").acquire(wait=False)
    started = time.monotonic()
    with Lease.beside(folder, what="resume").acquire(wait=True):
        waited = time.monotonic() - started
    assert 0.5 < waited < 5


def test_an_unreadable_lease_is_broken(tmp_path: Path, caplog) -> None:
    folder = tmp_path / "artifact"
    lease_file(folder).write_text("not json")
    with caplog.at_level(logging.WARNING, logger="kiln.artifacts.lease"):
        with Lease.beside(folder, what="resume").acquire(wait=False):
            pass
    assert "taking over the lease" in caplog.text and "it is unreadable" in caplog.text


def _hold_and_count(folder: str, log: str, rounds: int) -> None:
    for _ in range(rounds):
        with Lease.beside(Path(folder), what="contender").acquire(wait=True):
            with open(log, "a") as f:
                f.write(f"in {os.getpid()}\n")
                f.flush()
            time.sleep(0.01)
            with open(log, "a") as f:
                f.write(f"out {os.getpid()}\n")


def test_contending_processes_hold_it_one_at_a_time(tmp_path: Path) -> None:
    import multiprocessing

    log = tmp_path / "log"
    context = multiprocessing.get_context("spawn")
    workers = [
        context.Process(target=_hold_and_count, args=(str(tmp_path / "a"), str(log), 10))
        for _ in range(4)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert [w.exitcode for w in workers] == [0] * 4
    lines = log.read_text().splitlines()
    assert len(lines) == 80
    for enter, leave in zip(lines[::2], lines[1::2]):  # strictly alternating, same process
        assert enter.startswith("in ") and leave == "out " + enter.split()[1]
