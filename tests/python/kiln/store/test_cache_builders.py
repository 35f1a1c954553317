"""Store-mode token caches built by real `python -m kiln.data.tokenize` processes, laid out as
the Pants backend lays them out: concurrent builders, a killed builder, a full disk,
housekeeping between shards."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kiln_testing.data import make_spec, sample_texts, write_jsonl
from kiln_testing.housekeeping import remove
from kiln_testing.processes import python_env
from kiln_testing.small_disk import FULL_DISK, SmallDisk

from kiln.artifacts.folder import ArtifactFolder
from kiln.artifacts.lease import Lease
from kiln.artifacts.locations import open_store
from kiln.data.cache import TokenCache
from kiln.data.spec import parse_cache_spec
from kiln.data.tokenize import merge_cache, tokenize_shard
from kiln.data.verify import verify_cache

NUM_SHARDS = 3
NAME, VERSION = "tokenized/test", "2026.11.29"


def write_spec(root: Path, documents_per_file: int) -> Path:
    corpus = root / "corpus"
    corpus.mkdir(parents=True)
    for i in range(NUM_SHARDS):
        write_jsonl(corpus / f"part-{i}.jsonl", sample_texts(documents_per_file, seed=i))
    spec = make_spec({"kind": "files", "paths": [str(corpus / "*.jsonl")]}, num_shards=NUM_SHARDS)
    path = root / "spec.json"
    path.write_text(json.dumps(spec))
    return path


def layout(prefix: Path) -> tuple[Path, list[Path]]:
    """(cache, shard folders) where store mode builds them (kiln_pants.tokenize_rules)."""
    cache = prefix / NAME / VERSION
    staging = prefix / NAME / f".{VERSION}.shards"
    return cache, [staging / f"shard-{i}" for i in range(NUM_SHARDS)]


def tokenize(*args: object) -> list[str]:
    return [sys.executable, "-m", "kiln.data.tokenize", *map(str, args)]


def environment() -> dict[str, str]:
    return python_env()


def builder(spec: Path, prefix: Path) -> subprocess.Popen:
    """One build as Pants runs it in store mode: every shard process at once, then the merge."""
    cache, shards = layout(prefix)
    shard_commands = [
        " ".join(tokenize("shard", spec, "--index", i, "--out", shard, "--unless-built", cache))
        for i, shard in enumerate(shards)
    ]
    merge = " ".join(tokenize("merge", spec, "--shards", *shards, "--out", cache))
    script = " & ".join(shard_commands) + " & wait && " + merge
    return subprocess.Popen(
        ["bash", "-c", script], env=environment(), stderr=subprocess.PIPE, text=True
    )


def test_two_concurrent_builders_build_a_store_cache_once(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, documents_per_file=3000)
    prefix = tmp_path / "store"
    builders = [builder(spec, prefix), builder(spec, prefix)]
    errors = [b.communicate(timeout=300)[1] for b in builders]
    assert [b.returncode for b in builders] == [0, 0], errors
    both = "".join(errors)
    assert both.count(" documents, ") == NUM_SHARDS, both  # each shard tokenized once
    assert both.count("cache ready at") == 1 and both.count("already built at") >= 1, both
    assert "no such shard folder" not in both and "Traceback" not in both
    cache, shards = layout(prefix)
    assert verify_cache(open_store(cache)).files == 1 + 5 * NUM_SHARDS
    assert not shards[0].parent.exists()  # the staging folder is gone
    assert sorted(p.name for p in cache.parent.iterdir()) == [VERSION]  # no lease, no temp


def test_a_second_builder_waits_for_the_holder_and_uses_its_cache(tmp_path: Path) -> None:
    spec_path = write_spec(tmp_path, documents_per_file=50)
    cache = tmp_path / "store" / NAME / VERSION
    with Lease.beside(cache, what="merge by the first builder").acquire(wait=False):
        second = subprocess.Popen(
            tokenize("build", spec_path, "--out", cache), env=environment(),
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert second.stderr is not None
        line = second.stderr.readline()
        assert "waiting for build tokenized/test@2026.11.29: merge by the first builder" in line
        # The holder builds the cache meanwhile (without the lease API: it holds the lease).
        spec = parse_cache_spec(json.loads(spec_path.read_text()))
        shards = [tmp_path / f"s{i}" for i in range(NUM_SHARDS)]
        for index, shard in enumerate(shards):
            tokenize_shard(spec, index, shard)
        merge_cache(spec, shards, cache)
        time.sleep(0.5)
        assert second.poll() is None  # still waiting
    rest = second.communicate(timeout=60)[1]
    assert second.returncode == 0, rest
    assert " documents, " not in rest  # it tokenized nothing: it used the holder's cache
    assert "tokenized/test@2026.11.29: cache ready at" in rest
    assert TokenCache.open(cache).num_documents == NUM_SHARDS * 50


def test_a_killed_shard_builder_is_taken_over_and_its_temp_folder_removed(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, documents_per_file=15000)
    cache, shards = layout(tmp_path / "store")
    command = tokenize("shard", spec, "--index", 0, "--out", shards[0], "--unless-built", cache)
    killed = subprocess.Popen(command, env=environment(), stderr=subprocess.DEVNULL)
    temp = []
    deadline = time.monotonic() + 60
    while not temp and time.monotonic() < deadline and killed.poll() is None:
        temp = list(shards[0].parent.glob(".shard-0.tmp-*"))
        time.sleep(0.01)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert temp and temp[0].exists(), "the shard finished before it could be killed"
    assert (shards[0].parent / ".shard-0.lease").exists()  # its lease is left behind too

    started = time.monotonic()
    result = subprocess.run(command, env=environment(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < 60  # not the lease's two minutes
    assert f"pid {killed.pid} on this host, has ended" in result.stderr
    assert ArtifactFolder.at(shards[0]).status() == "SUCCESS"
    assert sorted(p.name for p in shards[0].parent.iterdir()) == ["shard-0"]


@pytest.fixture()
def small_disk(tmp_path: Path):
    disk = SmallDisk(tmp_path / "disk", size=16 * 1024, file_limit=1024)
    yield disk
    disk.close()


def test_a_full_disk_fails_in_one_line_and_the_build_resumes(small_disk, tmp_path: Path) -> None:
    spec = write_spec(tmp_path, documents_per_file=300)
    cache = small_disk.folder / "cache"
    full = small_disk.run(tokenize("build", spec, "--out", cache))
    assert full.returncode == 4, full.stderr
    [line] = full.stderr.splitlines()[-1:]
    assert line.startswith(f"error: {small_disk.folder}/") and line.endswith(FULL_DISK), line
    assert "Traceback" not in full.stderr
    assert ArtifactFolder.at(cache).status() is None
    small_disk.grow()
    resumed = small_disk.run(tokenize("build", spec, "--out", cache))
    assert resumed.returncode == 0, resumed.stderr
    assert verify_cache(open_store(cache)).files == 1 + 5 * NUM_SHARDS


@pytest.mark.parametrize("num_shards", [1, NUM_SHARDS])
def test_a_failed_shard_leaves_failed_and_its_reason_in_the_cache(
    tmp_path: Path, num_shards: int
) -> None:
    """A shard of a store-mode cache reading a file that is not JSON Lines fails in one line, and
    the cache's folder then says FAILED and why (what `plan` shows); no lease is left. The next
    build that succeeds clears the reason."""
    spec_path = write_spec(tmp_path, documents_per_file=5)
    spec = json.loads(spec_path.read_text())
    spec["config"]["num_shards"] = num_shards
    spec_path.write_text(json.dumps(spec))
    files = sorted((tmp_path / "corpus").glob("*.jsonl"))
    good = [f.read_text() for f in files]
    for f in files:
        f.write_text("not json\n")
    cache, shards = layout(tmp_path / "store")
    failed = subprocess.run(
        tokenize("shard", spec_path, "--index", 0, "--out", shards[0], "--unless-built", cache),
        env=environment(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert failed.returncode == 2, failed.stderr
    folder = ArtifactFolder.at(cache)
    assert folder.status() == "FAILED"
    reason = folder.text("failure.txt")
    assert reason is not None and "part-" in reason and "JSON" in reason, reason
    leases = [p for p in (tmp_path / "store").rglob("*.lease")]
    assert leases == [], leases
    for f, text in zip(files, good):
        f.write_text(text)
    for i, shard in enumerate(shards[:num_shards]):
        subprocess.run(tokenize("shard", spec_path, "--index", i, "--out", shard, "--unless-built",
                                cache), env=environment(), check=True, timeout=300)  # fmt: skip
    subprocess.run(tokenize("merge", spec_path, "--shards", *shards[:num_shards], "--out", cache),
                   env=environment(), check=True, timeout=300)  # fmt: skip
    assert folder.status() == "SUCCESS" and folder.text("failure.txt") is None


def test_housekeeping_keeps_a_cache_from_its_first_shard_to_its_merge(tmp_path: Path) -> None:
    """Removals between shard processes (shards 1 and 2 done, 0 not started) and just before
    the merge keep the cache, naming the build; the merge then finds every shard, and once it
    has ended the build nothing holds the cache."""
    spec = write_spec(tmp_path, documents_per_file=20)
    prefix = tmp_path / "store"
    cache, shards = layout(prefix)

    def shard(index: int) -> None:
        command = tokenize("shard", spec, "--index", index, "--out", shards[index],
                           "--unless-built", cache)  # fmt: skip
        subprocess.run(command, env=environment(), check=True, timeout=300)

    for index in (1, 2):
        shard(index)
        outcome = remove(prefix, f"{NAME}/{VERSION}")
        assert not outcome.done and outcome.kept is not None, outcome
        done = [f"tokenize {NAME}@{VERSION} shard {i} (host " for i in range(1, index + 1)]
        assert any(shard in outcome.kept for shard in done), outcome.kept  # a done shard's hold
    shard(0)
    assert not remove(prefix, f"{NAME}/{VERSION}").done
    merge = tokenize("merge", spec, "--shards", *shards, "--out", cache)
    merged = subprocess.run(merge, env=environment(), capture_output=True, text=True, timeout=300)
    assert merged.returncode == 0, merged.stderr
    assert verify_cache(open_store(cache)).files == 1 + 5 * NUM_SHARDS
    assert sorted(p.name for p in cache.parent.iterdir()) == [VERSION]  # no hold, no lease
    assert remove(prefix, f"{NAME}/{VERSION}").done


def test_a_disk_that_fills_during_a_merge_leaves_failed_and_no_lease(tmp_path: Path) -> None:
    """The merge finds room for the cache's lease and its STATUS, then none for the shards'
    leases: another program filled the disk, and it stays full (where nothing can be mounted,
    the file-size limit stands in: EFBIG, later in the merge). One line names the cache and the
    full disk; STATUS says FAILED (written over RUNNING in place), the reason beside it when
    there was room; no lease and no temporary is left. Once there is room the merge succeeds."""
    spec_path = write_spec(tmp_path, documents_per_file=300)
    disk = SmallDisk(tmp_path / "disk", size=1 << 20, file_limit=1024)
    try:
        cache, shards = layout(disk.folder)
        spec = parse_cache_spec(json.loads(spec_path.read_text()))
        for index, shard in enumerate(shards):
            tokenize_shard(spec, index, shard)
        disk.fill(leave_blocks=2)
        merge = tokenize("merge", spec_path, "--shards", *shards, "--out", cache)
        full = disk.run(merge, timeout=300)
        assert full.returncode == 4, full.stderr
        [line] = full.stderr.splitlines()[-1:]
        assert line.startswith(f"error: {disk.folder}/") and line.endswith(FULL_DISK), line
        assert "Traceback" not in full.stderr and "could not release" not in full.stderr
        folder = ArtifactFolder.at(cache)
        assert folder.status() == "FAILED"
        assert folder.stop_reason() in (None, line.removeprefix("error: "))
        left = [p.name for p in disk.folder.rglob("*") if ".lease" in p.name or ".tmp-" in p.name]
        assert left == []
        disk.grow()
        merged = disk.run(merge, timeout=300)
        assert merged.returncode == 0, merged.stderr
        assert folder.status() == "SUCCESS" and folder.stop_reason() is None
        assert verify_cache(open_store(cache)).files == 1 + 5 * NUM_SHARDS
    finally:
        disk.close()
