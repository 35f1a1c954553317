"""Helpers for kiln.data tests: step specs and small generated corpora."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# tests/python/kiln_testing/data.py -> the repository root.
REPO_ROOT = Path(__file__).resolve().parents[3]
STDLIB_TOKENIZER = {
    "kind": "local",
    "path": str(REPO_ROOT / "experiments/tokenizers/kiln-stdlib-8k"),
}

# The BOS of bos_tokenizer_folder's tokenizer (Llama 3's text).
BOS = "<|begin_of_text|>"


def bos_tokenizer_folder(folder: Path) -> Path:
    """The quickstart tokenizer with a BOS token that its post-processor puts first (so Kiln's
    rule gives its documents a BOS, as Llama 3's)."""
    shutil.copytree(STDLIB_TOKENIZER["path"], folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    bos_id = len(spec["model"]["vocab"])
    spec["added_tokens"].append(
        {"id": bos_id, "content": BOS, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
    )  # fmt: skip
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {BOS: {"id": BOS, "ids": [bos_id], "tokens": [BOS]}},
    }  # fmt: skip
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": BOS}))
    return folder


def damaged_tokenizer_folder(folder: Path) -> Path:
    """The quickstart tokenizer's folder with its tokenizer.json cut at 5,000 bytes, as a copy
    cut short leaves it."""
    folder.mkdir(parents=True)
    saved = Path(STDLIB_TOKENIZER["path"])
    shutil.copyfile(saved / "tokenizer_config.json", folder / "tokenizer_config.json")
    (folder / "tokenizer.json").write_bytes((saved / "tokenizer.json").read_bytes()[:5000])
    return folder


def make_spec(source: dict[str, Any], **config: Any) -> dict[str, Any]:
    return {
        "spec_version": 1,
        "kind": "tokenized_cache",
        "name": "tokenized/test",
        "version": "2026.11.29",
        "fingerprint": "1a2b3c4d",
        "config": {"source": source, "tokenizer": STDLIB_TOKENIZER, **config},
    }


def write_jsonl(path: Path, texts: Iterable[str], key: str = "text") -> Path:
    path.write_text(
        "".join(json.dumps({key: text, "id": i}) + "\n" for i, text in enumerate(texts))
    )
    return path


def sample_texts(count: int, seed: int = 0) -> list[str]:
    """Varied English-ish documents of 5 to 44 words."""
    words = "the cache reads each window of tokens from shards with offsets and a ledger".split()
    texts = []
    for i in range(count):
        length = 5 + (i * 7 + seed) % 40
        texts.append(" ".join(words[(i + j * 3 + seed) % len(words)] for j in range(length)) + ".")
    return texts


def write_corpus(folder: Path, seed: int = 0) -> list[str]:
    """Three jsonl files of different sizes (50, 20, 20 documents); returns all texts in order."""
    folder.mkdir(parents=True, exist_ok=True)
    texts = sample_texts(90, seed)
    write_jsonl(folder / "a.jsonl", texts[:50])
    write_jsonl(folder / "b.jsonl", texts[50:70])
    write_jsonl(folder / "c.jsonl", texts[70:])
    return texts
