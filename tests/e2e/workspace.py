"""A copy of this workspace for end-to-end tests to run real ./pants in, and what they read
back from its output."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

WORKSPACE = (
    "BUILD", "pants", "pants.toml", "ruff.toml", "mypy.ini", "3rdparty", "src", "experiments",
    "scripts",
)  # fmt: skip


def copy_workspace(destination: Path) -> Path:
    for name in WORKSPACE:
        source = Path(name)
        if source.is_dir():
            shutil.copytree(
                source, destination / name, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            shutil.copy2(source, destination / name)
    return destination


def run_pants(repo: Path, *args: str, env: dict[str, str], check: bool = True,
              ) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """`./pants ARGS` in `repo`, through its daemon; its exit code checked unless `check` is
    False."""
    result = subprocess.run(["./pants", *args], cwd=repo, env=env, capture_output=True,
                            text=True, timeout=1500)  # fmt: skip
    if check:
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def pantsd_pids(repo: Path) -> list[int]:
    """The pids of the Pants daemon serving `repo` (its process title names the build root)."""
    title = f"pantsd [{repo}]".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            alive = entry.name.isdigit() and (entry / "stat").read_text().split()[2] not in "ZX"
            if alive and (entry / "cmdline").read_bytes().startswith(title):
                pids.append(int(entry.name))
        except OSError:
            continue  # ended meanwhile
    return pids


def stop_pantsd(repo: Path) -> None:
    for pid in pantsd_pids(repo):
        os.kill(pid, signal.SIGKILL)


def store_rows(stdout: str) -> dict[str, tuple[str, str]]:
    """`pants store`'s table: artifact ref -> (STATUS, target)."""
    row = r"^  (\S+) +[\d.]+ k?[MGT]?B +(?:\d+ \w+|now) +(\S+@\S+) +(.+)$"
    return {m.group(2): (m.group(1), m.group(3)) for m in re.finditer(row, stdout, re.M)}

