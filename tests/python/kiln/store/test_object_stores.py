"""The object-store contract, the same for a local directory and S3 and GCS buckets (servers on
loopback, conftest.py); bucket failures as one line naming the URL, in seconds."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from kiln.artifacts import dep_failed
from kiln.artifacts.bucket import Transient, with_retries
from kiln.artifacts.folder import ArtifactFolder
from kiln.artifacts.local import LocalStore
from kiln.artifacts.locations import UnsupportedStore, open_store
from kiln.artifacts.storage_errors import StorageError
from kiln.artifacts.store import ObjectExists, ObjectMissing, ObjectStore, PreconditionFailed
from kiln_contract.inventory import FolderOutcome
from kiln_contract.location import StoreLocation, is_bucket_url, location_argument


def test_open_store_maps_locations_to_implementations(tmp_path: Path) -> None:
    assert isinstance(open_store(tmp_path), LocalStore)
    with pytest.raises(UnsupportedStore, match=r"^hdfs://x/y: Kiln stores artifacts in s3://"):
        open_store("hdfs://x/y")
    with pytest.raises(ValueError, match=r"^s3://: not a bucket URL; write it as s3://BUCKET/PATH"):
        open_store("s3://")


def test_a_location_is_parsed_once_into_a_folder_or_a_bucket(tmp_path: Path) -> None:
    bucket = StoreLocation.parse("s3://b/runs/")
    assert (bucket.in_bucket, bucket.folder, str(bucket)) == (True, None, "s3://b/runs")
    assert str(bucket.under("x/y")) == "s3://b/runs/x/y" and bucket.under("") is bucket
    folder = StoreLocation.parse(tmp_path)
    assert (folder.in_bucket, folder.folder) == (False, tmp_path)
    assert folder.under("x").folder == tmp_path / "x"
    assert location_argument("gs://b/p/") == "gs://b/p" and location_argument("a/b") == Path("a/b")
    assert [is_bucket_url(u) for u in ("s3://b/p", "gs://b", "s3://", "hdfs://b/p", "/p")] == [
        True, True, False, False, False,
    ]  # fmt: skip
    assert open_store(bucket).root_location == bucket


def test_an_artifact_becomes_local_files_and_local_files_an_artifact(store: ObjectStore) -> None:
    """ArtifactFolder.local_output writes a folder whole (a bucket's: STATUS last, objects no new
    file replaces deleted); local_files reads it back on this machine."""
    folder = ArtifactFolder(store, "name/1")
    store.write("name/1/stale.txt", b"old")
    with folder.local_output() as local:
        (local / "sub").mkdir(parents=True, exist_ok=True)
        (local / "sub" / "data.bin").write_bytes(b"new")
        (local / "STATUS").write_text("SUCCESS\n")
        if store.root_location.in_bucket:
            assert folder.status() is None  # nothing is uploaded before the body ends
    if store.root_location.in_bucket:
        assert sorted(store.keys("name/1")) == ["STATUS", "sub/data.bin"]
    assert folder.is_built() and store.folder_exists("name/1") and not store.folder_exists("x")
    with folder.local_files() as local:
        assert (local / "sub" / "data.bin").read_bytes() == b"new"
        assert (local / "STATUS").read_text() == "SUCCESS\n"


def test_objects_are_written_read_and_located(store: ObjectStore, store_location: str) -> None:
    first = store.write("a/b/object one.json", b"1")
    assert store.read("a/b/object one.json").data == b"1"
    second = store.write("a/b/object one.json", b"22")
    assert store.read("a/b/object one.json").generation == second != first
    assert store.generation("a/b/object one.json") == second  # without reading it
    with pytest.raises(ObjectMissing, match="a/absent"):
        store.generation("a/absent")
    assert store.location("a/k") == f"{store_location}/a/k"
    with pytest.raises(ObjectMissing, match="a/missing"):
        store.read("a/missing")


def test_a_folder_is_listed_and_its_objects_removed(store: ObjectStore) -> None:
    for key in ("run/b", "run/a/x.json", "run/a/y/z", "runner/other", "elsewhere"):
        store.write(key, b"1")
    assert store.keys("run") == ["a/x.json", "a/y/z", "b"]  # not runner/: a folder, not a prefix
    store.remove("run/a/x.json")
    store.remove("run/a/x.json")  # absent: no error
    assert store.keys("run/") == ["a/y/z", "b"]
    assert store.keys("nothing") == []


def test_a_folder_is_a_store_of_its_own_on_the_same_connection(
    store: ObjectStore, store_location: str
) -> None:
    store.write("caches/a/cache.json", b"{}")
    folder = store.under("caches/a")
    assert folder.location("") == f"{store_location}/caches/a"
    assert folder.read("cache.json").data == b"{}"
    folder.under("shards").write("s0/STATUS", b"SUCCESS")
    assert store.read("caches/a/shards/s0/STATUS").data == b"SUCCESS"
    assert store.keys("caches") == ["a/cache.json", "a/shards/s0/STATUS"]  # the root unchanged


def test_create_refuses_an_existing_key(store: ObjectStore) -> None:
    generation = store.create("lease", b"mine")
    with pytest.raises(ObjectExists):
        store.create("lease", b"theirs")
    assert store.read("lease") == type(store.read("lease"))(b"mine", generation)


def test_replace_needs_the_generation_read(store: ObjectStore) -> None:
    old = store.create("lease", b"v1")
    new = store.replace("lease", b"v2", generation=old)
    with pytest.raises(PreconditionFailed):
        store.replace("lease", b"v3", generation=old)
    assert store.read("lease").data == b"v2" and store.read("lease").generation == new


def test_delete_needs_the_generation_read(store: ObjectStore, store_location: str) -> None:
    old = store.create("lease", b"v1")
    new = store.replace("lease", b"v2", generation=old)
    if not store_location.startswith("gs://"):  # the GCS emulator ignores it on delete
        with pytest.raises(PreconditionFailed):
            store.delete("lease", generation=old)
    store.delete("lease", generation=new)
    with pytest.raises(ObjectMissing):
        store.read("lease")


def test_files_stream_in_parts_and_appear_whole(
    store_location: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Parts as small as the services allow, so that a file of a few MB takes several.
    monkeypatch.setattr("kiln.artifacts.s3.PART_BYTES", 5 << 20)  # S3's smallest part
    monkeypatch.setattr("kiln.artifacts.gcs.CHUNK_BYTES", 1 << 20)  # a multiple of 256 KiB
    store = open_store(store_location)
    data = os.urandom((11 << 20) + 12345)  # three S3 parts, twelve GCS chunks, the last short
    (tmp_path / "big").write_bytes(data)
    (tmp_path / "small").write_bytes(b"12345")
    store.upload("ckpt/state/big", tmp_path / "big")
    store.upload("ckpt/small", tmp_path / "small")
    assert store.size("ckpt/state/big") == len(data)
    store.download("ckpt/state/big", tmp_path / "back" / "big")
    store.download("ckpt/small", tmp_path / "back" / "small")
    assert (tmp_path / "back" / "big").read_bytes() == data
    assert (tmp_path / "back" / "small").read_bytes() == b"12345"
    assert sorted(p.name for p in (tmp_path / "back").iterdir()) == ["big", "small"]  # no temps
    with pytest.raises(ObjectMissing, match="ckpt/missing"):
        store.download("ckpt/missing", tmp_path / "back" / "missing")
    assert not (tmp_path / "back" / "missing").exists()


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_a_missing_bucket_is_named(scheme: str, request: pytest.FixtureRequest) -> None:
    request.getfixturevalue({"s3": "s3_server", "gs": "gcs_server"}[scheme])
    store = open_store(f"{scheme}://no-such-bucket-kiln/runs")
    with pytest.raises(StorageError) as error:
        store.check()
    assert str(error.value).startswith(
        f"{scheme}://no-such-bucket-kiln/runs: the bucket no-such-bucket-kiln does not exist"
    )
    with pytest.raises(StorageError, match="does not exist"):
        store.write("x", b"1")


@pytest.mark.parametrize(
    ("scheme", "variable"), [("s3", "AWS_ENDPOINT_URL"), ("gs", "STORAGE_EMULATOR_HOST")]
)
def test_an_unreachable_endpoint_fails_in_seconds(
    scheme: str, variable: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(variable, "http://127.0.0.1:9")  # discard: nothing listens
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAKILNTEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "unused")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    started = time.monotonic()
    with pytest.raises(StorageError) as error:
        open_store(f"{scheme}://kiln-test/runs").check()
    assert time.monotonic() - started < 10
    assert re.fullmatch(
        rf"{scheme}://kiln-test/runs: cannot reach http://127.0.0.1:9 \(\w+\): "
        rf"check {variable} and the network",
        str(error.value),
    )


def test_missing_s3_credentials_are_named(s3_server: str, monkeypatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(StorageError, match=r"^s3://kiln-test/runs: no AWS credentials found"):
        open_store("s3://kiln-test/runs").check()


def test_a_local_store_needs_no_check(tmp_path: Path) -> None:
    open_store(tmp_path / "not yet made").check()
    assert not os.path.exists(tmp_path / "not yet made")


def test_transient_failures_are_retried_with_backoff() -> None:
    calls: list[float] = []

    def flaky() -> str:
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise Transient() from ConnectionError("dropped")
        return "done"

    assert with_retries(flaky) == "done"
    first_pause, second_pause = (b - a for a, b in zip(calls, calls[1:]))
    assert first_pause >= 0.2 and second_pause >= 0.4  # the pause doubles
    calls.clear()

    def down() -> str:
        calls.append(time.monotonic())
        raise Transient() from ConnectionError("refused")

    with pytest.raises(ConnectionError, match="refused"):
        with_retries(down, attempts=2)
    assert len(calls) == 2


def test_dep_failed_marks_leave_built_artifacts_and_runs_alone(
    store: ObjectStore, store_location: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`pants build`'s DEP_FAILED marks (kiln.artifacts.dep_failed, as the Pants backend runs
    it), in every store."""
    store.write("built/v1/STATUS", b"SUCCESS\n")
    store.write("running/v1/STATUS", b"RUNNING\n")
    store.write("failed/v1/STATUS", b"FAILED\n")
    marks = [arg for key in ("built/v1", "running/v1", "failed/v1", "new/v1")
             for arg in ("--mark", key, f"input a@v1 failed ({key})")]  # fmt: skip
    assert dep_failed.main([store_location, *marks]) == 0
    assert FolderOutcome.read_lines(capsys.readouterr().out) == (
        FolderOutcome("failed/v1", done=True), FolderOutcome("new/v1", done=True)
    )
    assert store.read("new/v1/STATUS").data == b"DEP_FAILED\n"
    assert store.read("new/v1/failure.txt").data == b"input a@v1 failed (new/v1)\n"
    assert store.read("built/v1/STATUS").data == b"SUCCESS\n"
    assert store.keys("built/v1") == ["STATUS"]
    store.write("failed/v1/artifact.json", b"{}")
    assert dep_failed.main([store_location, "--clear", "new/v1", "--clear", "failed/v1"]) == 0
    assert store.keys("new/v1") == []
    # A folder with more than the mark is left as it is: the runner resumes the run in it.
    assert store.read("failed/v1/STATUS").data == b"DEP_FAILED\n"
    assert dep_failed.main([store_location, "--mark", "x/v1"]) == 2
