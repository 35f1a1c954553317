"""`python -m kiln.report RUN_DIR`: print the run's metrics table (see kiln.report.table)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kiln.report.metrics_log import MetricsError
from kiln.report.table import format_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.report")
    parser.add_argument("run_dir", type=Path, help="a checkpoint artifact's output directory")
    args = parser.parse_args(argv)
    try:
        print(format_report(args.run_dir), end="")
    except MetricsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
