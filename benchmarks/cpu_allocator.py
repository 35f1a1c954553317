"""The CPU trainer's allocator setting (kiln_contract.train.CPU_MALLOC_TUNABLES), measured.

    PYTHONPATH=src/python:src/contract python3 benchmarks/cpu_allocator.py [--repeat 3]

Runs benchmarks/train_step.py (float32, xla attention, the docs layout) in a fresh process per
measurement, with glibc's defaults and with the setting Kiln gives CPU training processes, one
after the other, `--repeat` times, for two shapes: the quickstart's (vocabulary 8192, batch
16 x 128: 64 MiB of lm-head logits a step) and the benchmark's tiny one (vocabulary 1024, batch
8 x 128). Prints the median step time, first step (trace, compile, run) and page faults per
shape and setting, and the setting's ratios against the defaults. glibc reads the setting when a
process starts, hence one process a measurement.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from kiln_contract.train import Resources

SHAPES = {  # name: train_step.py options
    "quickstart (V 8192, 16 x 128)": ["--vocab-size", "8192", "--batch-size", "16"],
    "tiny (V 1024, 8 x 128)": ["--vocab-size", "1024", "--batch-size", "8"],
}
SETTINGS = {"glibc defaults": {}, "Kiln's CPU setting": Resources("cpu").process_env()}
_MEASURE = """
import os, resource, runpy, sys
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))  # train_step.py's sibling modules
runpy.run_path(sys.argv[0], run_name="__main__")
print("minor_faults", resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
"""


def measure(options: list[str], env: dict[str, str], steps: int) -> tuple[float, float, int]:
    """(step ms, first step s, minor page faults of the whole process) of one run."""
    script = Path(__file__).with_name("train_step.py")
    argv = [sys.executable, "-c", _MEASURE, str(script), "--model", "tiny", "--attention", "xla",
            "--layouts", "docs", "--compute-dtype", "float32", "--steps", str(steps), *options]  # fmt: skip
    clean = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    out = subprocess.run(argv, env={**clean, **env}, capture_output=True, text=True, check=True)
    [row] = [line.split() for line in out.stdout.splitlines() if line.split()[:2] == ["docs", "xla"]]
    [faults] = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("minor_")]
    return float(row[3]), float(row[6]), int(faults)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args(argv)
    print(f"{'shape':<30} {'setting':<20} {'step ms':>8} {'1st step s':>10} {'faults':>9} "
          f"{'step ratio':>10} {'1st ratio':>9}")  # fmt: skip
    for shape, options in SHAPES.items():
        runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name in SETTINGS}
        for _ in range(args.repeat):  # alternating, so that a slow minute hits both
            for name, env in SETTINGS.items():
                runs[name].append(measure(options, env, args.steps))
        base = None
        for name, measured in runs.items():
            step, first, faults = (statistics.median(column) for column in zip(*measured))
            base = base or (step, first)
            print(f"{shape:<30} {name:<20} {step:>8.1f} {first:>10.2f} {faults:>9.0f} "
                  f"{step / base[0]:>10.2f} {first / base[1]:>9.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
