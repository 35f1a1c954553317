"""Building a `tokenized_cache`, one small rule per result: a shard (one process each, in
parallel), the merge of the shards (one process), an import (a `levanter_cache(...)` source:
one process, nothing is tokenized), a fan-out (a store-mode cache with `[kiln] cluster` set: one
process that runs the shards and the merge as Ray tasks, kiln.cluster.fanout, docs/clusters.md).
`tokenize_cache` picks among them; `cache_process` is the one place a cache's runtime process is
made. Small caches (one shard of a few repo files: a data-ablation study's thousand
one-document caches) are tokenized many to a process instead, `python -m kiln.data.tokenize
many` (`small_cache_batches`): starting a process with its tokenizer costs seconds, tokenizing
such a cache milliseconds. Each cache is still its own artifact with its own fingerprint, and
one that fails fails alone. A store batch holds the caches a goal asks for that the store lacks;
an inline batch is a Pants-cached process, so it is fixed by the BUILD directory (its small
inline caches, in order), whichever of them a goal asks for.

Each process runs `python -m kiln.data.tokenize` from the tokenize runtime PEX, whose sources are
kiln.data's closure only, so trainer edits never re-tokenize. Two storage modes (the `storage`
field):
- inline: the shards and the merged cache are process outputs; identical inputs are cache hits,
  locally and in a remote cache, and the cache travels through Pants' store.
- store: the processes write straight into `{prefix}/{name}/{version}` (shards beside it; in a
  bucket, at their final keys inside it) and are never served from Pants' cache; the store
  itself skips a finished shard or cache, so a rerun resumes where a killed build stopped. For
  data too large for Pants' store. A cache the store holds built with this fingerprint starts
  no tokenize process at all (`built_or_tokenized_caches`). With a bucket prefix the processes
  get the bucket clients' credentials and endpoints from the caller's environment (PER_SESSION:
  never in a cache key).

The rules that run store-mode processes in order (shards, then their merge) are uncacheable:
pantsd re-runs them in a new session from the top. A cacheable rule would instead be "cleaned",
which requests all of its previous dependencies at once (Pants' graph does so speculatively):
the merge would start while its shards are being rebuilt, after the store was deleted.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from typing import Optional

from pants.base.build_root import BuildRoot
from pants.base.specs import DirLiteralSpec, RawSpecs
from pants.engine.addresses import Address, Addresses
from pants.engine.env_vars import EnvironmentVars, EnvironmentVarsRequest
from pants.engine.fs import (
    EMPTY_DIGEST,
    AddPrefix,
    CreateDigest,
    Digest,
    DigestSubset,
    FileContent,
    MergeDigests,
    PathGlobs,
    RemovePrefix,
)
from pants.engine.process import (
    FallibleProcessResult,
    Process,
    ProcessResult,
    ProcessResultMetadata,
)
from pants.engine.rules import Get, MultiGet, _uncacheable_rule, collect_rules, rule
from pants.engine.target import Targets
from pants.util.frozendict import FrozenDict

from kiln_contract.tokenize import FilesSource, LevanterCacheSource
from kiln_pants.artifact_graph import (
    Artifact,
    ArtifactGraph,
    ArtifactGraphRequest,
    TokenizerFiles,
    TokenizerFilesRequest,
    target_and_graph,
)
from kiln_pants.artifact_store import RECORD_INPUT, StoredStates, StoredStatesRequest, artifact_path
from kiln_pants.cache_layout import (
    CACHE_DIR,
    CacheBuild,
    CacheBuildRequest,
    CacheProcessRequest,
    CacheTokenizationFailed,
)
from kiln_pants.cache_spec import SPEC_FILE, RepoFileSizes, RepoFileSizesRequest
from kiln_pants.runtime import FAN_OUT, KilnProcess
from kiln_pants.subsystem import KilnSubsystem
from kiln_pants.target_types import TokenizedCacheTarget, TokenizerField, tokenizer_address


@dataclass(frozen=True)
class BuildCachesRequest:
    """Built caches: served from the artifact store when it holds them already, else tokenized."""

    addresses: Addresses


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
    # The process that finished it (merge, import, fan-out, or its batch's): whether it ran or
    # was served from Pants' cache, and how long it took. Not part of the cache: left out of
    # equality, as Pants leaves it out of a process result's.
    process: Optional[ProcessResultMetadata] = field(default=None, compare=False, hash=False)


@dataclass(frozen=True)
class BuiltCaches:
    caches: tuple[BuiltCache, ...]  # in the order asked for


def _in_store(build: CacheBuild) -> BuiltCache:
    tokenizer = build.inputs.tokenizer_digest
    return BuiltCache(build.artifact, EMPTY_DIGEST, tokenizer, store_path=build.layout.cache)


async def _finished(build: CacheBuild, last: ProcessResult | FallibleProcessResult) -> BuiltCache:
    """The cache the last process (merge, import or fan-out) finished: in the store, or its
    output."""
    if build.layout.in_store:
        return replace(_in_store(build), process=last.metadata)
    cache = await Get(Digest, RemovePrefix(last.output_digest, CACHE_DIR))
    return BuiltCache(build.artifact, cache, build.inputs.tokenizer_digest, process=last.metadata)


@dataclass(frozen=True)
class ImportRequest:
    build: CacheBuild


@rule(desc="Importing a Levanter cache")
async def import_cache(request: ImportRequest) -> BuiltCache:
    build = request.build
    layout, source = build.layout, build.inputs.spec.source
    assert isinstance(source, LevanterCacheSource)
    process = (await Get(
        KilnProcess,
        CacheProcessRequest(
            build,
            argv=("import", SPEC_FILE, "--out", layout.cache, "--record", RECORD_INPUT,
                  *layout.confined),  # fmt: skip
            description=f"Importing the Levanter cache {source.location} as {build.artifact.ref}",
            outputs=(layout.cache,),
        ),
    )).process
    return await _finished(build, await Get(ProcessResult, Process, process))


@dataclass(frozen=True)
class ShardRequest:
    build: CacheBuild
    index: int


@dataclass(frozen=True)
class TokenizedShard:
    digest: Digest  # inline storage: the shard folder, at its sandbox path; else empty


@rule(desc="Tokenizing a shard")
async def tokenize_shard(request: ShardRequest) -> TokenizedShard:
    build, index = request.build, request.index
    layout = build.layout
    shard = layout.shards[index]
    process = (await Get(
        KilnProcess,
        CacheProcessRequest(
            build,
            argv=("shard", SPEC_FILE, "--index", str(index), "--out", shard, *layout.skip,
                  *layout.confined),  # fmt: skip
            description=f"Tokenizing {build.artifact.ref} shard {index + 1}/{len(layout.shards)}",
            outputs=(shard,),
        ),
    )).process
    result = await Get(ProcessResult, Process, process)
    return TokenizedShard(result.output_digest)


@dataclass(frozen=True)
class MergeRequest:
    """Every shard, then their merge: inline (cached processes)."""

    build: CacheBuild


@dataclass(frozen=True)
class StoreMergeRequest:
    """Every shard, then their merge: into the store (per-session processes, run in order)."""

    build: CacheBuild


async def _shards_then_merge(build: CacheBuild) -> BuiltCache:
    layout = build.layout
    shards = await MultiGet(
        Get(TokenizedShard, ShardRequest(build, index)) for index in range(len(layout.shards))
    )
    merge_input = await Get(
        Digest, MergeDigests([build.inputs.digest, *(shard.digest for shard in shards)])
    )
    process = (await Get(
        KilnProcess,
        CacheProcessRequest(
            build,
            argv=("merge", SPEC_FILE, "--shards", *layout.shards, "--out", layout.cache,
                  "--record", RECORD_INPUT, *layout.confined),  # fmt: skip
            description=f"Merging {len(layout.shards)} shard(s) of {build.artifact.ref}",
            outputs=(layout.cache,),
            input_digest=merge_input,
        ),
    )).process
    return await _finished(build, await Get(ProcessResult, Process, process))


@rule(desc="Merging a cache's shards")
async def merge_shards(request: MergeRequest) -> BuiltCache:
    return await _shards_then_merge(request.build)


@_uncacheable_rule(desc="Merging a cache's shards in the store")
async def merge_shards_in_store(request: StoreMergeRequest) -> BuiltCache:
    return await _shards_then_merge(request.build)


@dataclass(frozen=True)
class FanOutRequest:
    build: CacheBuild


@rule(desc="Tokenizing a cache on a Ray cluster")
async def fan_out_cache(request: FanOutRequest) -> BuiltCache:
    """One process for every shard and the merge, each a Ray task on the cluster; per session,
    like every store-mode process (the store resumes and skips by itself)."""
    build = request.build
    layout = build.layout
    environment = await Get(EnvironmentVars, EnvironmentVarsRequest(("RAY_ADDRESS",)))  # `auto`
    process = (await Get(
        KilnProcess,
        CacheProcessRequest(
            build,
            argv=(SPEC_FILE, "--cluster", build.cluster, "--prefix", layout.root or build.prefix,
                  "--shards", *layout.shards, "--out", layout.cache, "--record", RECORD_INPUT),  # fmt: skip
            description=(
                f"Tokenizing {build.artifact.ref}: {len(layout.shards)} shard(s) on the Ray "
                f"cluster {build.cluster}"
            ),
            entry=FAN_OUT,
            env=FrozenDict(environment),
            ships_runtime=True,
        ),
    )).process
    result = await Get(FallibleProcessResult, Process, process)
    if result.exit_code != 0:
        lines = result.stderr.decode(errors="replace").strip().splitlines()
        why = lines[-1].removeprefix("kiln: ").removeprefix("error: ") if lines else ""
        raise CacheTokenizationFailed(
            f"{build.artifact.address}: "
            f"{why or f'tokenizing on the cluster failed (exit {result.exit_code})'}"
        )
    return await _finished(build, result)


@rule(desc="Tokenizing a cache")
async def tokenize_cache(request: TokenizeCacheRequest) -> BuiltCache:
    build = await Get(CacheBuild, CacheBuildRequest(request.address))
    if isinstance(build.inputs.spec.source, LevanterCacheSource):  # read in place: no fan-out
        return await Get(BuiltCache, ImportRequest(build))
    if build.cluster != "local":
        return await Get(BuiltCache, FanOutRequest(build))
    if build.layout.in_store:
        return await Get(BuiltCache, StoreMergeRequest(build))
    return await Get(BuiltCache, MergeRequest(build))


# A cache of one shard whose repo files weigh at most SMALL_CACHE_BYTES is tokenized in a batch,
# about CACHES_PER_BATCH to a process (at most MAX_CACHES_PER_BATCH): a few seconds of start-up
# shared by all of them, and enough batches for a thousand caches to keep every core busy.
SMALL_CACHE_BYTES = 1 << 20
CACHES_PER_BATCH = 50
MAX_CACHES_PER_BATCH = 4 * CACHES_PER_BATCH
BATCH_FOLDER = "caches"  # each cache's spec, record (and inline outputs) in BATCH_FOLDER/{i}/
BATCH_MANIFEST = "many.json"


@dataclass(frozen=True)
class CacheBatch:
    """Caches of one storage tokenized in one process, in this order."""

    addresses: tuple[Address, ...]


@dataclass(frozen=True)
class CacheBatches:
    batches: tuple[CacheBatch, ...]


def in_batches(addresses: list[Address]) -> tuple[CacheBatch, ...]:
    """The caches in address order, cut after each address that `_ends_batch` (as rsync cuts a
    file where its content says): a cache added or removed changes its own batch only (one that
    ends a batch splits it in two), never the others', which Pants then serves from its cache."""
    batches: list[CacheBatch] = []
    current: list[Address] = []
    for address in sorted(addresses):
        current.append(address)
        if _ends_batch(address) or len(current) == MAX_CACHES_PER_BATCH:
            batches.append(CacheBatch(tuple(current)))
            current = []
    if current:
        batches.append(CacheBatch(tuple(current)))
    return tuple(batches)


