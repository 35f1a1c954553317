"""How long the runner's PEX takes to build from an empty pex root, by pex version.

The first `pants run` on a machine builds the runner's PEX (kiln_pants.runtime: its requirements
from 3rdparty/python/runtime.lock) before anything else can start. This builds the same
requirements with each pex tool given (the launcher's, by default the one ./pants pins and the
one before it), each into an empty pex root, as Pants asks for it (a packed venv PEX from the
lock), and prints each phase pex reports (`-vv`): downloading the distributions, installing
them, and packing the PEX, with ratios against the first tool.

    python3 benchmarks/pex_build.py                      # the pinned pex against 2.1.148
    python3 benchmarks/pex_build.py --pex A.pex --pex B.pex

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
PHASES = {  # pex's timing line -> the column it fills
    "download": re.compile(r"Downloading \d+ distributions to satisfy \d+ requirements: ([\d.]+)ms"),
    "install": re.compile(r"^pex:\s+Installing \d+ distributions: ([\d.]+)ms", re.M),
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


def build(pex_tool: str, requirements: list[str], lock: Path, folder: Path) -> dict[str, float]:
    """Seconds per phase of one build into an empty pex root, and the whole build's."""
    python = runtime_python()
    command = [
        sys.executable if pex_tool.endswith(".pex") else pex_tool,
        *([pex_tool] if pex_tool.endswith(".pex") else []),
        "-vv", "--pex-root", str(folder / "pex_root"), "--lock", str(lock), "--python", python,
        "--layout", "packed", "--venv", "-o", str(folder / "runner.pex"), *requirements,
    ]  # fmt: skip
    env = {**os.environ, "PIP_CONFIG_FILE": "/dev/null"}
    started = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    whole = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{pex_tool} failed:\n{result.stderr[-3000:]}")
    seconds = {"whole": whole}
    for phase, pattern in PHASES.items():
        match = pattern.search(result.stderr)
        seconds[phase] = float(match.group(1)) / 1000 if match else float("nan")
    seconds["pack"] = whole - seconds["resolve"]
    return seconds


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
    args = parser.parse_args(argv)
    pinned = re.search(r'^readonly PEX_VERSION="([^"]+)"$', (ROOT / "pants").read_text(), re.M)
    assert pinned, "./pants pins PEX_VERSION"
    tools = args.pex or [launcher_tool("2.1.148"), launcher_tool(pinned.group(1))]
    requirements = runner_requirements()
    print(f"{len(requirements)} requirements of the runner: {' '.join(requirements)}")
    rows = []
    for tool in tools:
        with tempfile.TemporaryDirectory(prefix="kiln-pex-build-") as folder:
            lock = plain_lock(Path(folder))
            rows.append((tool, build(tool, requirements, lock, Path(folder))))
            print(f"built with {tool}: {rows[-1][1]['whole']:.1f} s", flush=True)
    base = rows[0][1]["whole"]
    print("| pex tool | download s | install s | pack s | whole s | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    for tool, s in rows:
        print(f"| {Path(tool).name} | {s['download']:.1f} | {s['install']:.1f} | {s['pack']:.1f} "
              f"| {s['whole']:.1f} | {s['whole'] / base:.2f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
