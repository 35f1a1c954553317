"""kiln.artifacts.replacement, in a directory and in S3 and GCS buckets: a forced rebuild keeps
the old artifact aside until the new one has STATUS SUCCESS; every state a kill can leave is one
the next run goes on from."""

from __future__ import annotations

import json

import pytest

from kiln import artifacts
from kiln.artifacts.replacement import (
    MOVED_MARKER,
    NotThisArtifact,
    built_dependents,
    finish,
    is_replacing,
    replaced_key,
    resume,
    set_aside,
)
from kiln.artifacts.store import ObjectStore, read_text

NAME, VERSION = "checkpoints/x", "2026.11.29"
REF = f"{NAME}@{VERSION}"
KEY = f"{NAME}/{VERSION}"
ASIDE = replaced_key(KEY)


def artifact(
    store: ObjectStore,
    key: str = KEY,
    *,
    fingerprint: str = "old",
    status: str | None = artifacts.SUCCESS,
    name: str = NAME,
    version: str = VERSION,
    kind: str = "lm_checkpoint",
    inputs: tuple[tuple[str, str], ...] = (),
) -> str:
    record = {
        "kind": kind, "name": name, "version": version, "fingerprint": fingerprint,
        "inputs": [{"ref": ref, "fingerprint": fp} for ref, fp in inputs],
    }  # fmt: skip
    store.write(f"{key}/{artifacts.RECORD_FILE}", json.dumps(record).encode())
    store.write(f"{key}/weights", f"weights of {fingerprint}".encode())
    if status is not None:
        store.write(f"{key}/{artifacts.STATUS_FILE}", f"{status}\n".encode())
    return key


def fingerprint_in(store: ObjectStore, key: str) -> str:
    return json.loads(store.read(f"{key}/{artifacts.RECORD_FILE}").data)["fingerprint"]


def status_of(store: ObjectStore, key: str) -> str | None:
    text = read_text(store, f"{key}/{artifacts.STATUS_FILE}")
    return None if text is None else text.strip()


def test_the_built_artifact_is_set_aside_whole_and_deleted_only_after_success(
    store: ObjectStore,
) -> None:
    artifact(store)
    said = set_aside(store, KEY, NAME, VERSION, "new")
    assert ASIDE == f"{NAME}/.{VERSION}.replaced"
    assert f"moved {store.location(KEY)} aside to {store.location(ASIDE)}" in said
    assert store.keys(KEY) == [] and read_text(store, f"{ASIDE}/weights") == "weights of old"
    assert is_replacing(store, KEY)

    artifact(store, fingerprint="new", status=artifacts.RUNNING)  # the rebuild trains
    assert finish(store, KEY) is None and is_replacing(store, KEY)  # not SUCCESS: old one kept
    store.write(f"{KEY}/{artifacts.STATUS_FILE}", b"SUCCESS\n")
    finished = finish(store, KEY)
    assert finished is not None and finished.fingerprint == "old"
    assert store.keys(ASIDE) == [] and not is_replacing(store, KEY)
    assert fingerprint_in(store, KEY) == "new"


def test_a_stopped_forced_rebuild_is_resumed_not_set_aside_again(store: ObjectStore) -> None:
    artifact(store)
    set_aside(store, KEY, NAME, VERSION, "new")
    artifact(store, fingerprint="new", status=artifacts.FAILED)  # killed or failed mid-way
    said = set_aside(store, KEY, NAME, VERSION, "new")
    assert said.startswith("resuming the rebuild")
    assert fingerprint_in(store, KEY) == "new" and fingerprint_in(store, ASIDE) == "old"


def test_a_stopped_rebuild_of_another_configuration_is_deleted(store: ObjectStore) -> None:
    artifact(store)
    set_aside(store, KEY, NAME, VERSION, "new")
    artifact(store, fingerprint="new", status=artifacts.RUNNING)
    said = set_aside(store, KEY, NAME, VERSION, "newer")
    assert said.startswith("deleted an unfinished rebuild") and store.keys(KEY) == []
    assert fingerprint_in(store, ASIDE) == "old"  # the artifact set aside stays


def test_a_finished_replacement_left_behind_is_deleted_before_the_next(store: ObjectStore) -> None:
    artifact(store)
    set_aside(store, KEY, NAME, VERSION, "new")
    artifact(store, fingerprint="new")  # SUCCESS, then killed before the old one was deleted
    store.remove(f"{ASIDE}/{artifacts.RECORD_FILE}")  # ... even partly deleted
    said = set_aside(store, KEY, NAME, VERSION, "newer")
    assert f"moved {store.location(KEY)} aside" in said
    assert fingerprint_in(store, ASIDE) == "new"


def test_a_move_cut_off_is_finished_and_the_old_artifacts_rest_deleted(
    store: ObjectStore,
) -> None:
    """A bucket moves object by object: cut off before `.moved`, the move is carried on;
    cut off while deleting the originals, what is left of them in the folder is deleted."""
    artifact(store)
    store.copy(f"{KEY}/{artifacts.STATUS_FILE}", f"{ASIDE}/{artifacts.STATUS_FILE}")
    store.remove(f"{KEY}/{artifacts.STATUS_FILE}")  # STATUS moved first, then the kill
    assert resume(store, KEY) is not None
    assert read_text(store, f"{ASIDE}/{MOVED_MARKER}") == "" and store.keys(KEY) == []
    assert fingerprint_in(store, ASIDE) == "old" and status_of(store, ASIDE) == "SUCCESS"

    artifact(store, fingerprint="old", status=None)  # the deletion cut off: old objects remain
    store.copy(f"{ASIDE}/{artifacts.RECORD_FILE}", f"{KEY}/{artifacts.RECORD_FILE}")
    assert "deleted what was left" in (resume(store, KEY) or "")
    assert store.keys(KEY) == []
    artifact(store, fingerprint="new", status=artifacts.RUNNING)  # the rebuild's own: kept
    assert resume(store, KEY) is None and fingerprint_in(store, KEY) == "new"


def test_nothing_built_yet(store: ObjectStore) -> None:
    assert "nothing is built" in set_aside(store, KEY, NAME, VERSION, "new")
    assert not is_replacing(store, KEY)


def test_a_folder_of_another_artifact_is_neither_moved_nor_deleted(store: ObjectStore) -> None:
    artifact(store, name="checkpoints/other")
    with pytest.raises(NotThisArtifact, match="does not name checkpoints/x@2026.11.29"):
        set_aside(store, KEY, NAME, VERSION, "new")
    assert read_text(store, f"{KEY}/weights") is not None and not is_replacing(store, KEY)


def test_built_dependents_are_found_by_their_records(store: ObjectStore) -> None:
    artifact(store)
    built_from = ((REF, "old"),)
    artifact(store, f"hf/x/{VERSION}", name="hf/x", kind="hf_model", inputs=built_from)
    artifact(store, "checkpoints/y/v2", name="checkpoints/y", version="v2", inputs=built_from)
    artifact(store, "hf/unbuilt/v1", name="hf/unbuilt", status=artifacts.FAILED, inputs=built_from)
    artifact(store, "hf/other/v1", name="hf/other", inputs=(("checkpoints/z@v1", "z"),))
    artifact(store, replaced_key(f"hf/x/{VERSION}"), name="hf/x", inputs=built_from)
    found = built_dependents(store, REF)
    assert [(d.ref, d.kind, d.input_fingerprint) for d in found] == [
        ("checkpoints/y@v2", "lm_checkpoint", "old"),
        (f"hf/x@{VERSION}", "hf_model", "old"),
    ]
    assert found[1].folder == store.location(f"hf/x/{VERSION}")
