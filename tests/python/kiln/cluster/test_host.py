"""A host's sweep of its node's abandoned host folders (kiln.cluster.host)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kiln.cluster.host import FOLDER_PREFIX, OWNERS, remove_abandoned_folders


def _host_folder(temp: Path, name: str, *pids: int) -> Path:
    folder = temp / f"{FOLDER_PREFIX}{name}"
    (folder / "staging").mkdir(parents=True)
    (folder / "staging" / "step.json").write_text("{}")
    if pids:
        (folder / OWNERS).write_text(" ".join(map(str, pids)))
    return folder


def test_only_folders_whose_actor_and_trainer_both_ended_are_removed(tmp_path: Path) -> None:
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()  # a pid that has ended, as a killed actor's or trainer's
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        abandoned = _host_folder(tmp_path, "abandoned", ended.pid, ended.pid)
        trainer_saving = _host_folder(tmp_path, "saving", ended.pid, alive.pid)
        running = _host_folder(tmp_path, "running", os.getpid())
        starting = _host_folder(tmp_path, "starting")  # its owners not yet written
        other = tmp_path / "not-a-host"
        other.mkdir()
        remove_abandoned_folders(tmp_path)
        assert not abandoned.exists()
        assert trainer_saving.exists() and running.exists() and starting.exists()
        assert other.exists()
    finally:
        alive.kill()
        alive.wait()