def _ends_batch(address: Address) -> bool:
    """One address in CACHES_PER_BATCH, by a hash of its spec (stable across runs and hosts)."""
    digest = hashlib.sha256(address.spec.encode()).digest()
    return int.from_bytes(digest[:8], "big") % CACHES_PER_BATCH == 0


@dataclass(frozen=True)
class SmallCachesRequest:
    """Of these caches, the small ones, in batches (the others are left out)."""

    addresses: Addresses


@dataclass(frozen=True)
class SmallCaches:
    store: tuple[Address, ...]
    inline: tuple[Address, ...]


@dataclass(frozen=True)
class SmallCacheRequest:
    address: Address


@dataclass(frozen=True)
class SmallCache:
    """Whether a cache may be tokenized in a batch, and in which storage."""

    small: bool
    in_store: bool = False


@rule(desc="Sizing a cache")
async def small_cache(request: SmallCacheRequest) -> SmallCache:
    try:  # a sibling's bad field is its own build's error, not its directory's batch's
        build = await Get(CacheBuild, CacheBuildRequest(request.address))
    except Exception:  # noqa: BLE001
        return SmallCache(False)
    spec = build.inputs.spec
    if build.cluster != "local" or spec.num_shards != 1 or not isinstance(spec.source, FilesSource):
        return SmallCache(False)
    # Repository files only: a file outside it has no size in Pants' digests.
    files = await Get(RepoFileSizes, RepoFileSizesRequest(request.address))
    small = bool(files.sizes) and sum(files.sizes.values()) <= SMALL_CACHE_BYTES
    return SmallCache(small, build.layout.in_store)


