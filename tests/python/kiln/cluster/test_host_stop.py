"""A host asked to stop before its trainer starts never starts it (kiln.cluster.host)."""

from __future__ import annotations

from kiln.cluster.host import INPUTS, STOPPED_EXIT, TrainerHost


def test_a_host_stopped_before_its_trainer_starts_ends_stopped_without_starting_it() -> None:
    trainer_host = TrainerHost(INPUTS)
    trainer_host.stop()  # while the driver still places and starts the hosts
    runtime: dict[str, object] = {}  # never read: nothing is fetched or started
    assert trainer_host.run({}, ["never-run"], runtime, {}, None, 0) == STOPPED_EXIT
