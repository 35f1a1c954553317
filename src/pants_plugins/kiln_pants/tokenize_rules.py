"""Building a `tokenized_cache`: one cached Pants process per shard, then a merge process.

Each process runs `python -m kiln.data.tokenize` from the tokenize runtime PEX, whose sources are
kiln.data's closure only; so identical inputs are cache hits (locally and in a remote cache), a
changed field or tokenizer reruns, and trainer edits do not. The merged cache is the process
output: it travels through Pants' store and remote cache. (Caches too large for that — the DCLM
components — need an artifact-store mode writing straight to `{prefix}`; see docs/artifacts.md.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pants.core.util_rules.source_files import SourceFiles, SourceFilesRequest
from pants.engine.addresses import Address, Addresses
from pants.engine.fs import (
    AddPrefix,
    CreateDigest,
    Digest,
    FileContent,
    MergeDigests,
    RemovePrefix,
)
from pants.engine.process import Process, ProcessResult
from pants.engine.rules import Get, MultiGet, collect_rules, rule
from pants.engine.target import WrappedTarget, WrappedTargetRequest

from kiln_pants.artifact_graph import (
    Artifact,
    ArtifactGraph,
    ArtifactGraphRequest,
    TokenizerFiles,
    TokenizerFilesRequest,
)
from kiln_pants.artifact_store import RECORD_FILE, artifact_record
from kiln_pants.runtime import TOKENIZE, Runtime, RuntimeProcess, RuntimeRequest
from kiln_pants.target_types import (
    STDLIB_SOURCES,
    CacheSourceField,
    CacheSourcesField,
    HfRevisionField,
    HfSubsetField,
    MaxDocumentCharsField,
    NumShardsField,
    RecordFilterField,
    SplitField,
    TextKeyField,
    TokenizerField,
    tokenizer_address,
)

SPEC_VERSION = 1
SPEC_FILE = "tokenize_spec.json"
CACHE_DIR = "cache"


@dataclass(frozen=True)
class BuildCacheRequest:
    address: Address


@dataclass(frozen=True)
class BuiltCache:
    artifact: Artifact
    digest: Digest  # the cache's files, at the digest root


def _source_spec(target: Any, files: SourceFiles | None) -> dict[str, Any]:
    source = target[CacheSourceField].value
    split = target[SplitField].value
    if files is not None:
        return {"kind": "files", "paths": sorted(files.files)}
    if source in STDLIB_SOURCES:
        return {"kind": "python_stdlib", "part": source.split(":", 1)[1], "split": split}
    if source.startswith("/"):
        return {"kind": "files", "paths": [source]}
    spec: dict[str, Any] = {
        "kind": "hf",
        "id": source,
        "split": split,
        "revision": target[HfRevisionField].value,
        "subset": target[HfSubsetField].value,
    }
    if target[RecordFilterField].value:
        spec["where"] = dict(target[RecordFilterField].value)
    return spec


def _tokenizer_spec(tokenizer: str, files: TokenizerFiles | None) -> dict[str, Any]:
    if files is not None:
        return {"kind": "local", "path": files.directory}
    if tokenizer.startswith("package:"):
        return {"kind": "package", "name": tokenizer.split(":", 1)[1]}
    return {"kind": "hf", "id": tokenizer, "revision": None}


@rule(desc="Tokenizing a cache")
async def build_tokenized_cache(request: BuildCacheRequest) -> BuiltCache:
    wrapped, graph, runtime = await MultiGet(
        Get(
            WrappedTarget,
            WrappedTargetRequest(request.address, description_of_origin="<kiln cache build>"),
        ),
        Get(ArtifactGraph, ArtifactGraphRequest(Addresses([request.address]))),
        Get(Runtime, RuntimeRequest(*TOKENIZE)),
    )
    target = wrapped.target
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

    num_shards = target[NumShardsField].value
    spec = {
        "spec_version": SPEC_VERSION,
        "kind": "tokenized_cache",
        "name": artifact.name,
        "version": artifact.version,
        "fingerprint": artifact.fingerprint,
        "config": {
            "source": _source_spec(target, source_files),
            "tokenizer": _tokenizer_spec(tokenizer, tokenizer_files),
            "text_key": target[TextKeyField].value,
            "max_document_chars": target[MaxDocumentCharsField].value,
            "num_shards": num_shards,
        },
    }
    spec_digest = await Get(
        Digest, CreateDigest([FileContent(SPEC_FILE, json.dumps(spec, indent=2).encode())])
    )
    input_digest = await Get(Digest, MergeDigests([spec_digest, *inputs]))

    shard_processes = await MultiGet(
        Get(
            Process,
            RuntimeProcess(
                runtime,
                argv=("shard", SPEC_FILE, "--index", str(index), "--out", f"shard-{index}"),
                description=f"Tokenizing {artifact.ref} shard {index + 1}/{num_shards}",
                input_digest=input_digest,
                output_directories=(f"shard-{index}",),
            ),
        )
        for index in range(num_shards)
    )
    shards = await MultiGet(Get(ProcessResult, Process, p) for p in shard_processes)
    merge_input = await Get(
        Digest, MergeDigests([input_digest, *(shard.output_digest for shard in shards)])
    )
    merge_process = await Get(
        Process,
        RuntimeProcess(
            runtime,
            argv=(
                "merge",
                SPEC_FILE,
                "--shards",
                *(f"shard-{index}" for index in range(num_shards)),
                "--out",
                CACHE_DIR,
            ),
            description=f"Merging {num_shards} shard(s) of {artifact.ref}",
            input_digest=merge_input,
            output_directories=(CACHE_DIR,),
        ),
    )
    merged = await Get(ProcessResult, Process, merge_process)
    cache, record = await MultiGet(
        Get(Digest, RemovePrefix(merged.output_digest, CACHE_DIR)),
        Get(
            Digest,
            CreateDigest(
                [FileContent(RECORD_FILE, json.dumps(artifact_record(artifact, []), indent=2).encode())]
            ),
        ),
    )
    return BuiltCache(artifact, await Get(Digest, MergeDigests([cache, record])))


def cache_location(artifact: Artifact) -> str:
    """Where a built cache sits among a step's inputs: `inputs/{name}/{version}`."""
    return f"inputs/{artifact.name}/{artifact.version}"


@dataclass(frozen=True)
class CachesAsInputs:
    digest: Digest


@dataclass(frozen=True)
class CachesAsInputsRequest:
    addresses: Addresses


@rule
async def caches_as_inputs(request: CachesAsInputsRequest) -> CachesAsInputs:
    built = await MultiGet(
        Get(BuiltCache, BuildCacheRequest(address)) for address in request.addresses
    )
    placed = await MultiGet(
        Get(Digest, AddPrefix(cache.digest, cache_location(cache.artifact))) for cache in built
    )
    return CachesAsInputs(await Get(Digest, MergeDigests(placed)))


def rules():
    return collect_rules()
