from __future__ import annotations

import copy

import pytest
from kiln_testing.data import make_spec

from kiln.data.errors import SpecError
from kiln.data.spec import FilesSource, HfSource, StdlibSource, TokenizerSpec, parse_cache_spec


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
        (lambda s: s["config"].update(tokenizer={"kind": "local"}), "config.tokenizer.path"),
        (
            lambda s: s["config"].update(tokenizer="gpt2"),
            "config.tokenizer: expected a JSON object",
        ),
    ],
)
def test_errors_name_the_field(edit, expected):
    assert expected in _broken(edit)
