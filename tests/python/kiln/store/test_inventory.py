"""What a store holds, artifact by artifact, and removals under the artifact's lease: the same
in a directory and in S3 and GCS buckets (servers on loopback, conftest.py)."""

from __future__ import annotations

import json
import time

import pytest

from kiln.artifacts import holds
from kiln.artifacts.folder import ArtifactFolder
from kiln.artifacts.inventory import main, remove_artifact, take_inventory
from kiln.artifacts.lease import Lease, LeaseRecord, lease_key
from kiln.artifacts.store import ObjectStore
from kiln_contract.inventory import FolderOutcome


def _record(kind: str, name: str, version: str, inputs: tuple[str, ...] = ()) -> bytes:
    refs = [{"ref": ref, "fingerprint": "f" * 12} for ref in inputs]
    record = {"kind": kind, "name": name, "version": version, "fingerprint": f"fp-{name}",
              "identity": {}, "inputs": refs}  # fmt: skip
    return json.dumps(record).encode()


def _fill(store: ObjectStore) -> None:
    """A built cache, a run built from it, a failed run, a store-mode cache with only its
    shards, an aside of a forced rebuild, and what Kiln keeps beside the artifacts."""
    store.write("tokenized/web/2026.01.01/artifact.json", _record("tokenized_cache", "tokenized/web", "2026.01.01"))
    store.write("tokenized/web/2026.01.01/data/c/0", b"x" * 1000)
    store.write("tokenized/web/2026.01.01/STATUS", b"SUCCESS\n")
    store.write("checkpoints/run/2026.01.01/artifact.json", _record(
        "lm_checkpoint", "checkpoints/run", "2026.01.01", ("tokenized/web@2026.01.01",)))
    store.write("checkpoints/run/2026.01.01/checkpoints/step-10/state/0", b"y" * 500)
    store.write("checkpoints/run/2026.01.01/STATUS", b"SUCCESS\n")
    store.write("checkpoints/run/.2026.01.01.replaced/STATUS", b"SUCCESS\n")
    store.write("checkpoints/bad/2026.02.02/failure.txt", b"non-finite loss\n")
    store.write("checkpoints/bad/2026.02.02/STATUS", b"FAILED\n")
    store.write("tokenized/big/.2026.03.03.shards/shard-00000/data", b"z" * 300)
    store.write(".kiln/code/abc/kiln.tar", b"k" * 70)  # fmt: skip


def test_the_inventory_names_each_artifact_its_state_inputs_and_size(store: ObjectStore) -> None:
    _fill(store)
    inventory = take_inventory(store)
    by_folder = {a.folder: a for a in inventory.artifacts}
    assert sorted(by_folder) == [
        "checkpoints/bad/2026.02.02", "checkpoints/run/2026.01.01",
        "tokenized/big/2026.03.03", "tokenized/web/2026.01.01",
    ]  # fmt: skip
    web, run = by_folder["tokenized/web/2026.01.01"], by_folder["checkpoints/run/2026.01.01"]
    assert (web.status, web.kind, web.fingerprint, web.inputs) == (
        "SUCCESS", "tokenized_cache", "fp-tokenized/web", ())
    assert web.objects == 3 and web.size == 1000 + 8 + len(
        _record("tokenized_cache", "tokenized/web", "2026.01.01"))
    assert run.inputs == ("tokenized/web@2026.01.01",)
    assert run.objects == 4  # its aside counts as its own
    bad, big = by_folder["checkpoints/bad/2026.02.02"], by_folder["tokenized/big/2026.03.03"]
    assert (bad.status, bad.kind, bad.size) == ("FAILED", None, 16 + 7)
    assert (big.status, big.objects, big.size) == (None, 1, 300)
    assert (inventory.other_objects, inventory.other_size) == (1, 70)  # .kiln/
    assert all(abs(a.modified - time.time()) < 600 for a in inventory.artifacts)
    assert all(a.lease is None for a in inventory.artifacts)