@rule(desc="Finding small caches")
async def small_caches(request: SmallCachesRequest) -> SmallCaches:
    sized = await MultiGet(
        Get(SmallCache, SmallCacheRequest(address)) for address in request.addresses
    )
    pairs = list(zip(request.addresses, sized))
    return SmallCaches(
        store=tuple(a for a, s in pairs if s.small and s.in_store),
        inline=tuple(a for a, s in pairs if s.small and not s.in_store),
    )


@dataclass(frozen=True)
class DirectoryBatchesRequest:
    directory: str


@rule(desc="Grouping a directory's small inline caches")
async def directory_batches(request: DirectoryBatchesRequest) -> CacheBatches:
    """An inline batch is a process served from Pants' cache by its inputs, so it must be the
    same whichever of its caches a goal asks for: every small inline cache of the BUILD
    directory, in order. A change to one cache, or a new one, reruns its batch (one process)."""
    addresses = await Get(
        Addresses,
        RawSpecs(
            dir_literals=(DirLiteralSpec(request.directory),),
            description_of_origin="<kiln small caches>",
        ),
    )
    targets = await Get(Targets, Addresses, addresses)
    caches = Addresses(t.address for t in targets if t.alias == TokenizedCacheTarget.alias)
    small = await Get(SmallCaches, SmallCachesRequest(caches))
    return CacheBatches(in_batches(list(small.inline)))


