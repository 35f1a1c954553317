"""Building a `tokenized_cache`: one Pants process per shard (in parallel), then a merge process;
for a `levanter_cache(...)` source, one import process instead (nothing is tokenized); for a
store-mode cache with `[kiln] cluster` set, one process that runs the shards and the merge as Ray
tasks on the cluster (kiln.cluster.fanout, docs/clusters.md).

Each process runs `python -m kiln.data.tokenize` from the tokenize runtime PEX, whose sources are
kiln.data's closure only, so trainer edits never re-tokenize. Two storage modes (the `storage`
field):
- inline: the shards and the merged cache are process outputs; identical inputs are cache hits,
  locally and in a remote cache, and the cache travels through Pants' store.
- store: the processes write straight into `{prefix}/{name}/{version}` (shards beside it; in a
  bucket, at their final keys inside it) and are never served from Pants' cache; the store
  itself skips a finished shard or cache, so a rerun resumes where a killed build stopped. For
  data too large for Pants' store. A cache a local store holds built with this fingerprint
  starts no process at all (`built_or_tokenized_cache`). With a bucket prefix the processes get
  the bucket clients' credentials and endpoints from the caller's environment (PER_SESSION:
  never in a cache key).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional

from pants.base.build_root import BuildRoot
from pants.core.util_rules.source_files import SourceFiles, SourceFilesRequest
from pants.engine.addresses import Address, Addresses
from pants.engine.env_vars import EnvironmentVars, EnvironmentVarsRequest
from pants.engine.fs import (
    EMPTY_DIGEST,
    AddPrefix,
    CreateDigest,
    Digest,
    FileContent,
    MergeDigests,
    RemovePrefix,
)
from pants.engine.process import FallibleProcessResult, Process, ProcessCacheScope, ProcessResult
from pants.engine.rules import Get, MultiGet, collect_rules, rule
from pants.engine.target import WrappedTarget, WrappedTargetRequest
from pants.util.frozendict import FrozenDict

from kiln_contract.layout import RECORD_FILE, STATUS_FILE
from kiln_contract.tokenize import (
    CacheSpec,
    FilesSource,
    HfSource,
    LevanterCacheSource,
    Source,
    StdlibSource,
    TokenizerSpec,
    UrlFilesSource,
    shard_dir_name,
)
from kiln_pants.artifact_graph import (
    Artifact,
    ArtifactGraph,
    ArtifactGraphRequest,
    TokenizerFiles,
    TokenizerFilesRequest,
)
from kiln_pants.artifact_store import (
    STORE_ENVIRONMENT,
    StoredFiles,
    StoredFilesRequest,
    artifact_path,
    artifact_record,
    recorded_state,
)
from kiln_pants.hub_settings import HubSettingsCache
from kiln_pants.runtime import FAN_OUT, TOKENIZE, Runtime, RuntimeProcess, RuntimeRequest
from kiln_pants.subsystem import KilnSubsystem
from kiln_pants.target_types import (
    STDLIB_SOURCES,
    CacheSourceField,
    CacheSourcesField,
    CacheStorageField,
    FramingField,
    HfDataFilesField,
    HfRevisionField,
    HfSubsetField,
    MaxDocumentCharsField,
    MaxTokensField,
    NumShardsField,
    RecordFilterField,
    SplitField,
    TextKeyField,
    TokenizerField,
    tokenizer_address,
    tokenizer_directory,
)

SPEC_FILE = "tokenize_spec.json"
RECORD_INPUT = "artifact_record.json"
CACHE_DIR = "cache"
NO_CLUSTER = ("", "local")  # [kiln] cluster values that mean this machine


class CacheTokenizationFailed(Exception):
    pass


@dataclass(frozen=True)
class BuildCacheRequest:
    """A built cache: served from the artifact store when it is there already, else tokenized."""

    address: Address


@dataclass(frozen=True)
class TokenizeCacheRequest:
    """Tokenize (or import) the cache, whatever the store holds."""

    address: Address


@dataclass(frozen=True)
class BuiltCache:
    artifact: Artifact
    digest: Digest  # inline storage: the cache's files, at the digest root; else empty
    # A repo tokenizer's files at their repo paths: cache.json names that path, and evals
    # reload the tokenizer from it.
    tokenizer: Digest = EMPTY_DIGEST
    store_path: Optional[str] = None  # store storage: where the cache is, outside Pants


@dataclass(frozen=True)
class _Layout:
    """Where the shards and the cache go: sandbox-relative outputs, or store paths (absolute
    local paths, or bucket URLs)."""

    shards: tuple[str, ...]
    cache: str
    cache_scope: ProcessCacheScope
    in_store: bool = False
    root: Optional[str] = None  # a local store: the prefix every written folder must stay in

    @classmethod
    def for_storage(cls, storage: str, num_shards: int, store_path: str, prefix: str) -> _Layout:
        if storage == "inline":
            shards = tuple(f"shard-{i}" for i in range(num_shards))
            return cls(shards, CACHE_DIR, ProcessCacheScope.SUCCESSFUL)
        # The store resumes and skips by itself (a finished shard or cache is a no-op), and its
        # contents can vanish behind Pants' back: never serve these processes from a cache.
        scope = ProcessCacheScope.PER_SESSION
        if "://" in prefix:  # a bucket has no rename: shards are uploaded at their final keys
            shards = tuple(f"{store_path}/shards/{shard_dir_name(i)}" for i in range(num_shards))
            return cls(shards, store_path, scope, in_store=True)
        building = os.path.join(
            os.path.dirname(store_path), f".{os.path.basename(store_path)}.shards"
        )
        shards = tuple(os.path.join(building, f"shard-{i}") for i in range(num_shards))
        return cls(shards, store_path, scope, in_store=True, root=prefix)

    @property
    def skip(self) -> tuple[str, ...]:
        """Shards moved into a finished cache are gone: skip them when the cache is built."""
        return ("--unless-built", self.cache) if self.in_store else ()

    @property
    def confined(self) -> tuple[str, ...]:
        """Local store writes are checked (symlinks resolved) to stay in the prefix."""
        return ("--root", self.root) if self.root else ()

    def outputs(self, path: str) -> tuple[str, ...]:
        return () if self.in_store else (path,)


def _source_spec(target: Any, files: SourceFiles | None) -> Source:
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


def _tokenizer_spec(tokenizer: str, files: TokenizerFiles | None) -> TokenizerSpec:
    if files is not None:
        return TokenizerSpec("local", path=files.directory)
    if tokenizer_directory(tokenizer):
        return TokenizerSpec("local", path=tokenizer)
    if tokenizer.startswith("package:"):
        return TokenizerSpec("package", name=tokenizer.split(":", 1)[1])
    return TokenizerSpec("hf", id=tokenizer)


async def _built(
    artifact: Artifact,
    layout: _Layout,
    last: ProcessResult | FallibleProcessResult,
    tokenizer_files: Optional[TokenizerFiles],
) -> BuiltCache:
    """The cache the last process (merge, import or fan-out) finished: its output, or in the
    store."""
    tokenizer_digest = tokenizer_files.digest if tokenizer_files else EMPTY_DIGEST
    if layout.in_store:
        return BuiltCache(artifact, EMPTY_DIGEST, tokenizer_digest, store_path=layout.cache)
    cache = await Get(Digest, RemovePrefix(last.output_digest, CACHE_DIR))
    return BuiltCache(artifact, cache, tokenizer_digest)


async def _tokenize_on_cluster(
    address: Address,
    artifact: Artifact,
    layout: _Layout,
    input_digest: Digest,
    cluster: str,
    hub: HubSettingsCache,
) -> FallibleProcessResult:
    """One process for every shard and the merge, each a Ray task on the cluster; per session,
    like every store-mode process (the store resumes and skips by itself)."""
    runtime, environment = await MultiGet(
        Get(Runtime, RuntimeRequest(*FAN_OUT)),
        Get(EnvironmentVars, EnvironmentVarsRequest(("RAY_ADDRESS",))),  # for `auto`
    )
    assert layout.root is not None  # store storage
    process = await Get(
        Process,
        RuntimeProcess(
            runtime,
            argv=(
                SPEC_FILE, "--cluster", cluster, "--prefix", layout.root,
                "--shards", *layout.shards, "--out", layout.cache, "--record", RECORD_INPUT,
            ),  # fmt: skip
            description=(
                f"Tokenizing {artifact.ref}: {len(layout.shards)} shard(s) on the Ray cluster "
                f"{cluster}"
            ),
            input_digest=input_digest,
            output_directories=(),
            cache_scope=layout.cache_scope,
            env=FrozenDict(environment),
            append_only_caches=hub.append_only_caches,
        ),
    )
    result = await Get(FallibleProcessResult, Process, process)
    if result.exit_code != 0:
        lines = result.stderr.decode(errors="replace").strip().splitlines()
        why = lines[-1].removeprefix("kiln: ").removeprefix("error: ") if lines else ""
        raise CacheTokenizationFailed(
            f"{address}: {why or f'tokenizing on the cluster failed (exit {result.exit_code})'}"
        )
    return result


@rule(desc="Looking for a built cache")
async def built_or_tokenized_cache(
    request: BuildCacheRequest, kiln: KilnSubsystem, build_root: BuildRoot
) -> BuiltCache:
    """A store cache already built with this fingerprint (artifact.json, then STATUS SUCCESS) is
    served from two file reads, without starting its shard and merge processes (each would exit
    at once, hundreds for DCLM). Inline caches are Pants process outputs: its cache serves them."""
    wrapped = await Get(
        WrappedTarget,
        WrappedTargetRequest(request.address, description_of_origin="<kiln cache build>"),
    )
    target = wrapped.target
    prefix = kiln.prefix_location(build_root.path)
    if target[CacheStorageField].value == "store" and "://" not in prefix:
        graph = await Get(ArtifactGraph, ArtifactGraphRequest(Addresses([request.address])))
        artifact = graph.get(request.address)
        stored = await Get(
            StoredFiles,
            StoredFilesRequest(artifact_path(prefix, artifact), (STATUS_FILE, RECORD_FILE)),
        )
        if not artifact.mutable and recorded_state(artifact, *stored.texts).status == "built":
            tokenizer = target[TokenizerField].value
            tokenizer_files = EMPTY_DIGEST
            if tokenizer_address(tokenizer):
                files = await Get(
                    TokenizerFiles, TokenizerFilesRequest(request.address, tokenizer)
                )
                tokenizer_files = files.digest
            return BuiltCache(
                artifact, EMPTY_DIGEST, tokenizer_files, artifact_path(prefix, artifact)
            )
    return await Get(BuiltCache, TokenizeCacheRequest(request.address))


@dataclass(frozen=True)
class CacheSpecRequest:
    address: Address


@dataclass(frozen=True)
class CacheSpecInputs:
    """What every `python -m kiln.data.tokenize` process of a cache reads: its CacheSpec, written
    as SPEC_FILE beside its artifact record (RECORD_INPUT), the repo's source files and a repo
    tokenizer's files."""

    artifact: Artifact
    spec: CacheSpec
    digest: Digest
    tokenizer_files: Optional[TokenizerFiles]


