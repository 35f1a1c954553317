"""The runs' loss curves side by side: train loss and a validation loss against step and against
training tokens, one line per run, its name in the legend (`curves.png` of `pants compare`).

Read from each run's metrics.jsonl in its folder (a path or a bucket URL), so a run still
training shows its steps so far; an evaluation (no training) has no curve. A family is drawn in
one frame: a run started from another (`init_from` a run of the graph) begins at the step and
the tokens where it left its parent (kiln.report.compare.family_start).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from kiln.artifacts.atomic import atomic_write_bytes
from kiln.artifacts.folder import ArtifactFolder
from kiln.report.compare import RunRow
from kiln.report.metrics_log import TRAIN_LOSS, Record, by_step, parse_metrics

CURVES_FILE = "curves.png"
METRICS_FILE = "metrics.jsonl"


def plot_curves(rows: list[RunRow], metric: str, out_dir: Path) -> int:
    """Draws `out_dir`/curves.png: train loss and `metric` of each run with metrics, against
    step and tokens. Returns how many runs it shows."""
    runs = [(row, records) for row in rows if (records := _records(row))]
    figure = Figure(figsize=(11, 7), layout="constrained")
    FigureCanvasAgg(figure)
    panels = figure.subplots(2, 2, sharey="row")
    for (key, label), axes_row in zip(((TRAIN_LOSS, "train loss"), (metric, metric)), panels):
        for row, records in runs:
            per_step = _tokens_per_step(row.identity)
            step0, tokens0 = row.start.step, row.start.tokens
            points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
            if not points:
                continue
            steps, values = zip(*points)
            name = row.name.split("@")[0].rsplit("/", 1)[-1]
            axes_row[0].plot([step0 + s for s in steps], values, label=name, linewidth=1)
            if per_step is not None:
                axes_row[1].plot([tokens0 + s * per_step for s in steps], values, label=name,
                                 linewidth=1)  # fmt: skip
        axes_row[0].set_ylabel(label)
        for axes, x in zip(axes_row, ("step", "training tokens")):
            axes.set_xlabel(x)
            axes.grid(True, alpha=0.3)
    if runs:
        panels[0][0].legend(fontsize=7)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    atomic_write_bytes(out_dir / CURVES_FILE, buffer.getvalue())
    return len(runs)


def _records(row: RunRow) -> list[Record]:
    text = ArtifactFolder.at(row.folder).text(METRICS_FILE)
    return by_step(parse_metrics(text, f"{row.folder}/{METRICS_FILE}"), row.folder) if text else []


def _tokens_per_step(identity: dict[str, Any]) -> int | None:
    if "batch_size" not in identity or "seq_len" not in identity:
        return None
    return int(identity["batch_size"]) * int(identity["seq_len"])
