"""Where this process trains the run: the artifact's folder itself in a directory store; in a
bucket, a staging folder of this host mirrored into the bucket (kiln.train.run_mirror), so that
hosts that share nothing but the bucket train one run."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kiln.artifacts.folder import ArtifactFolder
from kiln.train.run_mirror import RunMirror


@dataclass(frozen=True)
class Workspace:
    local: Path  # the folder the trainer writes
    mirror: RunMirror | None  # None: `local` is the artifact's folder in the store

    @property
    def per_host_folders(self) -> bool:
        """Whether each host of the run writes a folder of its own (kiln.train.checkpoints)."""
        return self.mirror is not None and self.mirror.process_count > 1

    def pull(self, *, checkpoints: bool) -> None:
        """The run's files and its newest complete checkpoint, from the bucket."""
        if self.mirror is not None:
            self.mirror.pull(checkpoints=checkpoints)

    def uploading(self) -> contextlib.AbstractContextManager[None]:
        """Uploads checkpoints and files as the trainer writes them, in the background."""
        return self.mirror.uploading() if self.mirror is not None else contextlib.nullcontext()

    def holds_checkpoint(self, path: Path) -> bool:
        """Whether the checkpoint committed at `path` is in the store for good: at once in a
        directory store, once its marker is in the bucket for a bucket's run."""
        return self.mirror is None or self.mirror.holds_checkpoint(path)

    def publish(self, *, status: bool, final: bool) -> None:
        """Uploads what is not in the bucket yet, `STATUS` last when `status`; a `final` publish
        on process 0 first waits for the other hosts' shards of the newest checkpoint."""
        if self.mirror is not None:
            self.mirror.push(status=status, final=final)

    def complete(self) -> None:
        """On the hosts of a run that write folders of their own: what the others wrote (their
        shards of the newest checkpoint, process 0's run files), for the readers of the model
        and the run after training."""
        if self.per_host_folders and self.mirror is not None:
            self.mirror.fetch(step="last")


@contextlib.contextmanager
def opened(
    folder: ArtifactFolder, *, process_index: int, process_count: int, staging: Path | None
) -> Iterator[Workspace]:
    """The workspace of a run in `folder`: a bucket's run stages in `staging` (a cluster host's
    folder for the run), else in a temporary folder."""
    if not folder.store.root_location.in_bucket:
        yield Workspace(Path(folder.location()), None)
        return
    with contextlib.ExitStack() as stack:
        if staging is None:
            staging = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kiln-staging-")))
        local = staging / "run"
        mirror = RunMirror(folder, local, process_index=process_index,
                           process_count=process_count)  # fmt: skip
        yield Workspace(local, mirror)
