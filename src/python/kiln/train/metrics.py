"""Training metrics: metrics.jsonl (append, one JSON object per line) and W&B (offline by default).

metrics.jsonl lines are {"step": N, "train/loss": ..., ...}; validation and eval lines share the
step of the train line they follow. A resumed run rewinds the file to the checkpoint it resumed
from (lines with step > N are dropped, atomically), so the file always reads as one uninterrupted
run. W&B is fed from a background thread: a W&B failure is logged once and training goes on.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import queue
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from kiln.artifacts.atomic import atomic_write_text
from kiln_contract.tpu import TPU_DEVICE_KINDS, TPU_PEAK_BF16_FLOPS
from kiln_contract.train import WandbSpec
from kiln_contract.vocabulary import WANDB_MODES

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TRACKER_FILE = "tracker_metrics.jsonl"  # {"config", "summary"} of a complete run (Marin's)
WANDB_DIR = "wandb"

# Dense bf16 peak FLOP/s per device, from vendor spec sheets; used for MFU. Matched as a
# substring of jax's device_kind, first match wins (so "H100" does not shadow "H200").
PEAK_BF16_FLOPS = (
    ("H200", 989e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L4", 121e12),
    *((kind, TPU_PEAK_BF16_FLOPS[generation]) for kind, generation in TPU_DEVICE_KINDS),
)


def peak_flops_per_device(device_kind: str, compute_dtype: str) -> float | None:
    """Peak FLOP/s of one device for this compute dtype, or None when unknown (CPUs, fp32)."""
    if compute_dtype != "bfloat16":
        return None
    for marker, flops in PEAK_BF16_FLOPS:
        if marker in device_kind:
            return flops
    return None


@dataclass(frozen=True)
class Throughput:
    """Converts a measured step time into the throughput/* metrics."""

    tokens_per_step: int
    flops_per_token: float
    peak_flops: float | None  # all devices together; None: MFU unknown

    def metrics(self, step_seconds: float) -> dict[str, float]:
        tokens_per_second = self.tokens_per_step / step_seconds
        out = {
            "throughput/step_time": step_seconds,
            "throughput/tokens_per_second": tokens_per_second,
        }
        if self.peak_flops:
            out["throughput/mfu"] = tokens_per_second * self.flops_per_token / self.peak_flops
        return out


def wandb_run_id(explicit: str | None, name: str, version: str) -> str:
    """runtime.wandb.run_id, else name+version: stable across resumes."""
    run_id = explicit or f"{name}-{version}"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", run_id).strip("-")


# The variable each W&B setting falls back to (the names W&B itself reads), then Kiln's default.
WANDB_VARIABLES = {
    "mode": "WANDB_MODE",
    "project": "WANDB_PROJECT",
    "entity": "WANDB_ENTITY",
    "group": "WANDB_RUN_GROUP",
    "run_id": "WANDB_RUN_ID",
    "tags": "WANDB_TAGS",  # comma-separated
}
WANDB_DEFAULTS = {"mode": "offline", "project": "kiln"}


@dataclass(frozen=True)
class WandbSettings:
    """The W&B run as it starts. Each setting: the spec's (the BUILD target's, else `[kiln]`'s),
    else its `WANDB_*` variable, else Kiln's default; as `wandb.init` arguments beat W&B's
    variables and the reference's explicit run id beats the environment's."""

    mode: str  # online | offline | disabled
    project: str
    entity: str | None
    group: str | None
    run_id: str  # else {name}-{version}: stable across resumes
    tags: tuple[str, ...]

    @classmethod
    def resolve(
        cls, spec: WandbSpec, name: str, version: str, environ: Mapping[str, str] = os.environ
    ) -> WandbSettings:
        values: dict[str, Any] = {
            key: getattr(spec, key) or environ.get(variable) or WANDB_DEFAULTS.get(key)
            for key, variable in WANDB_VARIABLES.items()
        }
        if isinstance(values["tags"], str):
            values["tags"] = tuple(t.strip() for t in values["tags"].split(",") if t.strip())
        values["tags"] = tuple(values["tags"] or ())
        if values["mode"] not in WANDB_MODES:
            raise ValueError(
                f"W&B mode {values['mode']!r} (from $WANDB_MODE) is not one of "
                f"{', '.join(WANDB_MODES)}"
            )
        values["run_id"] = wandb_run_id(values["run_id"], name, version)
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "tags": list(self.tags)}


def rewind_metrics_file(path: Path, last_step: int) -> dict[str, float]:
    """Drops lines with step > last_step (and a line cut short by a kill); returns the latest
    value of every metric that remains."""
    if not path.exists():
        return {}
    kept, latest = [], {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # only a kill mid-append leaves a partial line
        if record.get("step", math.inf) <= last_step:
            kept.append(line)
            latest.update(record)
    atomic_write_text(path, "".join(f"{line}\n" for line in kept))
    latest.pop("step", None)
    return latest


class MetricsLogger:
    """Writes each step's metrics to metrics.jsonl and, via a background thread, to W&B.

    With several processes only process 0 writes (`write=True`); the others keep just `latest`.
    """

    def __init__(
        self,
        output_path: Path,
        *,
        resume_step: int,
        wandb: WandbSettings | None,
        run_config: Mapping[str, Any] | None = None,
        write: bool = True,
    ):
        self.path = output_path / METRICS_FILE
        self.latest: dict[str, float] = {}
        self._file = None
        self._wandb = None
        if write:
            self.latest = rewind_metrics_file(self.path, resume_step)
            self._file = self.path.open("a")
            if wandb is not None and wandb.mode != "disabled":
                self._wandb = _WandbThread(wandb, run_config or {}, output_path)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        values = {k: float(v) for k, v in metrics.items()}
        self.latest.update(values)
        if self._file is not None:
            self._file.write(json.dumps({"step": step, **values}) + "\n")
            self._file.flush()
        if self._wandb is not None:
            self._wandb.log(step, values)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._wandb is not None:
            self._wandb.close()


class _WandbThread:
    """Owns the W&B run on a daemon thread; any W&B error disables W&B for the rest of the run."""

    _STOP = object()

    def __init__(self, settings: WandbSettings, config: Mapping[str, Any], output_path: Path):
        self._settings = settings
        self._config = config
        self._dir = output_path
        self._queue: queue.Queue[Any] = queue.Queue()
        self._run: Any = None
        self._failed = False
        self._thread = threading.Thread(target=self._work, name="kiln-wandb", daemon=True)
        self._thread.start()

    def log(self, step: int, values: dict[str, float]) -> None:
        self._queue.put((step, values))

    def close(self, timeout: float = 60.0) -> None:
        self._queue.put(self._STOP)
        self._thread.join(timeout)

    def _work(self) -> None:
        while (item := self._queue.get()) is not self._STOP:
            self._guarded(self._log_item, item)
        if self._run is not None:
            self._guarded(self._run.finish)

    def _log_item(self, item: tuple[int, dict[str, float]]) -> None:
        if self._run is None:
            self._run = self._init()
        step, values = item
        self._run.log(values, step=step)

    def _guarded(self, fn: Any, *args: Any) -> None:
        if self._failed:
            return
        try:
            fn(*args)
        except Exception as e:  # a W&B outage must not stop training
            self._failed = True
            log.error("W&B logging failed, continuing without it: %s: %s", type(e).__name__, e)

    def _init(self) -> Any:
        import wandb

        s = self._settings
        (self._dir / WANDB_DIR).mkdir(parents=True, exist_ok=True)
        return wandb.init(
            project=s.project,
            entity=s.entity,
            group=s.group,
            tags=list(s.tags),
            id=s.run_id,
            name=s.run_id,
            resume="allow",
            dir=str(self._dir),
            mode=cast(Any, s.mode),
            config=dict(self._config),
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
        )
