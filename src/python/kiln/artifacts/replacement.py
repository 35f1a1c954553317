"""Replacing a built artifact (`--force`), in any store: the old folder is kept aside until the
new one has STATUS SUCCESS, and is then deleted.

    {name}/{version}/                    the rebuild (RUNNING until it succeeds)
    {name}/.{version}.replaced/          the artifact it replaces, as it was
    {name}/.{version}.replaced/.moved    written once every object of it is aside

Setting aside is one rename in a directory and a copy of every object then the deletion of the
originals in a bucket (ObjectStore.move_folder), so a process killed at any moment leaves one of
these states, and the next run (forced or not; each under the artifact's lease) goes on:

- nothing aside: an ordinary run; a forced one sets the folder aside first.
- aside without `.moved`: the move was cut off; it is carried on (the originals are still there,
  or already aside), then the rebuild starts.
- aside with `.moved`, the folder not SUCCESS: what the folder holds is either the rest of the
  old artifact (the deletion after the copy was cut off: its record, if any, is the replaced
  one's), which is deleted, or the rebuild, which goes on from its newest checkpoint.
- aside (perhaps partly deleted), the folder SUCCESS: the rebuild is done; the aside is deleted.

The old artifact is recovered by hand, with no run going: delete the folder and move
`.{version}.replaced` back to `{version}` (less its `.moved`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kiln.artifacts.store import ObjectStore, read_text
from kiln_contract.layout import (
    RECORD_FILE,
    REPLACED_SIBLING,
    STATUS_FILE,
    SUCCESS,
    sibling_key,
)

MOVED_MARKER = ".moved"


def replaced_key(key: str) -> str:
    """'checkpoints/x/v1' -> 'checkpoints/x/.v1.replaced'."""
    return sibling_key(key, REPLACED_SIBLING)


def is_replacing(store: ObjectStore, key: str) -> bool:
    """Whether a replacement of the folder `key` has begun and not finished."""
    return bool(store.keys(replaced_key(key)))


class NotThisArtifact(RuntimeError):
    """The folder's record names another artifact: nothing in it is moved or deleted."""


def set_aside(store: ObjectStore, key: str, name: str, version: str, fingerprint: str) -> str:
    """Begins (or goes on with) the replacement of the folder `key`, the artifact
    `name@version`, by a rebuild with `fingerprint`; returns what it did, for people. The caller
    holds the lease.

    A finished replacement's leftover is deleted first. When none is under way, the folder is
    set aside whole. When one is (a forced run was stopped), its rebuild is kept to be resumed,
    unless it was started with another fingerprint: then it is deleted (it never succeeded) and
    the rebuild starts over; the artifact set aside stays as it is."""
    finish(store, key)
    stored = _record(store, key)
    if stored is not None and (stored.get("name"), stored.get("version")) != (name, version):
        raise NotThisArtifact(
            f"{store.location(key)} holds a record that does not name {name}@{version}; it is "
            "not this artifact's folder, so it is neither moved nor deleted. Move it away and "
            "rerun."
        )
    aside = replaced_key(key)
    if not is_replacing(store, key):
        if not store.keys(key):
            return f"nothing is built at {store.location(key)} yet: building it"
        _move_aside(store, key)
        return (
            f"moved {store.location(key)} aside to {store.location(aside)}; it is deleted once "
            "the rebuild succeeds"
        )
    said = resume(store, key)
    stored = _record(store, key)
    if stored is not None and stored.get("fingerprint") != fingerprint:
        store.remove_folder(key, first=(STATUS_FILE,))
        return (
            f"deleted an unfinished rebuild with another configuration from {store.location(key)}; "
            f"the replaced artifact stays at {store.location(aside)} until the rebuild succeeds"
        )
    return said or (
        f"resuming the rebuild; the replaced artifact stays at {store.location(aside)} until it "
        "succeeds"
    )


def resume(store: ObjectStore, key: str) -> str | None:
    """With a replacement under way and not finished: completes a move that was cut off and
    deletes what is left of the old artifact in the folder, so that only the rebuild's own
    objects remain; says what it did (None when there was nothing to do)."""
    aside = replaced_key(key)
    if read_text(store, f"{aside}/{MOVED_MARKER}") is None:
        _move_aside(store, key)
        return f"finished setting the replaced artifact aside at {store.location(aside)}"
    stored, replaced = _record(store, key), _record(store, aside)
    if store.keys(key) and (stored is None or stored == replaced):
        store.remove_folder(key, first=(STATUS_FILE,))
        return f"deleted what was left of the replaced artifact in {store.location(key)}"
    return None


def _move_aside(store: ObjectStore, key: str) -> None:
    """Moves the folder's objects aside (STATUS first out of the folder, so that the folder
    never reads as built while it holds a part), then marks the move complete."""
    aside = replaced_key(key)
    store.move_folder(key, aside, first=(STATUS_FILE,))
    store.write(f"{aside}/{MOVED_MARKER}", b"")


@dataclass(frozen=True)
class Finished:
    """A replacement just completed: where the artifact it replaced was, and its fingerprint."""

    replaced: str  # its location, for people
    fingerprint: str | None  # the replaced artifact's, when its record was still there


def finish(store: ObjectStore, key: str) -> Finished | None:
    """When the folder `key` has STATUS SUCCESS and an artifact set aside: deletes that one (the
    caller holds the lease). None when there is nothing to finish."""
    aside = replaced_key(key)
    built = (read_text(store, f"{key}/{STATUS_FILE}") or "").strip() == SUCCESS
    if not (built and is_replacing(store, key)):
        return None
    old = _record(store, aside) or {}
    store.remove_folder(aside, first=(RECORD_FILE,))
    fingerprint = old.get("fingerprint")
    return Finished(store.location(aside), fingerprint if isinstance(fingerprint, str) else None)


@dataclass(frozen=True)
class Dependent:
    """A built artifact whose record names an input."""

    ref: str
    kind: str
    folder: str  # its location, for people
    input_fingerprint: str  # the input's fingerprint it was built from


def built_dependents(store: ObjectStore, ref: str) -> list[Dependent]:
    """The built artifacts in `store` whose records name `ref` as an input: every record
    `{name}/{version}/artifact.json` in the store, not those inside hidden folders (leases,
    staging, replaced artifacts)."""
    found = []
    for name in store.keys(""):
        parts = name.split("/")
        if parts[-1] != RECORD_FILE or any(p.startswith(".") for p in parts) or len(parts) < 3:
            continue
        folder = "/".join(parts[:-1])
        stored = _record(store, folder)
        if stored is None or (read_text(store, f"{folder}/{STATUS_FILE}") or "").strip() != SUCCESS:
            continue
        for entry in stored.get("inputs") or ():
            if isinstance(entry, dict) and entry.get("ref") == ref:
                own = f"{stored.get('name')}@{stored.get('version')}"
                found.append(Dependent(own, str(stored.get("kind")), store.location(folder),
                                       str(entry.get("fingerprint"))))  # fmt: skip
    return found


def _record(store: ObjectStore, key: str) -> dict[str, Any] | None:
    """The record in the folder `key`; None when there is none or it cannot be read as JSON."""
    text = read_text(store, f"{key}/{RECORD_FILE}")
    try:
        stored = None if text is None else json.loads(text)
    except ValueError:
        return None
    return stored if isinstance(stored, dict) else None
