"""An unbuilt cache's shard plan, for `plan`: the files (pieces, units) and bytes each shard reads.

A plan is made where its facts are, by the rules the build follows (kiln_contract.sharding cuts
files sources for both): a cache of repository files from the sizes in Pants' own digests, one
of local files outside the repository from their sizes on disk, neither with a process. The
rest (the stdlib corpus's units, a hub dataset's file list at its pinned revision, parquet files
cut by row groups) come from the runtime, `python -m kiln.data.tokenize plan SPEC... --json`, in
one process for all of a goal's caches that Pants may cache and one, never cached beyond this
run (PER_SESSION), for those that read the hub (with the user's hub settings, hub_settings) or
files outside the repository. A plan that cannot be made (the hub unreachable, say) is one line
in place of the plan; it never fails `plan`. An imported `levanter_cache` has no shards: its plan
is its ledger (layout, parts, documents, tokens), read by the same command in the per-session
process (the cache lives outside Pants, in a folder or a bucket: then with the bucket's
settings); a ledger Kiln cannot import refuses the plan, in its one line.
"""

from __future__ import annotations

import glob
import json
import os
import statistics
from dataclasses import dataclass
from typing import Any, Optional

from pants.engine.addresses import Address
from pants.engine.env_vars import EnvironmentVars, EnvironmentVarsRequest
from pants.engine.fs import (
    CreateDigest,
    Digest,
    FileContent,
    MergeDigests,
)
from pants.engine.process import FallibleProcessResult, Process, ProcessCacheScope
from pants.engine.rules import Get, MultiGet, _uncacheable_rule, collect_rules, rule
from pants.engine.target import Target, WrappedTarget, WrappedTargetRequest
from pants.util.frozendict import FrozenDict

from kiln_contract.location import in_bucket
from kiln_contract.sharding import files_plan
from kiln_contract.tokenize import (
    FilesSource,
    HfSource,
    LevanterCacheSource,
    Source,
    UrlFilesSource,
)
from kiln_pants.cache_spec import (
    CacheSpecInputs,
    CacheSpecRequest,
    RepoFileSizes,
    RepoFileSizesRequest,
)
from kiln_pants.hub_settings import HubSettingsCache
from kiln_pants.runtime import TOKENIZE, KilnProcess, Runtime, RuntimeProcess, RuntimeRequest
from kiln_pants.store_process import STORE_ENVIRONMENT
from kiln_pants.target_types import CacheSourceField, NumShardsField

SHOWN_SHARDS = 3  # shards listed under the summary line (`--plan-shards`: all of them)
SHOWN_FILES = 2  # file names on each listed shard's line
HUB_TIMEOUT_SECONDS = 120  # a hub that does not answer costs `plan` this much, once
PLAN_SPECS_DIR = "plan_specs"


@dataclass(frozen=True)
class ShardPlan:
    # Per shard, in index order: its files and their bytes, in read order.
    shards: tuple[FrozenDict[str, int], ...] = ()
    streamed: Optional[str] = None  # how a source streamed through `datasets` is split instead
    unavailable: Optional[str] = None  # why there is no plan
    imported: Optional[str] = None  # an import's ledger, in a line
    imported_tokens: Optional[int] = None  # the tokens its ledger records
    imported_from: Optional[str] = None  # where an import's tokens are read, in place
    imported_dtype: Optional[str] = None  # how the imported cache stores its ids
    refused: Optional[str] = None  # why an import cannot be made: `plan` fails

    def describe(self, every_shard: bool) -> list[str]:
        """The summary line and the first shards; with `every_shard`, each shard and file."""
        for line in (self.unavailable, self.imported):
            if line is not None:
                return [line]
        if self.refused is not None:
            return [f"!! import refused: {self.refused}"]
        if self.streamed is not None:
            return [
                f"shard plan: {self.streamed}; a streamed source's parts are known only when "
                "it is read"
            ]
        if not self.shards:
            return []
        files = [len(shard) for shard in self.shards]
        sizes = [sum(shard.values()) for shard in self.shards]
        summary = (
            f"shard plan: {count_text(len(files), 'shard')}, {count_text(sum(files), 'file')}, "
            f"{size_text(sum(sizes))}"
        )
        if len(self.shards) > 1:
            summary += (
                f"; per shard (min/median/max) {_spread(files)} files, "
                f"{'/'.join(size_text(n) for n in _three(sizes))}"
            )
        lines = [summary]
        shown = self.shards if every_shard else self.shards[:SHOWN_SHARDS]
        for index, shard in enumerate(shown):
            shape = f"{count_text(len(shard), 'file')}, {size_text(sizes[index])}"
            lines.append(f"  shard {index}: {shape}")
            if every_shard:
                lines.extend(f"    {key} ({size:,} bytes)" for key, size in shard.items())
            elif shard:
                names = list(shard)[:SHOWN_FILES]
                more = f" and {len(shard) - len(names)} more" if len(shard) > len(names) else ""
                lines[-1] += f": {', '.join(names)}{more}"
        if len(shown) < len(self.shards):
            lines.append(
                f"  ... {len(self.shards) - len(shown)} more shards: `--plan-shards` lists "
                "every shard and file"
            )
        return lines


