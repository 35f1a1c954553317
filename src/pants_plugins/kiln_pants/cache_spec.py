"""What every `python -m kiln.data.tokenize` process of a cache reads: its CacheSpec (the
contract's JSON, kiln_contract.tokenize), its artifact record, and the repo files it needs (the
source files and a repo tokenizer's files)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from pants.core.util_rules.source_files import SourceFiles, SourceFilesRequest
from pants.engine.addresses import Address
from pants.engine.fs import (
    EMPTY_DIGEST,
    CreateDigest,
    Digest,
    DigestEntries,
    FileContent,
    FileEntry,
    MergeDigests,
)
from pants.engine.rules import Get, MultiGet, collect_rules, rule
from pants.engine.target import WrappedTarget, WrappedTargetRequest
from pants.util.frozendict import FrozenDict

from kiln_contract.tokenize import (
    CacheSpec,
    FilesSource,
    HfSource,
    LevanterCacheSource,
    Source,
    StdlibSource,
    TokenizerSpec,
    UrlFilesSource,
)
from kiln_pants.artifact_graph import (
    Artifact,
    TokenizerFiles,
    TokenizerFilesRequest,
    target_and_graph,
)
from kiln_pants.artifact_store import RECORD_INPUT, artifact_record
from kiln_pants.target_types import (
    STDLIB_SOURCES,
    CacheSourceField,
    CacheSourcesField,
    FramingField,
    HfDataFilesField,
    HfRevisionField,
    HfSubsetField,
    MaxDocumentCharsField,
    MaxTokensField,
    NumShardsField,
    RecordFilterField,
    SplitField,
    TokenizerField,
    document_format,
    tokenizer_address,
    tokenizer_directory,
)

SPEC_FILE = "tokenize_spec.json"


@dataclass(frozen=True)
class CacheSpecRequest:
    address: Address


@dataclass(frozen=True)
class CacheSpecInputs:
    """A cache's CacheSpec, written as SPEC_FILE beside its artifact record (RECORD_INPUT) in
    `spec_digest`; the repo's source files and a repo tokenizer's files in `files`; both merged
    in `digest`, the input of each of its processes."""

    artifact: Artifact
    spec: CacheSpec
    spec_digest: Digest
    files: Digest
    digest: Digest
    tokenizer_files: Optional[TokenizerFiles]

    @property
    def tokenizer_digest(self) -> Digest:
        return self.tokenizer_files.digest if self.tokenizer_files else EMPTY_DIGEST


def source_spec(target: Any, files: Optional[SourceFiles]) -> Source:
    source = target[CacheSourceField].value
    split = target[SplitField].value
    if files is not None:
        return FilesSource(tuple(sorted(files.files)))
    if isinstance(source, (LevanterCacheSource, UrlFilesSource)):
        return source
    if source in STDLIB_SOURCES:
        return StdlibSource(part=source.split(":", 1)[1], split=split)
    if source.startswith("/"):
        return FilesSource((source,))
    return HfSource(
        id=source,
        split=split,
        revision=target[HfRevisionField].value,
        subset=target[HfSubsetField].value,
        data_files=tuple(target[HfDataFilesField].value or ()),
        where=tuple(sorted((target[RecordFilterField].value or {}).items())),
    )


def _tokenizer_spec(tokenizer: str, files: Optional[TokenizerFiles]) -> TokenizerSpec:
    if files is not None:
        return TokenizerSpec("local", path=files.directory)
    if tokenizer_directory(tokenizer):
        return TokenizerSpec("local", path=tokenizer)
    if tokenizer.startswith("package:"):
        return TokenizerSpec("package", name=tokenizer.split(":", 1)[1])
    return TokenizerSpec("hf", id=tokenizer)


@rule(desc="Assembling a cache's tokenize spec")
async def cache_spec_inputs(request: CacheSpecRequest) -> CacheSpecInputs:
    target, graph = await target_and_graph(request.address, "<kiln cache build>")
    artifact = graph.get(request.address)
    inputs = []
    source_files = None
    if target[CacheSourcesField].value:
        source_files = await Get(SourceFiles, SourceFilesRequest([target[CacheSourcesField]]))
        inputs.append(source_files.snapshot.digest)
    tokenizer = target[TokenizerField].value
    tokenizer_files = None
    if tokenizer_address(tokenizer):
        tokenizer_files = await Get(
            TokenizerFiles, TokenizerFilesRequest(request.address, tokenizer)
        )
        inputs.append(tokenizer_files.digest)
    spec = CacheSpec(
        name=artifact.name,
        version=artifact.version,
        fingerprint=artifact.fingerprint,
        source=source_spec(target, source_files),
        tokenizer=_tokenizer_spec(tokenizer, tokenizer_files),
        max_document_chars=target[MaxDocumentCharsField].value,
        num_shards=target[NumShardsField].value,
        max_tokens=target[MaxTokensField].value,
        framing=target[FramingField].value,
        **document_format(target),
    )
    record = artifact_record(artifact, []).to_json()
    spec_digest, files = await MultiGet(
        Get(
            Digest,
            CreateDigest(
                [
                    FileContent(SPEC_FILE, json.dumps(spec.to_json(), indent=2).encode()),
                    FileContent(RECORD_INPUT, json.dumps(record, indent=2).encode()),
                ]
            ),
        ),
        Get(Digest, MergeDigests(inputs)),
    )
    digest = await Get(Digest, MergeDigests([spec_digest, files]))
    return CacheSpecInputs(artifact, spec, spec_digest, files, digest, tokenizer_files)


@dataclass(frozen=True)
class RepoFileSizesRequest:
    address: Address


@dataclass(frozen=True)
class RepoFileSizes:
    """A cache's repository files (its `sources` field) and their bytes, from Pants' digests;
    empty for a cache of another source."""

    sizes: FrozenDict[str, int]


@rule(desc="Sizing a cache's repository files")
async def repo_file_sizes(request: RepoFileSizesRequest) -> RepoFileSizes:
    wrapped = await Get(
        WrappedTarget, WrappedTargetRequest(request.address, description_of_origin="<kiln cache>")
    )
    field = wrapped.target[CacheSourcesField]
    if not field.value:
        return RepoFileSizes(FrozenDict())
    files = await Get(SourceFiles, SourceFilesRequest([field]))
    entries = await Get(DigestEntries, Digest, files.snapshot.digest)
    return RepoFileSizes(
        FrozenDict(
            (entry.path, entry.file_digest.serialized_bytes_length)
            for entry in entries
            if isinstance(entry, FileEntry)
        )
    )


def rules():
    return collect_rules()
