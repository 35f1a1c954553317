"""Train the quickstart's byte-level BPE on the Python stdlib corpus (train split).

    python -m kiln.data.train_tokenizer OUT_DIR --vocab-size 8192

GPT-2's 50k vocabulary makes the CPU quickstart's embedding and softmax dominate; 8k tokens trained
on the same text the quickstart learns from keep the model small. The folder holds tokenizer.json and
tokenizer_config.json (naming `<|endoftext|>` as EOS), loadable as {"kind": "local", "path": OUT_DIR}.
The committed experiments/tokenizers/kiln-stdlib-8k was made by this script.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Iterator
from pathlib import Path

from kiln.artifacts.atomic import atomic_write_text
from kiln.data import stdlib_corpus
from kiln_contract.vocabulary import STDLIB_PARTS

EOS_TOKEN = "<|endoftext|>"


def train_tokenizer(out_dir: Path, vocab_size: int, part: str = "all") -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte stays encodable
        show_progress=False,
    )
    tokenizer.train_from_iterator(_train_texts(part), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN)
    wrapped.save_pretrained(str(out_dir))
    atomic_write_text(
        out_dir / "README.md",
        f"Byte-level BPE, vocab {vocab_size}, EOS `{EOS_TOKEN}`; made by "
        f"`python -m kiln.data.train_tokenizer {out_dir} --vocab-size {vocab_size} --part {part}` "
        f"on the stdlib corpus ({part}, train split) of CPython {platform.python_version()}.\n",
    )
    return out_dir


def _train_texts(part: str) -> Iterator[str]:
    for unit in stdlib_corpus.units(part):
        for document in stdlib_corpus.documents(unit.key, "train"):
            yield document.text


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    parser = argparse.ArgumentParser(
        prog="python -m kiln.data.train_tokenizer", description=__doc__
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--part", choices=STDLIB_PARTS, default="all")
    args = parser.parse_args(argv)
    train_tokenizer(args.out_dir, args.vocab_size, args.part)
    print(f"tokenizer written to {args.out_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