@dataclass(frozen=True)
class ShardPlansRequest:
    addresses: tuple[Address, ...]  # unbuilt caches


@dataclass(frozen=True)
class ShardPlans:
    plans: tuple[ShardPlan, ...]  # one per address, in order


@dataclass(frozen=True)
class RepoFilesPlanRequest:
    address: Address


@dataclass(frozen=True)
class PlannedHere:
    """A plan made without the runtime; None where only the runtime can make it."""

    plan: Optional[ShardPlan]


@dataclass(frozen=True)
class RuntimePlansRequest:
    addresses: tuple[Address, ...]


@dataclass(frozen=True)
class PlanProcessRequest:
    runtime: Runtime
    caches: tuple[CacheSpecInputs, ...]  # all of one cache scope


@_uncacheable_rule(desc="Planning caches' shards")
async def plan_shards(request: ShardPlansRequest) -> ShardPlans:
    """Uncacheable: files outside the repository and hub listings change behind pantsd's back,
    so they are looked at again in every session (the repository's files are in Pants' digests,
    and their plans memoized with them)."""
    wrapped = await MultiGet(
        Get(WrappedTarget, WrappedTargetRequest(a, description_of_origin="<kiln plan>"))
        for a in request.addresses
    )
    here = await MultiGet(Get(PlannedHere, RepoFilesPlanRequest(a)) for a in request.addresses)
    plans = [
        found.plan or _planned_without_runtime(w.target)
        for w, found in zip(wrapped, here)
    ]
    pending = tuple(a for a, plan in zip(request.addresses, plans) if plan is None)
    from_runtime = dict(zip(pending, (await Get(ShardPlans, RuntimePlansRequest(pending))).plans))
    return ShardPlans(
        tuple(plan or from_runtime[a] for a, plan in zip(request.addresses, plans))
    )


def _planned_without_runtime(target: Target) -> Optional[ShardPlan]:
    """The plan of a source whose plan needs no runtime: URL files (planned once downloaded),
    local files outside the repository (from their sizes on disk, now); None for the others
    (an imported cache's ledger is read by the runtime)."""
    source = target[CacheSourceField].value
    if isinstance(source, UrlFilesSource):  # planning would download them
        return ShardPlan(unavailable="shard plan: url_files are planned once downloaded")
    if isinstance(source, str) and source.startswith("/"):
        sizes = _sizes_on_disk(source)
        return None if sizes is None else _files_plan(sizes, target[NumShardsField].value)
    return None


def _sizes_on_disk(pattern: str) -> Optional[dict[str, int]]:
    """The sizes of the files a path or glob names (as the runtime expands it); None when one is
    missing or empty, for the runtime to say so."""
    paths = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
    try:
        sizes = {path: os.stat(path).st_size for path in paths if os.path.isfile(path)}
    except OSError:
        return None
    return sizes if sizes and len(sizes) == len(paths) and all(sizes.values()) else None


def _files_plan(sizes: dict[str, int], num_shards: int) -> Optional[ShardPlan]:
    shards = files_plan(sizes, num_shards)
    return None if shards is None else ShardPlan(tuple(map(FrozenDict, shards)))


@rule(desc="Planning a cache's shards from its files")
async def plan_repo_files(request: RepoFilesPlanRequest) -> PlannedHere:
    """A cache of repository files, planned from their sizes in Pants' digests."""
    wrapped, repo_files = await MultiGet(
        Get(
            WrappedTarget,
            WrappedTargetRequest(request.address, description_of_origin="<kiln plan>"),
        ),
        Get(RepoFileSizes, RepoFileSizesRequest(request.address)),
    )
    sizes = dict(repo_files.sizes)
    if not sizes or not all(sizes.values()):
        return PlannedHere(None)  # no repository files, or the runtime names the empty one
    return PlannedHere(_files_plan(sizes, wrapped.target[NumShardsField].value))


@rule(desc="Planning caches' shards in the runtime")
async def plan_in_runtime(request: RuntimePlansRequest) -> ShardPlans:
    """Every cache whose plan needs the runtime, as few processes as the cache scopes allow:
    one that Pants may cache (the stdlib corpus, repository files), one per session for those
    that read the hub or files outside the repository."""
    if not request.addresses:
        return ShardPlans(())
    inputs = await MultiGet(Get(CacheSpecInputs, CacheSpecRequest(a)) for a in request.addresses)
    try:
        runtime = await Get(Runtime, RuntimeRequest(TOKENIZE))
    except Exception as e:  # e.g. offline, its lockfile's wheels not yet downloaded
        error = str(e).strip().splitlines() or [type(e).__name__]
        unavailable = ShardPlan(unavailable=f"shard plan: no tokenize runtime: {error[-1]}")
        return ShardPlans(tuple(unavailable for _ in inputs))
    groups: dict[tuple[bool, bool], list[int]] = {}
    for index, cache in enumerate(inputs):
        scope = (_per_session(cache.spec.source), _reads_bucket(cache.spec.source))
        groups.setdefault(scope, []).append(index)
    planned = await MultiGet(
        Get(ShardPlans, PlanProcessRequest(runtime, tuple(inputs[i] for i in members)))
        for members in groups.values()
    )
    by_index = {
        index: plan
        for members, plans in zip(groups.values(), planned)
        for index, plan in zip(members, plans.plans)
    }
    return ShardPlans(tuple(by_index[index] for index in range(len(inputs))))


