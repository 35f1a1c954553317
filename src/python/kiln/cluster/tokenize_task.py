"""The Ray task each shard (and the merge) of a fanned-out token cache runs on a cluster node:
one `python -m kiln.data.tokenize` process (kiln.cluster.fanout).

Standard library only (and Ray, present on every worker): the submitter ships this module by
value, so a node needs no Kiln installed to run it; the process it starts runs Kiln's runtime as
kiln.cluster.node_runtime provides it on the node.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from kiln.cluster import node_runtime

OUTPUT_TAIL_LINES = 20  # of the process's output, returned to the submitter


def run_tokenize(
    files: dict[str, bytes], argv: list[str], runtime: dict[str, Any], secrets: dict[str, str]
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
        import ray

        node = node_runtime.NodeRuntime.from_json(runtime)
        command, runtime_env = node_runtime.python_command(ray, node, "kiln.data.tokenize")
        env = {
            **os.environ,
            **secrets,  # the Hub's and the bucket's credentials: never on a command line
            **runtime_env,
            "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
        }
        result = subprocess.run(
            [*command, *argv],
            cwd=folder,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        return result.returncode, result.stdout.strip().splitlines()[-OUTPUT_TAIL_LINES:]