@rule(desc="Assembling a cache's tokenize spec")
async def cache_spec_inputs(request: CacheSpecRequest) -> CacheSpecInputs:
    wrapped, graph = await MultiGet(
        Get(
            WrappedTarget,
            WrappedTargetRequest(request.address, description_of_origin="<kiln cache build>"),
        ),
        Get(ArtifactGraph, ArtifactGraphRequest(Addresses([request.address]))),
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

    spec = CacheSpec(
        name=artifact.name,
        version=artifact.version,
        fingerprint=artifact.fingerprint,
        source=_source_spec(target, source_files),
        tokenizer=_tokenizer_spec(tokenizer, tokenizer_files),
        text_key=target[TextKeyField].value,
        max_document_chars=target[MaxDocumentCharsField].value,
        num_shards=target[NumShardsField].value,
        max_tokens=target[MaxTokensField].value,
        framing=target[FramingField].value,
    )
    spec_digest = await Get(
        Digest,
        CreateDigest(
            [
                FileContent(SPEC_FILE, json.dumps(spec.to_json(), indent=2).encode()),
                FileContent(
                    RECORD_INPUT,
                    json.dumps(artifact_record(artifact, []).to_json(), indent=2).encode(),
                ),
            ]
        ),
    )
    digest = await Get(Digest, MergeDigests([spec_digest, *inputs]))
    return CacheSpecInputs(artifact, spec, digest, tokenizer_files)


@rule(desc="Tokenizing a cache")
async def build_tokenized_cache(
    request: TokenizeCacheRequest,
    kiln: KilnSubsystem,
    build_root: BuildRoot,
    hub: HubSettingsCache,
) -> BuiltCache:
    wrapped, inputs = await MultiGet(
        Get(
            WrappedTarget,
            WrappedTargetRequest(request.address, description_of_origin="<kiln cache build>"),
        ),
        Get(CacheSpecInputs, CacheSpecRequest(request.address)),
    )
    artifact, spec, input_digest = inputs.artifact, inputs.spec, inputs.digest
    tokenizer_files, num_shards = inputs.tokenizer_files, inputs.spec.num_shards
    storage = wrapped.target[CacheStorageField].value
    prefix = kiln.prefix_location(build_root.path)
    store_path = artifact_path(prefix, artifact)
    layout = _Layout.for_storage(storage, num_shards, store_path, prefix)
    # An imported cache is read in place: nothing to fan out.
    if (
        storage == "store"
        and kiln.cluster not in NO_CLUSTER
        and not isinstance(spec.source, LevanterCacheSource)
    ):
        if "://" in prefix:
            raise CacheTokenizationFailed(
                f"{request.address}: [kiln] cluster = {kiln.cluster!r} fans shards out into a "
                f"local artifact store, and the prefix is the bucket {prefix}; unset "
                "`[kiln] cluster` (`--kiln-cluster=local`) to tokenize here into the bucket."
            )
        fanned_out = await _tokenize_on_cluster(
            request.address, artifact, layout, input_digest, kiln.cluster, hub
        )
        return await _built(artifact, layout, fanned_out, tokenizer_files)
    env = FrozenDict[str, str]()
    if layout.in_store and "://" in prefix:  # the processes reach the bucket themselves
        env = FrozenDict(await Get(EnvironmentVars, EnvironmentVarsRequest(STORE_ENVIRONMENT)))
    runtime = await Get(Runtime, RuntimeRequest(*TOKENIZE))
    if isinstance(spec.source, LevanterCacheSource):
        import_process = await Get(
            Process,
            RuntimeProcess(
                runtime,
                argv=(
                    "import", SPEC_FILE, "--out", layout.cache, "--record", RECORD_INPUT,
                    *layout.confined,
                ),  # fmt: skip
                description=f"Importing the Levanter cache {spec.source.location} as {artifact.ref}",
                input_digest=input_digest,
                output_directories=layout.outputs(layout.cache),
                cache_scope=layout.cache_scope,
                env=env,
                append_only_caches=hub.append_only_caches,
            ),
        )
        imported = await Get(ProcessResult, Process, import_process)
        return await _built(artifact, layout, imported, tokenizer_files)

    shard_processes = await MultiGet(
        Get(
            Process,
            RuntimeProcess(
                runtime,
                argv=(
                    "shard", SPEC_FILE, "--index", str(index), "--out", shard,
                    *layout.skip, *layout.confined,
                ),  # fmt: skip
                description=f"Tokenizing {artifact.ref} shard {index + 1}/{num_shards}",
                input_digest=input_digest,
                output_directories=layout.outputs(shard),
                cache_scope=layout.cache_scope,
                env=env,
                append_only_caches=hub.append_only_caches,
            ),
        )
        for index, shard in enumerate(layout.shards)
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
                *layout.shards,
                "--out",
                layout.cache,
                "--record",
                RECORD_INPUT,
                *layout.confined,
            ),
            description=f"Merging {num_shards} shard(s) of {artifact.ref}",
            input_digest=merge_input,
            output_directories=layout.outputs(layout.cache),
            cache_scope=layout.cache_scope,
            env=env,
            append_only_caches=hub.append_only_caches,
        ),
    )
    merged = await Get(ProcessResult, Process, merge_process)
    return await _built(artifact, layout, merged, tokenizer_files)


def cache_location(artifact: Artifact) -> str:
    """Where a built cache sits among a step's inputs: `inputs/{name}/{version}`."""
    return f"inputs/{artifact.name}/{artifact.version}"


@dataclass(frozen=True)
class CachesAsInputs:
    """Built caches as a step's inputs: the inline ones under their cache_location, with their
    tokenizers' files. Store caches are in the artifact store already, at artifact_path."""

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
        Get(Digest, AddPrefix(cache.digest, cache_location(cache.artifact)))
        for cache in built
        if cache.store_path is None
    )
    tokenizers = [cache.tokenizer for cache in built]
    return CachesAsInputs(await Get(Digest, MergeDigests([*placed, *tokenizers])))


def rules():
    return collect_rules()
