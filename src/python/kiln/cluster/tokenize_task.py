"""The Ray task each shard (and the merge) of a fanned-out token cache runs on a cluster node:
one `python -m kiln.data.tokenize` process (kiln.cluster.fanout).

Standard library only (and Ray, present on every worker): the submitter ships this module by
value, so a node needs no Kiln installed to run it; the process it starts finds Kiln's sources
in the shared store (`PYTHONPATH`, see dispatch.ship_code).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

OUTPUT_TAIL_LINES = 20  # of the process's output, returned to the submitter


def run_tokenize(
    files: dict[str, bytes], argv: list[str], pythonpath: str, hub_env: dict[str, str]
) -> tuple[int, list[str]]:
    """Writes `files` (the spec, the artifact record, the repository files the spec reads) at
    their relative paths into a fresh folder and runs `python -m kiln.data.tokenize ARGV` there;
    returns its exit code and the last lines of its output. The process stops by itself if this
    worker dies (kiln.lifetime)."""
    with tempfile.TemporaryDirectory(prefix="kiln-tokenize-") as folder:
        for name, content in files.items():
            path = Path(folder, name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
        paths = [pythonpath, os.environ.get("PYTHONPATH", "")]
        env = {
            **os.environ,
            **hub_env,  # credentials for a hub source or tokenizer: never on the command line
            "PYTHONPATH": os.pathsep.join(p for p in paths if p),
            "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
        }
        result = subprocess.run(
            [sys.executable, "-m", "kiln.data.tokenize", *argv],
            cwd=folder,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        return result.returncode, result.stdout.strip().splitlines()[-OUTPUT_TAIL_LINES:]
