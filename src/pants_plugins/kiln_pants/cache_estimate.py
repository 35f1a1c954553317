"""What building an unbuilt cache will take: tokens, bytes and CPU-hours, before it runs.

Tokens: `max_tokens` when the cache is bounded; else, for uncompressed local files, their size
over the bytes per token of a byte-level BPE on English text; else unknown (a hub or URL source
is sized when it is read). Bytes: as the cache stores its ids, before compression: 2 per token
(uint16) for a vocabulary of at most 65,536 ids, else 4 (uint32, as for Llama 3's); 4 when the
vocabulary is not known before the build. CPU-hours: tokens over the measured pipeline
throughput of one core.
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


@dataclass(frozen=True)
class CacheEstimate:
    tokens: Optional[int]
    basis: str  # where the token count comes from

    def describe(self, vocabulary: Optional[int] = None) -> str:
        """`vocabulary`: the tokenizer's size, which decides how the ids are stored."""
        if self.tokens is None:
            return f"estimate: tokens unknown ({self.basis})"
        hours = self.tokens / TOKENS_PER_CORE_SECOND / 3600
        small = vocabulary is not None and vocabulary <= UINT16_VOCABULARY
        dtype, width = ("uint16", 2) if small else ("uint32", 4)
        return (
            f"estimate: {count(self.tokens)} tokens ({self.basis}), "
            f"{self.tokens * width / 1e9:.2f} GB as {dtype}, "
            f"{hours:.1f} CPU-hours at {TOKENS_PER_CORE_SECOND // 1000}k tokens/s per core"
        )


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