@rule(desc="Grouping small caches into batches")
async def small_cache_batches(request: SmallCachesRequest) -> CacheBatches:
    """Store caches: the ones asked for (the store skips a built one by itself). Inline caches:
    their directories' batches."""
    small = await Get(SmallCaches, SmallCachesRequest, request)
    directories = sorted({address.spec_path for address in small.inline})
    by_directory = await MultiGet(
        Get(CacheBatches, DirectoryBatchesRequest(directory)) for directory in directories
    )
    wanted = set(small.inline)
    inline = tuple(
        batch
        for batches in by_directory
        for batch in batches.batches
        if wanted.intersection(batch.addresses)
    )
    return CacheBatches(in_batches(list(small.store)) + inline)


@dataclass(frozen=True)
class CacheBatchOutcome:
    built: FrozenDict[Address, BuiltCache]
    errors: FrozenDict[Address, str]  # the caches that failed: their error lines
    # The batch's process: each of its caches reports it (BuiltCache.process).
    process: Optional[ProcessResultMetadata] = field(default=None, compare=False, hash=False)


def _batch_paths(build: CacheBuild, folder: str) -> tuple[str, str]:
    """A cache's shard and cache folders: in the store, or its own outputs in the sandbox."""
    layout = build.layout
    if layout.in_store:
        return layout.shards[0], layout.cache
    return f"{folder}/{layout.shards[0]}", f"{folder}/{layout.cache}"


