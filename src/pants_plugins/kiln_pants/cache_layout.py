"""Where a cache's build writes and how its processes are made: the layout of its shards and
cache (process outputs, or folders in the artifact store), and `cache_process`, the one place
that makes a runtime process of a cache's build (kiln_pants.tokenize_rules runs them)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from pants.base.build_root import BuildRoot
from pants.engine.addresses import Address
from pants.engine.env_vars import EnvironmentVars, EnvironmentVarsRequest
from pants.engine.fs import Digest
from pants.engine.process import ProcessCacheScope
from pants.engine.rules import Get, MultiGet, collect_rules, rule
from pants.engine.target import WrappedTarget, WrappedTargetRequest
from pants.util.frozendict import FrozenDict

from kiln_contract.layout import SHARDS_SIBLING, sibling_key
from kiln_contract.location import in_bucket
from kiln_contract.tokenize import shard_dir_name
from kiln_pants.artifact_graph import Artifact
from kiln_pants.artifact_store import artifact_path
from kiln_pants.cache_spec import CacheSpecInputs, CacheSpecRequest
from kiln_pants.hub_settings import HubSettingsCache
from kiln_pants.runtime import (
    TOKENIZE,
    EntryPoint,
    KilnProcess,
    Runtime,
    RuntimeProcess,
    RuntimeRequest,
    shipped_to_nodes,
)
from kiln_pants.store_process import STORE_ENVIRONMENT
from kiln_pants.subsystem import KilnSubsystem
from kiln_pants.target_types import CacheStorageField

CACHE_DIR = "cache"
NO_CLUSTER = ("", "local")  # [kiln] cluster values that mean this machine


class CacheTokenizationFailed(Exception):
    pass


@dataclass(frozen=True)
class CacheLayout:
    """Where the shards and the cache go: sandbox-relative outputs, or store paths (absolute
    local paths, or bucket URLs)."""

    shards: tuple[str, ...]
    cache: str
    cache_scope: ProcessCacheScope
    in_store: bool = False
    root: Optional[str] = None  # a local store: the prefix every written folder must stay in

    @classmethod
    def for_storage(cls, storage: str, num_shards: int, store_path: str, prefix: str) -> CacheLayout:
        if storage == "inline":
            shards = tuple(f"shard-{i}" for i in range(num_shards))
            return cls(shards, CACHE_DIR, ProcessCacheScope.SUCCESSFUL)
        # The store resumes and skips by itself (a finished shard or cache is a no-op), and its
        # contents can vanish behind Pants' back: never serve these processes from a cache.
        scope = ProcessCacheScope.PER_SESSION
        if in_bucket(prefix):  # a bucket has no rename: shards are uploaded at their final keys
            shards = tuple(f"{store_path}/shards/{shard_dir_name(i)}" for i in range(num_shards))
            return cls(shards, store_path, scope, in_store=True)
        building = sibling_key(store_path, SHARDS_SIBLING)
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


@dataclass(frozen=True)
class CacheBuildRequest:
    address: Address


@dataclass(frozen=True)
class CacheBuild:
    """What every process of one cache's build shares: its spec and inputs, where it writes,
    and the environment its processes get (a bucket's credentials; else none)."""

    inputs: CacheSpecInputs
    prefix: str  # the artifact store
    layout: CacheLayout
    env: FrozenDict[str, str]
    cluster: str  # `[kiln] cluster`, for a store-mode cache; else "local"

    @property
    def artifact(self) -> Artifact:
        return self.inputs.artifact


@rule(desc="Laying out a cache's build")
async def cache_build(
    request: CacheBuildRequest, kiln: KilnSubsystem, build_root: BuildRoot
) -> CacheBuild:
    wrapped, inputs = await MultiGet(
        Get(
            WrappedTarget,
            WrappedTargetRequest(request.address, description_of_origin="<kiln cache build>"),
        ),
        Get(CacheSpecInputs, CacheSpecRequest(request.address)),
    )
    storage = wrapped.target[CacheStorageField].value
    prefix = kiln.prefix_location(build_root.path)
    store_path = artifact_path(prefix, inputs.artifact)
    layout = CacheLayout.for_storage(storage, inputs.spec.num_shards, store_path, prefix)
    env = FrozenDict[str, str]()
    if layout.in_store and in_bucket(prefix):  # the processes reach the bucket themselves
        env = FrozenDict(await Get(EnvironmentVars, EnvironmentVarsRequest(STORE_ENVIRONMENT)))
    cluster = kiln.cluster if layout.in_store and kiln.cluster not in NO_CLUSTER else "local"
    return CacheBuild(inputs, prefix, layout, env, cluster)


@dataclass(frozen=True)
class CacheProcessRequest:
    """One runtime process of a cache's build: `entry`'s command line, reading the cache's
    inputs (or `input_digest`), writing `outputs` (folders) when the cache is inline."""

    build: CacheBuild
    argv: tuple[str, ...]
    description: str
    outputs: tuple[str, ...] = ()
    input_digest: Optional[Digest] = None
    entry: EntryPoint = TOKENIZE
    env: FrozenDict[str, str] = FrozenDict()  # beyond the store's
    ships_runtime: bool = False  # a fan-out: its runtime PEX goes to the cluster's nodes


@rule
async def cache_process(request: CacheProcessRequest, hub: HubSettingsCache) -> KilnProcess:
    build = request.build
    runtime = await Get(Runtime, RuntimeRequest(request.entry))
    outputs = () if build.layout.in_store else request.outputs
    shipped = shipped_to_nodes(runtime) if request.ships_runtime else {}
    return await Get(
        KilnProcess,
        RuntimeProcess(
            runtime,
            argv=request.argv,
            description=request.description,
            input_digest=request.input_digest or build.inputs.digest,
            output_directories=outputs,
            cache_scope=build.layout.cache_scope,
            env=FrozenDict({**build.env, **request.env, **shipped}),
            append_only_caches=hub.append_only_caches,
        ),
    )


def rules():
    return collect_rules()
