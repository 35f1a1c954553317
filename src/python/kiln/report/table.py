"""The end-of-run table: what `python -m kiln.report RUN_DIR` prints.

Reads RUN_DIR/metrics.jsonl (required), RUN_DIR/tracker_metrics.jsonl (its summary, when the run
finished), RUN_DIR/artifact.json (name, version, fingerprint, when present) and the checkpoint
folders RUN_DIR/checkpoints/step-N/ (complete when metadata.json is there).
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kiln.artifacts import RECORD_FILE
from kiln.report.metrics_log import (
    TOKENS_PER_SECOND,
    TRAIN_LOSS,
    Record,
    read_metrics,
    read_summary,
    series,
)
from kiln.train.metrics import METRICS_FILE

CHECKPOINTS_DIR = "checkpoints"
CHECKPOINT_METADATA = "metadata.json"
WALL_TIME_KEY = "wall_time_seconds"  # in the tracker summary
_CHECKPOINT_NAME = re.compile(r"step-(\d+)")


def _number(value: float) -> str:
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3e}" if 0 < abs(value) < 1e-3 else f"{value:.4f}"


def clock_duration(seconds: float) -> str:
    """H:MM:SS."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def _latest(records: list[Record], key: str) -> tuple[int, float] | None:
    steps, values = series(records, key)
    return (steps[-1], values[-1]) if steps else None


def _aligned(rows: Sequence[tuple[str, ...]], indent: str = "  ") -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows
    ]


def _run_title(run_dir: Path) -> str:
    try:
        record = json.loads((run_dir / RECORD_FILE).read_text())
    except (OSError, ValueError):
        return f"Run {run_dir}"
    return (
        f"Run {record.get('name', run_dir.name)} {record.get('version', '')}"
        f" (fingerprint {record.get('fingerprint', '-')})"
    )


def _wall_time(records: list[Record], summary: Record) -> str:
    if isinstance(summary.get(WALL_TIME_KEY), (int, float)):
        return clock_duration(summary[WALL_TIME_KEY])
    stamps = [r["timestamp"] for r in records if isinstance(r.get("timestamp"), (int, float))]
    return clock_duration(stamps[-1] - stamps[0]) if len(stamps) > 1 else "-"


def _training_lines(records: list[Record], summary: Record) -> list[str]:
    rows = [
        ("steps logged", f"{records[0]['step']}..{records[-1]['step']} ({len(records)} records)")
    ]
    steps, losses = series(records, TRAIN_LOSS)
    if losses:
        best = min(range(len(losses)), key=losses.__getitem__)
        rows.append(
            (
                "train loss",
                f"final {_number(losses[-1])} (step {steps[-1]}), "
                f"best {_number(losses[best])} (step {steps[best]})",
            )
        )
    _, rates = series(records, TOKENS_PER_SECOND)
    if rates:
        # The first step includes compilation; the median ignores it and other stalls.
        steady = rates[1:] or rates
        rows.append(
            ("tokens/s", f"median {_number(statistics.median(steady))} (last {_number(rates[-1])})")
        )
    rows.append(("wall time", _wall_time(records, summary)))
    return _aligned(rows)


def _eval_lines(records: list[Record]) -> list[str]:
    """One row per validation set or group (eval/<name>/<metric>), one column per metric,
    latest values."""
    keys = sorted({k for r in records for k in r if k.startswith("eval/")})
    table: dict[str, dict[str, str]] = {}
    for key in keys:
        latest = _latest(records, key)
        if latest is None:
            continue
        set_name, _, metric = key[len("eval/") :].rpartition("/")
        table.setdefault(set_name or "(all sets)", {})[metric] = _number(latest[1])
    if not table:
        return []
    metrics = sorted({m for row in table.values() for m in row})
    rows = [("set or group", *metrics)] + [
        (name, *(row.get(m, "-") for m in metrics)) for name, row in sorted(table.items())
    ]
    return ["Validation (latest values)", *_aligned(rows)]


def _lm_eval_lines(records: list[Record], summary: Record) -> list[str]:
    keys = sorted({k for r in records for k in r if k.startswith("lm_eval/")})
    values = {key: latest[1] for key in keys if (latest := _latest(records, key)) is not None}
    for key, value in summary.items():
        if key.startswith("lm_eval/") and isinstance(value, (int, float)):
            values.setdefault(key, float(value))
    if not values:
        return []
    return ["lm_eval", *_aligned([(k, _number(v)) for k, v in sorted(values.items())])]


def _checkpoint_lines(run_dir: Path) -> list[str]:
    found: list[tuple[int, str]] = []
    for path in (run_dir / CHECKPOINTS_DIR).glob("step-*"):
        match = _CHECKPOINT_NAME.fullmatch(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), _checkpoint_kind(path)))
    if not found:
        return ["Checkpoints: none"]
    return ["Checkpoints", *_aligned([(f"step-{s}", kind) for s, kind in sorted(found)])]


def _checkpoint_kind(path: Path) -> str:
    try:
        metadata: Any = json.loads((path / CHECKPOINT_METADATA).read_text())
    except (OSError, ValueError):
        return "incomplete (no readable metadata.json)"
    return "temporary" if metadata.get("is_temporary") else "permanent"


def format_report(run_dir: Path) -> str:
    """The run's metrics as a compact text table; MetricsError if metrics.jsonl is missing/damaged."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir / METRICS_FILE)
    if not records:
        return f"{_run_title(run_dir)}\n  no steps logged yet in {run_dir / METRICS_FILE}\n"
    summary = read_summary(run_dir)
    sections = [
        [_run_title(run_dir), *_training_lines(records, summary)],
        _eval_lines(records),
        _lm_eval_lines(records, summary),
        _checkpoint_lines(run_dir),
    ]
    return "\n".join("\n".join(section) for section in sections if section) + "\n"
