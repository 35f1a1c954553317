from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from kiln_testing.data import REPO_ROOT, damaged_tokenizer_folder
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from kiln.data.errors import TokenizerError
from kiln.data.tokenizer import LoadedTokenizer, load_tokenizer, resolve_tokenizer_spec

TEXT = "Return the list of items, café 😀 naïve.\n  Indented."


def _byte_count(tokenizer: LoadedTokenizer, text: str) -> int:
    return int(tokenizer.info.token_byte_lengths[tokenizer.encode(text)].sum())


def test_packaged_gpt2():
    gpt2 = load_tokenizer({"kind": "package", "name": "gpt2"})
    assert (gpt2.info.name, gpt2.info.vocab_size, gpt2.info.eos_id) == ("gpt2", 50257, 50256)
    assert gpt2.info.bos_id is None  # GPT-2's BOS is its EOS and nothing adds it
    assert gpt2.encode("hello world") == [31373, 995]  # GPT-2's well-known ids
    assert gpt2.decode(gpt2.encode(TEXT)) == TEXT
    assert _byte_count(gpt2, TEXT) == len(TEXT.encode("utf-8"))
    assert gpt2.info.token_byte_lengths[gpt2.info.eos_id] == 0
    assert len(gpt2.info.digest) == 64


def test_committed_stdlib_tokenizer(tokenizer: LoadedTokenizer):
    info = tokenizer.info
    assert (info.name, info.vocab_size, info.bos_id) == ("kiln-stdlib-8k", 8192, None)
    assert tokenizer.hf_tokenizer.convert_ids_to_tokens(info.eos_id) == "<|endoftext|>"
    assert info.token_dtype() == np.uint16
    assert tokenizer.decode(tokenizer.encode(TEXT)) == TEXT
    assert _byte_count(tokenizer, TEXT) == len(TEXT.encode("utf-8"))
    assert tokenizer.encode_batch([TEXT, "x"]) == [tokenizer.encode(TEXT), tokenizer.encode("x")]


def test_documents_get_eos_appended(tokenizer: LoadedTokenizer):
    encoded = tokenizer.encode_documents(["alpha beta", "gamma"])
    eos = tokenizer.info.eos_id
    expected = [*tokenizer.encode("alpha beta"), eos, *tokenizer.encode("gamma"), eos]
    assert encoded.tokens.tolist() == expected
    assert encoded.lengths.tolist() == [
        len(tokenizer.encode(t)) + 1 for t in ["alpha beta", "gamma"]
    ]


def _save_tokenizer_with_bos(folder: Path) -> None:
    """A tiny word-level tokenizer whose post-processor adds <s>, like Llama 3's."""
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "hello": 3, "world": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 0)]
    )
    folder.mkdir()
    backend.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def test_special_token_text_is_plain_text(tokenizer: LoadedTokenizer):
    ids = tokenizer.encode_documents(["a <|endoftext|> b"]).tokens.tolist()
    assert ids.count(tokenizer.info.eos_id) == 1 and ids[-1] == tokenizer.info.eos_id
    assert tokenizer.decode(ids[:-1]) == "a <|endoftext|> b"


def test_bos_is_prepended_when_the_post_processor_adds_it(tmp_path: Path):
    _save_tokenizer_with_bos(tmp_path / "with-bos")
    with_bos = load_tokenizer({"kind": "local", "path": str(tmp_path / "with-bos")})
    assert (with_bos.info.bos_id, with_bos.info.eos_id) == (0, 1)
    encoded = with_bos.encode_documents(["hello world", "world"])
    assert encoded.tokens.tolist() == [0, 3, 4, 1, 0, 4, 1]
    assert encoded.lengths.tolist() == [4, 3]
    assert with_bos.encode("hello") == [3]  # plain encoding never adds specials


def test_digest_follows_the_files(tmp_path: Path):
    _save_tokenizer_with_bos(tmp_path / "one")
    _save_tokenizer_with_bos(tmp_path / "two")
    one = load_tokenizer({"kind": "local", "path": str(tmp_path / "one")})
    assert (
        one.info.digest
        == load_tokenizer({"kind": "local", "path": str(tmp_path / "two")}).info.digest
    )
    config = tmp_path / "two" / "tokenizer_config.json"
    config.write_text(config.read_text().replace("</s>", "<unk>"))
    assert (
        one.info.digest
        != load_tokenizer({"kind": "local", "path": str(tmp_path / "two")}).info.digest
    )


def test_bad_tokenizers_fail_clearly(tmp_path: Path):
    with pytest.raises(TokenizerError, match="no tokenizer.json here"):
        load_tokenizer({"kind": "local", "path": str(tmp_path)})
    with pytest.raises(TokenizerError, match="Unknown packaged tokenizer 'gpt5'"):
        load_tokenizer({"kind": "package", "name": "gpt5"})
    with pytest.raises(TokenizerError, match='\'meta-llama/Meta-Llama-3.1-8B\'.*"kind": "local"'):
        load_tokenizer({"kind": "hf", "id": "meta-llama/Meta-Llama-3.1-8B"})


def test_a_damaged_tokenizer_is_named_with_what_to_do(tmp_path: Path) -> None:
    folder = damaged_tokenizer_folder(tmp_path / "cut")
    with pytest.raises(TokenizerError) as cut:
        load_tokenizer({"kind": "local", "path": str(folder)})
    message = str(cut.value)
    assert message.startswith(f"{folder}/tokenizer.json: not valid JSON (")
    assert "cut short or altered. Copy the folder again" in message and "\n" not in message

    # Valid JSON that is no tokenizer: transformers' complaint, with the folder.
    (folder / "tokenizer.json").write_text('{"model": {"type": "NoSuchModel"}}')
    with pytest.raises(TokenizerError) as refused:
        load_tokenizer({"kind": "local", "path": str(folder)})
    assert str(refused.value).startswith(f"{folder}: transformers cannot load this tokenizer")


def test_a_relative_local_path_is_found_from_the_repo_root(tmp_path: Path) -> None:
    spec = {"kind": "local", "path": "experiments/tokenizers/kiln-stdlib-8k"}
    inside = REPO_ROOT / "src/python"
    resolved = resolve_tokenizer_spec(spec, [tmp_path, inside])
    assert resolved == {**spec, "path": str(REPO_ROOT / spec["path"])}
    assert resolve_tokenizer_spec({**spec, "path": "no/such"}, [inside])["path"] == "no/such"
