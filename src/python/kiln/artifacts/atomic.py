"""Atomic file writes: temp file + fsync + rename, so a process killed at any moment leaves
either the old file or the new one, never half of one; and a record file's bytes."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def temp_suffix() -> str:
    """`.tmp-PID`: how Kiln's temporaries end, so that a later build removes those whose process
    has ended (kiln.data.cache_writer.remove_dead_temporaries)."""
    return f".tmp-{os.getpid()}"


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    atomic_write_with(path, lambda f: f.write(data))


def atomic_write_with(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> None:
    """The file at `path` as `write` writes it into an open temp file (streamed, in pieces),
    renamed into place once complete. The temp file's name ends in its writer's pid
    (`temp_suffix`), so that what a killed writer left is known for its own."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=temp_suffix())
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates 0600; artifacts are shared, so give the usual umask-respecting mode.
        os.chmod(tmp, 0o666 & ~_current_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def json_bytes(obj: Any) -> bytes:
    """A record file's bytes: sorted keys, indented, one trailing newline."""
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8")


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    atomic_write_bytes(path, json_bytes(obj))
