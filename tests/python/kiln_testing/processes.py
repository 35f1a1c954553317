"""The processes a test starts: the environment of a Python subprocess (`python -m kiln...`,
`python -c`), and the command lines of what runs on the machine."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path


def python_env(**extra: str) -> dict[str, str]:
    """This process's environment, with its sys.path as PYTHONPATH (absolute paths:
    tests/python/conftest.py), so that the subprocess imports what the test does, from any
    working directory; then `extra`."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **extra}


def bundle_pythonpath() -> str:
    """PYTHONPATH for a runner started in a bundle's folder (kiln.runner.bundle): the bundle's
    sources, then this interpreter's packages without Kiln's checkout among them, as on a
    machine that has only the bundle."""
    others = [p for p in sys.path if p and not (Path(p) / "kiln").is_dir()]
    others = [p for p in others if not (Path(p) / "kiln_contract").is_dir()]
    return os.pathsep.join(["src", *others])


def command_lines() -> Iterator[tuple[int, str]]:
    """(pid, command line) of every process but this one, its arguments joined by spaces."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # ended meanwhile
        yield int(entry.name), line


def environment(pid: int) -> dict[str, str]:
    """The environment process `pid` started with; empty when it has ended."""
    try:
        entries = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return {}
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)
