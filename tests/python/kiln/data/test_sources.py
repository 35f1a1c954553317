from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from kiln_testing.data import sample_texts, write_corpus, write_jsonl

from kiln.data import hub_datasets, sources
from kiln.data.errors import SourceError
from kiln.data.sources import expand_paths, shard_documents
from kiln_contract import sharding
from kiln_contract.sharding import assign_to_shards
from kiln_contract.tokenize import FilesSource, HfSource


def _texts(source, num_shards=1, text_key="text") -> list[str]:
    return [
        doc.text
        for index in range(num_shards)
        for doc in shard_documents(source, text_key, num_shards, index)
    ]


def test_reads_every_format(tmp_path: Path):
    texts = sample_texts(6)
    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts[:2]).encode()
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(lines))
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    pq.write_table(pa.table({"text": texts[2:4], "n": [1, 2]}), tmp_path / "c.parquet")
    (tmp_path / "d.txt").write_text(texts[4] + "\n\n" + texts[5])
    write_jsonl(tmp_path / "e.jsonl", texts[:1])
    source = FilesSource(paths=(str(tmp_path / "*"),))
    expected = [*texts[:2], *texts[:2], *texts[2:4], texts[4] + "\n\n" + texts[5], texts[0]]
    assert _texts(source) == expected


def test_globs_and_relative_paths(tmp_path: Path, monkeypatch):
    texts = write_corpus(tmp_path / "corpus")
    monkeypatch.chdir(tmp_path)
    assert _texts(FilesSource(paths=("corpus/**/*.jsonl",))) == texts
    assert (
        _texts(FilesSource(paths=("corpus/c.jsonl", "corpus/a.jsonl"))) == texts[:50] + texts[70:]
    )


def test_shards_partition_files_by_size(tmp_path: Path):
    texts = write_corpus(tmp_path)
    source = FilesSource(paths=(str(tmp_path / "*.jsonl"),))
    # a.jsonl (largest) alone in shard 0; b and c, sorted, in shard 1.
    assert _texts(source, num_shards=2) == texts
    assert [doc.text for doc in shard_documents(source, "text", 2, 1)] == texts[50:]
    assert [len(list(shard_documents(source, "text", 4, i))) for i in range(4)] == [50, 20, 20, 0]


def test_assign_to_shards_balances_deterministically():
    sizes = {"e": 1, "a": 10, "b": 7, "c": 5, "d": 3}
    # a(10)->0, b(7)->1, c(5)->1 (7<10), d(3)->0 (10<12), e(1)->1 (12<13)
    assert assign_to_shards(sizes, 2) == [["a", "d"], ["b", "c", "e"]]
    assert assign_to_shards(sizes, 2) == assign_to_shards(dict(reversed(sizes.items())), 2)


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"text": "ok"}\n{"text": "\xff"}\n', "bad.jsonl:2: the line is not valid UTF-8"),
        (b'{"text": "ok"}\n\n{"text": \n', "bad.jsonl:3: the line is not valid JSON"),
        (
            b'{"body": "x", "id": 1}\n',
            "bad.jsonl:1: no field 'text' (the text_key); fields present: ['body', 'id']",
        ),
        (b'{"text": 5}\n', "bad.jsonl:1: field 'text' must be a string"),
        (b"[1, 2]\n", "bad.jsonl:1: expected a JSON object"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path: Path, content: bytes, message: str):
    (tmp_path / "bad.jsonl").write_bytes(content)
    with pytest.raises(SourceError, match="bad.jsonl") as error:
        _texts(FilesSource(paths=(str(tmp_path / "bad.jsonl"),)))
    assert message in str(error.value)


