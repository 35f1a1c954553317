"""The checkpoint hook's count of saves: a committed checkpoint is said and becomes the run's
last once the store holds it (a bucket's run uploads in the background), in order; one the
trainer pruned before it reached the store is dropped, never waited for."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from kiln.train.checkpoints import CheckpointInfo
from kiln.train.hooks import SyncPoint
from kiln.train.saves import Saves


class _Committed:
    """The checkpointer's side of a commit: the checkpoint each `commit()` completes."""

    def __init__(self) -> None:
        self.next: CheckpointInfo | None = None

    def commit(self) -> CheckpointInfo | None:
        done, self.next = self.next, None
        return done

    def writing(self) -> bool:
        return False


class _Lines:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def message(self, text: str) -> None:
        self.lines.append(text)


def _checkpoint(root: Path, step: int, *, temporary: bool) -> CheckpointInfo:
    path = root / f"step-{step}"
    path.mkdir(parents=True)
    return CheckpointInfo(path, step, 0.0, temporary)


def test_a_save_counts_once_the_store_holds_it_and_a_pruned_one_never(tmp_path: Path) -> None:
    stored: set[Path] = set()
    committed, progress = _Committed(), _Lines()
    saves = Saves(cast(Any, committed), None, cast(Any, None), cast(Any, progress), str,
                  lambda path: path in stored)  # fmt: skip
    first = _checkpoint(tmp_path, 10, temporary=True)
    committed.next = first
    saves.commit()
    assert (saves.last, progress.lines) == (None, [])  # committed here, not in the store yet

    second = _checkpoint(tmp_path, 20, temporary=False)
    committed.next = second
    saves.commit()
    first.path.rmdir()  # pruned by the trainer before its upload: the second supersedes it
    stored.add(second.path)
    saves(SyncPoint(21, None, final=False, ending=False, save=None, signum=None))  # the next
    assert saves.last == second
    assert progress.lines == [f"saved permanent checkpoint {second.path} (training held up 0.00s)"]
