"""The environment of a Python subprocess a test starts (`python -m kiln...`, `python -c`)."""

from __future__ import annotations

import os
import sys


def python_env(**extra: str) -> dict[str, str]:
    """This process's environment, with its sys.path as PYTHONPATH (absolute paths:
    tests/python/conftest.py), so that the subprocess imports what the test does, from any
    working directory; then `extra`."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **extra}
