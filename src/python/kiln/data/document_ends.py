"""Where each document of a shard starts and ends, as a reader of its windows needs them.

A shard's offsets array (the jagged layout of Levanter and Marin) holds the document count at
[0] and the end of document i at [1 + i]. Read as F, with F[0] = 0, F[j] is where document j
starts and F[D] is the shard's token count.

Format 4 writes the offsets in chunks of `stride` entries and, beside them, the index
`offsets_index.npy`: F[k * stride] for every chunk k. A window of tokens [a, b) finds the chunks
holding its documents' starts in the index and reads only those: opening a cache and reading a
window cost the same at 10^4 documents as at 10^9 (`IndexedEnds`). Caches of formats 1-3 and
imported Levanter caches have no index: their offsets are loaded whole when the cache is opened
(`LoadedEnds`, 8 bytes a document).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import tensorstore as ts

OFFSETS_STRIDE = 1024  # entries per offsets chunk, and between two entries of the index
OFFSETS_INDEX_FILE = "offsets_index.npy"

Damaged = Callable[[str], Exception]  # the error for offsets that are not what they should be
Wait = Callable[[ts.Future], np.ndarray]  # a read's result, its failure as the cache's error


def offsets_index(offsets: np.ndarray, stride: int) -> np.ndarray:
    """The index of a shard's offsets array (count first): F[k * stride] for every chunk k."""
    starts = np.asarray(offsets, np.uint64).copy()
    starts[:1] = 0
    return starts[::stride]


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


Locate = Callable[[np.ndarray], np.ndarray]  # ascending local token positions -> their documents


class DocumentEnds(Protocol):
    """One shard's document boundaries, in shard-local token positions."""

    def locate(self, low: int, high: int) -> Locate:
        """Issues what finding the documents of positions in [low, high] reads; the call
        returned waits for it and maps such positions to their documents."""
        ...

    def bounds(self, document: int) -> tuple[int, int]:
        """[start, end) of one document."""
        ...


class LoadedEnds:
    """Every document's end, in memory."""

    def __init__(self, ends: np.ndarray) -> None:
        self.ends = ends  # int64 [documents]

    def locate(self, low: int, high: int) -> Locate:
        return lambda positions: np.searchsorted(self.ends, positions, side="right")

    def bounds(self, document: int) -> tuple[int, int]:
        start = int(self.ends[document - 1]) if document else 0
        return start, int(self.ends[document])


class IndexedEnds:
    """Document boundaries read by the chunk from the offsets array, found through its index.
    Each chunk read is checked against the index (and to increase strictly), so damaged offsets
    are refused where they are read, as the open checks them for a loaded shard."""

    def __init__(
        self,
        offsets: ts.TensorStore,
        index: np.ndarray,
        stride: int,
        documents: int,
        wait: Wait,
        damaged: Damaged,
    ) -> None:
        self._offsets = offsets
        self._index = index.astype(np.int64)
        self._stride = stride
        self._documents = documents
        self._wait = wait
        self._damaged = damaged

    def locate(self, low: int, high: int) -> Locate:
        """The starts from the chunk whose first start is at or below `low` to the last chunk
        whose first start is at or below `high`: whole chunks, one read."""
        first_chunk = max(int(np.searchsorted(self._index, low, side="right")) - 1, 0)
        end_chunk = int(np.searchsorted(self._index, high, side="right"))
        j0 = first_chunk * self._stride
        read = self._offsets[j0 : min(end_chunk * self._stride, self._documents + 1)].read()
        return lambda positions: (
            j0 + np.searchsorted(self._starts(j0, read), positions, side="right") - 1
        )

    def bounds(self, document: int) -> tuple[int, int]:
        start, end = self._starts(document, self._offsets[document : document + 2].read())
        return int(start), int(end)

    def _starts(self, j0: int, read: ts.Future) -> np.ndarray:
        """F[j0:...] as `read` gives it, checked against the index entries it holds."""
        starts = self._wait(read).astype(np.int64)
        j1 = j0 + len(starts)
        if j0 == 0:
            starts[:1] = 0
        chunks = np.arange(-(-j0 // self._stride), -(-j1 // self._stride))
        indexed = starts[chunks * self._stride - j0]
        if np.any(np.diff(starts) <= 0) or not np.array_equal(indexed, self._index[chunks]):
            raise self._damaged(
                f"entries {j0}..{j1 - 1} are not strictly increasing or disagree with "
                f"{OFFSETS_INDEX_FILE}"
            )
        return starts


def read_ends(
    offsets: ts.TensorStore,
    record: dict[str, Any],
    index: bytes | None,
    wait: Wait,
    damaged: Damaged,
) -> Callable[[], DocumentEnds]:
    """Issues the reads that opening one shard (its ledger `record`) takes: the whole offsets
    array without an index (`index` None), else the count and the last end; the call returned
    waits for them and checks them against the ledger."""
    documents, tokens = int(record["documents"]), int(record["tokens"])
    if index is None:  # not the array's unused tail: Levanter's arrays are 2**54 long
        whole = offsets[: min(documents + 1, offsets.shape[0])].read()
        return lambda: LoadedEnds(_checked_whole(wait(whole), documents, tokens, damaged))
    stride = int(record["offsets_stride"])
    count, last = offsets[0:1].read(), offsets[documents : documents + 1].read()

    def checked() -> DocumentEnds:
        starts = np.load(io.BytesIO(index), allow_pickle=False).astype(np.int64)
        found = (int(wait(count)[0]), int(wait(last)[0]) if documents else 0)
        chunks = -(-(documents + 1) // stride)
        if found != (documents, tokens) or len(starts) != chunks or starts[:1].tolist() != [0]:
            raise damaged(f"hold a count of {found[0]} and a last end of {found[1]}")
        if np.any(np.diff(starts) <= 0):
            raise damaged(f"have an index ({OFFSETS_INDEX_FILE}) that is not increasing")
        return IndexedEnds(offsets, starts, stride, documents, wait, damaged)

    return checked


def _checked_whole(offsets: np.ndarray, documents: int, tokens: int, damaged: Damaged) -> np.ndarray:
    """A shard's document ends (local), after checking them against the ledger."""
    ends = offsets[1:].astype(np.int64)
    if len(offsets) != documents + 1 or int(offsets[0]) != documents:
        count = int(offsets[0]) if len(offsets) else None
        raise damaged(f"hold {len(offsets) - 1} document ends and a count of {count}")
    if documents and (np.any(np.diff(ends, prepend=0) <= 0) or ends[-1] != tokens):
        raise damaged("are not strictly increasing up to the shard's token count")
    return ends
