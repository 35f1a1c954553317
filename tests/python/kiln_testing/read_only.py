"""A folder nothing may write, for read-only store tests.

Where this process may mount file systems (root, as in CI), the folder is bind-mounted over
itself read-only, as a user's read-only store is: every write under it fails with EROFS.
Elsewhere its mode is 0o555, so nothing can be made in it: such writes fail with EACCES. Root
ignores modes, so a root that may not mount skips the test.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

# What a refused write reads like in a Kiln error line, in the two forms above.
READ_ONLY = ("Read-only file system (EROFS)", "Permission denied (EACCES)")


@contextlib.contextmanager
def read_only(folder: Path) -> Iterator[Path]:
    """`folder` (made if missing) read-only while the body runs."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield folder
        finally:
            folder.chmod(0o755)
        return
    bind = ["mount", "--bind", "-o", "ro", str(folder), str(folder)]
    if subprocess.run(bind, capture_output=True).returncode != 0:
        pytest.skip("root that may not mount: no way to make a folder read-only for it")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)
