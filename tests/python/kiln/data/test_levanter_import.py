"""Importing a Levanter/Marin token cache: read in place, checked against the tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from kiln_testing.buckets import fresh_url
from kiln_testing.data import STDLIB_TOKENIZER, sample_texts
from kiln_testing.levanter import write_levanter_cache

from kiln.artifacts.store import copy_folder_into, open_store
from kiln.data.cache import TokenCache
from kiln.data.errors import CacheDamaged, SourceError
from kiln.data.mixture import MixtureDataset, fixed_batches
from kiln.data.tokenize import build_cache, main
from kiln.data.tokenizer import LoadedTokenizer
from kiln.data.verify import verify_cache


def import_spec(location: Path | str, version: str = "2026.12.01") -> dict:
    return {
        "spec_version": 1,
        "kind": "tokenized_cache",
        "name": "tokenized/levanter-import",
        "version": version,
        "fingerprint": "levanter1",
        "config": {
            "source": {"kind": "levanter_cache", "location": str(location)},
            "tokenizer": STDLIB_TOKENIZER,
        },
    }


def encoded(tokenizer: LoadedTokenizer, texts: list[str]) -> list[np.ndarray]:
    framed = tokenizer.encode_documents(texts)
    return np.split(framed.tokens.astype(np.int64), np.cumsum(framed.lengths)[:-1])


@pytest.fixture(scope="module")
def documents(tokenizer: LoadedTokenizer) -> list[np.ndarray]:
    return encoded(tokenizer, sample_texts(60))


@pytest.fixture
def levanter_dir(tmp_path: Path, tokenizer: LoadedTokenizer, documents) -> Path:
    return write_levanter_cache(
        tmp_path / "levanter" / "train", documents,
        tokenizer="kiln-stdlib-8k", vocab_size=tokenizer.info.vocab_size,
    )  # fmt: skip


def test_an_imported_cache_reads_as_the_tokenized_one(
    tmp_path: Path, levanter_dir: Path, documents, tokenizer: LoadedTokenizer
) -> None:
    imported = TokenCache.open(build_cache(import_spec(levanter_dir), tmp_path / "imported"))
    assert not (tmp_path / "imported" / "shards").exists()  # nothing copied, nothing tokenized
    assert imported.num_documents == len(documents)
    assert imported.num_tokens == sum(len(d) for d in documents)
    for i in (0, 17, len(documents) - 1):
        assert imported.document(i).tolist() == documents[i].tolist()
    # The same documents tokenized by Kiln give the same windows, batches and validation batches.
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in sample_texts(60)))
    spec = import_spec(levanter_dir)
    spec["config"]["source"] = {"kind": "files", "paths": [str(source)]}
    tokenized = TokenCache.open(build_cache(spec, tmp_path / "tokenized"))
    both = (imported, tokenized)
    windows = [c.windows([0, 5, 9], 32).tokens.tolist() for c in both]
    assert windows[0] == windows[1]
    mixed = [MixtureDataset([(c, 1.0)], 32, seed=3).batch(2, 4)["tokens"].tolist() for c in both]
    assert mixed[0] == mixed[1]
    validation = [fixed_batches(c, 32, 4, 2)[1]["segment_ids"].tolist() for c in both]
    assert validation[0] == validation[1]
    assert "verified" in verify_cache(tmp_path / "imported").describe()
    info = imported.info
    assert info["source"]["kind"] == "levanter_cache" and info["source"]["dtype"] == "int32"
    assert info["format_version"] == 4


def test_a_cache_changed_after_its_import_is_refused(tmp_path: Path, levanter_dir: Path,
                                                     documents) -> None:  # fmt: skip
    out = build_cache(import_spec(levanter_dir), tmp_path / "imported")
    write_levanter_cache(levanter_dir, documents[:-1], tokenizer="kiln-stdlib-8k", vocab_size=8192)
    with pytest.raises(CacheDamaged, match=r"the imported cache at .*/train changed since it was"):
        TokenCache.open(out)


def test_another_tokenizers_cache_is_refused(tmp_path: Path, levanter_dir: Path, documents):
    ledger_file = levanter_dir / "shard_ledger.json"
    ledger = json.loads(ledger_file.read_text())
    ledger["metadata"]["preprocessor_metadata"].update(tokenizer="gpt2", vocab_size=50257)
    ledger_file.write_text(json.dumps(ledger))
    with pytest.raises(SourceError, match=r"tokenized by 'gpt2' with a vocabulary of 50257; the"):
        build_cache(import_spec(levanter_dir), tmp_path / "a")
    # Without metadata, the ids tell: beyond the vocabulary, or documents not ending with EOS.
    wide = write_levanter_cache(tmp_path / "wide", [np.array([9000, 0])], tokenizer="x",
                                vocab_size=None)  # fmt: skip
    with pytest.raises(SourceError, match=r"token id 9000 at position 0, not in the vocabulary"):
        build_cache(import_spec(wide), tmp_path / "b")
    no_eos = write_levanter_cache(tmp_path / "no_eos", [d[:-1] for d in documents],
                                  tokenizer="x", vocab_size=None)  # fmt: skip
    with pytest.raises(SourceError, match=r"document 0 ends with token \d+, not the EOS id 0"):
        build_cache(import_spec(no_eos), tmp_path / "c")
    assert not any((tmp_path / name / "STATUS").exists() for name in "abc")


def test_an_unfinished_or_missing_cache_is_refused(tmp_path: Path, documents) -> None:
    unfinished = write_levanter_cache(tmp_path / "u", documents, tokenizer="x", vocab_size=8192,
                                      finished=False)  # fmt: skip
    with pytest.raises(SourceError, match=r"at .*/u is not finished"):
        build_cache(import_spec(unfinished), tmp_path / "a")
    with pytest.raises(SourceError, match=r"has no shard_ledger.json: give the folder of one split"):
        build_cache(import_spec(tmp_path / "u" / "input_ids"), tmp_path / "b")


def test_the_import_command(tmp_path: Path, levanter_dir: Path, capsys) -> None:
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(import_spec(levanter_dir)))
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


def test_a_cache_in_a_bucket_is_imported_in_place(
    s3_server: str, tmp_path: Path, levanter_dir: Path, documents
) -> None:
    url = fresh_url("s3")
    copy_folder_into(open_store(url), "", levanter_dir)
    cache = TokenCache.open(build_cache(import_spec(url), tmp_path / "imported"))
    (shard,) = cache.ledger["shards"]
    assert shard["location"] == f"{url}/input_ids" and shard["identity"]["location"] == url
    assert cache.document(len(documents) - 1).tolist() == documents[-1].tolist()
    assert cache.windows([3], 64).tokens.tolist() == [np.concatenate(documents)[192:256].tolist()]
    # A store-mode import under a bucket prefix: its records are uploaded, STATUS last.
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(import_spec(url)))
    (tmp_path / "record.json").write_text('{"name": "tokenized/levanter-import"}')
    out = fresh_url("s3")
    record = ["--record", str(tmp_path / "record.json")]
    assert main(["import", str(spec_file), "--out", out, *record]) == 0
    in_bucket = TokenCache.open(out)
    assert in_bucket.ledger == cache.ledger
    assert in_bucket.document(len(documents) - 1).tolist() == documents[-1].tolist()
    assert open_store(out).read("artifact.json").data == b'{"name": "tokenized/levanter-import"}'
