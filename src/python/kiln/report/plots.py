"""The training plot: loss (train, each validation set or group), learning rate and throughput against step.

Drawn with matplotlib's object API on an Agg canvas rather than pyplot, so that it keeps no global
figure state and is safe to call from a running trainer (kiln.runner passes `plot_run` to it as
its metrics observer: the plot follows each validation).
"""

from __future__ import annotations

import io
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from kiln.artifacts.atomic import atomic_write_bytes
from kiln.report.metrics_log import (
    LEARNING_RATE,
    TOKENS_PER_SECOND,
    TRAIN_LOSS,
    Record,
    read_metrics,
    series,
)

PLOT_FILE = "plots/training.png"  # in the run's folder, beside metrics.jsonl
OVERALL_MACRO = "eval/macro_loss"  # over every set: not a group


def eval_loss_keys(records: list[Record]) -> list[str]:
    """The validation losses worth a line, sorted: `eval/loss`, each group's macro average
    (`eval/paloma/macro_loss`) and each set in no group (`eval/<set>/loss`). With Paloma and
    Uncheatable Eval's 23 sets, one line per set would drown the curves."""
    keys = {key for record in records for key in record if key.startswith("eval/")}
    groups = {
        k[: -len("/macro_loss")] for k in keys if k.endswith("/macro_loss") and k != OVERALL_MACRO
    }
    ungrouped = {
        k for k in keys if k.endswith("/loss") and not any(k.startswith(f"{g}/") for g in groups)
    }
    return sorted(ungrouped | {f"{g}/macro_loss" for g in groups})


def write_training_plot(metrics_jsonl: Path, out_png: Path) -> None:
    """Reads metrics_jsonl and writes a three-panel PNG to out_png (atomically)."""
    records = read_metrics(Path(metrics_jsonl))
    figure = Figure(figsize=(8, 9), layout="constrained")
    loss_axes, lr_axes, throughput_axes = figure.subplots(3, 1, sharex=True)

    loss_axes.plot(*series(records, TRAIN_LOSS), label=TRAIN_LOSS, linewidth=1)
    for key in eval_loss_keys(records):
        loss_axes.plot(*series(records, key), marker="o", markersize=3, label=key)
    loss_axes.set_ylabel("loss")
    loss_axes.legend(fontsize="small")

    lr_axes.plot(*series(records, LEARNING_RATE), color="tab:green")
    lr_axes.set_ylabel("learning rate")
    lr_axes.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))

    throughput_axes.plot(*series(records, TOKENS_PER_SECOND), color="tab:purple", linewidth=1)
    throughput_axes.set_ylabel("tokens / s")
    throughput_axes.set_xlabel("step")

    for axes in (loss_axes, lr_axes, throughput_axes):
        axes.grid(alpha=0.3)
    figure.suptitle(f"{Path(metrics_jsonl).parent.name}: {len(records)} steps logged")

    png = io.BytesIO()
    FigureCanvasAgg(figure).print_png(png)
    atomic_write_bytes(out_png, png.getvalue())


def plot_run(metrics_jsonl: Path) -> None:
    """Draws the plot of the run whose metrics file this is, into the run's PLOT_FILE."""
    write_training_plot(metrics_jsonl, Path(metrics_jsonl).parent / PLOT_FILE)
