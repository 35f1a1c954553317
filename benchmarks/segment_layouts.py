"""Segment layouts for the benchmarks: the segment ids a batch carries, as in training.

    none   no segment ids (the attention-only problem: nothing to compare)
    ones   segment ids all 1: one document per row, the ids still compared everywhere
    docs   documents packed as the trainer packs them: the quickstart corpus's documents (the
           standard library's docstrings and pydoc topics, tokenized by the committed
           kiln-stdlib-8k tokenizer, EOS included) back to back in corpus order, cut into
           windows of seq_len; a batch takes whole windows at random, and segment ids number
           the documents of each window from 0, as kiln.data.cache's reader does

The docs layout reads the documents' token lengths from a committed table
(stdlib_document_lengths.json), so a benchmark needs neither the tokenizer nor this Python's
standard library. Regenerate the table (its header records the Python version) with

    PYTHONPATH=src/python:src/contract python3 benchmarks/segment_layouts.py --write
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import numpy as np

LAYOUTS = ("none", "ones", "docs")
TABLE = Path(__file__).with_name("stdlib_document_lengths.json")
TOKENIZER = Path(__file__).parents[1] / "experiments" / "tokenizers" / "kiln-stdlib-8k"


def segment_ids(layout: str, batch: int, seq_len: int, seed: int = 0) -> np.ndarray | None:
    """int32 [batch, seq_len] segment ids of a layout (LAYOUTS), or None for "none"."""
    if layout == "none":
        return None
    if layout == "ones":
        return np.ones((batch, seq_len), np.int32)
    if layout == "docs":
        return packed_windows(document_lengths(), batch, seq_len, np.random.default_rng(seed))
    raise ValueError(f"segment layout must be one of {LAYOUTS}, got {layout!r}")


def packed_windows(
    lengths: np.ndarray, batch: int, seq_len: int, rng: np.random.Generator
) -> np.ndarray:
    """Segment ids of `batch` whole windows of seq_len tokens, taken at random from documents of
    these lengths packed back to back (with replacement when there are fewer windows)."""
    ends = np.cumsum(lengths)
    num_windows = int(ends[-1]) // seq_len
    if num_windows == 0:
        raise ValueError(f"the documents hold {int(ends[-1])} tokens: no window of {seq_len}")
    windows = rng.choice(num_windows, size=batch, replace=batch > num_windows)
    positions = windows[:, None] * seq_len + np.arange(seq_len)[None, :]
    documents = np.searchsorted(ends, positions, side="right")  # which document holds a token
    return (documents - documents[:, :1]).astype(np.int32)


def describe(segment_ids: np.ndarray | None) -> str:
    """One line about a layout: documents per row and their lengths within the windows."""
    if segment_ids is None:
        return "no segment ids"
    batch, seq_len = segment_ids.shape
    starts = np.ones((batch, seq_len), bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    per_row = starts.sum(axis=1)
    flat_starts = np.flatnonzero(starts.ravel())
    pieces = np.diff(np.append(flat_starts, batch * seq_len))  # rows end where the next begins
    return (
        f"{per_row.min()}-{per_row.max()} documents per row (mean {per_row.mean():.1f}), "
        f"median piece {int(np.median(pieces))} tokens"
    )


@functools.cache
def document_lengths() -> np.ndarray:
    """The quickstart corpus's document lengths in tokens, in corpus order (the committed table)."""
    return np.asarray(json.loads(TABLE.read_text())["lengths"], np.int64)


def write_table(path: Path = TABLE) -> dict:
    """Tokenizes the quickstart corpus (training split) and writes its document lengths."""
    from kiln.data import stdlib_corpus
    from kiln.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer({"kind": "local", "path": str(TOKENIZER)})
    lengths: list[int] = []
    for unit in stdlib_corpus.units("all"):
        texts = [doc.text for doc in stdlib_corpus.documents(unit.key, "train")]
        if texts:
            lengths += tokenizer.encode_documents(texts).lengths.tolist()
    table = {
        "source": "stdlib:all, split train (the quickstart's training corpus), corpus order",
        "tokenizer": "experiments/tokenizers/kiln-stdlib-8k (EOS appended per document)",
        "python_version": stdlib_corpus.provenance()["python_version"],
        "documents": len(lengths),
        "tokens": sum(lengths),
        "lengths": lengths,
    }
    path.write_text(json.dumps(table, separators=(",", ":")) + "\n")
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"regenerate {TABLE.name}")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8)
    options = parser.parse_args(argv)
    if options.write:
        table = write_table()
        print(f"wrote {TABLE}: {table['documents']} documents, {table['tokens']} tokens")
    for layout in LAYOUTS:
        ids = segment_ids(layout, options.batch, options.seq_len)
        print(f"{layout:>5}: {describe(ids)}")


if __name__ == "__main__":
    main()