def test_missing_empty_and_unmatched_files(tmp_path: Path):
    with pytest.raises(SourceError, match=r"nope\.jsonl: no such file"):
        expand_paths([str(tmp_path / "nope.jsonl")])
    (tmp_path / "empty.jsonl").write_bytes(b"")
    with pytest.raises(SourceError, match=r"empty\.jsonl: the file is empty"):
        expand_paths([str(tmp_path / "empty.jsonl")])
    with pytest.raises(SourceError, match=r"\*\.parquet: the glob matches no file"):
        expand_paths([str(tmp_path / "*.parquet")])
    (tmp_path / "data.csv").write_text("text\nhello\n")
    with pytest.raises(SourceError, match=r"data\.csv: cannot tell the format"):
        _texts(FilesSource(paths=(str(tmp_path / "data.csv"),)))


def test_parquet_missing_column_names_the_columns(tmp_path: Path):
    pq.write_table(pa.table({"content": ["a"], "id": [1]}), tmp_path / "x.parquet")
    with pytest.raises(SourceError, match=r"x\.parquet: no column 'text'.*\['content', 'id'\]"):
        _texts(FilesSource(paths=(str(tmp_path / "x.parquet"),)))


def test_hf_loading_path_on_a_local_dataset_folder(tmp_path: Path):
    """The code path that handles hub ids, run on a local folder (no hub here)."""
    folder = tmp_path / "dataset"
    texts = write_corpus(folder)
    source = HfSource(id=str(folder), split="train")
    assert sorted(_texts(source)) == sorted(texts)
    sharded = [_texts_of_shard(source, 3, i) for i in range(3)]
    assert all(sharded) and sorted(sum(sharded, [])) == sorted(texts)
    assert _texts(source, num_shards=3) == _texts(source, num_shards=3)  # deterministic order


def test_hf_where_keeps_one_category(tmp_path: Path):
    """`where` selects records by field, as one Uncheatable Eval category out of its snapshot."""
    folder = tmp_path / "snapshot"
    folder.mkdir()
    records = [
        {"text": f"document {i}", "category": "bbc_news" if i % 3 else "arxiv"} for i in range(12)
    ]
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    source = HfSource(id=str(folder), split="test", where=(("category", "arxiv"),))
    assert _texts(source) == [r["text"] for r in records if r["category"] == "arxiv"]


def test_hf_data_files_read_only_the_matching_files_as_the_split(tmp_path: Path):
    """Paloma's layout: `{subset}/val/val*.jsonl.gz` picks one subset's validation files."""
    folder = tmp_path / "paloma"
    for subset in ("c4_en", "ptb"):
        (folder / subset / "val").mkdir(parents=True)
        with gzip.open(folder / subset / "val" / "val_0.jsonl.gz", "wt") as f:
            f.writelines(json.dumps({"text": f"{subset} {i}"}) + "\n" for i in range(3))
    source = HfSource(id=str(folder), split="validation", data_files=("ptb/val/val*.jsonl.gz",))
    assert _texts(source) == ["ptb 0", "ptb 1", "ptb 2"]


def _hub_shaped_folder(folder: Path) -> dict[str, list[str]]:
    """A dataset repository's layout: split folders, a README; returns each data file's texts."""
    files = {
        "train/part-0.jsonl": sample_texts(30, seed=1),
        "train/part-1.jsonl": sample_texts(12, seed=2),
        "train/part-2.jsonl": sample_texts(9, seed=3),
        "validation/part-0.jsonl": sample_texts(5, seed=4),
    }
    for path, texts in files.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(folder / path, texts)
    (folder / "README.md").write_text("# a dataset card\n")
    return files


