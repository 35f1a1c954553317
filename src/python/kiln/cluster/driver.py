"""The Ray actor a cluster job is: a detached driver that outlives the terminal that submitted it.

It runs the hosts (kiln.cluster.dispatch.run_hosts) with Kiln's sources from its node's copy of
the job's code bundle (kiln.cluster.node_runtime), keeps
their output and the job's state, and answers `status`, `read`, `stop` and `endpoint` (through the
host of process 0) from any client of the cluster (kiln.cluster.jobs). Standard library only at
import (and Ray, present on every worker): the submitter ships this module by value, like
host.TrainerHost.
"""

from __future__ import annotations

import math
import os
import re
import sys
import threading
import time
from typing import Any

from kiln.cluster import node_runtime  # shipped by value with this module

JOB_NAMESPACE = "kiln"  # the Ray namespace of every job's driver, named by the job's id
RUNNING, SUCCEEDED, FAILED, STOPPED = "RUNNING", "SUCCEEDED", "FAILED", "STOPPED"
FINISHED = (SUCCEEDED, FAILED, STOPPED)
KEEP_FINISHED_S = 24 * 3600  # a finished job's status and output stay readable this long
READ_LINES = 2000  # the most output lines one `read` returns
ENDPOINT_TIMEOUT_S = 30.0  # how long `endpoint` waits for process 0's host to answer
# A line of host 1+ that host 0 also prints within this long is host 0's to show: hosts run the
# same program, so the same library warnings and the same SIGTERM line come from each.
REPEAT_WINDOW_S = 5.0
_HOST_LINE = re.compile(r"\(host (\d+)\) (.*)", re.DOTALL)
# absl's header, `W1206 14:00:07.053934    2076 file.cc:136] `: its time and thread id differ
# between hosts saying the same thing.
_ABSL_TIME_AND_THREAD = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ")


def job_names() -> list[str]:
    """The ids of the cluster's jobs (run on the cluster: Ray Client cannot list actors)."""
    import ray

    actors = ray.util.list_named_actors(all_namespaces=True)
    return [actor["name"] for actor in actors if actor["namespace"] == JOB_NAMESPACE]


