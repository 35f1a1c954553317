"""Where a no-op `pants run` of a built experiment spends its time.

    python3 benchmarks/noop_run.py [experiments:ci_tiny] [--repeat 5]

Run it from the build root, with the target already built in the artifact store (`./pants run
experiments:ci_tiny` once). It runs each command once to warm pantsd, then `--repeat` times, and
prints the median wall time of each (the whole command, as a user waits for it):

- the launcher alone: `./pants list TARGET` with the launcher's final `exec` of Pants' client
  replaced by `exit 0` (its checks and set-up, before Pants starts);
- `pants list TARGET`: the launcher, Pants' native client and pantsd, with a goal that runs
  nothing: Pants' floor;
- `pants run TARGET`: served by the Pants rule from the store's STATUS, record and summary (one
  uncacheable rule reads them), with no runtime started;
- the same through Pants' Python client (`{bootstrap venv}/bin/pants`, what `./pants`
  runs where the native client cannot be installed): the client's own start-up;
- `pants run TARGET -- --attention xla`: any `--` option leaves the decision to the runner:
  the runtime PEX's venv starts, `kiln.runner` imports, reads the store.

and the differences between them.

With --trace, one more served run is traced with Pants' own `workunit_logger` backend at trace
level (Pants restarts its scheduler for those options, and again for the next plain command) and
the rule's share is split: the run goal, the BUILD files Pants parsed again in that session (and
the time from the first parse's start to the last one's end), the store read (STATUS, record,
summary), the interactive process that prints.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path


def _launcher_version(name: str) -> str:
    """A version the launcher pins (`readonly NAME="..."` in ./pants)."""
    launcher = Path(__file__).resolve().parents[1] / "pants"
    match = re.search(rf'^readonly {name}="([^"]+)"$', launcher.read_text(), re.M)
    if match is None:
        raise SystemExit(f"./pants no longer pins {name}: update noop_run.py")
    return match.group(1)


PEX_VERSION = _launcher_version("PEX_VERSION")
BOOTSTRAP = os.path.join(
    os.environ.get("KILN_BOOTSTRAP_DIR", os.path.expanduser("~/.cache/kiln/bootstrap")),
    f"pants-{_launcher_version('PANTS_VERSION')}-pex-{PEX_VERSION}",
)


def wall_seconds(argv: Sequence[str], repeat: int, env: dict[str, str] | None = None) -> float:
    """The median wall time of `argv` over `repeat` runs, after one run that warms pantsd."""
    subprocess.run(argv, check=True, capture_output=True, env=env)
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True, env=env)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def launcher_seconds(target: str, repeat: int) -> float:
    """The median wall time of `./pants` up to the moment it would start Pants' client."""
    text = Path("pants").read_text()
    client = 'exec "${NATIVE_CLIENT}" "$@"'
    if client not in text:
        raise SystemExit(f"./pants no longer runs `{client}`: update launcher_seconds")
    with tempfile.TemporaryDirectory() as folder:
        stub = Path(folder) / "pants"
        stub.write_text(text.replace(client, "exit 0"))
        stub.chmod(0o755)
        return wall_seconds([str(stub), "list", target], repeat)


def python_client() -> tuple[list[str], dict[str, str]]:
    """Pants' Python client, with the environment `./pants` gives it."""
    env = {**os.environ, "KILN_PEX_TOOL": os.path.join(BOOTSTRAP, f"pex-{PEX_VERSION}.pex"),
           "NO_SCIE_WARNING": "1", "PIP_CONFIG_FILE": "/dev/null"}  # fmt: skip
    return [os.path.join(BOOTSTRAP, "venv", "bin", "pants")], env


TRACE_OPTIONS = (
    '--backend-packages=+["pants.backend.experimental.tools.workunit_logger"]',
    "--workunit-logger-enabled",
    "--streaming-workunits-level=trace",
)


def traced_run(target: str) -> list[dict]:
    """The workunits of one served `pants run`, after two with the same options (the first
    restarts Pants' scheduler for them)."""
    with tempfile.TemporaryDirectory() as folder:
        argv = ["./pants", *TRACE_OPTIONS, f"--workunit-logger-logdir={folder}", "run", target]
        for _ in range(3):
            for old in Path(folder).glob("*.json"):
                old.unlink()
            subprocess.run(argv, check=True, capture_output=True)
        [log] = Path(folder).glob("*.json")
        return json.loads(log.read_text())


def trace_rows(workunits: list[dict]) -> list[tuple[str, float]]:
    """(part, seconds) of a served run's workunits."""

    def start(w: dict) -> float:
        return w["start_secs"] + w["start_nanos"] / 1e9

    def seconds(w: dict) -> float:
        return w["duration_secs"] + w["duration_nanos"] / 1e9

    def named(suffix: str) -> list[dict]:
        return [w for w in workunits if w["name"].endswith(suffix)]

    parses = named("parse_address_family")
    rows = [("the `run` goal", sum(seconds(w) for w in named("core.goals.run.run")))]
    if parses:
        span = max(start(w) + seconds(w) for w in parses) - min(start(w) for w in parses)
        rows.append((f"BUILD files parsed again: {len(parses)}, first start to last end", span))
    rows.append(("the store read", sum(seconds(w) for w in named("read_stored_files"))))
    rows.append(("the process that prints", sum(seconds(w) for w in named("interactive_process"))))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("target", nargs="?", default="experiments:ci_tiny")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--trace", action="store_true", help="split the served run's rule time")
    args = parser.parse_args(argv)
    if not os.path.exists("pants.toml"):
        parser.error("run it from the build root")
    target = args.target

    launcher = launcher_seconds(target, args.repeat)
    listed = wall_seconds(["./pants", "list", target], args.repeat)
    served = wall_seconds(["./pants", "run", target], args.repeat)
    client, env = python_client()
    python_served = wall_seconds([*client, "run", target], args.repeat, env)
    runner = wall_seconds(["./pants", "run", target, "--", "--attention", "xla"], args.repeat)
    load = os.getloadavg()[0]
    print(f"{target}, median of {args.repeat}, {platform.machine()}, {os.cpu_count()} CPUs, "
          f"load average {load:.1f}")  # fmt: skip
    print()
    print("| command / part | wall s |")
    print("|---|---|")
    print(f"| the launcher alone (`./pants` before Pants' client) | {launcher:.3f} |")
    print(f"| `pants list` (launcher, native client, pantsd; no rules run) | {listed:.2f} |")
    print(f"| `pants run`, served by the Pants rule | {served:.2f} |")
    print(f"| `pants run` through the Python client | {python_served:.2f} |")
    print(f"| `pants run -- --attention xla`, served by the runner | {runner:.2f} |")
    print(f"| = the run rule, the store read, printing (run - list) | {served - listed:.2f} |")
    print(f"| = the Python client's start-up (Python client - run) | {python_served - served:.2f} |")
    print(f"| = the runtime: venv, imports, store read (runner - run) | {runner - served:.2f} |")
    if args.trace:
        print()
        print("| one served run, traced | s |")
        print("|---|---|")
        for part, seconds in trace_rows(traced_run(target)):
            print(f"| {part} | {seconds:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
