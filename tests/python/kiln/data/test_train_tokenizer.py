from __future__ import annotations

from pathlib import Path

from kiln.data.tokenizer import load_tokenizer
from kiln.data.train_tokenizer import EOS_TOKEN, main


def test_trains_a_loadable_byte_level_bpe(tmp_path: Path):
    out = tmp_path / "tok"
    assert main([str(out), "--vocab-size", "400", "--part", "pydoc_topics"]) == 0
    assert "--vocab-size 400" in (out / "README.md").read_text()
    tokenizer = load_tokenizer({"kind": "local", "path": str(out)})
    assert tokenizer.info.vocab_size == 400
    assert tokenizer.hf_tokenizer.convert_ids_to_tokens(tokenizer.info.eos_id) == EOS_TOKEN
    text = "def f(x):\n    return x  # café ✓"
    assert tokenizer.decode(tokenizer.encode(text)) == text  # byte-level: nothing is unknown
