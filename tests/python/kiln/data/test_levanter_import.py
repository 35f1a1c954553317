"""Levanter's and Marin's caches, written by Levanter's own code (levanter_writer.py, from PyPI),
imported in place in both layouts, checked, verified, planned, and trained from; and Kiln's
Levanter framing, id for id against Levanter's writer on the same files."""

from __future__ import annotations

import itertools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts
from kiln_testing.buckets import fresh_url
from kiln_testing.data import STDLIB_TOKENIZER, sample_texts, write_jsonl
from kiln_testing.levanter import LevanterCache, import_spec, spec_of, write_levanter_caches
from kiln_testing.training import make_spec, read_jsonl

from kiln.artifacts.content import copy_folder_into
from kiln.artifacts.locations import open_store
from kiln.data.cache import TokenCache, zarr_spec
from kiln.data.errors import CacheDamaged, SourceError
from kiln.data.tokenize import build_cache, main
from kiln.data.train_tokenizer import train_tokenizer
from kiln.data.verify import main as verify_main
from kiln.data.verify import verify_cache
from kiln.train.spec import parse_spec
from kiln.train.trainer import train

# Longer than Marin's 10,000 characters: cut at its first whitespace from the 10,000th on,
# which falls inside a run of three spaces, so the cut pieces encode differently ("  " is one
# token of kiln-stdlib-8k; cut, it becomes two).
LONG_TEXT = ("word " * 2000)[:9_999] + "   " + "the end of a long document."


def corpus(folder: Path) -> list[Path]:
    """Three files, Marin's three parts: short documents, an empty and a blank one, the text of
    an EOS inside a document, and LONG_TEXT."""
    long_text = LONG_TEXT
    texts = [
        sample_texts(25, seed=1) + ["", "a document that says <|endoftext|> inside", "   "],
        sample_texts(10, seed=2) + [long_text],
        sample_texts(20, seed=3),
    ]
    folder.mkdir(parents=True, exist_ok=True)
    return [write_jsonl(folder / f"{name}.jsonl", part) for name, part in zip("abc", texts)]


@dataclass(frozen=True)
class Written:
    caches: dict[str, LevanterCache]  # by layout folder: consolidated, sharded, bos, no_eos
    files: list[str]  # the documents they hold
    with_bos: str  # kiln-stdlib-8k, its tokenizer_config naming a bos_token

    def __getitem__(self, name: str) -> LevanterCache:
        return self.caches[name]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Written:
    """Every cache the tests read, from one Levanter process."""
    root = tmp_path_factory.mktemp("levanter")
    files = [str(path) for path in corpus(root / "docs")]
    with_bos = root / "tokenizer-with-bos"
    shutil.copytree(STDLIB_TOKENIZER["path"], with_bos)
    config = json.loads((with_bos / "tokenizer_config.json").read_text())
    config["bos_token"] = "<|endoftext|>"
    (with_bos / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = STDLIB_TOKENIZER["path"]
    jobs = [
        {"kind": "consolidated", "docs": files, "tokenizer": tokenizer, "out": f"{root}/consolidated/train"},
        {"kind": "sharded", "docs": files, "tokenizer": tokenizer, "out": f"{root}/sharded/train"},
        {"kind": "consolidated", "docs": files, "tokenizer": str(with_bos), "out": f"{root}/bos/train"},
        {"kind": "consolidated", "docs": files, "tokenizer": tokenizer, "out": f"{root}/no_eos/train",
         "enforce_eos": False},
    ]  # fmt: skip
    caches = write_levanter_caches(jobs, root)
    by_layout = {Path(out).parent.name: cache for out, cache in caches.items()}
    return Written(by_layout, files, str(with_bos))


def copy_of(cache: LevanterCache, tmp_path: Path) -> Path:
    copy = tmp_path / cache.path.parent.name / "train"
    shutil.copytree(cache.path, copy)
    return copy


def documents(cache: TokenCache) -> list[list[int]]:
    return [cache.document(i).tolist() for i in range(cache.num_documents)]


def test_both_layouts_import_and_read_as_levanters_reader(written, tmp_path: Path) -> None:
    for layout, parts in (("consolidated", 1), ("sharded", 3)):
        levanter = written[layout]
        assert levanter.ledger.get("layout") == layout and levanter.dtype == "int64"
        imported = TokenCache.open(build_cache(import_spec(levanter.path), tmp_path / layout))
        assert documents(imported) == [row.tolist() for row in levanter.rows]
        assert imported.num_tokens == levanter.ledger["field_counts"]["input_ids"]
        assert len(imported.ledger["shards"]) == parts
        source = imported.info["source"]
        assert (source["layout"], source["parts"], source["dtype"]) == (layout, parts, "int64")
        assert imported.info["format_version"] == 4  # Levanter's arrays, read as they are
        assert not (tmp_path / layout / "shards").exists()  # nothing copied, nothing tokenized
    # Marin's ledger names no tokenizer: its vocabulary rests on the ids, every one scanned.
    marin = TokenCache.open(tmp_path / "sharded")
    assert marin.info["source"]["preprocessor_metadata"] == {}
    assert marin.info["source"]["tokenizer_check"] == {
        "vocab_size": "ids", "scanned_tokens": marin.num_tokens,
    }  # fmt: skip
    assert [s["name"] for s in marin.ledger["shards"]] == written["sharded"].ledger["finished_shards"]


def test_plan_reports_the_layout_and_counts_from_the_ledger(written, tmp_path, capsys) -> None:
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(import_spec(written["sharded"].path)))
    assert main(["plan", str(spec_file), "--json"]) == 0
    (plan,) = json.loads(capsys.readouterr().out)
    rows = written["sharded"].ledger["total_num_rows"]
    tokens = written["sharded"].ledger["field_counts"]["input_ids"]
    assert plan["imported"] == {
        "location": str(written["sharded"].path), "layout": "sharded", "parts": 3,
        "documents": rows, "tokens": tokens, "tokenizer": None, "vocab_size": None,
        "dtype": "int64",  # as this Levanter writer stores ids: what an import reads, in place
    }  # fmt: skip
    assert main(["plan", str(spec_file)]) == 0
    assert f"sharded layout, 3 part(s), {rows:,} documents, {tokens:,} tokens" in (
        capsys.readouterr().out
    )


