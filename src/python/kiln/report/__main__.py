"""`python -m kiln.report RUN_DIR`: print the run's metrics table (see kiln.report.table).

`python -m kiln.report compare RUN_DIR... [--runs FILE] [--out DIR] [--metric KEY]`: the runs
side by side (kiln.report.compare), as a table, `DIR/compare.csv`, `DIR/compare.png`
(kiln.report.compare_plot) and their loss curves, `DIR/curves.png` (kiln.report.curves). `--runs` names runs by a JSON list of `{"name", "folder",
"identity"}` (what `pants compare` writes), so that a run with no folder yet keeps its row.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kiln.artifacts.atomic import atomic_write_bytes
from kiln.artifacts.storage_errors import EXIT_STORAGE, StorageError
from kiln.report.compare import (
    CSV_FILE,
    RunRow,
    columns_note,
    csv_text,
    format_table,
    in_grid_order,
    read_run,
    table,
)
from kiln.report.compare_plot import PLOT_FILE, plot_comparison
from kiln.report.curves import CURVES_FILE, plot_curves
from kiln.report.metrics_log import MetricsError
from kiln.report.table import format_report


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compare"]:
        return compare(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m kiln.report")
    parser.add_argument("run_dir", type=Path, help="a checkpoint artifact's output directory")
    args = parser.parse_args(argv)
    try:
        print(format_report(args.run_dir), end="")
    except MetricsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def compare(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.report compare")
    parser.add_argument("run_dirs", nargs="*", help="checkpoint artifact folders (or bucket URLs)")
    parser.add_argument("--runs", type=Path, help="a JSON list of runs: name, folder, identity")
    parser.add_argument("--out", type=Path, default=Path("compare"), help="where the CSV and PNG go")
    parser.add_argument(
        "--metric", help="the plot's loss (default: the first validation set's eval/NAME/loss)"
    )
    args = parser.parse_args(argv)
    try:
        rows = [read_run(folder) for folder in args.run_dirs] + _listed_runs(args.runs)
    except StorageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_STORAGE
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"error: --runs {args.runs}: {e}", file=sys.stderr)
        return 1
    if not rows:
        print("error: give the runs' folders, or --runs FILE", file=sys.stderr)
        return 1
    rows = in_grid_order(rows)
    header, cells = table(rows)
    print(format_table(header, cells), end="")
    note = columns_note(rows)
    if note:
        print(note)
    atomic_write_bytes(args.out / CSV_FILE, csv_text(header, cells).encode())
    metric = args.metric or _default_metric(rows)
    shown = plot_comparison(rows, metric, args.out)
    curves = plot_curves(rows, metric, args.out)
    print(f"\nwrote {args.out / CSV_FILE} and {args.out / PLOT_FILE}: {shown}")
    print(f"wrote {args.out / CURVES_FILE}: train loss and {metric} of {curves} run(s) against "
          "step and training tokens")  # fmt: skip
    not_built = [row for row in rows if not row.built]
    if not_built:
        print(f"{len(not_built)} of {len(rows)} run(s) not built: " + ", ".join(
            f"{row.name} ({row.state})" for row in not_built))  # fmt: skip
    return 0


def _listed_runs(path: Path | None) -> list[RunRow]:
    if path is None:
        return []
    runs = json.loads(path.read_text())
    return [read_run(str(r["folder"]), r["name"], r.get("identity")) for r in runs]


def _default_metric(rows: list[RunRow]) -> str:
    losses = sorted(
        k for row in rows for k in row.summary if k.startswith("eval/") and k.count("/") == 2
        and k.endswith("/loss")
    )  # fmt: skip
    return losses[0] if losses else "train/loss"


if __name__ == "__main__":
    sys.exit(main())