class JobDriver:
    """One job: trains in a thread of its own from `start` on, so the job goes on when the
    submitter disconnects."""

    def __init__(self, job_id: str, job: dict[str, Any], summary: dict[str, Any]):
        self._status: dict[str, Any] = {
            **summary, "job": job_id, "state": RUNNING, "exit_code": None, "retries": 0,
            "started_at": time.time(), "ended_at": None,
        }  # fmt: skip
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._host_0: Any = None  # the current attempt's host 0 actor (dispatch.run_hosts)
        self._job = job
        self._repeats = HostRepeats()

    def start(self, environment: dict[str, str]) -> None:
        """Starts the hosts, with `environment` (the submitter's secrets and settings,
        dispatch.host_environment) for their trainers: held in this actor's memory only."""
        thread = threading.Thread(target=self._run, args=(environment,), daemon=True)
        thread.start()

    def write(self, lines: list[str]) -> None:
        """Appends lines of the job's output (each host sends its own, in order), less the
        lines of hosts 1+ that repeat host 0's (HostRepeats)."""
        with self._lock:
            self._lines.extend(self._repeats.add(lines, time.monotonic()))

    def say(self, line: str) -> None:
        """Appends a line of the driver's own to the job's output."""
        with self._lock:
            self._lines.append(line)

    def say_retry(self, line: str) -> None:
        """Appends the line that announces a retry, and counts the retry in the status."""
        with self._lock:
            self._lines.append(line)
            self._status["retries"] += 1

    def read(self, offset: int) -> tuple[list[str], dict[str, Any]]:
        """The output lines from `offset` on (at most READ_LINES) and the status."""
        with self._lock:
            self._release_held(time.monotonic())
            return self._lines[offset : offset + READ_LINES], dict(self._status)

    def status(self) -> dict[str, Any]:
        with self._lock:
            self._release_held(time.monotonic())
            return {**self._status, "lines": len(self._lines)}

    def _release_held(self, now: float) -> None:
        """Appends the held lines of hosts 1+ whose window has ended by `now` (under the lock)."""
        self._lines.extend(self._repeats.due(now))

    def stop(self) -> bool:
        """Asks the hosts to save a checkpoint and stop; False when the job had finished."""
        with self._lock:
            if self._status["state"] in FINISHED:
                return False
        self._stopping.set()
        return True

    def endpoint(self, ttl_minutes: float | None = None) -> dict[str, Any] | None:
        """The control endpoint process 0 serves now (with a capability URL when
        `ttl_minutes`; kiln.cluster.endpoints), or None: not serving yet, between attempts,
        or finished."""
        import ray

        with self._lock:
            host_0 = self._host_0 if self._status["state"] == RUNNING else None
        if host_0 is None:
            return None
        try:
            found: dict[str, Any] | None = ray.get(
                host_0.endpoint.remote(ttl_minutes), timeout=ENDPOINT_TIMEOUT_S
            )
        except (ray.exceptions.RayError, TimeoutError):  # the host is going: a retry or the end
            return None
        return found

    def _set_host_0(self, host_0: Any) -> None:
        with self._lock:
            self._host_0 = host_0

    def _run(self, environment: dict[str, str]) -> None:
        exit_code = 1
        try:
            import ray

            runtime = node_runtime.NodeRuntime.from_json(self._job["runtime"])
            sys.path.insert(0, str(node_runtime.fetch(ray, runtime.code)))
            from kiln.cluster import dispatch

            me = ray.get_runtime_context().current_actor
            exit_code = dispatch.run_hosts(
                self._job, environment, me, (self.say, self.say_retry), self._stopping,
                self._set_host_0,
            )
        except Exception as e:  # noqa: BLE001 - every failure ends the job, in its output
            self.say(f"kiln: error: {e}")
        self._finish(exit_code)

    def _finish(self, exit_code: int) -> None:
        state = SUCCEEDED if exit_code == 0 else STOPPED if self._stopping.is_set() else FAILED
        with self._lock:
            self._release_held(math.inf)  # the hosts have ended
            self._status.update(state=state, exit_code=exit_code, ended_at=time.time())
        # The actor is detached: it ends itself once its status has been readable long enough.
        threading.Timer(KEEP_FINISHED_S, os._exit, args=(0,)).start()


class HostRepeats:
    """Holds each line of hosts 1+ up to REPEAT_WINDOW_S, and drops it when host 0 says the same
    within that window (before or after it): what every host prints shows once, as host 0's,
    and whatever only another host says shows, late by at most the window."""

    def __init__(self) -> None:
        self._said: dict[str, float] = {}  # host 0's lines (as `_text`) -> when last said
        self._held: list[tuple[float, str, str]] = []  # (when, text, line) of hosts 1+

    def add(self, lines: list[str], now: float) -> list[str]:
        """The lines to show now of those that came at `now`, and of those held till now."""
        shown = []
        for line in lines:
            host, text = _host_and_text(line)
            if host == 0:
                self._said[text] = now
                self._held = [held for held in self._held if held[1] != text]
                shown.append(line)
            elif host is None:
                shown.append(line)
            elif now - self._said.get(text, -math.inf) > REPEAT_WINDOW_S:
                self._held.append((now, text, line))
        return shown + self.due(now)

    def due(self, now: float) -> list[str]:
        """The held lines that host 0 has not repeated in their window, which ends by `now`."""
        ended = now - REPEAT_WINDOW_S
        due = [line for when, _, line in self._held if when <= ended]
        self._held = [held for held in self._held if held[0] > ended]
        self._said = {text: when for text, when in self._said.items() if when > ended}
        return due


def _host_and_text(line: str) -> tuple[int | None, str]:
    """The host of a `(host N) ...` line (None for the driver's own) and what it says, without
    what differs between hosts saying the same (absl's time and thread id)."""
    matched = _HOST_LINE.match(line)
    if matched is None:
        return None, line
    return int(matched.group(1)), _ABSL_TIME_AND_THREAD.sub(r"\1 ", matched.group(2))
