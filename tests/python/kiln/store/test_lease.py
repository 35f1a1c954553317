"""kiln.artifacts.lease: one holder at a time, renewed, released, taken over only when stale;
in a local directory and in S3 and GCS buckets (servers on loopback, conftest.py)."""

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
from kiln_testing.processes import python_env

from kiln.artifacts.lease import Lease, LeaseHeld, LeaseRecord, lease_key
from kiln.artifacts.locations import open_store
from kiln.artifacts.store import ObjectMissing, ObjectStore
from kiln_contract.processes import is_running

HOLDER = Path(__file__).with_name("lease_holder.py")
KEY = lease_key("artifact")  # the lease of the folder "artifact" at the store's root


def foreign_lease(store: ObjectStore, *, host: str, pid: int, expires_in: float) -> None:
    """A lease written by another process, as it would have written it."""
    now = time.time()
    record = LeaseRecord(
        owner="elsewhere", host=host, pid=pid, pid_started=None, what="train x@v",
        created=now - 60, expires=now + expires_in,
    )  # fmt: skip
    store.create(KEY, record.to_bytes())


def held(store: ObjectStore) -> dict:
    return json.loads(store.read(KEY).data)


def lease(store: ObjectStore, what: str, **options: float) -> Lease:
    return Lease(store, KEY, what=what, **options)


def test_lease_keys_sit_beside_their_folder() -> None:
    assert lease_key("tokenized/x/v1") == "tokenized/x/.v1.lease"
    assert lease_key("v1") == ".v1.lease"


def test_the_lease_records_its_holder_and_is_released(store: ObjectStore) -> None:
    with lease(store, "train x@v").acquire(wait=False):
        record = held(store)
        assert record["host"] == socket.gethostname() and record["pid"] == os.getpid()
        assert record["what"] == "train x@v"
        assert 119 < record["expires"] - record["created"] <= 120
        with pytest.raises(ObjectMissing):  # the lease exists before its folder does
            store.read("artifact/STATUS")
    with pytest.raises(ObjectMissing):
        store.read(KEY)


def test_the_lease_beside_a_local_folder_is_a_file(tmp_path: Path) -> None:
    folder = tmp_path / "artifact"
    with Lease.beside(folder, what="train x@v").acquire(wait=False):
        assert json.loads((tmp_path / ".artifact.lease").read_text())["what"] == "train x@v"
        assert not folder.exists()
    assert not (tmp_path / ".artifact.lease").exists()


def test_a_second_taker_is_told_who_holds_it(store: ObjectStore) -> None:
    with lease(store, "train x@v").acquire(wait=False):
        with pytest.raises(LeaseHeld) as refused:
            lease(store, "another run").acquire(wait=False)
    message = str(refused.value)
    assert f"held by train x@v (host {socket.gethostname()}, pid {os.getpid()}, since " in message
    assert store.location(KEY) in message


def test_of_two_concurrent_takers_exactly_one_wins(store: ObjectStore) -> None:
    for _ in range(3):
        start = threading.Barrier(2)
        outcomes: list[str] = []

        def take(name: str, start: threading.Barrier, outcomes: list[str]) -> None:
            start.wait()
            try:
                taken: Lease | None = lease(store, name).acquire(wait=False)
                outcomes.append("won")
            except LeaseHeld:
                taken = None
                outcomes.append("refused")
            start.wait()  # the winner holds it until the other taker has tried
            if taken is not None:
                taken.release()

        takers = [
            threading.Thread(target=take, args=(f"taker {i}", start, outcomes)) for i in range(2)
        ]
        for taker in takers:
            taker.start()
        for taker in takers:
            taker.join(30)
        assert sorted(outcomes) == ["refused", "won"]


def test_a_waiter_gets_the_lease_when_it_is_released(store: ObjectStore, caplog) -> None:
    first = lease(store, "merge x@v").acquire(wait=False)
    threading.Timer(0.5, first.release).start()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="kiln.artifacts.lease"):
        with lease(store, "merge x@v (second)").acquire(wait=True):
            waited = time.monotonic() - started
    assert 0.4 < waited < 5
    assert "waiting for merge x@v (second): merge x@v (host" in caplog.text


def test_the_heartbeat_renews_the_lease(store: ObjectStore) -> None:
    with lease(store, "train x@v", ttl=1.0, heartbeat=0.1).acquire(wait=False) as holder:
        first = held(store)
        time.sleep(1.5)  # past the first expiry: renewals keep it alive
        renewed = held(store)
        assert renewed["expires"] > first["expires"] and renewed["created"] == first["created"]
        with pytest.raises(LeaseHeld):
            lease(store, "another run").acquire(wait=False)
        assert holder.lost is None


def test_a_holder_whose_lease_was_taken_over_knows_it(store: ObjectStore) -> None:
    stalled = lease(store, "train x@v", ttl=0.3, heartbeat=0.2).acquire(wait=False)
    store.delete(KEY, generation=store.read(KEY).generation)  # expired, broken by another run
    foreign_lease(store, host="elsewhere", pid=1, expires_in=60)
    time.sleep(0.5)
    assert stalled.lost is not None and "another process took it over" in stalled.lost
    stalled.release()
    assert held(store)["owner"] == "elsewhere"  # not deleted


