"""Where the first `pants run` of the quickstart spends its time, from a fresh clone and HOME.

    python3 benchmarks/first_run.py [--target experiments:quickstart] [--keep]

Clones this checkout's HEAD into a temporary folder and makes an empty HOME beside it, so that
nothing is cached: the launcher bootstraps Pants, pip fetches every wheel from the package
index, Pants builds every PEX, the caches are tokenized and the model trained. It runs
`./pants run TARGET` there, timestamps each line of its output as it arrives, and prints one row
per phase, found by the lines that begin and end it:

- launcher: from the command's start to Pants' first line (bootstrapping Pants into HOME);
- pantsd and scheduler: Pants' daemon started and its rule graph built;
- each process Pants runs (`Starting:` .. `Completed:`), with when it started: they overlap;
- runtime start: from the last of those to the run's first line (its PEX's venv, imports);
- first step: `first step in`: data opened, state initialised, the step compiled and run;
- training: to the last `step N/N` line;
- the end: validation, lm-eval and the final save of the last step;
- summary: samples and report, to `kiln: built`; then the command's exit.

Run it on an idle machine; it needs the package index (PyPI) and PYENV_ROOT's interpreters.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

DROPPED_VARIABLES = ("PANTS_", "KILN_", "PEX_", "XDG_", "JAX_", "HF_", "WANDB_")
PANTS_LINE = re.compile(r"^\d\d:\d\d:\d\d\.\d\d \[(?:INFO|WARN|ERROR)\] (.*)$")


@dataclass(frozen=True)
class Line:
    seconds: float  # since the command started
    text: str


def run_cold(repo: Path, home: Path, target: str) -> tuple[list[Line], float, int]:
    """`./pants run TARGET` in `repo` with HOME at `home`: its timestamped lines, its wall
    seconds and its exit code."""
    # The machine's settings (PATH, the package index and its certificates) stay; what would
    # point at caches or settings under the old HOME goes.
    env = {k: v for k, v in os.environ.items() if not k.startswith(DROPPED_VARIABLES)}
    env["HOME"] = str(home)
    env.setdefault("PYENV_ROOT", os.path.expanduser("~/.pyenv"))  # interpreters, not caches
    started = time.monotonic()
    process = subprocess.Popen(
        ["./pants", "run", target], cwd=repo, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=1,
    )  # fmt: skip
    assert process.stdout is not None
    lines = [Line(time.monotonic() - started, text.rstrip("\n")) for text in process.stdout]
    code = process.wait()
    return lines, time.monotonic() - started, code


def first(lines: list[Line], pattern: str, after: float = 0.0) -> Line | None:
    found = re.compile(pattern)
    return next((line for line in lines if line.seconds >= after and found.search(line.text)), None)


def last(lines: list[Line], pattern: str) -> Line | None:
    found = re.compile(pattern)
    return next((line for line in reversed(lines) if found.search(line.text)), None)


def pants_processes(lines: list[Line]) -> list[tuple[str, float, float]]:
    """(description, start, seconds) of each process Pants ran to completion."""
    started: dict[str, float] = {}
    done = []
    for line in lines:
        match = PANTS_LINE.match(line.text)
        if match is None:
            continue
        kind, _, what = match.group(1).partition(": ")
        if kind == "Starting":
            started[what] = line.seconds
        elif kind == "Completed" and what in started:
            done.append((what, started[what], line.seconds - started.pop(what)))
    return done


def phases(lines: list[Line], wall: float) -> list[tuple[str, float, float]]:
    """(phase, start, seconds) in order, from the milestones found in the output."""
    rows: list[tuple[str, float, float]] = []
    pants_start = first(lines, PANTS_LINE.pattern)
    scheduler = first(lines, r"Initializing scheduler")
    scheduled = first(lines, r"Scheduler initialized")
    if pants_start is not None:
        rows.append(("launcher (bootstrap Pants)", 0.0, pants_start.seconds))
        if scheduled is not None:
            rows.append(("pantsd and scheduler", pants_start.seconds,
                         scheduled.seconds - pants_start.seconds))  # fmt: skip
    if scheduler is not None and scheduled is not None:
        rows.append(("  of which the rule graph", scheduler.seconds,
                     scheduled.seconds - scheduler.seconds))  # fmt: skip
    processes = pants_processes(lines)
    rows += [(f"  {_short(what)}", start, seconds) for what, start, seconds in processes]
    pants_done = max((start + seconds for _, start, seconds in processes), default=0.0)
    run_pattern = r"^(kiln|training control|first step|started from|resumed from)"
    milestones = [
        ("runtime start (venv, imports)", Line(pants_done, "") if processes else None),
        ("first step (data, init, compile)", first(lines, run_pattern, after=pants_done)),
        ("training", first(lines, r"^first step in ")),
        ("last step: validation, lm-eval, save", last(lines, r"^step (\d+)/\1 ")),
        ("summary (samples, report)", last(lines, r"^saved permanent checkpoint ")),
        ("exit", first(lines, r"^kiln: built ")),
    ]
    present = [(name, line) for name, line in milestones if line is not None]
    ends = [line.seconds for _, line in present[1:]] + [wall]
    rows += [(name, line.seconds, end - line.seconds) for (name, line), end in zip(present, ends)]
    return rows


def _short(what: str) -> str:
    """A Pants process's description without its list of requirements."""
    return what.split(" from the ")[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="experiments:quickstart")
    parser.add_argument("--keep", action="store_true", help="keep the clone, HOME and the log")
    args = parser.parse_args()
    here = Path.cwd()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()  # fmt: skip
    folder = Path(tempfile.mkdtemp(prefix="kiln-first-run-"))
    try:
        repo, home = folder / "repo", folder / "home"
        home.mkdir()
        subprocess.run(["git", "clone", "-q", str(here), str(repo)], check=True)
        lines, wall, code = run_cold(repo, home, args.target)
        (folder / "output.log").write_text(
            "".join(f"{line.seconds:8.2f}  {line.text}\n" for line in lines)
        )
        if code != 0:
            print("\n".join(line.text for line in lines[-40:]), file=sys.stderr)
            print(f"first_run: ./pants run {args.target} failed ({code})", file=sys.stderr)
            return 1
        print(f"`./pants run {args.target}` at {commit}, fresh clone and HOME; "
              f"{platform.machine()}, {os.cpu_count()} cores")  # fmt: skip
        print("| phase | starts at | seconds |\n| --- | --- | --- |")
        for name, start, seconds in phases(lines, wall):
            print(f"| {name} | {start:.1f} | {seconds:.1f} |")
        print(f"| **whole command** | 0.0 | **{wall:.1f}** ({wall / 60:.1f} min) |")
        return 0
    finally:
        if args.keep:
            print(f"first_run: kept {folder} (output.log: every line with its seconds)")
        else:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
