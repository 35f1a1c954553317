"""Rolling checkpoints: temporary by time, permanent by step, on demand; resume from the newest.

Layout of one checkpoint (under the permanent root, output_path/checkpoints, or the temporary
root when runtime.checkpointer.temporary_base_path is set):

    step-N/state/          the TrainState pytree, written by orbax (its own temp dir + rename)
    step-N/metadata.json   {"step": N, "timestamp": unix seconds, "is_temporary": bool,
                           "files": {path under state/: {"bytes": N, "sha256": HEX}},
                           "data": where the training data's stream stands at step N
                           (kiln.data.mixture.StreamPosition: what a derived run continues)},
                           written LAST: its presence means the checkpoint is complete

A save writes into `.step-N.saving/` beside it and renames that folder to `step-N` once
metadata.json is in, so a step folder is complete or absent whenever the process is killed.

The data position is the step itself (the mixture is a pure function of the step) and the model
has no RNG state to carry, so the state pytree plus N is everything a resume needs. Readers of
the model alone (export, evaluating a trained run) use `checkpoint_params.restore_params`, which
reads the parameters without the optimizer state. Orbax's side of a save is `orbax_saves`.
A `.step-N.saving` folder is a save that was killed: ignored, and deleted on start. A step-N
folder whose metadata.json is missing or unreadable cannot be a half-finished save (saves commit
by renaming): it is damaged, ignored, and moved aside on start (`step-N.damaged`, below).
Older checkpoints are deleted only after a newer one is complete.

Saves are asynchronous: `begin_save` returns once orbax has copied the state off the devices,
orbax writes the files on a background thread, and `commit` (when they are written) completes
the checkpoint: metadata.json, then pruning. `save` does both, waiting. The digest of every
state file is computed on the same background thread once orbax has written it (orbax writes
through TensorStore, which offers no hook into its writes, so the files are read back while
they are still in the page cache): training is not held up by it, and benchmarks/
checkpoint_digest.py measures its cost.

Resuming (`restore_latest`) takes the newest complete checkpoint that is intact: its state files
present with the sizes and sha256 digests metadata.json records, and restorable by orbax. A
damaged one is skipped, named with the file and the reason on the log, and the previous one is
tried. Once an intact one is found, the skipped ones are moved aside (`step-N` ->
`step-N.damaged`) for a person to inspect: they never count as kept checkpoints, are never
resumed from again, and a new save of their step does not see them. Older checkpoints are pruned
only once a newer one is complete (its files written and digested, metadata.json last), so the
newest intact checkpoint is never deleted before its successor exists. When every complete
checkpoint is damaged, the run stops (CheckpointDamaged) and leaves them where they are, rather
than start over silently. `restore_params` (export, evaluation) refuses a damaged checkpoint the
same way. Checkpoints saved before digests were
recorded (sizes alone) are checked by their sizes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from kiln.artifacts.atomic import atomic_write_json
from kiln.artifacts.content import (
    FileRecords,
    check_digests,
    check_sizes,
)
from kiln.train.multihost import barrier
from kiln.train.orbax_saves import OrbaxFailuresQuieted, SaveInProgress, orbax_checkpointer
from kiln.train.spec import CheckpointerSpec

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"  # a run's permanent checkpoints, in its output folder
METADATA_FILE = "metadata.json"
STATE_DIR = "state"
PARAMS_KEY = "params"  # the parameters' field of the saved TrainState (kiln.train.step)
STEP_DIR = re.compile(r"^step-(\d+)$")
DAMAGED_SUFFIX = ".damaged"  # a checkpoint that failed its check, moved aside (not a STEP_DIR)
SAVING_DIR = re.compile(r"^\.step-(\d+)\.saving$")  # a save in progress, renamed to step-N last


class CheckpointDamaged(RuntimeError):
    """No complete checkpoint of the run can be restored: the message names each and why."""


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    timestamp: float
    is_temporary: bool
    files: FileRecords | None = None  # sizes and digests of the state's files; None: not recorded


def checkpoint_roots(output_path: Path, spec: CheckpointerSpec, name: str, version: str):
    """(permanent root, temporary root). Temporaries under a shared base get a per-run folder."""
    permanent = output_path / CHECKPOINTS_DIR
    if spec.temporary_base_path is None:
        return permanent, permanent
    return permanent, spec.temporary_base_path / name / version / CHECKPOINTS_DIR


def read_checkpoint(path: Path) -> CheckpointInfo | None:
    """The checkpoint at `path` if it is complete (has readable metadata), else None."""
    try:
        meta = json.loads((path / METADATA_FILE).read_text())
        return CheckpointInfo(path, int(meta["step"]), float(meta["timestamp"]),
                              bool(meta["is_temporary"]), meta.get("files"))  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


class Checkpointer:
    """Decides when to save, saves and restores TrainState pytrees, and prunes old temporaries."""

    def __init__(
        self,
        permanent_root: Path,
        temporary_root: Path,
        *,
        save_interval_seconds: float,
        keep_last_temporary: int,
        every: int | None,
        per_host_folders: bool = False,
        clock: Callable[[], float] = time.monotonic,
        data_at: Callable[[int], Mapping[str, Any]] | None = None,
    ):
        """data_at(step): the data stream's position after `step` steps, for metadata.json."""
        self.permanent_root = permanent_root
        self.data_at = data_at
        self.temporary_root = temporary_root
        self.save_interval_seconds = save_interval_seconds
        self.keep_last_temporary = keep_last_temporary
        self.every = every
        self._clock = clock
        self._last_save_time = clock()
        self._orbax = orbax_checkpointer(per_host_folders)
        # In a folder every host shares, process 0 writes the metadata and prunes; in folders of
        # their own, every host does so in its own.
        self._is_writer = per_host_folders or jax.process_index() == 0
        self._in_progress: SaveInProgress | None = None

    @classmethod
    def from_spec(
        cls,
        output_path: Path,
        spec: CheckpointerSpec,
        *,
        name: str,
        version: str,
        data_at: Callable[[int], Mapping[str, Any]] | None = None,
    ) -> Checkpointer:
        permanent, temporary = checkpoint_roots(output_path, spec, name, version)
        return cls(
            permanent,
            temporary,
            save_interval_seconds=spec.save_interval_minutes * 60.0,
            keep_last_temporary=spec.keep_last_temporary,
            every=spec.every,
            per_host_folders=spec.per_host_folders,
            data_at=data_at,
        )

    def _roots(self) -> list[Path]:
        return list(dict.fromkeys([self.permanent_root, self.temporary_root]))

    def _step_dirs(self) -> list[Path]:
        return [
            p
            for root in self._roots()
            if root.is_dir()
            for p in sorted(root.iterdir())
            if p.is_dir() and STEP_DIR.match(p.name)
        ]

    def complete(self) -> list[CheckpointInfo]:
        """Complete checkpoints across both roots, oldest first (a permanent after a temporary)."""
        infos = [info for p in self._step_dirs() if (info := read_checkpoint(p)) is not None]
        return sorted(infos, key=lambda c: (c.step, not c.is_temporary))

    def latest(self) -> CheckpointInfo | None:
        """The checkpoint to resume from: the newest complete one, permanent winning a tie."""
        infos = self.complete()
        return infos[-1] if infos else None

    def remove_incomplete(self) -> list[Path]:
        """Deletes saves that were killed midway (`.step-N.saving` folders) and moves aside step
        folders whose metadata.json is missing or unreadable (damaged: a step folder only ever
        appears complete); returns what it deleted. Process 0 acts, and every process waits."""
        removed = []
        if self._is_writer:
            for path in self._step_dirs():
                if read_checkpoint(path) is None:
                    aside = _unused(path.with_name(path.name + DAMAGED_SUFFIX))
                    path.rename(aside)
                    log.warning("moved the damaged checkpoint %s aside to %s: its %s is "
                                "missing or unreadable", path, aside, METADATA_FILE)  # fmt: skip
            removed = [p for root in self._roots() if root.is_dir()
                       for p in sorted(root.iterdir()) if SAVING_DIR.match(p.name)]  # fmt: skip
            for path in removed:
                log.warning("removing incomplete checkpoint %s (its save did not finish)", path)
                shutil.rmtree(path, ignore_errors=True)
        barrier("kiln: incomplete checkpoints removed")
        return removed

    def restore(self, info: CheckpointInfo, like: Any) -> Any:
        """Restores the state saved at `info` with the structure, dtypes and shardings of `like`."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        return self._orbax.restore(info.path / STATE_DIR, abstract)

    def restore_latest(self, like: Any) -> tuple[Any, CheckpointInfo] | None:
        """(state, checkpoint) from the newest intact complete checkpoint, skipping damaged ones
        (each named on the log with the reason, and moved aside); None when there is no complete
        checkpoint; CheckpointDamaged when every one is damaged (they stay in place). Multi-host:
        every process calls it."""
        skipped: list[tuple[CheckpointInfo, str]] = []
        restored = None
        for info in reversed(self.complete()):
            problem = damage(info)
            if problem is None:
                try:
                    restored = self.restore(info, like), info
                    break
                except Exception as e:  # orbax raises many types; all mean "not restorable"
                    problem = f"orbax cannot restore it: {(str(e) or repr(e)).splitlines()[0]}"
            log.warning("skipping checkpoint %s: %s", info.path, problem)
            skipped.append((info, problem))
        if restored is not None:
            self._move_aside([info for info, _ in skipped])
        elif skipped:
            raise CheckpointDamaged(
                "no checkpoint of this run can be restored: "
                + "; ".join(f"{info.path} ({problem})" for info, problem in skipped)
                + ". If the run's config changed, give it a new version; else delete these "
                "checkpoints to start over."
            )
        return restored

    def _move_aside(self, damaged: list[CheckpointInfo]) -> None:
        """Renames each damaged checkpoint's folder out of the checkpointer's sight, keeping it
        for a person to inspect (process 0 renames; every process waits for it)."""
        barrier("kiln: checkpoints checked")  # no process is still reading one
        if self._is_writer:
            for info in damaged:
                aside = _unused(info.path.with_name(info.path.name + DAMAGED_SUFFIX))
                info.path.rename(aside)
                log.warning("moved the damaged checkpoint %s aside to %s", info.path, aside)
        barrier("kiln: damaged checkpoints moved aside")

    def due(self, step: int, *, final: bool = False, requested: bool = False) -> str | None:
        """Which save, if any, is due after `step`: "permanent", "temporary" or None."""
        if final or (self.every is not None and step % self.every == 0):
            return "permanent"
        if requested or self._clock() - self._last_save_time >= self.save_interval_seconds:
            return "temporary"
        return None

    def save(self, step: int, state: Any, *, temporary: bool) -> CheckpointInfo:
        """Saves `state` as step-N and waits until it is complete (`begin_save` + `commit`)."""
        info = self.begin_save(step, state, temporary=temporary) or self.commit()
        assert info is not None  # begin_save left a save in progress, and commit completed it
        return info

    def begin_save(self, step: int, state: Any, *, temporary: bool) -> CheckpointInfo | None:
        """Starts saving `state` as step-N and returns once orbax holds a copy of it off the
        devices (training may go on, donating the state's buffers); orbax writes the files in
        the background, and `commit` completes the checkpoint. Returns the checkpoint instead,
        with nothing left to commit, when step N is already saved as durably as asked (a
        temporary of the same step in the same folder is promoted in place).

        A save still in progress is committed first. Multi-host: every process calls it with the
        same arguments (orbax saves collectively)."""
        self.commit()
        existing = self._existing(step)
        if existing is not None and (temporary or not existing.is_temporary):
            return existing  # already saved at this step, as durably as asked
        root = self.temporary_root if temporary else self.permanent_root
        path = root / f"step-{step}"
        self._last_save_time = self._clock()
        if existing is not None and existing.path == path:  # promote in place
            info = self._write_metadata(path, step, temporary=False, files=existing.files)
            return self._committed(info)
        staging = root / f".step-{step}.saving"
        if self._is_writer:
            for leftover in (path, staging):  # a killed save of this very step
                shutil.rmtree(leftover, ignore_errors=True)
        quiet = OrbaxFailuresQuieted()
        try:
            self._orbax.save(staging / STATE_DIR, state)
        except BaseException:
            quiet.end(succeeded=False)
            raise
        self._in_progress = SaveInProgress(
            staging, STATE_DIR, step, temporary, quiet, self._orbax, record_digests=self._is_writer
        )
        return None

    def writing(self) -> bool:
        """Whether a save begun on this process is still writing its files."""
        return self._in_progress is not None and not self._in_progress.done.is_set()

    def commit(self) -> CheckpointInfo | None:
        """Waits for the save in progress, if any, and completes it: metadata.json (process 0),
        then the older checkpoints it supersedes are pruned. Returns the checkpoint, or None
        when no save was in progress. A failed save raises its error (its staging folder stays,
        and is deleted on the next start). Multi-host: every process calls it at
        the same point, and all leave together."""
        saving, self._in_progress = self._in_progress, None
        if saving is None:
            return None
        saving.finish()
        return self._committed(self._complete(saving))

    def _committed(self, info: CheckpointInfo) -> CheckpointInfo:
        self._prune(info)
        barrier(f"kiln: saved step {info.step}")  # the path differs across per-host folders
        return info

    def _existing(self, step: int) -> CheckpointInfo | None:
        matches = [c for c in self.complete() if c.step == step]
        return matches[-1] if matches else None

    def _complete(self, saving: SaveInProgress) -> CheckpointInfo:
        """A finished save made a checkpoint: metadata.json into its staging folder, which is
        then renamed to step-N (process 0)."""
        staged = self._write_metadata(
            saving.path, saving.step, temporary=saving.temporary, files=saving.files
        )
        final = saving.path.with_name(f"step-{saving.step}")
        if self._is_writer:
            saving.path.rename(final)
        return dataclasses.replace(staged, path=final)

    def _write_metadata(
        self, path: Path, step: int, *, temporary: bool, files: FileRecords | None
    ) -> CheckpointInfo:
        """metadata.json (process 0), with the state files' records made when they were saved."""
        info = CheckpointInfo(path, step, time.time(), temporary, files)
        if self._is_writer:
            metadata = {"step": step, "timestamp": info.timestamp, "is_temporary": temporary,
                        "files": info.files}  # fmt: skip
            if self.data_at is not None:
                metadata["data"] = dict(self.data_at(step))
            atomic_write_json(path / METADATA_FILE, metadata)
        return info

    def _prune(self, newest: CheckpointInfo) -> None:
        """A permanent save supersedes all older temporaries; beyond that keep the last N. Runs
        once `newest` is complete (its files written and digested, metadata.json last), so the
        checkpoints it prunes are never the newest intact one."""
        if not self._is_writer:
            return
        temporaries = [c for c in self.complete() if c.is_temporary and c.path != newest.path]
        if newest.is_temporary:
            keep = self.keep_last_temporary - 1
            doomed = temporaries[: max(0, len(temporaries) - keep)]
        else:
            doomed = [c for c in temporaries if c.step <= newest.step]
        for c in doomed:
            shutil.rmtree(c.path, ignore_errors=True)

    def close(self) -> None:
        """Completes a save still in progress (a run that fails after starting it still keeps
        that checkpoint; a save that fails is logged, its staging folder left behind), then closes
        orbax. Not a collective: nothing is pruned and no process is waited for."""
        saving, self._in_progress = self._in_progress, None
        if saving is not None:
            try:
                saving.finish()
                self._complete(saving)
            except Exception as e:  # noqa: BLE001 - the run is ending on another error already
                log.warning("the checkpoint save of %s failed: %s", saving.path, e)
        self._orbax.close()


def _unused(path: Path) -> Path:
    """`path`, or `path.1`, `path.2`, ... : the first name nothing holds yet."""
    candidate, n = path, 0
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}.{n}")
    return candidate


def damage(info: CheckpointInfo) -> str | None:
    """Why the checkpoint's state files are not as saved (missing, other sizes, other bytes than
    their digests), or None. Reads every file when digests are recorded."""
    if info.files is None:
        return None  # saved without records: orbax's own checks are all there are
    state = info.path / STATE_DIR
    digested = all("sha256" in record for record in info.files.values())
    found = check_digests(state, info.files) if digested else check_sizes(state, info.files)
    if not found:
        return None
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return f"{STATE_DIR}/{found[0].file} {found[0].reason}{more}"


def check_intact(info: CheckpointInfo) -> None:
    """CheckpointDamaged naming the checkpoint and its first damaged file, if any."""
    problem = damage(info)
    if problem is not None:
        raise CheckpointDamaged(
            f"checkpoint {info.path} is damaged: {problem}; restore it from a good copy or use "
            "another checkpoint of the run"
        )