def test_a_stalled_holders_release_leaves_the_lease_that_took_it_over(store: ObjectStore) -> None:
    """The holder stopped renewing (no heartbeat before its expiry), another run took the lease
    over, and then the first one finishes: its release must not end the new holder's lease, on
    a server that ignores a delete's generation too (fake-gcs-server): release is a conditional
    replace, which every store honours."""
    stalled = lease(store, "train x@v", ttl=0.2, heartbeat=60).acquire(wait=False)
    time.sleep(0.3)
    with lease(store, "resume").acquire(wait=False) as new_holder:
        stalled.release()
        assert held(store)["what"] == "resume" and not held(store)["released"]
        assert new_holder.lost is None
    with pytest.raises(ObjectMissing):  # released by its holder: gone
        store.read(KEY)


def test_of_two_takers_of_a_stale_lease_exactly_one_wins(store: ObjectStore) -> None:
    """Taking over is one conditional replace of the generation read, not a delete and a create:
    two takers who read the same stale lease cannot both win."""
    for _ in range(3):
        foreign_lease(store, host="other-host", pid=1, expires_in=-1)
        start = threading.Barrier(2)
        outcomes: list[str] = []
        winners: list[Lease] = []

        def take(
            name: str, start: threading.Barrier, outcomes: list[str], winners: list[Lease]
        ) -> None:
            start.wait()
            try:
                winners.append(lease(store, name).acquire(wait=False))
                outcomes.append("won")
            except LeaseHeld:
                outcomes.append("refused")

        takers = [
            threading.Thread(target=take, args=(f"taker {i}", start, outcomes, winners))
            for i in range(2)
        ]
        for taker in takers:
            taker.start()
        for taker in takers:
            taker.join(30)
        assert sorted(outcomes) == ["refused", "won"]
        assert held(store)["what"] == winners[0].what
        winners[0].release()


def test_a_killed_holder_on_this_host_is_taken_over_at_once(
    store: ObjectStore, store_location: str
) -> None:
    env = python_env()
    holder = subprocess.Popen(
        [sys.executable, str(HOLDER), store_location, "artifact"],
        env=env, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "holding\n"
        with pytest.raises(LeaseHeld, match=f"pid {holder.pid}"):
            lease(store, "resume").acquire(wait=False)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert held(store)["pid"] == holder.pid  # left behind
    started = time.monotonic()
    with lease(store, "resume").acquire(wait=False):
        assert held(store)["pid"] == os.getpid()
    assert time.monotonic() - started < 1  # no waiting for the expiry


def test_a_reused_pid_does_not_keep_a_dead_holders_lease(store: ObjectStore) -> None:
    # This process's pid, but "started" at another time: the holder was an earlier process.
    now = time.time()
    record = LeaseRecord("old", socket.gethostname(), os.getpid(), 1, "train", now, now + 60)
    store.create(KEY, record.to_bytes())
    with lease(store, "resume").acquire(wait=False):
        assert held(store)["owner"] != "old"


def test_a_holder_on_another_host_is_taken_over_after_expiry(store: ObjectStore) -> None:
    foreign_lease(store, host="other-host", pid=os.getpid(), expires_in=1.0)
    with pytest.raises(LeaseHeld, match=r"held by train x@v \(host other-host, pid"):
        lease(store, "resume").acquire(wait=False)
    started = time.monotonic()
    with lease(store, "resume").acquire(wait=True):
        waited = time.monotonic() - started
    assert 0.5 < waited < 5


def test_an_unreadable_lease_is_broken(store: ObjectStore, caplog) -> None:
    store.write(KEY, b"not json")
    with caplog.at_level(logging.WARNING, logger="kiln.artifacts.lease"):
        with lease(store, "resume").acquire(wait=False):
            pass
    assert "taking over the lease" in caplog.text and "it is unreadable" in caplog.text


def _hold_and_count(location: str, log: str, rounds: int) -> None:
    for _ in range(rounds):
        with Lease(open_store(location), KEY, what="contender").acquire(wait=True):
            with open(log, "a") as f:
                f.write(f"in {os.getpid()}\n")
                f.flush()
            time.sleep(0.01)
            with open(log, "a") as f:
                f.write(f"out {os.getpid()}\n")


def test_contending_processes_hold_it_one_at_a_time(store_location: str, tmp_path: Path) -> None:
    import multiprocessing

    # Fewer rounds against the loopback servers: each round is a few requests per process.
    workers, rounds = (4, 10) if "://" not in store_location else (2, 3)
    log = tmp_path / "log"
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(target=_hold_and_count, args=(store_location, str(log), rounds))
        for _ in range(workers)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
    assert [p.exitcode for p in processes] == [0] * workers
    lines = log.read_text().splitlines()
    assert len(lines) == 2 * workers * rounds
    for enter, leave in zip(lines[::2], lines[1::2]):  # strictly alternating, same process
        assert enter.startswith("in ") and leave == "out " + enter.split()[1]


def test_an_ended_process_not_yet_reaped_is_not_running() -> None:
    """A zombie (ended, its exit not yet reaped: an orphan in a container whose first process
    reaps nothing) holds no lease and owns no temporaries."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while Path(f"/proc/{ended.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the child never ended"
        time.sleep(0.05)
    assert not is_running(ended.pid)  # a zombie, not reaped yet
    ended.wait()
    assert not is_running(ended.pid)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert is_running(alive.pid)
    finally:
        alive.kill()
        alive.wait()
