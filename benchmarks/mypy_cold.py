"""`./pants check` from an empty mypy cache (CI's fresh machine), with mypy.ini as it is and
without the packages it does not follow (the baseline).

    python3 benchmarks/mypy_cold.py [--rounds 1]

Each round runs, one after the other, the baseline and the current config: `./pants
--no-local-cache check src/python:: src/contract:: src/pants_plugins::` through a daemon started
beforehand, Pants' named mypy cache moved aside first (and put back at the end), mypy's
`--timing-stats` kept. It prints the wall seconds of each command, its ratio to the baseline, and
the seconds mypy spent per top-level package in the partition that finishes last (the
runtime's: both partitions write the one stats file).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGETS = ["src/python::", "src/contract::", "src/pants_plugins::"]
NOT_FOLLOWED = re.compile(r"\n# Not followed:.*?follow_imports = skip\n", re.S)
BASELINE_CONFIG = ".mypy-baseline.ini"  # in the build root, where Pants reads configs


def mypy_cache() -> Path:
    cache_home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache_home / "pants/named_caches/mypy_cache"


def cold_check(config: str, stats: Path) -> float:
    """Seconds of one `./pants check` from an empty mypy cache."""
    shutil.rmtree(mypy_cache(), ignore_errors=True)
    mypy_cache().mkdir(parents=True)
    command = ["./pants", "--no-local-cache", "check", *TARGETS, f"--mypy-config={config}",
               f"--mypy-args=--timing-stats={stats}"]  # fmt: skip
    started = time.monotonic()
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.monotonic() - started


def per_package(stats: Path) -> Counter[str]:
    seconds: Counter[str] = Counter()
    for line in stats.read_text().splitlines():
        module, _, micros = line.rpartition(" ")
        if module and micros.isdigit():
            seconds[module.split(".")[0]] += int(micros) / 1e6
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    current = (REPO / "mypy.ini").read_text()
    if not NOT_FOLLOWED.search(current):
        raise SystemExit("mypy.ini has no `# Not followed:` section to leave out")
    (REPO / BASELINE_CONFIG).write_text(NOT_FOLLOWED.sub("\n", current))
    kept = Path(tempfile.mkdtemp(prefix="kiln-mypy-cache-")) / "mypy_cache"
    if mypy_cache().exists():
        shutil.move(mypy_cache(), kept)
    rows = []
    try:
        subprocess.run(["./pants", "list", "src/contract::"], cwd=REPO, check=True,
                       stdout=subprocess.DEVNULL)  # the daemon up before anything is timed  # fmt: skip
        for round_index in range(args.rounds):
            for name, config in (("baseline: every package followed", BASELINE_CONFIG),
                                 ("mypy.ini", "mypy.ini")):  # fmt: skip
                stats = Path(tempfile.mkdtemp()) / "timing.txt"
                seconds = cold_check(config, stats)
                rows.append((name, round_index, seconds, per_package(stats)))
    finally:
        (REPO / BASELINE_CONFIG).unlink()
        shutil.rmtree(mypy_cache(), ignore_errors=True)
        if kept.exists():
            shutil.move(kept, mypy_cache())
    print("| config | round | `./pants check` s | vs baseline | mypy's module s | slowest packages (s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    baseline = {r: s for n, r, s, _ in rows if n.startswith("baseline")}
    for name, round_index, seconds, packages in rows:
        slowest = ", ".join(f"{p} {s:.1f}" for p, s in packages.most_common(5))
        print(f"| {name} | {round_index} | {seconds:.1f} | {seconds / baseline[round_index]:.2f} | "
              f"{sum(packages.values()):.1f} | {slowest} |")  # fmt: skip


if __name__ == "__main__":
    main()