def test_a_removal_takes_the_lease_and_leaves_nothing_of_the_artifact(store: ObjectStore) -> None:
    _fill(store)
    assert remove_artifact(store, "checkpoints/run/2026.01.01") is None
    assert store.keys("checkpoints/run") == []  # folder, aside and lease
    assert remove_artifact(store, "tokenized/big/2026.03.03") is None
    assert store.keys("tokenized/big") == []
    left = [a.folder for a in take_inventory(store).artifacts]
    assert left == ["checkpoints/bad/2026.02.02", "tokenized/web/2026.01.01"]
    root = store.root_location.folder
    if root is not None:  # no empty `name/` folder is left behind
        assert not (root / "checkpoints/run").exists() and not (root / "tokenized/big").exists()
        assert (root / "tokenized/web/2026.01.01").is_dir()


def test_an_artifact_whose_lease_a_run_holds_is_kept_and_its_holder_named(
    store: ObjectStore,
) -> None:
    _fill(store)
    folder = "checkpoints/bad/2026.02.02"
    with ArtifactFolder(store, folder).lease("train checkpoints/bad@2026.02.02").acquire(wait=False):
        [bad] = [a for a in take_inventory(store).artifacts if a.folder == folder]
        assert bad.lease is not None and bad.lease.startswith("train checkpoints/bad@2026.02.02 (host ")
        kept = remove_artifact(store, folder)
        assert kept is not None and kept.startswith("a run holds its lease: train checkpoints/bad")
        assert store.keys(folder) == ["STATUS", "failure.txt"]
    assert store.keys("checkpoints/bad") == ["2026.02.02/STATUS", "2026.02.02/failure.txt"]
    assert lease_key(folder) not in store.keys("")


LEASES = {  # kind -> (artifact folder, its lease while that kind of build runs, what it says)
    "tokenizing a shard": (
        "tokenized/big/2026.03.03", "tokenized/big/.2026.03.03.shards/.shard-00000.lease",
        "tokenize tokenized/big@2026.03.03 shard 0",
    ),
    "merging shards": (
        "tokenized/big/2026.03.03", lease_key("tokenized/big/2026.03.03"),
        "merge tokenized/big@2026.03.03",
    ),
    "training": (
        "checkpoints/bad/2026.02.02", lease_key("checkpoints/bad/2026.02.02"),
        "train checkpoints/bad@2026.02.02",
    ),
    "exporting": (
        "exports/run/2026.01.01", lease_key("exports/run/2026.01.01"),
        "export exports/run@2026.01.01",
    ),
    "evaluating": (
        "evals/run/2026.01.01", lease_key("evals/run/2026.01.01"),
        "evaluate evals/run@2026.01.01",
    ),
}  # fmt: skip


@pytest.mark.parametrize("kind", LEASES, ids=[k.replace(" ", "-") for k in LEASES])
def test_every_lease_of_an_artifact_keeps_it_while_its_holder_lives(
    store: ObjectStore, kind: str
) -> None:
    """A build holding any lease of an artifact (its own, or one inside it: a shard's) keeps it
    from removal, and the inventory names the holder; once released, it can go."""
    _fill(store)
    store.write("exports/run/2026.01.01/config.json", b"{}")  # in progress: no STATUS yet
    store.write("exports/run/2026.01.01/artifact.json", _record("hf_model", "exports/run", "2026.01.01"))
    store.write("evals/run/2026.01.01/artifact.json", _record("lm_eval_run", "evals/run", "2026.01.01"))
    folder, key, what = LEASES[kind]
    before = store.keys(folder.rpartition("/")[0])
    with Lease(store, key, what=what).acquire(wait=False):  # the build, its lease renewed
        [artifact] = [a for a in take_inventory(store).artifacts if a.folder == folder]
        assert artifact.lease is not None and artifact.lease.startswith(f"{what} (host ")
        kept = remove_artifact(store, folder)
        assert kept is not None and what in kept, kept
        assert [k for k in store.keys(folder.rpartition("/")[0]) if not k.endswith(".lease")] == [
            k for k in before if not k.endswith(".lease")
        ]  # nothing of it removed
    assert remove_artifact(store, folder) is None
    assert store.keys(folder.rpartition("/")[0]) == []


