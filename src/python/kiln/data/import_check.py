"""The whole-data check of an imported cache, for `python -m kiln.data.verify`.

An import's arrays are Levanter's, where Levanter wrote them: Kiln records no digest of their
terabytes (kiln.data.levanter_cache pins their ledger and metadata instead). Verifying one reads
its token data whole, in blocks: every id must be in the tokenizer's vocabulary, and each part's
rows and tokens must be what Levanter's ledger records for it. Opening the cache (TokenCache) has
already checked each part's offsets: one end per document, strictly increasing, up to the part's
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorstore as ts

from kiln.artifacts.content import Damage
from kiln.data.cache import DATA_ARRAY, ImportedSource, TokenCache
from kiln.data.levanter_cache import LEDGER_FILE, read_ledger

BLOCK_TOKENS = 1 << 22  # ids read and checked at once (32 MB of int64)
READS_IN_FLIGHT = 4


@dataclass(frozen=True)
class ImportCheck:
    location: str
    layout: str
    parts: int
    documents: int
    tokens: int
    vocab_size: int

    def describe(self) -> str:
        return (
            f"the Levanter cache at {self.location} ({self.layout}, {self.parts} part(s)): "
            f"{self.documents:,} documents, {self.tokens:,} token ids read, each in "
            f"[0, {self.vocab_size}), offsets increasing, rows and tokens as its {LEDGER_FILE}"
        )


def is_import(cache: TokenCache) -> bool:
    return cache.imported is not None


def check_import(cache: TokenCache) -> ImportCheck:
    """Reads every token of the imported shards; CacheDamaged names the first problem."""
    shards = [shard for shard in cache.ledger["shards"] if "location" in shard]
    imported = cache.imported
    assert imported is not None  # is_import(cache)
    identity = imported.identity
    ledger = read_ledger(imported.store, f"the Levanter cache at {cache.path}")
    _check_counts(cache, shards, [(p.documents, p.tokens) for p in ledger.parts])
    for shard in shards:
        _check_ids(cache, imported, shard)
    return ImportCheck(
        location=identity["location"],
        layout=cache.info["source"].get("layout", ledger.layout),
        parts=len(shards),
        documents=sum(int(shard["documents"]) for shard in shards),
        tokens=sum(int(shard["tokens"]) for shard in shards),
        vocab_size=cache.tokenizer.vocab_size,
    )


def _check_counts(
    cache: TokenCache, shards: list[dict[str, Any]], levanter: list[tuple[int, int | None]]
) -> None:
    if len(levanter) != len(shards):
        raise cache.damaged(
            None,
            Damage(
                LEDGER_FILE,
                f"lists {len(levanter)} parts with rows; the import recorded {len(shards)}",
            ),
        )
    for shard, (documents, tokens) in zip(shards, levanter):
        if documents != shard["documents"] or tokens not in (None, shard["tokens"]):
            raise cache.damaged(
                shard["name"],
                Damage(
                    LEDGER_FILE,
                    f"records {documents} rows and {tokens} tokens for it; the import read "
                    f"{shard['documents']} and {shard['tokens']}",
                ),
            )


def _check_ids(cache: TokenCache, imported: ImportedSource, shard: dict[str, Any]) -> None:
    data = ts.open(imported.array_spec(shard, DATA_ARRAY), open=True, read=True).result()
    tokens = int(shard["tokens"])
    shape = data.chunk_layout.write_chunk.shape  # the elements of one stored file
    file_elements = int(shape[0] or tokens) if shape else max(tokens, 1)
    starts = list(range(0, tokens, BLOCK_TOKENS))
    pending: list[tuple[int, ts.Future]] = []
    for start in starts:
        pending.append((start, data[start : min(start + BLOCK_TOKENS, tokens)].read()))
        if len(pending) >= READS_IN_FLIGHT:
            _check_block(cache, shard, file_elements, *pending.pop(0))
    for start, read in pending:
        _check_block(cache, shard, file_elements, start, read)


def _check_block(
    cache: TokenCache, shard: dict[str, Any], file_elements: int, start: int, read: ts.Future
) -> None:
    block = read.result()
    vocab_size = cache.tokenizer.vocab_size
    if not len(block) or (int(block.min()) >= 0 and int(block.max()) < vocab_size):
        return
    offset = int(np.argmax((block < 0) | (block >= vocab_size)))
    position = start + offset
    raise cache.damaged(
        shard["name"],
        Damage(
            f"{DATA_ARRAY}/c/{position // file_elements}",
            f"holds token id {int(block[offset])} at position {position}, not in the "
            f"tokenizer's vocabulary of {vocab_size}",
        ),
    )
