"""How long the runner's PEX takes to build from an empty pex root, by pex version and jobs.

The first `pants run` on a machine builds the runner's PEX (kiln_pants.runtime: its requirements
from 3rdparty/python/runtime.lock) before anything else can start. This builds the same
requirements with each pex tool given (by default the one ./pants pins), each into an empty pex
root, as Pants asks for it (a packed venv PEX from the lock, its wheels as downloaded), once per
`--jobs` value (pex's parallel jobs; by default pex's own choice, the CPU count), and prints each
phase pex reports (`-vv`): downloading the distributions (pex runs one `pip download` process
per distribution), installing them, and packing the PEX, the CPU seconds the build used, and
ratios against the first row.

    python3 benchmarks/pex_build.py                          # the pinned pex
    python3 benchmarks/pex_build.py --jobs 2 --jobs 8        # pex's parallel jobs
    python3 benchmarks/pex_build.py --pex A.pex --pex B.pex  # pex versions

Downloads come from where the lockfile's URLs point (PyPI), so the download column depends on
the network as well as the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNNER = "src/python/kiln/runner/__main__.py"
DISTRIBUTIONS = re.compile(r"Downloading (\d+) distributions to satisfy")
PHASES = {  # pex's timing line -> the column it fills
    "download": re.compile(r"Downloading \d+ distributions to satisfy \d+ requirements: ([\d.]+)ms"),
    "install": re.compile(
        r"^pex:\s+(?:Installing \d+ distributions|Building \d+ artifacts and installing \d+): "
        r"([\d.]+)ms",
        re.M,
    ),
    "resolve": re.compile(r"^pex: Building pex: ([\d.]+)ms", re.M),
}


def runner_requirements() -> list[str]:
    """The runtime requirements in the runner's closure, as runtime-requirements.txt pins them."""
    listed = subprocess.run(
        ["./pants", "dependencies", "--transitive", RUNNER],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    names = {line.split("#", 1)[1] for line in listed.splitlines() if "python:runtime#" in line}
    pins = {}
    for line in (ROOT / "3rdparty/python/runtime-requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            pins[re.split(r"[\[<>=!~ ]", line, maxsplit=1)[0].lower()] = line
    return sorted(pins[name.lower()] for name in names)


def plain_lock(folder: Path) -> Path:
    """The runtime lock without Pants' header comments: a pex lock file."""
    text = (ROOT / "3rdparty/python/runtime.lock").read_text()
    lock = folder / "runtime.lock.json"
    lock.write_text("".join(line for line in text.splitlines(True) if not line.startswith("//")))
    json.loads(lock.read_text())
    return lock


def build(
    pex_tool: str, requirements: list[str], lock: Path, folder: Path, jobs: int | None
) -> dict[str, float]:
    """Seconds per phase of one build into an empty pex root, the whole build's, and its CPU."""
    python = runtime_python()
    command = [
        sys.executable if pex_tool.endswith(".pex") else pex_tool,
        *([pex_tool] if pex_tool.endswith(".pex") else []),
        "-vv", "--pex-root", str(folder / "pex_root"), "--lock", str(lock), "--python", python,
        "--layout", "packed", "--venv", "--no-pre-install-wheels", "-o", str(folder / "runner.pex"),
        *(["--jobs", str(jobs)] if jobs else []), *requirements,
    ]  # fmt: skip
    env = {**os.environ, "PIP_CONFIG_FILE": "/dev/null"}
    cpu_before = _children_cpu()
    started = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    whole = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{pex_tool} failed:\n{result.stderr[-3000:]}")
    seconds = {"whole": whole, "cpu": _children_cpu() - cpu_before}
    for phase, pattern in PHASES.items():
        match = pattern.search(result.stderr)
        seconds[phase] = float(match.group(1)) / 1000 if match else float("nan")
    seconds["pack"] = whole - seconds["resolve"]
    counted = DISTRIBUTIONS.search(result.stderr)
    seconds["distributions"] = float(counted.group(1)) if counted else float("nan")
    return seconds


def _children_cpu() -> float:
    usage = os.times()
    return usage.children_user + usage.children_system


def runtime_python() -> str:
    """The runtime's CPython 3.12, found as Pants finds it (pyenv first, then PATH)."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    found = sorted(root.glob("versions/3.12*/bin/python3.12")) or [
        Path(p) for p in [shutil.which("python3.12")] if p
    ]
    if not found:
        raise SystemExit("no CPython 3.12 found (pyenv or PATH)")
    return str(found[-1])


def launcher_tool(version: str) -> str:
    bootstrap = Path(os.environ.get("KILN_BOOTSTRAP_DIR", Path.home() / ".cache/kiln/bootstrap"))
    tools = sorted(bootstrap.glob(f"pants-*-pex-{version}/pex-{version}.pex"))
    if not tools:
        raise SystemExit(f"no pex {version} tool under {bootstrap}: give --pex PATH")
    return str(tools[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pex", action="append", help="a pex tool (repeat); the first is the baseline")
    parser.add_argument("--jobs", action="append", type=int, help="pex's parallel jobs (repeat)")
    args = parser.parse_args(argv)
    pinned = re.search(r'^readonly PEX_VERSION="([^"]+)"$', (ROOT / "pants").read_text(), re.M)
    assert pinned, "./pants pins PEX_VERSION"
    tools = args.pex or [launcher_tool(pinned.group(1))]
    requirements = runner_requirements()
    print(f"{len(requirements)} requirements of the runner: {' '.join(requirements)}")
    rows = []
    for tool in tools:
        for jobs in args.jobs or [None]:
            with tempfile.TemporaryDirectory(prefix="kiln-pex-build-") as folder:
                lock = plain_lock(Path(folder))
                rows.append((tool, jobs, build(tool, requirements, lock, Path(folder), jobs)))
                print(f"built with {tool}, jobs {jobs or 'default'}: {rows[-1][2]['whole']:.1f} s",
                      flush=True)  # fmt: skip
    base = rows[0][2]["whole"]
    print("| pex tool | jobs | distributions | download s | install s | pack s | whole s | CPU s "
          "| ratio |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for tool, jobs, s in rows:
        print(f"| {Path(tool).name} | {jobs or 'default'} | {s['distributions']:.0f} "
              f"| {s['download']:.1f} | {s['install']:.1f} | {s['pack']:.1f} | {s['whole']:.1f} "
              f"| {s['cpu']:.1f} | {s['whole'] / base:.2f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
