"""The sweep's plot: validation loss against training FLOPs with a fitted power law
L(C) = a * C^(-b) + c when the runs differ in compute, else loss against the field they vary.

The power law is fitted to the compute frontier (the lowest loss at each FLOPs value: a
learning-rate sweep at each size keeps its best run), which needs three FLOPs values or more,
and only across runs that each start on their own: runs started from each other (a family)
share their parents' FLOPs, and are drawn without a law.
For a given floor c the law is a line in log-log space, so the fit scans c below the lowest loss
and solves each line by least squares, keeping the c whose curve fits the losses best.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from kiln.artifacts.atomic import atomic_write_bytes
from kiln.report.compare import RunRow, flat, started_from_each_other, varied_fields

PLOT_FILE = "compare.png"
_FLOOR_STEPS = 400


@dataclass(frozen=True)
class PowerLaw:
    a: float
    b: float
    c: float

    def __call__(self, compute: np.ndarray) -> np.ndarray:
        return self.a * compute ** (-self.b) + self.c

    def describe(self) -> str:
        return f"L(C) = {self.a:.4g} * C^(-{self.b:.4g}) + {self.c:.4g}"


def fit_power_law(compute: list[float], loss: list[float]) -> PowerLaw | None:
    """The law through the points, or None when fewer than 3 compute values or no decreasing
    law fits them."""
    x, y = np.asarray(compute, float), np.asarray(loss, float)
    if len(set(compute)) < 3 or np.any(x <= 0):
        return None
    best: tuple[float, PowerLaw] | None = None
    for c in np.linspace(0.0, y.min(), _FLOOR_STEPS, endpoint=False):
        slope, intercept = np.polyfit(np.log(x), np.log(y - c), 1)
        if slope >= 0:
            continue
        law = PowerLaw(float(math.exp(intercept)), float(-slope), float(c))
        error = float(np.sum((law(x) - y) ** 2))
        if best is None or error < best[0]:
            best = (error, law)
    return None if best is None else best[1]


def frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The lowest loss at each compute value, by compute."""
    lowest: dict[float, float] = {}
    for compute, loss in points:
        lowest[compute] = min(loss, lowest.get(compute, math.inf))
    return sorted(lowest.items())


def plot_comparison(rows: list[RunRow], metric: str, out_dir: Path) -> str:
    """Draws the plot into `out_dir`/compare.png; what it shows, in one line."""
    built = [r for r in rows if r.built and not r.is_evaluation and r.metric(metric) is not None]
    figure = Figure(figsize=(7, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.set_ylabel(metric)
    compute = {r.flops for r in built if r.flops is not None}
    if len(compute) > 1 and all(r.flops is not None for r in built):
        shown = _against_compute(axes, built, metric)
    else:
        shown = _against_field(axes, built, metric, varied_fields(rows))
    axes.grid(True, alpha=0.3)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    atomic_write_bytes(out_dir / PLOT_FILE, buffer.getvalue())
    return shown


def _against_compute(axes: Axes, rows: list[RunRow], metric: str) -> str:
    points = [(float(r.flops or 0.0), float(r.metric(metric) or 0.0)) for r in rows]
    axes.scatter(*zip(*points), label="runs", color="tab:blue")
    for row, (x, y) in zip(rows, points):
        axes.annotate(row.name.split("@")[0].rsplit("/", 1)[-1], (x, y), fontsize=6, alpha=0.7)
    axes.margins(x=0.15)
    axes.set_xscale("log")
    axes.set_xlabel("training FLOPs")
    if started_from_each_other(rows):  # a parent's FLOPs are in its children's: no scaling law
        return (f"{metric} against training FLOPs; no power law: the runs started from each "
                "other (a family, not a sweep)")  # fmt: skip
    best = frontier(points)
    law = fit_power_law([x for x, _ in best], [y for _, y in best])
    if law is None:
        return f"{metric} against training FLOPs; no power law: it needs 3 or more FLOPs values"
    grid = np.geomspace(best[0][0], best[-1][0], 100)
    axes.plot(grid, law(grid), color="tab:red", label=law.describe())
    axes.legend(fontsize=8)
    return f"{metric} against training FLOPs; fitted to the frontier: {law.describe()}"


def _against_field(axes: Axes, rows: list[RunRow], metric: str, varied: list[str]) -> str:
    field = varied[0] if varied else None
    values = [flat(r.identity).get(field) if field else r.name for r in rows]
    losses = [r.metric(metric) or math.nan for r in rows]  # the rows given have it
    numbers = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if values and len(numbers) == len(values):
        axes.scatter(numbers, losses, color="tab:blue")
        if min(numbers) > 0 and max(numbers) / min(numbers) >= 10:
            axes.set_xscale("log")
    else:
        axes.scatter(range(len(values)), losses, color="tab:blue")
        axes.set_xticks(range(len(values)), [str(v) for v in values], rotation=30, fontsize=7)
    axes.set_xlabel(field or "run")
    return f"{metric} against {field or 'run'}"
