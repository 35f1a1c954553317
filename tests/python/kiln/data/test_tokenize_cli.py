from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kiln_testing.data import damaged_tokenizer_folder, make_spec, write_corpus
from kiln_testing.processes import python_env
from kiln_testing.read_only import READ_ONLY, read_only

from kiln.artifacts.folder import ArtifactFolder
from kiln.data.cache import TokenCache
from kiln.data.tokenize import main
from kiln_contract import sharding


def _write_spec(tmp_path: Path, spec: dict) -> str:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return str(path)


def test_shard_and_merge_commands(tmp_path: Path, monkeypatch, capsys):
    texts = write_corpus(tmp_path / "corpus")
    monkeypatch.chdir(tmp_path)  # relative paths in the spec are relative to CWD, as in Pants
    spec = _write_spec(
        tmp_path, make_spec({"kind": "files", "paths": ["corpus/*.jsonl"]}, num_shards=2)
    )
    assert main(["shard", spec, "--index", "1", "--out", "out/s1"]) == 0
    assert main(["shard", spec, "--index", "0", "--out", "out/s0"]) == 0
    assert ArtifactFolder.at(tmp_path / "out/s0").status() == "SUCCESS"
    assert main(["merge", spec, "--shards", "out/s0", "out/s1", "--out", "cache"]) == 0
    assert TokenCache.open(tmp_path / "cache").num_documents == len(texts)
    assert "cache ready at cache" in capsys.readouterr().err


