from __future__ import annotations

import copy

import pytest
from kiln_testing.data import make_spec

from kiln.data.errors import SpecError
from kiln.data.spec import parse_cache_spec
from kiln_contract.tokenize import (
    FilesSource,
    HfSource,
    StdlibSource,
    TokenizerSpec,
    UrlFilesSource,
    source_from_json,
    source_to_json,
)


def test_parses_a_full_spec():
    spec = make_spec(
        {"kind": "files", "paths": ["a.jsonl", "b/*.parquet"], "format": "auto"},
        text_key="body",
        max_document_chars=500,
        num_shards=4,
    )
    parsed = parse_cache_spec(spec)
    assert parsed.source == FilesSource(paths=("a.jsonl", "b/*.parquet"), format="auto")
    assert parsed.tokenizer.kind == "local"
    assert (parsed.text_key, parsed.max_document_chars, parsed.num_shards) == ("body", 500, 4)
    assert (parsed.name, parsed.version, parsed.fingerprint) == (
        "tokenized/test",
        "2026.11.29",
        "1a2b3c4d",
    )


def test_max_tokens_round_trips_and_splits_over_the_shards():
    spec = make_spec({"kind": "files", "paths": ["a.jsonl"]}, num_shards=3, max_tokens=1001)
    parsed = parse_cache_spec(spec)
    assert parse_cache_spec(parsed.to_json()) == parsed
    assert [parsed.shard_token_quota(i) for i in range(3)] == [334, 334, 333]
    unbounded = parse_cache_spec(make_spec({"kind": "files", "paths": ["a.jsonl"]}))
    assert "max_tokens" not in unbounded.to_json()["config"]
    assert unbounded.shard_token_quota(0) is None
    imported = make_spec({"kind": "levanter_cache", "location": "/c"}, max_tokens=5)
    with pytest.raises(SpecError, match="config.max_tokens: an imported levanter_cache is used whole"):
        parse_cache_spec(imported)


def test_defaults_and_other_source_and_tokenizer_kinds():
    spec = make_spec(
        {"kind": "hf", "id": "org/name", "revision": None, "subset": None, "split": "train"}
    )
    spec["config"]["tokenizer"] = {
        "kind": "hf",
        "id": "meta-llama/Meta-Llama-3.1-8B",
        "revision": None,
    }
    parsed = parse_cache_spec(spec)
    assert parsed.source == HfSource(id="org/name", split="train")
    assert parsed.tokenizer == TokenizerSpec("hf", id="meta-llama/Meta-Llama-3.1-8B")
    assert (parsed.text_key, parsed.max_document_chars, parsed.num_shards) == ("text", 1_000_000, 1)
    stdlib = parse_cache_spec(
        make_spec({"kind": "python_stdlib", "part": "all", "split": "validation"})
    )
    assert stdlib.source == StdlibSource(part="all", split="validation")


def test_url_files_and_hub_data_files_round_trip():
    url = "https://raw.githubusercontent.com/o/r/0123/data/a.json"
    digest = "git-blob-sha1:" + "0a" * 20
    url_files = UrlFilesSource(((url, digest),))
    assert parse_cache_spec(make_spec(source_to_json(url_files))).source == url_files
    paloma = HfSource("allenai/paloma", "validation", "65cd6fc", data_files=("c4_en/val/val*.jsonl.gz",))
    assert source_from_json(source_to_json(paloma)) == paloma
    bad = {"kind": "url_files", "files": {url: "md5:" + "0" * 32}, "format": "auto"}
    with pytest.raises(SpecError, match=r"config\.source\.files\['https://raw.*expected 'sha256:'"):
        parse_cache_spec(make_spec(bad))


def _broken(edit) -> str:
    spec = copy.deepcopy(make_spec({"kind": "files", "paths": ["a.jsonl"]}))
    edit(spec)
    with pytest.raises(SpecError) as error:
        parse_cache_spec(spec)
    return str(error.value)


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda s: s.pop("fingerprint"), "fingerprint: required field is missing"),
        (lambda s: s.update(spec_version=2), "spec_version: expected 1, got 2"),
        (lambda s: s.update(kind="lm_checkpoint"), "kind: expected 'tokenized_cache'"),
        (lambda s: s["config"].pop("source"), "config.source: required field is missing"),
        (lambda s: s["config"].update(num_shards=0), "config.num_shards: expected an integer >= 1"),
        (
            lambda s: s["config"].update(num_shards=True),
            "config.num_shards: expected an integer >= 1, got True",
        ),
        (lambda s: s["config"].update(text_keys="t"), "config: unknown field(s) text_keys"),
        (
            lambda s: s["config"]["source"].update(kind="s3"),
            "config.source.kind: expected one of files, hf, python_stdlib",
        ),
        (
            lambda s: s["config"]["source"].update(paths=[]),
            "config.source.paths: expected a list of files or globs",
        ),
        (lambda s: s["config"]["source"].update(paths=["a", 3]), "config.source.paths[1]"),
        (lambda s: s["config"]["source"].update(format="csv"), "config.source.format"),
        (lambda s: s["config"].update(max_tokens=0), "config.max_tokens: expected an integer >= 1"),
        (lambda s: s["config"].update(tokenizer={"kind": "local"}), "config.tokenizer.path"),
        (
            lambda s: s["config"].update(tokenizer="gpt2"),
            "config.tokenizer: expected a JSON object",
        ),
    ],
)
def test_errors_name_the_field(edit, expected):
    assert expected in _broken(edit)
