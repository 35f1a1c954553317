"""Live progress: a rich bar on a terminal, plain periodic log lines otherwise.

runtime.progress: "bar", "log", "none", or "auto" (a bar when stdout is a TTY, else log lines).
Log lines go to stdout, one per `log_every` steps (about 50 per run) and at least every
`max_quiet_seconds`, in a grep-friendly form: `step 12/200 loss 3.2100 tok/s 4512 eta 0:01:40`.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import time
from typing import Protocol

# Third-party progress bars on the run's console: lm-eval's request bars (tqdm) and the datasets
# library's "Generating test split" bars of local tasks. Off unless asked for (the runner's
# `--library-output`): a run's own progress says how far it is.
LIBRARY_PROGRESS_OFF = {"TQDM_DISABLE": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}


def quiet_libraries() -> None:
    """Turns the libraries' progress bars off for this process and its children; call it before
    they are imported (they read these variables then). A variable already set wins."""
    for name, value in LIBRARY_PROGRESS_OFF.items():
        os.environ.setdefault(name, value)


def configure_logging() -> None:
    """Kiln's own notes at INFO; libraries (orbax/absl log every save at INFO) at WARNING."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("kiln").setLevel(logging.INFO)


class Progress(Protocol):
    def update(self, step: int, loss: float, tokens_per_second: float) -> None: ...

    def message(self, text: str) -> None: ...

    def close(self) -> None: ...


def make_progress(mode: str, *, total_steps: int, start_step: int) -> Progress:
    if mode == "auto":
        mode = "bar" if sys.stdout.isatty() else "log"
    if mode == "bar":
        return BarProgress(total_steps, start_step)
    if mode == "log":
        return LogProgress(total_steps, start_step)
    return QuietProgress()


def _format_eta(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(seconds)))


class LogProgress:
    def __init__(self, total_steps: int, start_step: int, max_quiet_seconds: float = 30.0):
        self.total_steps = total_steps
        self.log_every = max(1, total_steps // 50)
        self.max_quiet_seconds = max_quiet_seconds
        self._start_step = start_step
        self._start_time = time.monotonic()
        self._last_line_time = self._start_time

    def update(self, step: int, loss: float, tokens_per_second: float) -> None:
        now = time.monotonic()
        due = step % self.log_every == 0 or step == self.total_steps
        if not due and now - self._last_line_time < self.max_quiet_seconds:
            return
        self._last_line_time = now
        done = step - self._start_step
        eta = (now - self._start_time) / done * (self.total_steps - step) if done else 0.0
        print(
            f"step {step}/{self.total_steps} loss {loss:.4f} tok/s {tokens_per_second:.0f} "
            f"eta {_format_eta(eta)}",
            flush=True,
        )

    def message(self, text: str) -> None:
        print(text, flush=True)

    def close(self) -> None:
        pass


class BarProgress:
    def __init__(self, total_steps: int, start_step: int):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as RichProgress

        self._bar = RichProgress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  tok/s {task.fields[tps]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
        )
        self._task = self._bar.add_task(
            "train", total=total_steps, completed=start_step, loss="-", tps="-"
        )
        self._bar.start()

    def update(self, step: int, loss: float, tokens_per_second: float) -> None:
        self._bar.update(
            self._task, completed=step, loss=f"{loss:.4f}", tps=f"{tokens_per_second:.0f}"
        )

    def message(self, text: str) -> None:
        self._bar.console.print(text, soft_wrap=True)  # a URL must stay on one line

    def close(self) -> None:
        self._bar.stop()


class QuietProgress:
    """Prints messages but no per-step output."""

    def update(self, step: int, loss: float, tokens_per_second: float) -> None:
        pass

    def message(self, text: str) -> None:
        print(text, flush=True)

    def close(self) -> None:
        pass


class SilentProgress:
    """Every process but process 0 of a multi-host run: process 0 says how far the run is."""

    def update(self, step: int, loss: float, tokens_per_second: float) -> None:
        pass

    def message(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass
