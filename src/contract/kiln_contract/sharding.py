"""How a files source is cut into shards: shared by the runtime, which reads the shards
(kiln.data.sources), and the Pants backend, which plans them from the files' sizes alone.

Files are assigned to shards by size, greedily (largest first, ties by key, each to the
least-loaded shard); within a shard they are read in sorted key order. A file of at least
2 * MIN_PIECE_BYTES is first cut into up to num_shards pieces, so one big file still spreads
over the shards: an uncompressed JSONL file into byte ranges (key `path@start-end`, each owning
the lines that start inside it), a parquet file into runs of whole row groups (which only its
reader can see: `file_pieces` returns None for it). Compressed JSONL and text files stay whole.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass

MIN_PIECE_BYTES = 64 * 2**20
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst")
COMPRESSED_SUFFIXES = (".gz", ".zst")


def assign_to_shards(sizes: Mapping[str, int], num_shards: int) -> list[list[str]]:
    """Greedy size balancing: largest first (ties by key) to the least-loaded shard (ties by index)."""
    loads = [(0, shard) for shard in range(num_shards)]
    assigned: list[list[str]] = [[] for _ in range(num_shards)]
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        load, shard = heapq.heappop(loads)
        assigned[shard].append(key)
        heapq.heappush(loads, (load + sizes[key], shard))
    return [sorted(keys) for keys in assigned]


def format_of(name: str) -> str | None:
    """A file's format by its extension; None when the extension does not tell."""
    name = name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    for suffix, kind in ((".json", "json"), (".parquet", "parquet"), (".txt", "text")):
        if name.endswith(suffix):
            return kind
    return None


@dataclass(frozen=True)
class FilePiece:
    """A whole file (end None), or the lines of an uncompressed JSONL file that start in the byte
    range [start, end); `size` is what it weighs when shards are balanced."""

    path: str
    size: int
    start: int = 0
    end: int | None = None

    @property
    def key(self) -> str:  # zero-padded: a file's pieces sort in file order
        if self.end is None:
            return self.path
        return f"{self.path}@{self.start:020d}-{self.end:020d}"


def file_pieces(path: str, size: int, file_format: str, num_shards: int) -> list[FilePiece] | None:
    """The pieces of one file of a files source, as its reader cuts them; None where only the
    file's contents tell (a parquet file cut by row groups, a format the name does not tell)."""
    resolved = format_of(path) if file_format == "auto" else file_format
    count = min(num_shards, size // MIN_PIECE_BYTES)
    if resolved is None or (resolved == "parquet" and count >= 2):
        return None
    if resolved != "jsonl" or path.endswith(COMPRESSED_SUFFIXES) or count < 2:
        return [FilePiece(path, size)]
    bounds = [size * i // count for i in range(count + 1)]
    # One nominal size for every piece: ties go by key, so the pieces of a file cut into
    # num_shards land in shards 0, 1, ... in file order.
    return [FilePiece(path, size // count, start, end) for start, end in zip(bounds, bounds[1:])]


def files_plan(sizes: Mapping[str, int], num_shards: int) -> list[dict[str, int]] | None:
    """Per shard, the pieces it reads and their sizes, in read order, for files of these sizes
    (by path, format "auto"); None where one file's contents decide (see `file_pieces`)."""
    pieces: dict[str, int] = {}
    for path, size in sizes.items():
        cut = file_pieces(path, size, "auto", num_shards)
        if cut is None:
            return None
        pieces.update((piece.key, piece.size) for piece in cut)
    return [{key: pieces[key] for key in keys} for keys in assign_to_shards(pieces, num_shards)]
