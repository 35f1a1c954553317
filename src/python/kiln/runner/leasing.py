"""The artifact's lease (kiln.artifacts.lease): one builder at a time, in any store. A second run
waits for the holder, saying who it is and how far it has come, then decides again."""

from __future__ import annotations

import contextlib
import time

from kiln.artifacts.folder import ArtifactFolder
from kiln.artifacts.lease import Lease, LeaseHeld, LeaseRecord
from kiln.runner.decision import same_artifact, serve
from kiln.runner.errors import LeaseLost, StepError
from kiln_contract.layout import FAILED, SUCCESS
from kiln_contract.step import StepSpec
from kiln_contract.vocabulary import is_mutable_version

# How often a run waiting for another run's lease says again who holds it and how far it is.
WAIT_REPORT_SECONDS = 30.0


def hold(
    step: StepSpec,
    folder: ArtifactFolder,
    held: contextlib.ExitStack,
    *,
    wait: bool,
    job: str | None = None,
) -> Lease | None:
    """Takes the artifact's lease into `held`. Without `wait` a live holder is refused at once
    (StepError). With it, this run waits, saying who holds the lease, and then decides again:
    the run it waited for built the artifact -> served (None); it failed -> StepError; it ended
    without finishing (killed, its lease taken over when stale, or stopped by --max-steps) ->
    this run goes on with the build (the lease). `job`: the cluster job this run is a host of
    (an earlier attempt's lease is its to take over)."""
    lease = folder.lease(f"train {step.ref}", job=job)
    if not wait:
        try:
            return held.enter_context(lease.acquire(wait=False))
        except LeaseHeld as e:
            raise StepError(
                f"{step.ref} is being built by another run: {e}. A second run of {step.ref} is "
                "refused; nothing was changed."
            ) from None
    watch = HolderWatch(step, folder)
    held.enter_context(lease.acquire(wait=True, on_wait=watch))
    if watch.holder is None:
        return lease
    return _after_waiting(step, folder, watch.holder, lease)


def _after_waiting(
    step: StepSpec, folder: ArtifactFolder, holder: LeaseRecord, lease: Lease
) -> Lease | None:
    status = folder.status()
    if is_mutable_version(step.version):
        print(f"kiln: {holder.describe()} ended; a dev version is rebuilt by every run", flush=True)
        return lease
    stored = same_artifact(folder, step.record)
    if status == SUCCESS and stored is not None:
        lease.release()
        serve(step, stored, folder)
        return None
    if status == FAILED:
        why = folder.stop_reason() or "its output says why"
        raise StepError(
            f"{step.ref}: the run this one waited for, {holder.describe()}, failed (STATUS "
            f"FAILED in {folder.location()}: {why}). Rerun to resume the build from its newest "
            "checkpoint."
        )
    print(
        f"kiln: {holder.describe()} ended without finishing {step.ref} (STATUS "
        f"{status or 'none'}): this run goes on with it, from its newest checkpoint",
        flush=True,
    )
    return lease


def check_still_held(lease: Lease, step: StepSpec) -> None:
    if lease.lost is not None:
        raise LeaseLost(
            f"{step.ref}: this run lost its lease ({lease.lost}), so another run owns the "
            "artifact now; this run's result is not recorded."
        )


class HolderWatch:
    """`Lease.acquire`'s `on_wait`: prints who holds the lease, at once and then at most every
    WAIT_REPORT_SECONDS, with the holder's step and ETA from its metrics.jsonl."""

    def __init__(self, step: StepSpec, folder: ArtifactFolder) -> None:
        self.step = step
        self.folder = folder
        self.holder: LeaseRecord | None = None
        self._said_at: float | None = None

    def __call__(self, holder: LeaseRecord) -> None:
        self.holder = holder
        now = time.monotonic()
        if self._said_at is not None and now - self._said_at < WAIT_REPORT_SECONDS:
            return
        self._said_at = now
        print(
            f"kiln: waiting for {self.step.ref}: {holder.describe()} holds its lease; "
            f"{self._progress()} (--no-wait refuses instead of waiting)",
            flush=True,
        )

    def _progress(self) -> str:
        from kiln.report.metrics_log import STEP_TIME, latest_train_step
        from kiln.train.metrics import METRICS_FILE

        latest = latest_train_step(self.folder.text(METRICS_FILE) or "")
        if latest is None:
            return "no step logged yet"
        step, total = latest["step"], self.step.config.num_train_steps
        eta = float(latest[STEP_TIME]) * max(0, total - step)
        return f"step {step} of {total}, ETA {_duration(eta)}"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
