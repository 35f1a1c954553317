"""The step's input caches in the artifact store: placed once, under their lease, checked.

A cache the Pants backend built in its sandbox (`inline`) is copied into the store at
`{name}/{version}` unless the same cache is there already: its files' digests are checked first
(the full check, kiln.data.verify), its objects are written with STATUS last
(kiln.artifacts.content.copy_folder_into), so a copy cut off at any point is never read as
complete. A cache built in place in the store (`storage="store"`) must be finished there, in
this store. Either way the trainer reads the cache in the store (a folder or a bucket: every host
of a run reads the same bytes), and the run holds it there until it ends (`hold_inputs`).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from kiln.artifacts.content import copy_folder_into
from kiln.artifacts.folder import ArtifactFolder
from kiln.artifacts.holds import NotBuilt, reading
from kiln.artifacts.local import LocalStore
from kiln.artifacts.locations import open_store
from kiln.artifacts.store import ObjectStore
from kiln.containment import OutsideRoot, within
from kiln.data.errors import KilnDataError
from kiln.data.verify import mark_verified, verify_once
from kiln.runner.decision import same_artifact
from kiln.runner.errors import StepError
from kiln_contract.record import ArtifactRecord
from kiln_contract.step import StepInput, StepSpec


def input_locations(step: StepSpec, inputs_root: Path, store: ObjectStore | None) -> dict[str, str]:
    """Where the trainer reads each input cache, by ref: in the store (a path or a URL), or in
    place in the sandbox for a run that has no store (`--output`)."""
    return {entry.ref: _location(entry, inputs_root, store) for entry in step.inputs}


def built_inputs(step: StepSpec, inputs_root: Path) -> dict[str, ObjectStore]:
    """Each input cache where it was built, by ref, opened: where the step spec's locations
    enter the runtime (in place in the sandbox, or in the artifact store for storage="store")."""
    locations = input_locations(step, inputs_root, None)
    return {ref: open_store(where) for ref, where in locations.items()}


def _location(entry: StepInput, inputs_root: Path, store: ObjectStore | None) -> str:
    if store is not None:
        return store.location(_key(entry))
    if entry.store_path is not None:  # built in place in the artifact store (storage="store")
        return entry.store_path
    assert entry.location is not None  # a StepInput has one of the two
    return str((inputs_root / entry.location).resolve())


def place_inputs(step: StepSpec, inputs_root: Path, store: ObjectStore) -> None:
    """Copies each built input cache into the store unless it is there already, and checks
    those already in the store."""
    for entry in step.inputs:
        if entry.store_path is not None:  # built in place: in this store, at its key
            _check_placed(ArtifactFolder(store, _key(entry)), entry.record)
        else:
            assert entry.location is not None
            place_cache(store, _key(entry), inputs_root / entry.location, entry.record)


def hold_inputs(step: StepSpec, store: ObjectStore, held: contextlib.ExitStack) -> None:
    """Holds each input cache in the store until `held` closes (kiln.artifacts.holds): no
    housekeeping removes what the run reads, from this clone or any other."""
    for entry in step.inputs:
        try:
            held.enter_context(reading(ArtifactFolder(store, _key(entry)), f"train {step.ref}"))
        except NotBuilt as e:
            raise StepError(f"input {entry.ref} was removed from the store: {e}") from None


def place_cache(store: ObjectStore, key: str, source: Path, record: ArtifactRecord) -> str:
    """Copies the built cache in the local folder `source` to `key` in `store` (checked against
    its digests first, STATUS last, under the cache's lease) unless the same cache is there;
    returns its location. A partial copy left by a killed placement is deleted first."""
    folder = ArtifactFolder(store, key)
    _contained(store, key, f"input cache {record.ref} at")
    if _check_placed(folder, record, missing_ok=True):
        return folder.location()
    built = LocalStore(source)
    if not ArtifactFolder(built, "").is_built():
        raise StepError(f"input cache {source} is not complete (no STATUS SUCCESS)")
    with folder.lease(f"place {record.ref}").acquire(wait=True):
        if not _check_placed(folder, record, missing_ok=True):  # or another run placed it
            _check_cache(built, record, mark=False)
            store.remove_folder(key)
            copy_folder_into(store, key, source)
            mark_verified(folder.as_store())  # the bytes just checked
    return folder.location()


def _check_placed(folder: ArtifactFolder, record: ArtifactRecord, *, missing_ok: bool = False) -> bool:
    """Whether the folder holds this cache, finished (its files present with their sizes);
    StepError when it holds another, or (unless `missing_ok`) no finished one."""
    if same_artifact(folder, record) is not None and folder.is_built():
        _check_cache(folder.as_store(), record)
        return True
    if missing_ok:
        return False
    raise StepError(
        f"input {record.ref} has storage=\"store\" and {folder.location()} holds no finished "
        "copy of it: build it under this prefix first (`pants package` of its tokenized_cache "
        "target with the same [kiln] prefix)"
    )


def check_in_place(step: StepSpec, inputs_root: Path) -> None:
    """Checks the input caches of a run without a store (`--output`) where Pants built them: in
    full, every run (a sandbox's folders are not the run's to mark)."""
    built = built_inputs(step, inputs_root)
    for entry in step.inputs:
        _check_cache(built[entry.ref], entry.record, mark=False)


def _check_cache(store: ObjectStore, record: ArtifactRecord, *, mark: bool = True) -> None:
    """kiln.data.verify's full check of an input cache, unless it passed it before and is
    unchanged since (`mark`: record that it passed, in its folder): StepError if it is
    damaged."""
    try:
        verification = verify_once(store, record=mark)
    except KilnDataError as e:
        raise StepError(f"input {record.ref}: {e}") from None
    if not verification.cache.verified:
        print(f"kiln: note: input {verification.describe()}", file=sys.stderr)


def _contained(store: ObjectStore, key: str, what: str) -> None:
    """In a directory: the key's folder, symlinks and `..` resolved, lies in the store."""
    root = store.root_location.folder
    if root is None:
        return
    try:
        within(Path(store.location(key)), root, what)
    except OutsideRoot as e:
        raise StepError(str(e)) from None


def _key(entry: StepInput) -> str:
    return f"{entry.name}/{entry.version}"