def _batch_commands(build: CacheBuild, folder: str) -> list[list[str]]:
    """A cache's `shard` and `merge` command lines, as its own processes would run them."""
    layout = build.layout
    spec, record = f"{folder}/{SPEC_FILE}", f"{folder}/{RECORD_INPUT}"
    shard, cache = _batch_paths(build, folder)
    return [
        ["shard", spec, "--index", "0", "--out", shard, *layout.skip, *layout.confined],
        ["merge", spec, "--shards", shard, "--out", cache, "--record", record, *layout.confined],
    ]


def _errors_by_cache(stderr: str, builds: tuple[CacheBuild, ...]) -> dict[Address, str]:
    """`many` prints a failed cache's errors, then `error: ADDRESS failed`."""
    errors: dict[Address, str] = {}
    pending: list[str] = []
    names = {str(b.artifact.address): b.artifact.address for b in builds}
    for line in stderr.splitlines():
        name = line.removeprefix("error: ").removesuffix(" failed")
        if line.startswith("error: ") and line.endswith(" failed") and name in names:
            errors[names[name]] = "\n".join(pending) or "tokenizing failed"
            pending = []
        elif line.startswith("error: "):
            pending.append(line.removeprefix("error: "))
    return errors


@dataclass(frozen=True)
class BatchOutputRequest:
    """One cache that a batch's process built: its folder of the sandbox."""

    build: CacheBuild
    folder: str
    output: Digest  # the batch's process's outputs


@rule
async def batch_output(request: BatchOutputRequest) -> BuiltCache:
    build = request.build
    if build.layout.in_store:
        return _in_store(build)
    cache = _batch_paths(build, request.folder)[1]
    subset = await Get(Digest, DigestSubset(request.output, PathGlobs([f"{cache}/**"])))
    files = await Get(Digest, RemovePrefix(subset, cache))
    return BuiltCache(build.artifact, files, build.inputs.tokenizer_digest)


@rule(desc="Tokenizing small caches in one process")
async def tokenize_cache_batch(batch: CacheBatch) -> CacheBatchOutcome:
    builds = await MultiGet(
        Get(CacheBuild, CacheBuildRequest(address)) for address in batch.addresses
    )
    folders = [f"{BATCH_FOLDER}/{i}" for i in range(len(builds))]
    manifest = [
        {"name": str(b.artifact.address), "commands": _batch_commands(b, folder)}
        for b, folder in zip(builds, folders)
    ]
    specs = await MultiGet(
        Get(Digest, AddPrefix(b.inputs.spec_digest, folder)) for b, folder in zip(builds, folders)
    )
    listed = await Get(
        Digest, CreateDigest([FileContent(BATCH_MANIFEST, json.dumps(manifest).encode())])
    )
    digest = await Get(Digest, MergeDigests([listed, *specs, *(b.inputs.files for b in builds)]))
    first, last = builds[0].artifact.ref, builds[-1].artifact.ref
    process = (await Get(
        KilnProcess,
        CacheProcessRequest(
            builds[0],  # a batch's caches share their storage and store, so their environment
            argv=("many", BATCH_MANIFEST),
            description=f"Tokenizing {len(builds)} small cache(s), {first} to {last}",
            outputs=tuple(_batch_paths(b, folder)[1] for b, folder in zip(builds, folders)),
            input_digest=digest,
        ),
    )).process
    result = await Get(FallibleProcessResult, Process, process)
    errors = _errors_by_cache(result.stderr.decode(errors="replace"), builds)
    if result.exit_code != 0 and not errors:  # it died before reporting a cache
        why = result.stderr.decode(errors="replace").strip()[-2000:]
        errors = {b.artifact.address: why or f"exit {result.exit_code}" for b in builds}
    done = [(b, folder) for b, folder in zip(builds, folders) if b.artifact.address not in errors]
    built = await MultiGet(
        Get(BuiltCache, BatchOutputRequest(b, folder, result.output_digest)) for b, folder in done
    )
    return CacheBatchOutcome(
        FrozenDict((cache.artifact.address, cache) for cache in built),
        FrozenDict(errors),
        result.metadata,
    )


