"""Reading metrics.jsonl and tracker_metrics.jsonl, the trainer's append-only metric logs.

metrics.jsonl holds one JSON object per line, each with an integer "step" and metric keys such as
"train/loss", "optim/learning_rate", "throughput/tokens_per_second", "eval/<set>/loss",
"lm_eval/<task>/<metric>". The trainer may be killed mid-append, so a truncated LAST line is
skipped; a malformed line anywhere else is an error, since it means the file was damaged.
tracker_metrics.jsonl holds {"config": ..., "summary": {...}} lines; the last one counts.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kiln.train.metrics import TRACKER_FILE

TRAIN_LOSS = "train/loss"
LEARNING_RATE = "optim/learning_rate"
TOKENS_PER_SECOND = "throughput/tokens_per_second"
STEP_TIME = "throughput/step_time"

Record = dict[str, Any]


class MetricsError(ValueError):
    """A metrics file is missing or damaged."""


def _parse_lines(path: Path) -> list[Record]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise MetricsError(f"{path} does not exist: has this run logged any steps?") from None
    return parse_metrics(text, str(path))


def parse_metrics(text: str, path: str) -> list[Record]:
    """The records of a metrics.jsonl's text (`path` names it in errors), in file order."""
    lines = text.splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            if number == len(lines):  # cut short by a kill during the append
                break
            raise MetricsError(f"{path}:{number} is not valid JSON ({e})") from e
        if not isinstance(record, dict):
            raise MetricsError(f"{path}:{number} is not a JSON object")
        records.append(record)
    return records


def read_metrics(path: Path) -> list[Record]:
    """One record per step, in step order. Lines with the same step are merged, later values
    winning: an eval line shares its step with a train line, and a resumed run may re-log a step."""
    return by_step(_parse_lines(Path(path)), str(path))


def by_step(records: list[Record], path: str) -> list[Record]:
    """`records` merged into one per step, in step order (read_metrics)."""
    by_step: dict[int, Record] = {}
    for record in records:
        step = record.get("step")
        if not isinstance(step, int):
            raise MetricsError(f"{path}: a line has no integer 'step': {str(record)[:120]}")
        by_step[step] = {**by_step.get(step, {}), **record}
    return [by_step[step] for step in sorted(by_step)]


def latest_train_step(text: str) -> Record | None:
    """The last train line (one with a step time) in the text of a live run's metrics.jsonl;
    None before the first step. A line cut short by the append in progress, or by a kill, is
    skipped."""
    for line in reversed(text.splitlines()):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if (
            isinstance(record, dict)
            and isinstance(record.get("step"), int)
            and isinstance(record.get(STEP_TIME), (int, float))
        ):
            return record
    return None


def read_summary(run_dir: Path) -> Record:
    """The last summary in tracker_metrics.jsonl, or {} when the run has not finished."""
    path = Path(run_dir) / TRACKER_FILE
    if not path.exists():
        return {}
    records = _parse_lines(path)
    summary = records[-1].get("summary", {}) if records else {}
    return summary if isinstance(summary, dict) else {}


def series(records: list[Record], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric over the records that have a finite number for it."""
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            steps.append(record["step"])
            values.append(float(value))
    return steps, values
