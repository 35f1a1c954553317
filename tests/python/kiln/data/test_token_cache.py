from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from kiln_testing.data import make_spec, write_corpus, write_jsonl

from kiln.artifacts.folder import ArtifactFolder
from kiln.data import cache_build, cache_writer, document_ends, hub_datasets
from kiln.data.cache import CacheNotReady, TokenCache
from kiln.data.cache_writer import ShardWriter
from kiln.data.errors import CacheDamaged, CacheError, SourceError
from kiln.data.mixture import MixtureDataset, fixed_batches
from kiln.data.spec import parse_cache_spec
from kiln.data.tokenize import build_cache, merge_cache, tokenize_shard
from kiln.data.tokenizer import LoadedTokenizer, TokenizerInfo
from kiln.data.verify import main as verify_main


def _corpus_spec(tmp_path: Path, num_shards: int = 3, **config) -> tuple[dict, list[str]]:
    texts = write_corpus(tmp_path / "corpus")
    source = {"kind": "files", "paths": [str(tmp_path / "corpus" / "*.jsonl")]}
    return make_spec(source, num_shards=num_shards, **config), texts


def _stream(tokenizer: LoadedTokenizer, texts: list[str]) -> np.ndarray:
    return tokenizer.encode_documents(texts).tokens.astype(np.int32)


