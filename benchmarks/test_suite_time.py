"""How long the README's test command takes, and which test files take it.

    python3 benchmarks/test_suite_time.py [--log FILE] [--top 15] [-- PANTS ARGS...]

Run from the build root. Without `--log` it runs `./pants --no-local-cache lint check test ::`
(or `./pants` with the arguments after `--`), timing the whole command, and reads Pants' closing
lines (`✓ tests/... succeeded in 12.34s.`); with `--log` it reads a log of such a run instead
(its wall time, if the log has none, is left out). It prints the slowest test files with their
seconds and share of all test-file seconds (the baseline: every file's time summed, which is
more than the wall time, as Pants runs files side by side), the number of files, the summed
time, and the command's wall time.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import time

from report_table import markdown_table

DEFAULT_COMMAND = ["--no-local-cache", "lint", "check", "test", "::"]
RESULT_LINE = re.compile(
    r"^[✓✕] (?P<files>tests/\S+(?: and \d+ other files)?) (?P<outcome>succeeded|failed) "
    r"in (?P<seconds>[\d.]+)s\.?$"
)
COLOURS = re.compile(r"\x1b\[[0-9;]*m")


def file_times(log: str) -> list[tuple[str, str, float]]:
    """(test files, outcome, seconds) of each result line of a Pants test log."""
    found = []
    for line in log.splitlines():
        match = RESULT_LINE.match(COLOURS.sub("", line).strip())
        if match:
            found.append((match["files"], match["outcome"], float(match["seconds"])))
    return found


def run(pants_args: list[str]) -> tuple[str, float]:
    began = time.monotonic()
    result = subprocess.run(["./pants", *pants_args], capture_output=True, text=True)
    seconds = time.monotonic() - began
    if result.returncode != 0:
        print(f"./pants exited {result.returncode}; the times below include failures",
              file=sys.stderr)  # fmt: skip
    return result.stdout + result.stderr, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", help="a log of the command to read instead of running it")
    parser.add_argument("--top", type=int, default=15, help="how many files to list")
    parser.add_argument("pants_args", nargs="*", help="./pants arguments, after --")
    args = parser.parse_args(argv)
    if args.log:
        with open(args.log) as f:
            log, wall = f.read(), None
    else:
        log, wall = run(args.pants_args or DEFAULT_COMMAND)
    times = file_times(log)
    if not times:
        print("no test result lines found", file=sys.stderr)
        return 1
    total = sum(seconds for _, _, seconds in times)
    slowest = sorted(times, key=lambda t: -t[2])[: args.top]
    rows = [[files, outcome, f"{seconds:.1f}", f"{seconds / total:.2f}"]
            for files, outcome, seconds in slowest]  # fmt: skip
    what = f"the log {args.log}" if args.log else "./pants " + " ".join(args.pants_args or DEFAULT_COMMAND)
    print(f"{platform.machine()}, {os.cpu_count()} cores; {what}")
    print(markdown_table(["test files", "outcome", "seconds", "share of the sum"], rows))
    failed = sum(1 for _, outcome, _ in times if outcome == "failed")
    print(f"\n{len(times)} result lines ({failed} failed); test files' seconds summed: "
          f"{total:.0f} s")  # fmt: skip
    if wall is not None:
        print(f"wall time of the whole command: {wall:.0f} s ({wall / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
