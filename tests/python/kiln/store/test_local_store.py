"""kiln.artifacts.local: a directory with the object semantics buckets have."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from kiln.artifacts.gcs import GCSStore
from kiln.artifacts.local import LocalStore
from kiln.artifacts.locations import UnsupportedStore, open_store
from kiln.artifacts.s3 import S3Store
from kiln.artifacts.store import ObjectExists, ObjectMissing, PreconditionFailed


def test_whole_objects_and_generations(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    with pytest.raises(ObjectMissing):
        store.read("a/b.json")
    first = store.write("a/b.json", b"one")
    assert store.read("a/b.json").data == b"one"
    assert store.read("a/b.json").generation == first
    second = store.write("a/b.json", b"two")
    assert second != first and store.read("a/b.json").generation == second
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["b.json"]  # no temp file left


def test_conditional_create(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    generation = store.create("lease", b"mine")
    with pytest.raises(ObjectExists):
        store.create("lease", b"theirs")
    assert (store.read("lease").data, store.read("lease").generation) == (b"mine", generation)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lease"]


def test_conditional_replace_and_delete(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    old = store.create("lease", b"1")
    new = store.replace("lease", b"2", generation=old)
    with pytest.raises(PreconditionFailed, match="rewritten by another process"):
        store.replace("lease", b"3", generation=old)
    with pytest.raises(PreconditionFailed):
        store.delete("lease", generation=old)
    assert store.read("lease").data == b"2"
    store.delete("lease", generation=new)
    with pytest.raises(PreconditionFailed, match="no longer exists"):
        store.delete("lease", generation=new)
    assert list(tmp_path.iterdir()) == []  # the compare-and-swap leaves no lock file


def _create(args: tuple[str, int]) -> bool:
    root, index = args
    try:
        LocalStore(root).create("contested", str(index).encode())
    except ObjectExists:
        return False
    return True


def test_exactly_one_of_many_processes_creates(tmp_path: Path) -> None:
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        won = pool.map(_create, [(str(tmp_path), i) for i in range(16)])
    assert won.count(True) == 1
    winner = won.index(True)
    assert LocalStore(tmp_path).read("contested").data == str(winner).encode()


def test_open_store_maps_locations() -> None:
    assert isinstance(open_store("/some/where"), LocalStore)
    assert isinstance(open_store("s3://bucket/x"), S3Store)
    assert isinstance(open_store("gs://bucket/x"), GCSStore)
    with pytest.raises(UnsupportedStore, match="^ftp://bucket/x: Kiln stores artifacts in s3://"):
        open_store("ftp://bucket/x")