def _files(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def test_round_trip_documents_and_windows(tmp_path: Path, tokenizer: LoadedTokenizer):
    spec, texts = _corpus_spec(tmp_path)
    cache = TokenCache.open(build_cache(spec, tmp_path / "cache"))
    stream = _stream(tokenizer, texts)
    assert (cache.num_documents, cache.num_tokens) == (len(texts), len(stream))
    for i in (0, 49, 50, 89):  # first and last documents of the shards
        framed = [*tokenizer.encode(texts[i]), tokenizer.info.eos_id]
        assert cache.document(i).tolist() == framed
    seq_len = 37  # windows straddle documents and shard boundaries
    assert cache.num_windows(seq_len) == len(stream) // seq_len
    indices = [cache.num_windows(seq_len) - 1, 0, 5, 5]
    batch = cache.windows(indices, seq_len)
    assert batch.tokens.dtype == np.int32 and batch.tokens.shape == (4, seq_len)
    for row, index in enumerate(indices):
        assert (batch.tokens[row] == stream[index * seq_len : (index + 1) * seq_len]).all()
    assert cache.tokenizer.digest == tokenizer.info.digest
    assert (cache.token_byte_lengths == tokenizer.info.token_byte_lengths).all()
    with pytest.raises(IndexError):
        cache.windows([cache.num_windows(seq_len)], seq_len)


def test_cache_records(tmp_path: Path, tokenizer: LoadedTokenizer):
    spec, texts = _corpus_spec(tmp_path)
    cache_dir = build_cache(spec, tmp_path / "cache")
    assert ArtifactFolder.at(cache_dir).status() == "SUCCESS"
    assert not (cache_dir / ".building").exists()
    ledger = json.loads((cache_dir / "ledger.json").read_text())
    assert ledger["finished"] is True
    assert [s["documents"] for s in ledger["shards"]] == [50, 20, 20]
    assert [s["first_document"] for s in ledger["shards"]] == [0, 50, 70]
    tokens = [s["tokens"] for s in ledger["shards"]]
    assert [s["first_token"] for s in ledger["shards"]] == [0, tokens[0], tokens[0] + tokens[1]]
    stats = json.loads((cache_dir / "stats.json").read_text())
    lengths = tokenizer.encode_documents(texts).lengths
    assert stats["text_bytes"] == sum(len(t.encode()) for t in texts)
    assert stats["max_document_tokens"] == lengths.max()
    assert stats["mean_document_tokens"] == pytest.approx(lengths.mean())
    info = TokenCache.open(cache_dir).info
    assert info["tokenizer"]["eos_id"] == tokenizer.info.eos_id
    assert info["tokenizer"]["spec"]["kind"] == "local"
    assert (info["name"], info["fingerprint"], info["tokens"]) == (
        "tokenized/test",
        "1a2b3c4d",
        lengths.sum(),
    )
    cache = TokenCache.open(cache_dir)
    assert [len(cache.document(i)) for i in range(cache.num_documents)] == lengths.tolist()


def test_windows_on_a_hand_checkable_example(tmp_path: Path, tokenizer: LoadedTokenizer):
    words = ["a", " b", " c"]
    assert all(len(tokenizer.encode(w)) == 1 for w in ["a", "b", " b", " c"])
    write_jsonl(tmp_path / "x.jsonl", ["a", "b b", "b c b"])
    spec = make_spec({"kind": "files", "paths": [str(tmp_path / "x.jsonl")]})
    cache = TokenCache.open(build_cache(spec, tmp_path / "cache"))
    a, b, sb, sc = (tokenizer.encode(w)[0] for w in ["a", "b", *words[1:]])
    e = tokenizer.info.eos_id
    # stream: a E | b ␣b E | b ␣c ␣b E   (10 tokens)
    batch = cache.windows([0, 1], 4)
    assert batch.tokens.tolist() == [[a, e, b, sb], [e, b, sc, sb]]
    assert batch.segment_ids.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    assert batch.loss_mask.tolist() == [[1, 0, 1, 0], [0, 1, 1, 0]]
    assert batch.segment_ids.dtype == np.int32 and batch.loss_mask.dtype == np.float32
    assert cache.num_windows(4) == 2  # the last 2 tokens do not fill a window


def test_shard_then_merge_equals_build(tmp_path: Path, tokenizer: LoadedTokenizer):
    spec, _ = _corpus_spec(tmp_path)
    built = build_cache(spec, tmp_path / "built")
    parsed = parse_cache_spec(spec)
    shard_dirs = [tmp_path / "shards" / f"s{i}" for i in range(3)]
    for index, shard_dir in reversed(list(enumerate(shard_dirs))):
        tokenize_shard(parsed, index, shard_dir, tokenizer)
    merged = merge_cache(parsed, reversed(shard_dirs), tmp_path / "merged")
    assert _files(built) == _files(merged)


def test_builds_are_deterministic(tmp_path: Path):
    spec, _ = _corpus_spec(tmp_path, num_shards=2)
    one = _files(build_cache(spec, tmp_path / "one"))
    assert one == _files(build_cache(spec, tmp_path / "two"))
    assert "shards/shard-00001/data/c/0" in one


def test_merge_refuses_incomplete_missing_and_foreign_shards(tmp_path: Path, tokenizer):
    spec, _ = _corpus_spec(tmp_path, num_shards=2)
    parsed = parse_cache_spec(spec)
    s0, s1 = tmp_path / "s0", tmp_path / "s1"
    tokenize_shard(parsed, 0, s0, tokenizer)
    tokenize_shard(parsed, 1, s1, tokenizer)
    out = tmp_path / "cache"
    with pytest.raises(CacheError, match=r"shard\(s\) \[1\] of 2 are missing"):
        merge_cache(parsed, [s0], out, tokenizer)
    with pytest.raises(CacheError, match="are both shard 0"):
        merge_cache(parsed, [s0, s0, s1], out, tokenizer)
    other = parse_cache_spec({**spec, "fingerprint": "ffffffff"})
    with pytest.raises(CacheError, match="fingerprint: shard has '1a2b3c4d', spec has 'ffffffff'"):
        merge_cache(other, [s0, s1], out, tokenizer)
    (s1 / "STATUS").unlink()  # as if the shard's process was killed before its marker
    with pytest.raises(CacheError, match=r"s1: the shard is incomplete"):
        merge_cache(parsed, [s0, s1], out, tokenizer)
    assert ArtifactFolder.at(out).status() is None
    with pytest.raises(CacheNotReady, match="not a finished token cache"):
        TokenCache.open(out)


def test_a_killed_shard_leaves_nothing_behind(tmp_path: Path, tokenizer: LoadedTokenizer):
    out = tmp_path / "shard"
    with pytest.raises(KeyboardInterrupt):
        with ShardWriter(out, np.dtype(np.uint16)) as writer:
            writer.append(tokenizer.encode_documents(["some text"]))
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_build_resumes_from_complete_shards(tmp_path: Path, tokenizer: LoadedTokenizer):
    spec, _ = _corpus_spec(tmp_path, num_shards=2)
    reference = _files(build_cache(spec, tmp_path / "reference"))
    out = tmp_path / "cache"
    tokenize_shard(parse_cache_spec(spec), 0, out / ".building" / "shard-00000", tokenizer)
    marker = out / ".building" / "shard-00000" / "shard.json"
    marker.write_text(marker.read_text())  # the reused shard keeps this exact file
    assert _files(build_cache(spec, out)) == reference


def test_a_failed_re_merge_ends_failed_not_success(tmp_path: Path, tokenizer: LoadedTokenizer):
    spec, _ = _corpus_spec(tmp_path, num_shards=1)
    out = build_cache(spec, tmp_path / "cache")
    parsed = parse_cache_spec(spec)
    (tmp_path / "s0").mkdir()  # an empty, unfinished shard folder
    with pytest.raises(CacheError):
        merge_cache(parsed, [tmp_path / "s0"], out, tokenizer)
    assert ArtifactFolder.at(out).status() == "SUCCESS"  # refused before touching the old cache
    tokenize_shard(parsed, 0, tmp_path / "s0", tokenizer)
    shutil.rmtree(out / "shards")
    (out / "shards").write_text("in the way")  # assembling fails after it has started
    with pytest.raises(OSError):
        merge_cache(parsed, [tmp_path / "s0"], out, tokenizer)
    assert ArtifactFolder.at(out).status() == "FAILED"
    reason = (out / "failure.txt").read_text()
    assert re.match(r"\w+Error: ", reason) and reason.count("\n") == 1, reason  # one line
    with pytest.raises(CacheNotReady, match=r"\(STATUS FAILED: \w+Error: .*\); build it"):
        TokenCache.open(out)


def test_bad_documents(tmp_path: Path):
    write_jsonl(tmp_path / "long.jsonl", ["short", "x" * 101])
    spec = make_spec(
        {"kind": "files", "paths": [str(tmp_path / "long.jsonl")]}, max_document_chars=100
    )
    with pytest.raises(
        SourceError, match=r"long\.jsonl:2: the document has 101 characters.*max_document_chars=100"
    ):
        build_cache(spec, tmp_path / "cache")
    assert ArtifactFolder.at(tmp_path / "cache").status() is None
    write_jsonl(tmp_path / "blank.jsonl", ["", "  \n"])
    spec = make_spec({"kind": "files", "paths": [str(tmp_path / "blank.jsonl")]})
    with pytest.raises(SourceError, match="the dataset is empty"):
        build_cache(spec, tmp_path / "cache")
    assert ArtifactFolder.at(tmp_path / "cache").status() is None


def _first_documents_reaching(
    tokenizer: LoadedTokenizer, texts: list[str], quota: int
) -> list[str]:
    kept, tokens = [], 0
    for text in texts:
        if tokens >= quota:
            break
        kept.append(text)
        tokens += len(tokenizer.encode(text)) + 1  # + EOS
    return kept


def test_max_tokens_keeps_each_shards_first_documents_up_to_its_quota(
    tmp_path: Path, tokenizer: LoadedTokenizer, monkeypatch
):
    # quotas end inside and across batches
    monkeypatch.setattr(cache_build, "ENCODE_BATCH_DOCUMENTS", 7)
    spec, texts = _corpus_spec(tmp_path, max_tokens=601)  # quotas 201, 200, 200 for shards 0, 1, 2
    cache = TokenCache.open(build_cache(spec, tmp_path / "cache"))
    shards = [texts[:50], texts[50:70], texts[70:]]  # a.jsonl, b.jsonl, c.jsonl
    kept = [_first_documents_reaching(tokenizer, t, q) for t, q in zip(shards, (201, 200, 200))]
    assert [s["documents"] for s in cache.ledger["shards"]] == [len(k) for k in kept]
    assert all(0 < len(k) < len(t) for k, t in zip(kept, shards))
    documents = [text for shard in kept for text in shard]
    for i, text in enumerate(documents):
        assert cache.document(i).tolist() == [*tokenizer.encode(text), tokenizer.info.eos_id]
    assert cache.num_tokens >= 601 and cache.info["max_tokens"] == 601
    stats = json.loads((tmp_path / "cache/stats.json").read_text())
    assert stats["text_bytes"] == sum(len(text.encode()) for text in documents)
    assert build_cache(spec, tmp_path / "again") and _files(tmp_path / "again") == _files(
        tmp_path / "cache"
    )


def test_max_tokens_beyond_the_source_fails_naming_the_field(tmp_path: Path):
    spec, _ = _corpus_spec(tmp_path, num_shards=1, max_tokens=10**9)
    with pytest.raises(SourceError, match=r"tokenized/test@2026.11.29: shard 0 of 1 .* `max_tokens`"):
        build_cache(spec, tmp_path / "cache")
    assert ArtifactFolder.at(tmp_path / "cache").status() is None
    assert not list((tmp_path / "cache").rglob("shard.json"))  # nothing that passes as a shard


def test_a_hub_file_list_that_changed_under_its_revision_is_refused(tmp_path: Path, tokenizer):
    folder = tmp_path / "repo"
    for name in ("a", "b"):
        (folder / "train").mkdir(parents=True, exist_ok=True)
        write_jsonl(folder / "train" / f"{name}.jsonl", [f"{name} one", f"{name} two"])
    source = {"kind": "hf", "id": str(folder), "split": "train", "revision": "main"}
    spec = parse_cache_spec(make_spec(source, num_shards=2))
    shards = [tmp_path / f"shard-{i}" for i in range(2)]
    for index, shard in enumerate(shards):
        tokenize_shard(spec, index, shard, tokenizer)
    write_jsonl(folder / "train" / "c.jsonl", ["a file pushed to the branch"])
    hub_datasets.hf_file_sizes.cache_clear()  # a new process lists the files again
    with pytest.raises(CacheError, match=r"file list changed under revision 'main'.*Pin"):
        merge_cache(spec, shards, tmp_path / "cache", tokenizer)
    assert ArtifactFolder.at(tmp_path / "cache").status() is None


def test_empty_shards_in_the_middle(tmp_path: Path, tokenizer: LoadedTokenizer):
    texts = write_corpus(tmp_path / "corpus")
    spec = make_spec({"kind": "files", "paths": [str(tmp_path / "corpus/*.jsonl")]}, num_shards=5)
    cache = TokenCache.open(build_cache(spec, tmp_path / "cache"))
    assert [s["documents"] for s in cache.ledger["shards"]] == [50, 20, 20, 0, 0]
    stream = _stream(tokenizer, texts)
    last = cache.num_windows(16) - 1
    assert (cache.windows([last], 16).tokens[0] == stream[last * 16 : (last + 1) * 16]).all()
    assert cache.document(89).tolist() == [*tokenizer.encode(texts[89]), tokenizer.info.eos_id]


def test_shards_spanning_many_zarr_files(tmp_path: Path, tokenizer: LoadedTokenizer, monkeypatch):
    """Small chunk sizes exercise the buffered, chunk-aligned writes of large shards."""
    monkeypatch.setattr(cache_writer, "OUTER_CHUNK", 256)
    monkeypatch.setattr(cache_writer, "INNER_CHUNK", 64)
    spec, texts = _corpus_spec(tmp_path, num_shards=2)
    cache_dir = build_cache(spec, tmp_path / "cache")
    assert len(list((cache_dir / "shards/shard-00000/data/c").iterdir())) > 3
    cache = TokenCache.open(cache_dir)
    stream = _stream(tokenizer, texts)
    assert (
        np.concatenate([cache.document(i) for i in range(cache.num_documents)]).tolist()
        == stream.tolist()
    )


def test_windows_find_their_documents_through_the_offsets_index(
    tmp_path: Path, tokenizer: LoadedTokenizer, monkeypatch
):
    """Format 4 reads document boundaries by the chunk of offsets, found through the index: with
    7 documents a chunk, windows straddling chunks, documents and shards get the segment ids the
    documents' lengths give; an index changed on disk is refused where it is read."""
    monkeypatch.setattr(document_ends, "OFFSETS_STRIDE", 7)
    spec, texts = _corpus_spec(tmp_path, num_shards=2)
    cache = TokenCache.open(build_cache(spec, tmp_path / "cache"))
    assert cache.ledger["shards"][0]["offsets_stride"] == 7
    lengths = tokenizer.encode_documents(texts).lengths
    document_of = np.repeat(np.arange(len(lengths)), lengths)
    seq_len = 37
    indices = list(range(cache.num_windows(seq_len)))
    expected = document_of[: len(indices) * seq_len].reshape(-1, seq_len)
    assert (cache.windows(indices, seq_len).segment_ids == expected - expected[:, :1]).all()
    assert [len(cache.document(i)) for i in range(cache.num_documents)] == lengths.tolist()
    index_file = tmp_path / "cache/shards/shard-00000/offsets_index.npy"
    index = np.load(index_file)
    index[2] += 1  # the same size: only a read of that chunk can tell
    np.save(index_file, index)
    reopened = TokenCache.open(tmp_path / "cache")
    with pytest.raises(CacheDamaged, match=r"shard shard-00000, file offsets \(document bounda"):
        reopened.windows(indices, seq_len)


def test_merge_copies_a_symlinked_shard(tmp_path: Path, tokenizer: LoadedTokenizer):
    spec, texts = _corpus_spec(tmp_path, num_shards=1)
    parsed = parse_cache_spec(spec)
    tokenize_shard(parsed, 0, tmp_path / "real", tokenizer)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    cache = TokenCache.open(merge_cache(parsed, [tmp_path / "link"], tmp_path / "cache", tokenizer))
    assert not (tmp_path / "cache/shards/shard-00000").is_symlink()
    assert (tmp_path / "real/STATUS").exists()  # the link's target is left alone
    assert cache.num_documents == len(texts)


FORMAT_2_SAMPLE = Path(__file__).parent / "samples" / "format2"


def test_a_format_2_cache_still_reads_and_verifies(tokenizer: LoadedTokenizer):
    """A cache the previous Kiln wrote (committed; its documents beside it) reads the same ids."""
    lines = (FORMAT_2_SAMPLE / "documents.jsonl").read_text().splitlines()
    texts = [json.loads(line)["text"] for line in lines]
    cache = TokenCache.open(FORMAT_2_SAMPLE / "cache")
    assert cache.info["format_version"] == 2 and cache.verified
    assert cache.num_documents == len(texts)
    for i, text in enumerate(texts):
        assert cache.document(i).tolist() == [*tokenizer.encode(text), tokenizer.info.eos_id]
    assert verify_main([str(FORMAT_2_SAMPLE / "cache")]) == 0


def test_uint16_and_uint32_caches_read_the_same_ids(tmp_path: Path, monkeypatch):
    """Ids are stored as uint16 when the vocabulary fits (8192 here), else uint32; forcing
    uint32 stores the same ids twice as wide, and every reader returns the same batches."""
    spec, _ = _corpus_spec(tmp_path)
    narrow = TokenCache.open(build_cache(spec, tmp_path / "uint16"))
    monkeypatch.setattr(TokenizerInfo, "token_dtype", lambda self: np.dtype(np.uint32))
    wide = TokenCache.open(build_cache(spec, tmp_path / "uint32"))
    for cache, dtype in ((narrow, "uint16"), (wide, "uint32")):
        shard = json.loads((Path(cache.path) / "shards/shard-00000/shard.json").read_text())
        assert shard["dtype"] == dtype
        assert verify_main([str(cache.path)]) == 0
    both = (narrow, wide)
    mixed = [MixtureDataset([(c, 1.0)], 37, seed=1).batch(3, 8)["tokens"].tolist() for c in both]
    assert mixed[0] == mixed[1]
    validation = [[b["tokens"].tolist() for b in fixed_batches(c, 37, 8, 3)] for c in both]
    assert validation[0] == validation[1]
    assert narrow.document(89).tolist() == wide.document(89).tolist()
