"""Housekeeping as `pants store --yes` runs it: its removal, one process per command, as
another clone or machine sharing the store would run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kiln_testing.processes import python_env

from kiln.artifacts import inventory
from kiln_contract.inventory import FolderOutcome


def remove(store: Path | str, folder: str) -> FolderOutcome:
    """Removes the artifact `folder` from the store (`python -m kiln.artifacts.inventory STORE
    --remove FOLDER`): done, or kept and why."""
    command = [sys.executable, "-m", inventory.__name__, str(store), "--remove", folder]
    done = subprocess.run(command, env=python_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    [outcome] = FolderOutcome.read_lines(done.stdout)
    return outcome
