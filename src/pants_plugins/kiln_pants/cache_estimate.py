"""What building an unbuilt cache will take: tokens, bytes and CPU-hours, before it runs.

Tokens: `max_tokens` when the cache is bounded; else, for uncompressed local files, their size
over the bytes per token of a byte-level BPE on English text; else unknown (a hub or URL source
is sized when it is read). Bytes: as the cache stores its ids, before compression: 2 per token
(uint16) for a vocabulary of at most 65,536 ids, else 4 (uint32, as for Llama 3's); 4 when the
vocabulary is not known before the build. CPU-hours: tokens over the measured pipeline
throughput of one core; wall time: those hours over the shard processes that run at once (its
shards, up to Pants' local process parallelism), process starts not included.

An import (a `levanter_cache` source) tokenizes nothing: it reads the other cache's ledger and
the ids at its parts' starts, and writes Kiln's records; its tokens stay where they are, in the
type that cache stores them in.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Any, Optional

from kiln_pants.artifact_graph import Artifact

# benchmarks/RESULTS.md, "Tokenization at scale": the shard processes' tokens per CPU-second with
# GPT-2's byte-level BPE on 1 GB of jsonl.zst, 527k-786k in 1, 2 and 4 shards (2026-12-01).
TOKENS_PER_CORE_SECOND = 500_000
# GPT-2's BPE on the stdlib corpus's English: 1.8 MB/s at 0.54M tokens/s (ENVIRONMENT.md).
TEXT_BYTES_PER_TOKEN = 3.3
UINT16_VOCABULARY = 1 << 16  # kiln.data.tokenizer.TokenizerInfo.token_dtype: uint16 up to this
COMPRESSED_SUFFIXES = (".gz", ".zst", ".parquet")


def count(tokens: float) -> str:
    """Tokens as people read them: 102.40k, 28.80B."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if tokens >= size:
            return f"{tokens / size:.2f}{unit}"
    return f"{tokens:.0f}"


def duration(hours: float) -> str:
    """Hours as people read them: 2.5 days, 1.3 h, 12 min, 0.35 s, under 0.01 s."""
    for unit, size in (("days", 24.0), ("h", 1.0), ("min", 1 / 60)):
        if hours >= size:
            return f"{hours / size:.3g} {unit}"
    return f"{hours * 3600:.2g} s" if hours * 3600 >= 0.01 else "under 0.01 s"


@dataclass(frozen=True)
class CacheEstimate:
    tokens: Optional[int]
    basis: str  # where the token count comes from
    vocabulary: Optional[int] = None  # the tokenizer's size: it decides how the ids are stored
    processes: int = 1  # shard processes at once: its shards, up to Pants' local parallelism
    imported_from: Optional[str] = None  # an import: where its tokens are read, in place
    imported_dtype: Optional[str] = None  # an import: how that cache stores its ids

    @property
    def imports(self) -> bool:
        return self.imported_from is not None

    @property
    def dtype(self) -> tuple[str, int]:
        """The ids' type and bytes per token."""
        small = self.vocabulary is not None and self.vocabulary <= UINT16_VOCABULARY
        return ("uint16", 2) if small else ("uint32", 4)

    @property
    def cpu_hours(self) -> Optional[float]:
        if self.imports:
            return 0.0  # nothing is tokenized
        return None if self.tokens is None else self.tokens / TOKENS_PER_CORE_SECOND / 3600

    @property
    def wall_hours(self) -> Optional[float]:
        return None if self.cpu_hours is None else self.cpu_hours / self.processes

    def describe(self) -> str:
        if self.imports:
            tokens = "tokens not recorded" if self.tokens is None else f"{count(self.tokens)} tokens"
            stored = f"{self.imported_dtype} ids" if self.imported_dtype else "ids"
            return (
                f"import: reads {tokens} in place at {self.imported_from} ({stored}, as that "
                "cache stores them); tokenizes nothing: checks its ledger and the ids at its "
                "parts' starts, writes only Kiln's records (seconds)"
            )
        cpu_hours, wall_hours = self.cpu_hours, self.wall_hours
        if self.tokens is None or cpu_hours is None or wall_hours is None:
            return f"estimate: tokens unknown ({self.basis})"
        dtype, width = self.dtype
        return (
            f"estimate: {count(self.tokens)} tokens ({self.basis}), "
            f"{self.tokens * width / 1e9:.2f} GB as {dtype}, "
            f"{cpu_hours:.1f} CPU-hours at {TOKENS_PER_CORE_SECOND // 1000}k tokens/s per "
            f"core; wall ~ {duration(wall_hours)} tokenizing, {self.processes} shard "
            "process(es) at once"
        )

    def to_json(self) -> dict[str, Any]:
        """What `describe` says, as data (`plan --plan-json`); None where it is not known."""
        dtype, width = self.dtype
        if self.imports:  # read in place: nothing written but records
            dtype, width = self.imported_dtype or "unknown", 0
        return {
            "tokens": self.tokens,
            "basis": self.basis,
            "imported_from": self.imported_from,
            "dtype": dtype,
            "bytes": None if self.tokens is None else self.tokens * width,
            "cpu_hours": self.cpu_hours,
            "wall_hours": self.wall_hours,
            "processes_at_once": self.processes,
        }


def estimate_cache(artifact: Artifact, build_root: str) -> CacheEstimate:
    identity = artifact.identity
    if identity.get("max_tokens") is not None:
        return CacheEstimate(identity["max_tokens"], "max_tokens")
    source = identity["source"]
    sizes = _local_file_sizes(source, build_root)
    if sizes is None:
        return CacheEstimate(None, f"a {source['kind']} source is sized when it is read")
    if any(path.endswith(COMPRESSED_SUFFIXES) for path in sizes):
        return CacheEstimate(None, "compressed files: their text is sized when it is read")
    text_bytes = sum(sizes.values())
    return CacheEstimate(
        round(text_bytes / TEXT_BYTES_PER_TOKEN),
        f"{text_bytes / 1e6:.1f} MB of text / {TEXT_BYTES_PER_TOKEN} bytes per token",
    )


def most_tokens(artifact: Artifact, build_root: str) -> Optional[int]:
    """The most tokens an unbuilt cache of uncompressed local files can hold: their bytes (a
    byte-level BPE's token covers at least a byte, and a document's JSON or line framing takes
    more bytes than the tokens that mark its ends); None where the files do not tell."""
    sizes = _local_file_sizes(artifact.identity["source"], build_root)
    if sizes is None or any(path.endswith(COMPRESSED_SUFFIXES) for path in sizes):
        return None
    return sum(sizes.values())


def _local_file_sizes(source: dict[str, Any], build_root: str) -> Optional[dict[str, int]]:
    """Bytes of each file of a local files source (repo files, or absolute paths and globs)."""
    if source["kind"] != "files":
        return None
    if "files" in source:  # files in the repository, by repo-relative path
        paths = [os.path.join(build_root, path) for path in source["files"]]
    else:
        paths = [match for pattern in source["paths"] for match in glob.glob(pattern)]
    try:
        return {path: os.path.getsize(path) for path in paths}
    except OSError:
        return None  # gone since the BUILD file was read: the build will say so
