"""The steps' metrics on their way from the device to the metrics file and the display: queued
as each step is, read together at a sync point (the loop's one wait for the device)."""

from __future__ import annotations

import math
import time
from typing import Any

import jax
import numpy as np

from kiln.train.hooks import StepInfo
from kiln.train.metrics import MetricsLogger, Throughput
from kiln.train.progress import Progress


class StepLog:
    def __init__(self, throughput: Throughput, metrics: MetricsLogger, progress: Progress):
        self.throughput = throughput
        self.metrics = metrics
        self.progress = progress
        self.step_times: list[float] = []  # each read step's seconds
        self.data_waits: list[float] = []  # seconds each step waited for its batch
        self._unread: list[tuple[int, Any]] = []  # (step, device metrics) not yet on the host
        self._unread_since = 0.0  # when the first unread step asked for its batch

    def queued(self, info: StepInfo) -> None:
        self.data_waits.append(info.data_wait)
        if not self._unread:
            self._unread_since = info.began
        self._unread.append((info.step, info.metrics))

    def read(self) -> tuple[int, dict[str, float]] | None:
        """Brings the unread steps' metrics to the host and logs them, each given the mean time
        of the steps read together. Returns the first step whose loss or gradient norm is not
        finite, with its values (the steps after it are not logged), or None."""
        if not self._unread:
            return None
        values = jax.device_get([out for _, out in self._unread])
        seconds = (time.monotonic() - self._unread_since) / len(self._unread)
        waits = self.data_waits[-len(self._unread) :]
        steps = [step for step, _ in self._unread]
        self._unread = []
        for step, out, data_wait in zip(steps, values, waits):
            step_values = {k: float(v) for k, v in out.items()}
            tokens_per_second = self._log(step, step_values, seconds, data_wait)
            if not (math.isfinite(step_values["loss"]) and math.isfinite(step_values["grad_norm"])):
                return step, step_values
            self.progress.update(step, step_values["loss"], tokens_per_second)
        return None

    def _log(self, step: int, values: dict[str, float], seconds: float, data_wait: float) -> float:
        self.step_times.append(seconds)
        metrics = {
            "train/loss": values["loss"],
            "train/cross_entropy": values["cross_entropy"],
            "train/z_loss": values["z_loss"],
            "optim/learning_rate": values["learning_rate"],
            "optim/grad_norm": values["grad_norm"],
            **self.throughput.metrics(seconds),
            "throughput/data_wait_seconds": data_wait,
            "timestamp": time.time(),
        }
        self.metrics.log(step, metrics)
        return metrics["throughput/tokens_per_second"]

    def first_step(self, step: int, source: str) -> dict[str, Any]:
        """Logs and shows the invocation's first step, read already: its seconds include
        compiling its program or reading it from the compilation cache (`source`, kiln.train.
        compilation_cache.Compilations)."""
        from kiln.train.compilation_cache import active_folder

        folder = active_folder()
        seconds = self.step_times[-1]
        first = {"throughput/first_step_seconds": seconds}
        self.metrics.log(step, {**first, "throughput/first_step_from_cache": source == "cache"})
        how = {
            "cache": f"its program read from the compilation cache {folder}",
            "compiled": f"compiled, and kept in the compilation cache {folder}",
            "partly cached": f"compiled in part; the rest read from the compilation cache {folder}",
            "no cache": "compiled (no compilation cache)",
        }[source]
        self.progress.message(f"first step in {seconds:.1f}s: {how}")
        return {"seconds": seconds, "program": source, "cache": folder}

    def eta_seconds(self, steps_left: int) -> float:
        recent = self.step_times[-20:]
        return sum(recent) / len(recent) * steps_left

    def speed(self) -> dict[str, Any]:
        """The summary's speed: tokens/s without the first step (it includes compilation)."""
        timed = self.step_times[1:] or self.step_times
        tokens_per_second = (
            self.throughput.tokens_per_step * len(timed) / sum(timed) if timed else None
        )
        return {
            "steps_this_run": len(self.step_times),
            "tokens_per_second": tokens_per_second,
            "data_wait_seconds_p50": _percentile(self.data_waits, 50),
            "data_wait_seconds_p99": _percentile(self.data_waits, 99),
        }


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None
