"""Levanter caches written by Levanter's own code, for the import and framing tests.

The writer is tests/python/kiln/data/levanter_writer.py, the entry point of a PEX from the
`levanter-tests` resolve (marin-levanter from PyPI) that Pants builds beside the tests naming it
in `runtime_package_dependencies` (tests/python/kiln/data/BUILD: `:levanter`). One process writes every cache a
test module asks for and reads each back with Levanter's reader.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kiln_testing.data import STDLIB_TOKENIZER

# Where Pants puts tests/python/kiln/data:levanter for the tests that depend on it.
LEVANTER_PEX = Path("tests.python.kiln.data/levanter.pex")


@dataclass(frozen=True)
class LevanterCache:
    """A cache Levanter wrote: its split folder, ledger, and the rows Levanter's reader reads."""

    path: Path
    ledger: dict[str, Any]
    dtype: str
    rows: list[np.ndarray]


def spec_of(source: dict, tokenizer: dict = STDLIB_TOKENIZER, **config: Any) -> dict:
    """The step spec of a tokenized_cache of `source`, for kiln.data.tokenize.build_cache."""
    return {
        "spec_version": 1, "kind": "tokenized_cache", "name": "tokenized/levanter-import",
        "version": "2026.12.01", "fingerprint": "levanter1",
        "config": {"source": source, "tokenizer": tokenizer, **config},
    }  # fmt: skip


def import_spec(location: Path | str, tokenizer: dict = STDLIB_TOKENIZER) -> dict:
    """The step spec of a tokenized_cache importing the Levanter cache at `location`."""
    return spec_of({"kind": "levanter_cache", "location": str(location)}, tokenizer)


def write_levanter_caches(jobs: list[dict[str, Any]], folder: Path) -> dict[str, LevanterCache]:
    """Runs the writer's jobs (levanter_writer.py's docstring) in one process; the caches by
    `out` (other jobs leave their files at theirs)."""
    if not LEVANTER_PEX.exists():
        pytest.fail(f"{LEVANTER_PEX} is missing: run this test with `./pants test` (BUILD)")
    jobs_file = folder / "levanter-jobs.json"
    jobs_file.write_text(json.dumps(jobs))
    # The PEX's own environment, not this test's (Pants sets PEX_* for the test's PEX); a shared
    # PEX_ROOT keeps what the writer unpacks across runs. Marin's helpers write their scratch
    # files under MARIN_PREFIX (default /tmp/marin): the test's folder instead.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEX")}
    env["PEX_ROOT"] = str(Path(tempfile.gettempdir()) / "kiln-tests-pex-root")
    env["MARIN_PREFIX"] = str(folder / "marin")
    result = subprocess.run(
        [sys.executable, str(LEVANTER_PEX), str(jobs_file)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, f"Levanter's writer failed:\n{result.stderr[-4000:]}"
    written = {}
    for line in result.stdout.splitlines():
        if line.startswith("{"):
            report = json.loads(line)
            read = np.load(f"{report['out']}.ids.npz")
            rows = np.split(read["ids"], np.cumsum(read["lengths"])[:-1])
            out = Path(report["out"])
            written[str(out)] = LevanterCache(out, report["ledger"], report["dtype"], rows)
    return written
