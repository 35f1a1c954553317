"""Damaged caches are refused, naming the cache, shard and file; intact ones verify.

Each kind of damage: a deleted data chunk, altered bytes in a data chunk (caught by its digest,
and by the vocabulary check when the ids it decodes to are out of range), damaged offsets
(document boundaries), and an old cache that records no digests.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts
from kiln_testing.data import make_spec, write_corpus

from kiln.artifacts.content import record_files, record_sizes
from kiln.artifacts.locations import open_store
from kiln.data.cache import TokenCache, zarr_spec
from kiln.data.errors import CacheDamaged
from kiln.data.tokenize import build_cache
from kiln.data.verify import VERIFIED_FILE, verify_cache, verify_once
from kiln.data.verify import main as verify_main

SHARD = "shard-00001"


@pytest.fixture()
def cache_dir(tmp_path: Path) -> Path:
    write_corpus(tmp_path / "corpus")
    source = {"kind": "files", "paths": [str(tmp_path / "corpus" / "*.jsonl")]}
    return build_cache(make_spec(source, num_shards=2), tmp_path / "cache")


def shard_dir(cache_dir: Path) -> Path:
    return cache_dir / "shards" / SHARD


def rewrite(cache_dir: Path, array: str, index: int, value: int, *, digests: bool = False) -> None:
    """Changes one element of a shard's array through TensorStore (valid encoding, wrong
    content), then records the files' new sizes in the ledger: damage that keeps sizes, so
    only digests and the content checks can see it. With `digests`, their new digests too: the
    records agree with the bytes, as a writer that wrote wrong ids would have made them."""
    store = ts.open(zarr_spec(shard_dir(cache_dir) / array), open=True).result()
    store[index].write(value).result()
    ledger_path = cache_dir / "ledger.json"
    ledger = json.loads(ledger_path.read_text())
    for shard in ledger["shards"]:
        if shard["name"] == SHARD:
            record = record_files if digests else record_sizes
            for name, now in record(shard_dir(cache_dir), shard["files"]).items():
                shard["files"][name].update(now)
    ledger_path.write_text(json.dumps(ledger))


def test_an_intact_cache_records_and_verifies_every_file(cache_dir: Path) -> None:
    ledger = json.loads((cache_dir / "ledger.json").read_text())
    assert json.loads((cache_dir / "cache.json").read_text())["format_version"] == 4
    assert ledger["format_version"] == 4
    assert sorted(ledger["files"]) == ["token_byte_lengths.npy"]
    files = ledger["shards"][1]["files"]
    assert sorted(files) == [
        "data/c/0", "data/zarr.json", "offsets/c/0", "offsets/zarr.json", "offsets_index.npy"
    ]  # fmt: skip
    assert all(len(f["sha256"]) == 64 and f["bytes"] > 0 for f in files.values())
    verification = verify_cache(open_store(cache_dir))
    assert verification.cache.verified and verification.files == 11
    assert verification.describe().startswith(f"tokenized/test@2026.11.29 at {cache_dir}: verified")


def test_a_deleted_data_chunk_is_refused_on_open(cache_dir: Path) -> None:
    (shard_dir(cache_dir) / "data/c/0").unlink()
    with pytest.raises(CacheDamaged) as error:
        TokenCache.open(cache_dir)
    message = str(error.value)
    assert f"token cache tokenized/test@2026.11.29 at {cache_dir}: shard {SHARD}" in message
    assert "file data/c/0 is missing" in message and "\n" not in message


def test_a_truncated_chunk_is_refused_on_open(cache_dir: Path) -> None:
    chunk = shard_dir(cache_dir) / "offsets/c/0"
    chunk.write_bytes(chunk.read_bytes()[:-5])
    with pytest.raises(CacheDamaged, match=rf"shard {SHARD}, file offsets/c/0 has \d+ bytes"):
        TokenCache.open(cache_dir)


def test_altered_bytes_fail_their_digest(cache_dir: Path) -> None:
    chunk = shard_dir(cache_dir) / "data/c/0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(
        CacheDamaged, match=rf"shard {SHARD}, file data/c/0 does not match its sha256"
    ):
        verify_cache(open_store(cache_dir))


def test_ids_beyond_the_vocabulary_are_refused_when_read(cache_dir: Path) -> None:
    rewrite(cache_dir, "data", 3, 65000)
    cache = TokenCache.open(cache_dir)  # sizes and offsets are as recorded
    first = cache.ledger["shards"][1]["first_token"]
    cache.windows([0], 4)  # shard-00000 is intact
    with pytest.raises(CacheDamaged) as error:
        cache.windows([first // 4, first // 4 + 1], 4)
    message = str(error.value)
    assert f"shard {SHARD}, file data/c/0 holds token id 65000 at position 3" in message
    assert "not in the tokenizer's vocabulary of 8192" in message
    with pytest.raises(CacheDamaged, match="does not match its sha256 digest"):
        verify_cache(open_store(cache_dir))


def test_the_full_check_reads_every_token_id(cache_dir: Path) -> None:
    """Ids beyond the vocabulary under records that agree with them: the digests pass, and the
    full check still finds the id, before any training reads it."""
    rewrite(cache_dir, "data", 7, 9000, digests=True)
    with pytest.raises(CacheDamaged) as error:
        verify_cache(open_store(cache_dir))
    message = str(error.value)
    assert f"at {cache_dir}: shard {SHARD}, file data/c/0 holds token id 9000 at position 7" in (
        message
    )
    assert "\n" not in message
    assert verify_main([str(cache_dir)]) == 1


def test_a_cache_verified_once_is_not_read_again_until_a_file_changes(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = verify_once(open_store(cache_dir))
    assert not first.earlier and first.token_ids == first.cache.num_tokens > 0
    assert (cache_dir / VERIFIED_FILE).exists()
    import kiln.data.verify as verify

    full_checks: list[object] = []
    monkeypatch.setattr(verify, "_compare_digests", lambda *a: full_checks.append(a) or (0, 0))
    again = verify_once(open_store(cache_dir))
    assert again.earlier and not full_checks
    assert again.describe().endswith(": verified when placed, every file unchanged since")
    monkeypatch.undo()
    chunk = shard_dir(cache_dir) / "data/c/0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF  # rewritten in place: same inode and size, another mtime
    chunk.write_bytes(bytes(data))
    with pytest.raises(CacheDamaged, match=rf"shard {SHARD}, file data/c/0 does not match"):
        verify_once(open_store(cache_dir))


def test_a_cache_not_ours_to_mark_is_checked_every_time(cache_dir: Path) -> None:
    assert not verify_once(open_store(cache_dir), record=False).earlier
    assert not (cache_dir / VERIFIED_FILE).exists()
    assert not verify_once(open_store(cache_dir)).earlier  # nothing marked it before


def test_damaged_offsets_are_refused_when_read(cache_dir: Path) -> None:
    """Opening reads no offsets but the count and the last end (format 4: whatever the document
    count, kiln.data.document_ends); a read of the chunk holding a window's documents checks it."""
    ends = ts.open(zarr_spec(shard_dir(cache_dir) / "offsets"), open=True).result().read().result()
    rewrite(cache_dir, "offsets", 5, int(ends[3]))  # document 4 ends before document 3 does
    cache = TokenCache.open(cache_dir)
    first = cache.ledger["shards"][1]["first_token"]
    with pytest.raises(CacheDamaged) as error:
        cache.windows([first // 4 + 1], 4)
    message = str(error.value)
    assert f"shard {SHARD}, file offsets (document boundaries) entries 0..40 are not strictly" in message
    assert "the ledger records 40 documents" in message


def test_an_offsets_count_that_disagrees_with_the_ledger_is_refused(cache_dir: Path) -> None:
    rewrite(cache_dir, "offsets", 0, 39)
    with pytest.raises(CacheDamaged, match=r"hold a count of 39 and a last end of \d+, but the led"):
        TokenCache.open(cache_dir)


def test_an_old_format_cache_is_read_unverified(cache_dir: Path, caplog) -> None:
    info = json.loads((cache_dir / "cache.json").read_text())
    (cache_dir / "cache.json").write_text(json.dumps({**info, "format_version": 1}))
    with caplog.at_level(logging.WARNING, logger="kiln.data.cache"):
        cache = TokenCache.open(cache_dir)
    assert not cache.verified and cache.num_documents == 90
    assert "format_version 1 records no file sizes or digests" in caplog.text
    (shard_dir(cache_dir) / "data/c/0").unlink()
    TokenCache.open(cache_dir)  # nothing says the chunk was ever there: reads return zeros
    assert verify_main([str(cache_dir)]) == 3


def test_the_verify_command(cache_dir: Path, tmp_path: Path, capsys) -> None:
    assert verify_main([str(cache_dir)]) == 0
    assert "verified 11 files" in capsys.readouterr().out
    (shard_dir(cache_dir) / "data/c/0").unlink()
    assert verify_main([str(cache_dir), str(tmp_path / "nowhere")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "file data/c/0 is missing" in err[0]
    assert "nowhere is not a finished token cache" in err[1]


def test_the_verify_command_runs_as_a_module(cache_dir: Path) -> None:
    rewrite(cache_dir, "data", 0, 1)
    result = subprocess.run(
        [sys.executable, "-m", "kiln.data.verify", str(cache_dir)], capture_output=True, text=True
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert f"shard {SHARD}, file data/c/0 does not match its sha256 digest" in result.stderr


def test_reads_of_an_intact_cache_pass_the_id_check(cache_dir: Path) -> None:
    cache = TokenCache.open(cache_dir)
    tokens = np.concatenate([cache.document(i) for i in range(cache.num_documents)])
    assert tokens.max() < cache.tokenizer.vocab_size and len(tokens) == cache.num_tokens
