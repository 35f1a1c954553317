from __future__ import annotations

from pathlib import Path

from kiln_testing.data import make_spec

from kiln.data import stdlib_corpus
from kiln.data.cache import TokenCache
from kiln.data.tokenize import build_cache
from kiln.data.tokenizer import LoadedTokenizer


def test_docstrings_of_one_module():
    docs = list(stdlib_corpus.documents("json/__init__.py", "train")) + list(
        stdlib_corpus.documents("json/__init__.py", "validation")
    )
    assert docs and all(len(d.text) > stdlib_corpus.MIN_DOCSTRING_CHARS for d in docs)
    first = docs[0].origin
    assert first == "json/__init__.py:1" or first.startswith("json/__init__.py:")
    train_docs = stdlib_corpus.documents("json/__init__.py", "train")
    lines = [int(d.origin.rsplit(":", 1)[1]) for d in train_docs]
    assert lines == sorted(lines)
    assert any("JSON" in d.text for d in docs)


def test_units_exclude_tests_and_idlelib():
    keys = [unit.key for unit in stdlib_corpus.units("all")]
    assert keys == sorted(keys) and "json/__init__.py" in keys
    assert not any(k.startswith(("test/", "idlelib/")) or "/tests/" in k for k in keys)
    assert any(k.startswith(stdlib_corpus.PYDOC_TOPICS_PREFIX) for k in keys)


def test_split_is_stable_and_mostly_train():
    ids = [unit.key for unit in stdlib_corpus.units("pydoc_topics")]
    splits = [stdlib_corpus.split_of(i) for i in ids]
    assert splits == [stdlib_corpus.split_of(i) for i in ids]
    assert 0 < splits.count("validation") < len(ids) * 0.1


def test_pydoc_topics_cache(tmp_path: Path, tokenizer: LoadedTokenizer):
    source = {"kind": "python_stdlib", "part": "pydoc_topics", "split": "validation"}
    cache = TokenCache.open(build_cache(make_spec(source, num_shards=2), tmp_path / "cache"))
    texts = [
        doc.text
        for unit in stdlib_corpus.units("pydoc_topics")
        for doc in stdlib_corpus.documents(unit.key, "validation")
    ]
    assert cache.num_documents == len(texts)
    assert cache.info["split"] == "validation"
    assert cache.info["source"]["python_version"]
    all_documents = sorted(tuple(cache.document(i)) for i in range(cache.num_documents))
    framed = [tuple([*tokenizer.encode(t), tokenizer.info.eos_id]) for t in texts]
    assert all_documents == sorted(framed)
