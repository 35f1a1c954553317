"""What importing the runtime's heavy modules costs a fresh process, in CPU seconds.

    ./pants export --resolve=runtime
    PYTHONPATH=src/python:src/contract dist/export/python/virtualenvs/runtime/*/bin/python \\
        benchmarks/import_cost.py [--repeat 5] [--baseline-path DIR]

Each module is imported in a new interpreter `--repeat` times; the table gives the median user +
system CPU seconds of the whole process (interpreter start-up included; the first row, nothing
imported, is that start-up). Every process that trains, tokenizes or evaluates pays these, and
the test command starts a few hundred of them.

With `--baseline-path DIR` every module is also imported with DIR first on sys.path (another
version of a package, unpacked there) in the same run, interleaved, and the ratio of the two is
printed: the baseline's seconds over this environment's.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys

MODULES = (
    "",  # the interpreter alone
    "chardet.universaldetector",
    "requests",
    "jax",
    "transformers",
    "lm_eval.evaluator",
    "kiln.runner.checkpoint_step",
)


def cpu_seconds(module: str, extra_path: str | None) -> float:
    """CPU seconds (user + system) of one interpreter that imports `module`."""
    env = dict(os.environ)
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, env.get("PYTHONPATH")) if p)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    code = f"import {module}" if module else "pass"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, stderr=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--baseline-path", help="a folder put first on sys.path for the baseline")
    args = parser.parse_args()
    print(f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    header = "| import | CPU s (median) |"
    if args.baseline_path:
        header += f" with {args.baseline_path} first | baseline / this |"
    print(header)
    print("|" + " --- |" * (header.count("|") - 1))
    for module in MODULES:
        ours, baseline = [], []
        for _ in range(args.repeat):  # interleaved, so a busier minute weighs on both
            ours.append(cpu_seconds(module, None))
            if args.baseline_path:
                baseline.append(cpu_seconds(module, args.baseline_path))
        row = f"| {module or '(nothing)'} | {statistics.median(ours):.2f} |"
        if baseline:
            ratio = statistics.median(baseline) / statistics.median(ours)
            row += f" {statistics.median(baseline):.2f} | {ratio:.2f} |"
        print(row)


if __name__ == "__main__":
    main()
