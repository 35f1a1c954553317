"""A copy of this workspace for end-to-end tests to run real ./pants in."""

from __future__ import annotations

import shutil
from pathlib import Path

WORKSPACE = ("pants", "pants.toml", "ruff.toml", "mypy.ini", "3rdparty", "src", "experiments")


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