def test_a_hub_source_is_planned_from_its_file_list_and_shards_read_only_their_files(
    tmp_path: Path,
):
    files = _hub_shaped_folder(tmp_path / "repo")
    source = HfSource(id=str(tmp_path / "repo"), split="train", revision="abc123")
    train = [path for path in files if path.startswith("train/")]
    sizes = {path: (tmp_path / "repo" / path).stat().st_size for path in train}
    assert hub_datasets.hf_file_sizes(source) == sizes
    assigned = assign_to_shards(sizes, 2)
    for index in range(2):
        assert _texts_of_shard(source, 2, index) == [t for p in assigned[index] for t in files[p]]
        assert sources.shard_plan(source, 2, index) == [
            f"{path} ({sizes[path]} bytes)" for path in assigned[index]
        ]
    validation = HfSource(id=str(tmp_path / "repo"), split="validation", revision="abc123")
    assert _texts(validation) == files["validation/part-0.jsonl"]
    missing = HfSource(id=str(tmp_path / "repo"), split="test", revision="abc123")
    with pytest.raises(SourceError, match=r"revision 'abc123' has no data files of the split 'test'"):
        _texts(missing)


def test_hub_files_that_name_no_split_are_all_train(tmp_path: Path):
    """DCLM's layout: `global-shard_01_of_10/local-shard_0_of_10/shard_00000000_processed.jsonl`."""
    folder = tmp_path / "dclm"
    path = folder / "global-shard_01_of_10/local-shard_0_of_10/shard_00000000_processed.jsonl"
    path.parent.mkdir(parents=True)
    write_jsonl(path, ["a document", "another"])
    assert _texts(HfSource(id=str(folder), split="train", revision="r")) == ["a document", "another"]


def _texts_of_shard(source, num_shards, index) -> list[str]:
    return [doc.text for doc in shard_documents(source, "text", num_shards, index)]


def test_hf_offline_fails_fast_naming_the_dataset():
    with pytest.raises(SourceError) as error:
        _texts(HfSource(id="kiln-test/no-such-dataset", split="train"))
    message = str(error.value)
    assert "'kiln-test/no-such-dataset'" in message
    assert "Offline (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set)" in message
    assert '"kind": "files"' in message


@pytest.mark.parametrize("line_bytes", [None, 100], ids=["ragged-lines", "boundaries-on-newlines"])
def test_a_big_jsonl_file_is_cut_on_line_boundaries(tmp_path: Path, monkeypatch, line_bytes):
    rng = np.random.default_rng(0)
    if line_bytes is None:  # lengths from 1 character to far beyond a piece
        texts = ["x" * int(n) for n in rng.integers(1, 400, size=300)] + ["y" * 5000]
        rng.shuffle(texts)
    else:  # every line exactly line_bytes long: the 10000 bytes are cut at multiples of 100
        texts = [f"{i:0{line_bytes - 13}d}" for i in range(100)]  # {"text": "..."}\n is 13 more
    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts)
    (tmp_path / "big.jsonl").write_text(lines)
    if line_bytes is not None:
        assert len(lines) == 100 * line_bytes
    monkeypatch.setattr(sharding, "MIN_PIECE_BYTES", 1000)
    source = FilesSource(paths=(str(tmp_path / "big.jsonl"),))
    for num_shards in (2, 3, 4, 7):
        shards = [
            [d.text for d in shard_documents(source, "text", num_shards, i)]
            for i in range(num_shards)
        ]
        assert [t for shard in shards for t in shard] == texts, num_shards
        assert all(shards), f"a shard got no lines with {num_shards} shards"
    # Compressed files cannot be cut: all of it lands in one shard.
    (tmp_path / "big.jsonl.gz").write_bytes(gzip.compress((tmp_path / "big.jsonl").read_bytes()))
    whole = FilesSource(paths=(str(tmp_path / "big.jsonl.gz"),))
    counts = [len(list(shard_documents(whole, "text", 3, i))) for i in range(3)]
    assert sorted(counts) == [0, 0, len(texts)]


def test_a_bad_line_in_a_piece_names_its_byte_offset(tmp_path: Path, monkeypatch):
    lines = [json.dumps({"text": "a" * 90}) + "\n" for _ in range(30)]
    lines[20] = "{not json}\n"
    (tmp_path / "big.jsonl").write_text("".join(lines))
    offset = sum(len(line) for line in lines[:20])
    monkeypatch.setattr(sharding, "MIN_PIECE_BYTES", 500)
    source = FilesSource(paths=(str(tmp_path / "big.jsonl"),))
    with pytest.raises(SourceError, match=rf"big.jsonl:byte {offset}: the line is not valid JSON"):
        for index in range(2):
            list(shard_documents(source, "text", 2, index))