def test_a_layout_kiln_does_not_know_fails_at_plan_naming_the_field(
    written, tmp_path, capsys
) -> None:
    zoned = copy_of(written["sharded"], tmp_path)
    ledger = json.loads((zoned / "shard_ledger.json").read_text())
    (zoned / "shard_ledger.json").write_text(json.dumps({**ledger, "layout": "zoned"}))
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(import_spec(zoned)))
    assert main(["plan", str(spec_file), "--json"]) == 0  # the other specs are still planned
    planned = json.loads(capsys.readouterr().out)  # `pants plan` fails on a refusal
    assert "shard_ledger.json field `layout` is 'zoned'; Kiln imports the layouts" in (
        planned["refused"]
    )
    assert main(["plan", str(spec_file)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "shard_ledger.json field `layout` is 'zoned'; Kiln imports the layouts" in line
    with pytest.raises(SourceError, match="field `layout` is 'zoned'"):
        build_cache(import_spec(zoned), tmp_path / "out")
    assert not (tmp_path / "out" / "STATUS").exists()


def retyped(cache: LevanterCache, dtype: str, tmp_path: Path) -> Path:
    """The cache with its token ids stored as `dtype`, as other writers store them."""
    copy = tmp_path / dtype / "train"
    shutil.copytree(cache.path, copy)
    data_dir = copy / "input_ids" / "data"
    ids = ts.open(zarr_spec(data_dir)).result()
    values = ids[: cache.ledger["field_counts"]["input_ids"]].read().result()
    shutil.rmtree(data_dir)
    spec = {**zarr_spec(data_dir), "metadata": {"data_type": dtype, "shape": [len(values)]}}
    ts.open(spec, create=True).result()[...].write(values.astype(dtype)).result()
    return copy


@pytest.mark.parametrize("dtype", ["int32", "uint16", "uint32"])
def test_ids_of_any_integer_width_read(written, tmp_path: Path, dtype: str) -> None:
    levanter = written["consolidated"]
    cache = TokenCache.open(build_cache(import_spec(retyped(levanter, dtype, tmp_path)),
                                        tmp_path / "imported"))  # fmt: skip
    assert cache.info["source"]["dtype"] == dtype
    assert documents(cache) == [row.tolist() for row in levanter.rows]


def test_without_tokenizer_metadata_the_ids_decide(written, tmp_path: Path) -> None:
    small = train_tokenizer(tmp_path / "small", vocab_size=300, part="pydoc_topics")
    with pytest.raises(SourceError, match=r"holds token id \d+ at position \d+ \(part part-00000-of"):
        build_cache(import_spec(written["sharded"].path, {"kind": "local", "path": str(small)}),
                    tmp_path / "a")  # fmt: skip
    # With metadata the ledger's vocabulary decides first.
    with pytest.raises(SourceError, match="with a vocabulary of 8192; the target's tokenizer"):
        build_cache(import_spec(written["consolidated"].path, {"kind": "local", "path": str(small)}),
                    tmp_path / "b")  # fmt: skip
    with pytest.raises(SourceError, match=r"document 0 ends with token \d+, not the EOS id 0"):
        build_cache(import_spec(written["no_eos"].path), tmp_path / "c")
    assert not any((tmp_path / name / "STATUS").exists() for name in "abc")


def test_damaged_and_unfinished_caches_are_refused_naming_the_field(written, tmp_path) -> None:
    count = itertools.count()

    def refused(edit, pattern: str) -> None:
        folder = copy_of(written["sharded"], tmp_path / str(next(count)))
        ledger = json.loads((folder / "shard_ledger.json").read_text())
        edit(folder, ledger)
        (folder / "shard_ledger.json").write_text(json.dumps(ledger))
        with pytest.raises(SourceError, match=pattern):
            build_cache(import_spec(folder), folder.parent / "imported")
        assert not (folder.parent / "imported" / "STATUS").exists()

    first = written["sharded"].ledger["finished_shards"][0]
    refused(lambda f, ledger: ledger.update(is_finished=False), r"is not finished")
    refused(lambda f, ledger: ledger["shard_rows"].pop(first),
            r"field `shard_rows` has no row count for the part 'part-00000-of-00003'")  # fmt: skip
    refused(lambda f, ledger: ledger.update(total_num_rows=ledger["total_num_rows"] + 1),
            r"`shard_rows` counts \d+ rows over `finished_shards`, its `total_num_rows` says")  # fmt: skip
    refused(lambda f, ledger: ledger["field_counts_by_shard"][first].update(input_ids=1),
            r"part-00000-of-00003/input_ids holds \d+ tokens, shard_ledger.json field "
            r"`field_counts_by_shard` says 1")  # fmt: skip
    refused(lambda f, ledger: shutil.rmtree(f / first / "input_ids" / "data"),
            r"part-00000-of-00003/input_ids/data is not a readable zarr3 array")  # fmt: skip
    with pytest.raises(SourceError, match=r"has no shard_ledger.json: give the folder of one"):
        build_cache(import_spec(written["sharded"].path / first / "input_ids"), tmp_path / "x")


def test_a_cache_changed_after_its_import_is_refused(written, tmp_path: Path) -> None:
    folder = copy_of(written["sharded"], tmp_path)
    out = build_cache(import_spec(folder), tmp_path / "imported")
    ledger = json.loads((folder / "shard_ledger.json").read_text())
    (folder / "shard_ledger.json").write_text(json.dumps(ledger, indent=1))  # rewritten
    with pytest.raises(CacheDamaged, match=r"the imported cache at .*/train changed since it was"):
        TokenCache.open(out)


def test_verify_reads_an_imports_token_data(written, tmp_path: Path, capsys) -> None:
    folder = copy_of(written["sharded"], tmp_path)
    out = build_cache(import_spec(folder), tmp_path / "imported")
    tokens = written["sharded"].ledger["field_counts"]["input_ids"]
    assert verify_cache(open_store(out)).imported is None  # the runner's placement check reads no data
    described = verify_cache(open_store(out), token_data=True).describe()
    assert f"the Levanter cache at {folder} (sharded, 3 part(s)): " in described
    assert f"{tokens:,} token ids read, each in [0, 8192), offsets increasing, rows" in described
    # An id beyond the vocabulary, written into a part's data: the ledger and the array
    # metadata are unchanged, so only reading the data finds it.
    data = ts.open(zarr_spec(folder / "part-00001-of-00003" / "input_ids" / "data")).result()
    data[5].write(9000).result()
    assert verify_main([str(out)]) == 1
    error = capsys.readouterr().err
    assert "shard part-00001-of-00003, file data/c/0 holds token id 9000 at position 5" in error


def test_kilns_levanter_framing_equals_levanters_cache_id_for_id(written, tmp_path) -> None:
    source = {"kind": "files", "paths": written.files}
    framings = {"levanter": "consolidated", "marin": "sharded"}
    for framing, layout in framings.items():
        kiln = TokenCache.open(build_cache(spec_of(source, framing=framing), tmp_path / framing))
        assert documents(kiln) == [row.tolist() for row in written[layout].rows], framing
    # The two differ only on the long document; Kiln's own framing differs.
    levanter, marin = (written[layout].rows for layout in framings.values())
    differing = [i for i, (a, b) in enumerate(zip(levanter, marin)) if a.tolist() != b.tolist()]
    assert differing == [28 + 10]  # LONG_TEXT: the second file's last document
    own = TokenCache.open(build_cache(spec_of(source), tmp_path / "kiln"))
    assert own.num_documents == len(levanter) - 2  # the empty and the blank document: skipped
    assert own.document(0).tolist() != levanter[0].tolist()  # no " " before EOS
    # A tokenizer naming a BOS (here the EOS, as GPT-2's names its): Levanter prepends it.
    with_bos = {"kind": "local", "path": written.with_bos}
    kiln = TokenCache.open(
        build_cache(spec_of(source, with_bos, framing="levanter"), tmp_path / "bos")
    )
    assert documents(kiln) == [row.tolist() for row in written["bos"].rows]
    assert kiln.document(0)[0] == 0


def test_training_on_an_import_equals_training_on_kilns_cache_of_the_same_files(
    written, tmp_path: Path
) -> None:
    """Marin's cache, imported, and Kiln's cache of the same files in Marin's framing: the
    same batches, so the same losses, bit for bit."""
    imported = build_cache(import_spec(written["sharded"].path), tmp_path / "imported")
    source = {"kind": "files", "paths": written.files}
    tokenized = build_cache(spec_of(source, framing="marin"), tmp_path / "tokenized")
    losses = []
    for name, cache in (("imported", imported), ("tokenized", tokenized)):
        output = tmp_path / f"run-{name}"
        spec = make_spec(output, {"tokenized/train": cache}, {"tokenized/val": cache},
                         **{"config.num_train_steps": 4, "runtime.validation_every": 4})  # fmt: skip
        train(parse_spec(spec))
        losses.append([r for r in read_jsonl(output / "metrics.jsonl") if "train/loss" in r])
    assert [r["train/loss"] for r in losses[0]] == [r["train/loss"] for r in losses[1]]
    assert len(losses[0]) == 4


def test_the_import_command(written, tmp_path: Path, capsys) -> None:
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(import_spec(written["consolidated"].path)))
    record = tmp_path / "record.json"
    record.write_text('{"name": "tokenized/levanter-import"}')
    out = tmp_path / "cache"
    assert main(["shard", str(spec_file), "--index", "0", "--out", str(tmp_path / "s")]) == 2
    assert "is imported, not tokenized" in capsys.readouterr().err
    assert main(["import", str(spec_file), "--out", str(out), "--record", str(record)]) == 0
    assert (out / "artifact.json").read_text() == record.read_text()
    assert (out / "STATUS").read_text().strip() == "SUCCESS"
    assert main(["import", str(spec_file), "--out", str(out)]) == 0  # done: a no-op
    assert "already built" in capsys.readouterr().err


def test_a_sharded_cache_in_a_bucket_is_imported_in_place(
    s3_server: str, written, tmp_path: Path
) -> None:
    levanter = written["sharded"]
    url = fresh_url("s3")
    copy_folder_into(open_store(url), "", levanter.path)
    cache = TokenCache.open(build_cache(import_spec(url), tmp_path / "imported"))
    first = cache.ledger["shards"][0]
    assert first["location"] == f"{url}/part-00000-of-00003/input_ids"
    assert first["identity"]["location"] == url
    assert documents(cache) == [row.tolist() for row in levanter.rows]
    # A store-mode import under a bucket prefix: its records are uploaded, STATUS last.
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(import_spec(url)))
    (tmp_path / "record.json").write_text('{"name": "tokenized/levanter-import"}')
    out = fresh_url("s3")
    assert main(["import", str(spec_file), "--out", out, "--record", str(tmp_path / "record.json")]) == 0
    in_bucket = TokenCache.open(out)
    assert in_bucket.ledger == cache.ledger
    assert open_store(out).read("artifact.json").data == b'{"name": "tokenized/levanter-import"}'
    assert np.array_equal(in_bucket.document(cache.num_documents - 1), levanter.rows[-1])