def test_the_command_lists_as_json_and_removes_by_folder(
    store: ObjectStore, store_location: str, capsys
) -> None:
    _fill(store)
    assert main([store_location]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [a["folder"] for a in listed["artifacts"]][0] == "checkpoints/bad/2026.02.02"
    assert main([store_location, "--remove", "checkpoints/bad/2026.02.02"]) == 0
    assert FolderOutcome.read_lines(capsys.readouterr().out) == (
        FolderOutcome("checkpoints/bad/2026.02.02", done=True),
    )
    assert store.keys("checkpoints/bad") == []


def test_a_run_reading_an_artifact_keeps_it_until_it_is_done(store: ObjectStore) -> None:
    """A read hold (a training's input) keeps the artifact, named by its run, in any store;
    the removal of an artifact that is gone leaves nothing to hold."""
    _fill(store)
    web = ArtifactFolder(store, "tokenized/web/2026.01.01")
    with holds.reading(web, "train checkpoints/run@2026.01.02"):
        [listed] = [a for a in take_inventory(store).artifacts if a.folder == web.key]
        assert listed.lease is not None and listed.lease.startswith("train checkpoints/run@2026.01.02")
        kept = remove_artifact(store, web.key)
        assert kept is not None and "train checkpoints/run@2026.01.02 (host " in kept, kept
        assert web.is_built()
    assert remove_artifact(store, web.key) is None
    assert store.keys("tokenized/web") == []
    with pytest.raises(holds.NotBuilt, match="no finished artifact"):
        with holds.reading(web, "train checkpoints/run@2026.01.02"):
            pass
    assert store.keys("tokenized/web") == []  # no hold left behind


def test_a_build_hold_outlives_its_process_until_the_merge_ends_it(store: ObjectStore) -> None:
    """A store-mode cache's shard process leaves a detached hold: the cache is kept after the
    process is gone (between shards), and no longer once its merge has ended the build."""
    cache = store.location("tokenized/big/2026.03.03")
    with holds.building(cache, "tokenize tokenized/big@2026.03.03 shard 1"):
        pass  # the shard process, ended
    [record] = [k for k in store.keys("tokenized/big") if k.startswith(".2026.03.03.holds/build-")]
    held = LeaseRecord.from_bytes(store.read(f"tokenized/big/{record}").data)
    assert held.detached and held.expires - time.time() > holds.BUILD_HOLD_SECONDS - 60
    kept = remove_artifact(store, "tokenized/big/2026.03.03")
    assert kept is not None and "tokenize tokenized/big@2026.03.03 shard 1" in kept, kept
    holds.end_build_holds(cache)
    assert store.keys("tokenized/big") == []
    assert remove_artifact(store, "tokenized/big/2026.03.03") is None


def test_a_stale_hold_keeps_nothing(store: ObjectStore) -> None:
    """A hold whose process died (or whose time ran out) is no hold: the removal deletes it
    with the artifact."""
    _fill(store)
    folder = "tokenized/web/2026.01.01"
    dead = LeaseRecord(owner="x", host="elsewhere", pid=1, pid_started=None, what="train gone",
                       created=time.time() - 600, expires=time.time() - 1)  # fmt: skip
    store.write(f"{holds.holds_key(folder)}/read-0.lease", dead.to_bytes())
    assert remove_artifact(store, folder) is None
    assert store.keys("tokenized/web") == []


def test_a_shard_takes_its_build_hold_beside_a_merge_without_waiting(store: ObjectStore) -> None:
    """A builder holding the cache's lease (a merge) is not waited for; the hold taken beside
    it is let go at once when the cache turns out built."""
    folder = ArtifactFolder(store, "tokenized/big/2026.03.03")
    with folder.lease("merge tokenized/big@2026.03.03").acquire(wait=False):
        with holds.building(folder.location(), "tokenize tokenized/big@2026.03.03 shard 2"):
            pass
        assert [k for k in store.keys("tokenized/big") if ".holds/build-" in k]
        holds.end_build_holds(folder.location())
        folder.write_status("SUCCESS")
        with holds.building(folder.location(), "tokenize tokenized/big@2026.03.03 shard 2"):
            pass
        assert not [k for k in store.keys("tokenized/big") if ".holds/" in k]