def test_a_big_parquet_file_is_cut_into_runs_of_row_groups(tmp_path: Path, monkeypatch):
    rng = np.random.default_rng(0)
    texts = ["x" * int(n) + str(i) for i, n in enumerate(rng.integers(1, 300, size=300))]
    pq.write_table(pa.table({"text": texts}), tmp_path / "big.parquet", row_group_size=20)
    monkeypatch.setattr(sharding, "MIN_PIECE_BYTES", 100)
    source = FilesSource(paths=(str(tmp_path / "big.parquet"),))
    for num_shards in (2, 3, 4, 7):
        shards = [_texts_of_shard(source, num_shards, i) for i in range(num_shards)]
        assert [t for shard in shards for t in shard] == texts, num_shards
        assert all(shards), f"a shard got no row groups with {num_shards} shards"
        assert all(len(shard) % 20 == 0 for shard in shards[:-1])  # whole row groups
    # One row group cannot be cut: all of it lands in one shard.
    pq.write_table(pa.table({"text": texts}), tmp_path / "one.parquet")
    whole = FilesSource(paths=(str(tmp_path / "one.parquet"),))
    assert sorted(len(_texts_of_shard(whole, 3, i)) for i in range(3)) == [0, 0, len(texts)]


def test_a_bad_row_in_a_row_group_piece_names_its_row_in_the_file(tmp_path: Path, monkeypatch):
    texts: list[object] = [f"document {i}" for i in range(100)]
    texts[73] = None
    pq.write_table(pa.table({"text": texts}), tmp_path / "big.parquet", row_group_size=10)
    monkeypatch.setattr(sharding, "MIN_PIECE_BYTES", 10)
    source = FilesSource(paths=(str(tmp_path / "big.parquet"),))
    with pytest.raises(SourceError, match=r"big\.parquet\[row 73\]"):
        for index in range(4):
            list(shard_documents(source, "text", 4, index))


def test_the_backends_plan_from_file_sizes_is_the_plan_the_shards_read(
    tmp_path: Path, monkeypatch
) -> None:
    """`pants plan` plans a files source from the files' sizes alone (kiln_contract.sharding):
    the same pieces, shards and bytes the runtime reads, big files cut included; a parquet file
    big enough to be cut by its row groups is left to the runtime."""
    write_corpus(tmp_path / "corpus")
    big = "".join(json.dumps({"text": "x" * n}) + "\n" for n in range(1, 200))
    (tmp_path / "corpus/big.jsonl").write_text(big)
    (tmp_path / "corpus/big.jsonl.gz").write_bytes(gzip.compress(big.encode()))
    monkeypatch.setattr(sharding, "MIN_PIECE_BYTES", 2000)
    paths = sorted(str(path) for path in (tmp_path / "corpus").iterdir())
    sizes = {path: Path(path).stat().st_size for path in paths}
    source = FilesSource(paths=tuple(paths))
    for num_shards in (1, 2, 3, 5):
        planned = sharding.files_plan(sizes, num_shards)
        read = [sources.shard_sizes(source, num_shards, i) for i in range(num_shards)]
        assert planned == read, num_shards
        assert [list(shard) for shard in planned] == [
            sources.shard_plan(source, num_shards, i) for i in range(num_shards)
        ]
    assert any("@" in key for key in planned[0])  # big.jsonl was cut into byte ranges
    pq.write_table(pa.table({"text": ["y" * 90] * 200}), tmp_path / "big.parquet", row_group_size=20)
    assert sharding.files_plan({str(tmp_path / "big.parquet"): 20000}, 3) is None
