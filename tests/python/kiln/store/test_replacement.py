"""kiln.artifacts.replacement: a forced rebuild keeps the old artifact aside until the new one has
STATUS SUCCESS; every state a kill can leave is one the next run goes on from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln import artifacts
from kiln.artifacts.replacement import (
    NotThisArtifact,
    built_dependents,
    finish,
    is_replacing,
    replaced_folder,
    set_aside,
)

NAME, VERSION = "checkpoints/x", "2026.11.29"
REF = f"{NAME}@{VERSION}"


def artifact(
    folder: Path,
    *,
    fingerprint: str = "old",
    status: str | None = artifacts.SUCCESS,
    name: str = NAME,
    version: str = VERSION,
    kind: str = "lm_checkpoint",
    inputs: tuple[tuple[str, str], ...] = (),
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    record = {
        "kind": kind, "name": name, "version": version, "fingerprint": fingerprint,
        "inputs": [{"ref": ref, "fingerprint": fp} for ref, fp in inputs],
    }  # fmt: skip
    (folder / artifacts.RECORD_FILE).write_text(json.dumps(record))
    (folder / "weights").write_text(f"weights of {fingerprint}")
    if status is not None:
        artifacts.write_status(folder, status)
    return folder


@pytest.fixture
def output(tmp_path: Path) -> Path:
    return tmp_path / "store" / NAME / VERSION


def fingerprint_in(folder: Path) -> str:
    return json.loads((folder / artifacts.RECORD_FILE).read_text())["fingerprint"]


def test_the_built_artifact_is_set_aside_whole_and_deleted_only_after_success(
    output: Path,
) -> None:
    artifact(output)
    said = set_aside(output, NAME, VERSION, "new")
    aside = replaced_folder(output)
    assert aside.name == f".{VERSION}.replaced" and f"moved {output} aside to {aside}" in said
    assert not output.exists() and (aside / "weights").read_text() == "weights of old"
    assert is_replacing(output)

    artifact(output, fingerprint="new", status=artifacts.RUNNING)  # the rebuild trains
    assert finish(output) is None and aside.exists()  # not SUCCESS yet: the old one is kept
    artifacts.write_status(output, artifacts.SUCCESS)
    finished = finish(output)
    assert finished is not None and finished.fingerprint == "old"
    assert not aside.exists() and not is_replacing(output)
    assert fingerprint_in(output) == "new"


def test_a_stopped_forced_rebuild_is_resumed_not_set_aside_again(output: Path) -> None:
    artifact(output)
    set_aside(output, NAME, VERSION, "new")
    artifact(output, fingerprint="new", status=artifacts.FAILED)  # killed or failed mid-way
    said = set_aside(output, NAME, VERSION, "new")
    assert said.startswith("resuming the rebuild")
    assert fingerprint_in(output) == "new" and fingerprint_in(replaced_folder(output)) == "old"


def test_a_stopped_rebuild_of_another_configuration_is_deleted(output: Path) -> None:
    artifact(output)
    set_aside(output, NAME, VERSION, "new")
    artifact(output, fingerprint="new", status=artifacts.RUNNING)
    said = set_aside(output, NAME, VERSION, "newer")
    assert said.startswith("deleted an unfinished rebuild") and not output.exists()
    assert fingerprint_in(replaced_folder(output)) == "old"  # the artifact set aside stays


def test_a_finished_replacement_left_behind_is_deleted_before_the_next(output: Path) -> None:
    artifact(output)
    set_aside(output, NAME, VERSION, "new")
    artifact(output, fingerprint="new")  # SUCCESS, then killed before the old one was deleted
    (replaced_folder(output) / artifacts.RECORD_FILE).unlink()  # ... even partly deleted
    said = set_aside(output, NAME, VERSION, "newer")
    assert f"moved {output} aside" in said
    assert fingerprint_in(replaced_folder(output)) == "new"


def test_nothing_built_yet(output: Path) -> None:
    assert "nothing is built" in set_aside(output, NAME, VERSION, "new")
    assert not is_replacing(output)


def test_a_folder_of_another_artifact_is_neither_moved_nor_deleted(output: Path) -> None:
    artifact(output, name="checkpoints/other")
    with pytest.raises(NotThisArtifact, match="does not name checkpoints/x@2026.11.29"):
        set_aside(output, NAME, VERSION, "new")
    assert (output / "weights").exists() and not is_replacing(output)


def test_built_dependents_are_found_by_their_records(tmp_path: Path) -> None:
    store = tmp_path / "store"
    artifact(store / NAME / VERSION)
    built_from = ((REF, "old"),)
    artifact(store / "hf/x" / VERSION, name="hf/x", kind="hf_model", inputs=built_from)
    artifact(store / "checkpoints/y/v2", name="checkpoints/y", version="v2", inputs=built_from)
    artifact(store / "hf/unbuilt/v1", name="hf/unbuilt", status=artifacts.FAILED, inputs=built_from)
    artifact(store / "hf/other/v1", name="hf/other", inputs=(("checkpoints/z@v1", "z"),))
    artifact(replaced_folder(store / "hf/x" / VERSION), name="hf/x", inputs=built_from)
    found = built_dependents(store, REF)
    assert [(d.ref, d.kind, d.input_fingerprint) for d in found] == [
        ("checkpoints/y@v2", "lm_checkpoint", "old"),
        (f"hf/x@{VERSION}", "hf_model", "old"),
    ]
    assert found[1].folder == store / "hf/x" / VERSION