def _per_session(source: Source) -> bool:
    """The hub, files outside the repository and imported caches change behind Pants' back."""
    reads_outside = isinstance(source, FilesSource) and any(map(os.path.isabs, source.paths))
    return isinstance(source, (HfSource, LevanterCacheSource)) or reads_outside


def _reads_bucket(source: Source) -> bool:
    """An import from a bucket: its plan process gets the bucket's settings (STORE_ENVIRONMENT),
    which the other plan processes do without."""
    return isinstance(source, LevanterCacheSource) and in_bucket(source.location)


@rule(desc="Planning caches' shards in one process")
async def plan_process(request: PlanProcessRequest, hub: HubSettingsCache) -> ShardPlans:
    caches = request.caches
    names = [f"{PLAN_SPECS_DIR}/{index}.json" for index in range(len(caches))]
    specs = await Get(
        Digest,
        CreateDigest(
            FileContent(name, json.dumps(cache.spec.to_json()).encode())
            for name, cache in zip(names, caches)
        ),
    )
    digest = await Get(Digest, MergeDigests([specs, *(cache.files for cache in caches)]))
    per_session = _per_session(caches[0].spec.source)
    reads_hub = any(isinstance(cache.spec.source, HfSource) for cache in caches)
    env = FrozenDict[str, str]()
    if _reads_bucket(caches[0].spec.source):
        env = FrozenDict(await Get(EnvironmentVars, EnvironmentVarsRequest(STORE_ENVIRONMENT)))
    process = (await Get(
        KilnProcess,
        RuntimeProcess(
            request.runtime,
            argv=("plan", *names, "--json"),
            description=f"Planning the shards of {count_text(len(caches), 'cache')}",
            input_digest=digest,
            output_directories=(),
            cache_scope=(
                ProcessCacheScope.PER_SESSION if per_session else ProcessCacheScope.SUCCESSFUL
            ),
            timeout_seconds=HUB_TIMEOUT_SECONDS if reads_hub else None,
            env=env,
            append_only_caches=hub.append_only_caches if reads_hub else FrozenDict(),
        ),
    )).process
    result = await Get(FallibleProcessResult, Process, process)
    if result.exit_code != 0:
        lines = result.stderr.decode(errors="replace").strip().splitlines()
        why = lines[-1].removeprefix("error: ") if lines else f"exit {result.exit_code}"
        return ShardPlans(tuple(_unavailable(cache, why) for cache in caches))
    lines = result.stdout.decode().splitlines()
    return ShardPlans(
        tuple(_from_json(cache, json.loads(line)) for cache, line in zip(caches, lines))
    )


def _from_json(cache: CacheSpecInputs, planned: Any) -> ShardPlan:
    if isinstance(planned, dict) and "refused" in planned:  # bad input: the import cannot be made
        return ShardPlan(refused=planned["refused"])
    if isinstance(planned, dict):
        return _unavailable(cache, planned["error"])
    return _parsed(planned)


def _unavailable(cache: CacheSpecInputs, why: str) -> ShardPlan:
    needs = "shard plan needs the hub" if isinstance(cache.spec.source, HfSource) else "no shard plan"
    return ShardPlan(unavailable=f"{needs}: {why}")


def _parsed(shards: list[dict]) -> ShardPlan:
    """`tokenize plan --json`: per shard {"files": {key: bytes}} or {"streamed": how}; for an
    import, one {"imported": its ledger's counts}."""
    if shards and "imported" in shards[0]:
        ledger = shards[0]["imported"]
        return ShardPlan(
            imported=_imported_line(ledger),
            imported_tokens=ledger["tokens"],
            imported_from=ledger["location"],
            imported_dtype=ledger.get("dtype"),
        )
    if any("streamed" in shard for shard in shards):
        how = "each its rank's part of the stream (split_dataset_by_node)"
        return ShardPlan(streamed=f"{count_text(len(shards), 'shard')}, {how}")
    return ShardPlan(tuple(FrozenDict(shard["files"]) for shard in shards))


def _imported_line(imported: dict) -> str:
    tokens = "tokens not recorded" if imported["tokens"] is None else count_text(imported["tokens"], "token")
    return (
        f"imports the Levanter cache at {imported['location']}: {imported['layout']} layout, "
        f"{count_text(imported['parts'], 'part')}, {count_text(imported['documents'], 'document')}, "
        f"{tokens} (its shard_ledger.json)"
    )


def count_text(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _three(values: list[int]) -> tuple[int, int, int]:
    return min(values), statistics.median_low(values), max(values)


def _spread(values: list[int]) -> str:
    return "/".join(f"{n:,}" for n in _three(values))


def size_text(n: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def rules():
    return collect_rules()