def test_many_builds_each_cache_and_a_failed_one_fails_alone(tmp_path, monkeypatch, capsys):
    """`many`, as the Pants backend batches small store caches: each cache's shard and merge
    commands in order, in one process; the bad cache reports its error and its name."""
    write_corpus(tmp_path / "corpus")
    (tmp_path / "corpus/bad.jsonl").write_text('{"body": "no text field"}\n')
    monkeypatch.chdir(tmp_path)
    caches = []
    for name, paths in (("good", ["corpus/a.jsonl"]), ("bad", ["corpus/bad.jsonl"]),
                        ("also", ["corpus/b.jsonl"])):  # fmt: skip
        (tmp_path / name).mkdir()
        spec = make_spec({"kind": "files", "paths": paths}, num_shards=1)
        (tmp_path / name / "spec.json").write_text(json.dumps(spec))
        commands = [
            ["shard", f"{name}/spec.json", "--index", "0", "--out", f"shards/{name}"],
            ["merge", f"{name}/spec.json", "--shards", f"shards/{name}", "--out", f"caches/{name}"],
        ]
        caches.append({"name": f"//data:{name}", "commands": commands})
    (tmp_path / "many.json").write_text(json.dumps(caches))
    assert main(["many", "many.json"]) == 2
    err = capsys.readouterr().err
    assert "corpus/bad.jsonl:1: no field 'text'" in err and "error: //data:bad failed" in err
    assert ArtifactFolder.at(tmp_path / "caches/good").status() == ArtifactFolder.at(tmp_path / "caches/also").status() == "SUCCESS"
    assert not (tmp_path / "caches/bad").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["shard", "{spec}", "--index", "2", "--out", "s"], "--index 2 is out of range"),
        (["merge", "{spec}", "--shards", "nowhere", "--out", "c"], "nowhere: no such shard folder"),
        (["build", "missing.json", "--out", "c"], "missing.json: no such spec file"),
    ],
)
def test_bad_input_exits_2_with_a_message(tmp_path, monkeypatch, capsys, argv, message):
    write_corpus(tmp_path / "corpus")
    monkeypatch.chdir(tmp_path)
    spec = _write_spec(
        tmp_path, make_spec({"kind": "files", "paths": ["corpus/a.jsonl"]}, num_shards=2)
    )
    assert main([arg.replace("{spec}", spec) for arg in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_plan_prints_each_shards_files_and_bytes(tmp_path: Path, capsys) -> None:
    write_corpus(tmp_path / "corpus")
    spec = make_spec({"kind": "files", "paths": [str(tmp_path / "corpus/*.jsonl")]}, num_shards=2)
    assert main(["plan", _write_spec(tmp_path, spec)]) == 0
    sizes = {name: (tmp_path / "corpus" / f"{name}.jsonl").stat().st_size for name in "abc"}
    lines = capsys.readouterr().out.splitlines()
    # a.jsonl (50 documents) alone in shard 0; b and c (20 each) in shard 1.
    assert lines == [
        f"shard 0/2: 1 files, {sizes['a']:,} bytes",
        f"  {tmp_path}/corpus/a.jsonl ({sizes['a']:,} bytes)",
        f"shard 1/2: 2 files, {sizes['b'] + sizes['c']:,} bytes",
        f"  {tmp_path}/corpus/b.jsonl ({sizes['b']:,} bytes)",
        f"  {tmp_path}/corpus/c.jsonl ({sizes['c']:,} bytes)",
    ]
    assert not (tmp_path / "corpus" / "STATUS").exists()

    # --json, as `pants plan` reads it: the same plan, one object per shard.
    assert main(["plan", _write_spec(tmp_path, spec), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [
        {"files": {f"{tmp_path}/corpus/a.jsonl": sizes["a"]}},
        {"files": {f"{tmp_path}/corpus/{name}.jsonl": sizes[name] for name in "bc"}},
    ]


def test_plan_json_plans_many_specs_a_line_each_an_unplannable_one_too(
    tmp_path: Path, capsys
) -> None:
    """`pants plan` plans every cache that needs the runtime in one process."""
    write_corpus(tmp_path / "corpus")
    specs = []
    for name, pattern in (("good", "corpus/*.jsonl"), ("bad", "nowhere/*.jsonl")):
        (tmp_path / name).mkdir()
        spec = make_spec({"kind": "files", "paths": [str(tmp_path / pattern)]}, num_shards=2)
        specs.append(_write_spec(tmp_path / name, spec))
    assert main(["plan", specs[0], specs[1], specs[0], "--json"]) == 0
    good, bad, again = map(json.loads, capsys.readouterr().out.splitlines())
    assert len(good) == 2 and set(good[0]) == {"files"} and again == good
    assert bad == {"error": f"{tmp_path}/nowhere/*.jsonl: the glob matches no file (CWD is {os.getcwd()})."}


def test_a_damaged_tokenizer_fails_in_one_line_and_a_store_cache_says_why(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """A `files` target's tokenizer folder with tokenizer.json cut short, named relative to the
    repository as BUILD files name it: an inline build and a store-mode shard each print one
    line naming the file and what to do; the store-mode cache says FAILED and that line (what
    `pants plan` shows), and no lease is left."""
    write_corpus(tmp_path / "corpus")
    damaged_tokenizer_folder(tmp_path / "experiments/tc")
    monkeypatch.chdir(tmp_path)
    spec = make_spec({"kind": "files", "paths": ["corpus/*.jsonl"]}, num_shards=1)
    spec["config"]["tokenizer"] = {"kind": "local", "path": "experiments/tc"}
    spec_file = _write_spec(tmp_path, spec)
    assert main(["build", spec_file, "--out", "inline"]) == 2
    [inline] = capsys.readouterr().err.splitlines()
    assert inline.startswith("error: experiments/tc/tokenizer.json: not valid JSON (")
    assert "Copy the folder again from where the tokenizer was saved" in inline

    cache = "store/tokenized/test/2026.11.29"
    shard = ["--out", "store/tokenized/test/.2026.11.29.shards/shard-0", "--unless-built", cache]
    assert main(["shard", spec_file, "--index", "0", *shard, "--root", "store"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line == inline
    folder = ArtifactFolder.at(tmp_path / cache)
    assert folder.status() == "FAILED" and folder.stop_reason() == line.removeprefix("error: ")
    assert list((tmp_path / "store").rglob("*.lease")) == []


def test_a_read_only_store_fails_in_one_line_naming_it(tmp_path: Path, monkeypatch, capsys):
    """A store-mode shard into a store nothing may write (kiln_testing.read_only): one line
    naming the store and what to do, and nothing written."""
    write_corpus(tmp_path / "corpus")
    monkeypatch.chdir(tmp_path)
    spec = make_spec({"kind": "files", "paths": ["corpus/*.jsonl"]}, num_shards=1)
    spec_file = _write_spec(tmp_path, spec)
    with read_only(tmp_path / "store") as store:
        cache = f"{store}/tokenized/test/2026.11.29"
        shard = ["--out", f"{store}/tokenized/test/.2026.11.29.shards/shard-0", "--unless-built", cache]
        assert main(["shard", spec_file, "--index", "0", *shard, "--root", str(store)]) == 4
        assert list(store.iterdir()) == []
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {store}: the artifact store cannot be written here ({store}/")
    assert any(cause in line for cause in READ_ONLY) and line.endswith("make this one writable")


def test_offline_hf_dataset_fails_fast_without_a_traceback(tmp_path: Path):
    spec = make_spec({"kind": "hf", "id": "kiln-test/missing", "split": "train"})
    env = python_env(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kiln.data.tokenize",
            "build",
            _write_spec(tmp_path, spec),
            "--out",
            "c",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "'kiln-test/missing'" in result.stderr and '"kind": "files"' in result.stderr
    assert not (tmp_path / "c" / "STATUS").exists()


def test_a_finished_cache_is_served_and_a_changed_one_refused(tmp_path: Path) -> None:
    # The artifact-store mode runs shard/merge straight into {prefix}: reruns must be cheap no-ops.
    write_corpus(tmp_path / "corpus")
    spec = make_spec({"kind": "files", "paths": [str(tmp_path / "corpus/*.jsonl")]}, num_shards=1)
    spec_file = _write_spec(tmp_path, spec)
    shard, cache = tmp_path / "store/.building/shard-0", tmp_path / "store/cache"
    assert main(["shard", spec_file, "--index", "0", "--out", str(shard)]) == 0
    assert main(["shard", spec_file, "--index", "0", "--out", str(shard)]) == 0  # reused
    assert main(["merge", spec_file, "--shards", str(shard), "--out", str(cache)]) == 0
    before = (cache / "ledger.json").read_text()
    assert main(["merge", spec_file, "--shards", str(shard), "--out", str(cache)]) == 0
    assert (cache / "ledger.json").read_text() == before

    (tmp_path / "changed").mkdir()
    changed = _write_spec(tmp_path / "changed", {**spec, "fingerprint": "0" * 16})
    assert main(["merge", changed, "--shards", str(shard), "--out", str(cache)]) == 2
    # A shard of a finished cache is not tokenized again (its folder was moved into the cache).
    again = tmp_path / "store/.building/shard-0-again"
    assert main(["shard", spec_file, "--index", "0", "--out", str(again), "--unless-built", str(cache)]) == 0
    assert not again.exists()


def test_a_shard_cut_under_other_sharding_rules_is_rebuilt_not_merged(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """A big file is cut into pieces from 2 * MIN_PIECE_BYTES up; shards built before a rule
    change read other pieces (here: the whole file) and must not meet the new ones."""
    texts = write_corpus(tmp_path / "corpus")
    big = tmp_path / "big.jsonl"
    big.write_text("".join((tmp_path / "corpus" / f"{name}.jsonl").read_text() for name in "abc"))
    spec = make_spec({"kind": "files", "paths": [str(big)]}, num_shards=2)
    spec_file = _write_spec(tmp_path, spec)
    old_shard = tmp_path / "old-shard-0"
    assert main(["shard", spec_file, "--index", "0", "--out", str(old_shard)]) == 0  # whole file

    monkeypatch.setattr(sharding, "MIN_PIECE_BYTES", big.stat().st_size // 4)  # now: 2 pieces
    new_shard = tmp_path / "new-shard-1"
    assert main(["shard", spec_file, "--index", "1", "--out", str(new_shard)]) == 0
    shards = ["--shards", str(old_shard), str(new_shard)]
    capsys.readouterr()
    assert main(["merge", spec_file, *shards, "--out", str(tmp_path / "cache")]) == 2
    assert "other sharding rules" in capsys.readouterr().err
    assert main(["shard", spec_file, "--index", "0", "--out", str(old_shard)]) == 0  # rebuilt
    assert main(["merge", spec_file, *shards, "--out", str(tmp_path / "cache")]) == 0
    assert TokenCache.open(tmp_path / "cache").num_documents == len(texts)


def test_store_writes_through_a_symlink_out_of_the_root_are_refused(tmp_path: Path, capsys):
    write_corpus(tmp_path / "corpus")
    spec = make_spec({"kind": "files", "paths": [str(tmp_path / "corpus/*.jsonl")]}, num_shards=1)
    spec_file = _write_spec(tmp_path, spec)
    store, outside = tmp_path / "store", tmp_path / "outside"
    store.mkdir()
    outside.mkdir()
    (store / "tokenized").symlink_to(outside)
    shard = store / "tokenized/.c.shards/shard-0"
    assert main(["shard", spec_file, "--index", "0", "--out", str(shard), "--root", str(store)]) == 2
    assert f"resolves to {outside}/.c.shards/shard-0, outside {store}" in capsys.readouterr().err
    escaping = store / "../outside/cache"
    merge = ["merge", spec_file, "--shards", str(store / "s0"), "--out", str(escaping)]
    assert main([*merge, "--root", str(store)]) == 2
    assert list(outside.iterdir()) == []


def test_a_killed_builds_temporaries_are_removed_when_the_cache_is_next_built(tmp_path: Path):
    write_corpus(tmp_path / "corpus")
    spec = make_spec({"kind": "files", "paths": [str(tmp_path / "corpus/*.jsonl")]}, num_shards=1)
    spec_file = _write_spec(tmp_path, spec)
    store = tmp_path / "store"
    building = store / "tokenized/.c.shards"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    (building / f".shard-0.tmp-{dead}/data").mkdir(parents=True)  # a shard killed mid-write
    lease_write = building / f"..shard-0.lease.x1y2.tmp-{dead}"  # a lease killed mid-write
    lease_write.write_text("{}")
    live = building / f".shard-1.tmp-{os.getpid()}"  # a live process's temporary: kept
    live.mkdir()
    shard, cache = building / "shard-0", store / "tokenized/c"
    root = ["--root", str(store)]
    assert main(["shard", spec_file, "--index", "0", "--out", str(shard), *root]) == 0
    assert sorted(p.name for p in building.iterdir()) == [lease_write.name, live.name, "shard-0"]
    live.rmdir()
    assert main(["merge", spec_file, "--shards", str(shard), "--out", str(cache), *root]) == 0
    assert ArtifactFolder.at(cache).status() == "SUCCESS"
    assert not building.exists()  # emptied by the merge, then removed
