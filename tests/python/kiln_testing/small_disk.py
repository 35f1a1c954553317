"""A store with little space, for full-disk tests.

Where this process may mount file systems (root, as in CI), the folder is a tmpfs of `size`
bytes: writes fail with ENOSPC once it is full, and `grow` gives the space back (a remount keeps
the files). Elsewhere the commands run with RLIMIT_FSIZE at `file_limit` bytes (SIGXFSZ
ignored): writing a file past it fails with EFBIG, and `grow` lifts the limit.
"""

from __future__ import annotations

import errno
import os
import resource
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

from kiln_testing.processes import python_env

# What a full disk reads like in a Kiln error line, in the two forms above.
FULL_DISK = ("No space left on device (ENOSPC)", "File too large (EFBIG)")
_ROOMY = "1g"


class SmallDisk:
    def __init__(self, folder: Path, *, size: int, file_limit: int) -> None:
        self.folder = folder
        self.file_limit = file_limit
        folder.mkdir(parents=True, exist_ok=True)
        mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)]
        self.mounted = subprocess.run(mount, capture_output=True).returncode == 0
        self._limited = not self.mounted

    def run(self, command: list[str], **kwargs) -> subprocess.CompletedProcess:
        """Runs `command` (its output captured as text) against the small disk."""
        return subprocess.run(
            command, env=python_env(**kwargs.pop("env", {})), capture_output=True, text=True,
            preexec_fn=self._limit() if self._limited else None, **kwargs,
        )  # fmt: skip

    def fill(self, *, leave_blocks: int) -> None:
        """Fills the mounted disk but for `leave_blocks` blocks, as another program would:
        writes that need more fail with ENOSPC, and the disk stays full when they do. (The
        file-size limit stands in for it where nothing is mounted.)"""
        if not self.mounted:
            return
        block = os.statvfs(self.folder).f_frsize
        reserved = [self.folder / f".reserved-{i}" for i in range(leave_blocks)]
        for path in reserved:
            path.write_bytes(b"\0" * block)
        fd = os.open(self.folder / ".filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            while os.write(fd, b"\0" * block):
                pass
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
        finally:
            os.close(fd)
        for path in reserved:
            path.unlink()

    def grow(self) -> None:
        if self.mounted:
            subprocess.run(["mount", "-o", f"remount,size={_ROOMY}", str(self.folder)], check=True)
        self._limited = False

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", str(self.folder)], check=True)

    def _limit(self) -> Callable[[], None]:
        size = self.file_limit

        def limit() -> None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))

        return limit