@dataclass(frozen=True)
class BatchedCacheRequest:
    """One cache of a batch: built by the batch's process, or failed alone."""

    address: Address
    batch: CacheBatch


@_uncacheable_rule(desc="Tokenizing a small cache")
async def batched_cache(request: BatchedCacheRequest) -> BuiltCache:
    """Uncacheable, as a step's way into the store is: pantsd runs it again from the top in a
    new session (a cached one would be "cleaned", its batch rerun beneath it)."""
    outcome = await Get(CacheBatchOutcome, CacheBatch, request.batch)
    if request.address in outcome.errors:
        raise CacheTokenizationFailed(f"{request.address}: {outcome.errors[request.address]}")
    return replace(outcome.built[request.address], process=outcome.process)


@dataclass(frozen=True)
class StoredCacheRequest:
    """A store-mode cache that the store holds built: its place there and its tokenizer's files;
    no process runs."""

    address: Address


@rule(desc="Serving a built cache from the store")
async def stored_cache(
    request: StoredCacheRequest, kiln: KilnSubsystem, build_root: BuildRoot
) -> BuiltCache:
    target, graph = await target_and_graph(request.address, "<kiln cache build>")
    tokenizer = target[TokenizerField].value
    tokenizer_files = EMPTY_DIGEST
    if tokenizer_address(tokenizer):
        files = await Get(TokenizerFiles, TokenizerFilesRequest(request.address, tokenizer))
        tokenizer_files = files.digest
    artifact = graph.get(request.address)
    store_path = artifact_path(kiln.prefix_location(build_root.path), artifact)
    return BuiltCache(artifact, EMPTY_DIGEST, tokenizer_files, store_path)


@_uncacheable_rule(desc="Looking for built caches")
async def built_or_tokenized_caches(
    request: BuildCachesRequest, kiln: KilnSubsystem, build_root: BuildRoot
) -> BuiltCaches:
    """A store cache already built with this fingerprint (artifact.json, then STATUS SUCCESS) is
    served from its records, without starting its shard and merge processes (each would exit
    at once, hundreds for DCLM); the store is read once for all the caches asked for (one
    process in a bucket). Inline caches are Pants process outputs: its cache serves them.
    Uncacheable, so that pantsd looks at the store again in every session, before anything is
    built."""
    graph = await Get(ArtifactGraph, ArtifactGraphRequest(request.addresses))
    caches = [graph.get(address) for address in request.addresses]
    stored = tuple(c for c in caches if c.in_store and not c.mutable)
    prefix = kiln.prefix_location(build_root.path)
    built: set[Address] = set()
    if stored:
        read = await Get(StoredStates, StoredStatesRequest(prefix, ArtifactGraph(stored)))
        built = {a.address for a, state in read.states.items() if state.status == "built"}
    unbuilt = [c.address for c in stored if c.address not in built]
    inline = [c.address for c in caches if not c.in_store]
    batches = await Get(CacheBatches, SmallCachesRequest(Addresses([*unbuilt, *inline])))
    batch_of = {address: b for b in batches.batches for address in b.addresses}
    return BuiltCaches(
        await MultiGet(
            Get(BuiltCache, StoredCacheRequest(c.address))
            if c.address in built
            else Get(BuiltCache, BatchedCacheRequest(c.address, batch_of[c.address]))
            if c.address in batch_of
            else Get(BuiltCache, TokenizeCacheRequest(c.address))
            for c in caches
        )
    )


def cache_location(artifact: Artifact) -> str:
    """Where a built cache sits among a step's inputs: `inputs/{name}/{version}`."""
    return f"inputs/{artifact.folder}"


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
    built = (await Get(BuiltCaches, BuildCachesRequest(request.addresses))).caches
    placed = await MultiGet(
        Get(Digest, AddPrefix(cache.digest, cache_location(cache.artifact)))
        for cache in built
        if cache.store_path is None
    )
    tokenizers = [cache.tokenizer for cache in built]
    return CachesAsInputs(await Get(Digest, MergeDigests([*placed, *tokenizers])))


def rules():
    return collect_rules()
