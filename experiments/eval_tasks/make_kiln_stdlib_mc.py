"""Writes kiln_stdlib_mc.jsonl: a four-way sentence-completion task on held-out stdlib prose.

    ./pants run experiments/eval_tasks/make_kiln_stdlib_mc.py

Each document is a first sentence of a docstring or pydoc topic in the quickstart corpus's
*validation* split (kiln.data.stdlib_corpus: the run never trains on it), cut after its first
half: the query is that half, the gold choice its true ending, and the other three choices the
endings of other sentences of about the same length, so a model must know the prose to beat
chance (one in four), and no choice gives itself away by its length. The task is derived from
CPython 3.12's standard library with a fixed seed; the committed file is what the quickstart
scores.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from kiln.data.stdlib_corpus import documents, units

OUT = Path(__file__).with_name("kiln_stdlib_mc.jsonl")
SEED = 20261202
CHOICES = 4
MIN_WORDS, MAX_WORDS = 8, 32
SENTENCE_END = re.compile(r"(?<=[.!?])\s")


def first_sentences() -> list[list[str]]:
    """The words of each usable first sentence of the validation split, in corpus order."""
    found = []
    for unit in units("all"):
        for document in documents(unit.key, "validation"):
            text = " ".join(document.text.split())
            sentence = SENTENCE_END.split(text, maxsplit=1)[0]
            words = sentence.split()
            if MIN_WORDS <= len(words) <= MAX_WORDS and sentence.endswith("."):
                found.append(words)
    return found


def items(sentences: list[list[str]], rng: random.Random) -> list[dict[str, object]]:
    cut = [(words[: len(words) // 2], words[len(words) // 2 :]) for words in sentences]
    tasks = []
    for index, (query, ending) in enumerate(cut):
        others = [e for i, (_, e) in enumerate(cut) if i != index and e != ending]
        others.sort(key=lambda e: (abs(len(e) - len(ending)), rng.random()))
        choices = [" ".join(ending), *(" ".join(e) for e in others[: CHOICES - 1])]
        rng.shuffle(choices)
        tasks.append({"query": " ".join(query), "choices": choices,
                      "gold": choices.index(" ".join(ending))})  # fmt: skip
    return tasks


def main() -> None:
    rng = random.Random(SEED)
    tasks = items(first_sentences(), rng)
    OUT.write_text("".join(json.dumps(task) + "\n" for task in tasks))
    print(f"wrote {len(tasks)} items to {OUT}")


if __name__ == "__main__":
    main()
