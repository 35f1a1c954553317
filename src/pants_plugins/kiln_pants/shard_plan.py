"""An unbuilt cache's shard plan, for `plan`: the files (pieces, units) and bytes each shard reads.

The plan comes from the runtime, `python -m kiln.data.tokenize plan SPEC --json`, given the same
CacheSpec and inputs as the build (tokenize_rules.cache_spec_inputs), so it is the plan the build
follows. A hub source is planned from its file list at the pinned revision: that process reaches
the hub with the user's hub settings (hub_settings) and is never cached beyond this run
(PER_SESSION), nor is one reading local files outside the repository; repository files and stdlib
units are inputs Pants digests, so their plan is a cached process. A plan that cannot be made
(the hub unreachable, say) is one line in place of the plan; it never fails `plan`. An imported
`levanter_cache` has no shards: its plan is its ledger (layout, parts, documents, tokens), read
by the same command (PER_SESSION: the cache lives outside Pants, in a folder or a bucket); a
ledger Kiln cannot import refuses the plan, in its one line.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass
from typing import Optional

from pants.engine.addresses import Address
from pants.engine.env_vars import EnvironmentVars, EnvironmentVarsRequest
from pants.engine.process import FallibleProcessResult, Process, ProcessCacheScope
from pants.engine.rules import Get, collect_rules, rule
from pants.util.frozendict import FrozenDict

from kiln_contract.tokenize import FilesSource, HfSource, LevanterCacheSource, UrlFilesSource
from kiln_pants.artifact_store import STORE_ENVIRONMENT
from kiln_pants.hub_settings import HubSettingsCache
from kiln_pants.runtime import TOKENIZE, Runtime, RuntimeProcess, RuntimeRequest
from kiln_pants.tokenize_rules import SPEC_FILE, CacheSpecInputs, CacheSpecRequest

SHOWN_SHARDS = 3  # shards listed under the summary line (`--plan-shards`: all of them)
SHOWN_FILES = 2  # file names on each listed shard's line
HUB_TIMEOUT_SECONDS = 120  # a hub that does not answer costs `plan` this much, once


@dataclass(frozen=True)
class ShardPlanRequest:
    address: Address


@dataclass(frozen=True)
class ShardPlan:
    # Per shard, in index order: its files and their bytes, in read order.
    shards: tuple[FrozenDict[str, int], ...] = ()
    streamed: Optional[str] = None  # how a source streamed through `datasets` is split instead
    unavailable: Optional[str] = None  # why there is no plan
    imported: Optional[str] = None  # an import's ledger, in a line
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
            f"shard plan: {_count(len(files), 'shard')}, {_count(sum(files), 'file')}, "
            f"{_size(sum(sizes))}"
        )
        if len(self.shards) > 1:
            summary += (
                f"; per shard (min/median/max) {_spread(files)} files, "
                f"{'/'.join(_size(n) for n in _three(sizes))}"
            )
        lines = [summary]
        shown = self.shards if every_shard else self.shards[:SHOWN_SHARDS]
        for index, shard in enumerate(shown):
            lines.append(f"  shard {index}: {_count(len(shard), 'file')}, {_size(sizes[index])}")
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


@rule(desc="Planning a cache's shards")
async def plan_shards(request: ShardPlanRequest, hub: HubSettingsCache) -> ShardPlan:
    inputs = await Get(CacheSpecInputs, CacheSpecRequest(request.address))
    source = inputs.spec.source
    if isinstance(source, UrlFilesSource):  # planning would download them
        return ShardPlan(unavailable="shard plan: url_files are planned once downloaded")
    try:
        runtime = await Get(Runtime, RuntimeRequest(*TOKENIZE))
    except Exception as e:  # e.g. offline, its lockfile's wheels not yet downloaded
        error = str(e).strip().splitlines() or [type(e).__name__]
        return ShardPlan(unavailable=f"shard plan: no tokenize runtime: {error[-1]}")
    reads_hub = isinstance(source, HfSource)
    imports = isinstance(source, LevanterCacheSource)
    reads_outside = imports or (
        isinstance(source, FilesSource) and any(map(os.path.isabs, source.paths))
    )
    env = FrozenDict[str, str]()
    if isinstance(source, LevanterCacheSource) and "://" in source.location:  # read by the process
        env = FrozenDict(await Get(EnvironmentVars, EnvironmentVarsRequest(STORE_ENVIRONMENT)))
    process = await Get(
        Process,
        RuntimeProcess(
            runtime,
            argv=("plan", SPEC_FILE, "--json"),
            description=f"Planning the shards of {inputs.artifact.ref}",
            input_digest=inputs.digest,
            output_directories=(),
            # The hub and files outside the repository change behind Pants' back.
            cache_scope=(
                ProcessCacheScope.PER_SESSION
                if reads_hub or reads_outside
                else ProcessCacheScope.SUCCESSFUL
            ),
            timeout_seconds=HUB_TIMEOUT_SECONDS if reads_hub else None,
            env=env,
            append_only_caches=hub.append_only_caches if reads_hub else FrozenDict(),
        ),
    )
    result = await Get(FallibleProcessResult, Process, process)
    if result.exit_code != 0:
        lines = result.stderr.decode(errors="replace").strip().splitlines()
        why = lines[-1].removeprefix("error: ") if lines else f"exit {result.exit_code}"
        if imports and result.exit_code == 2:  # bad input: the import cannot be made
            return ShardPlan(refused=why)
        needs = "shard plan needs the hub" if reads_hub else "no shard plan"
        return ShardPlan(unavailable=f"{needs}: {why}")
    return _parsed(json.loads(result.stdout))


def _parsed(shards: list[dict]) -> ShardPlan:
    """`tokenize plan --json`: per shard {"files": {key: bytes}} or {"streamed": how}; for an
    import, one {"imported": its ledger's counts}."""
    if shards and "imported" in shards[0]:
        return ShardPlan(imported=_imported_line(shards[0]["imported"]))
    if any("streamed" in shard for shard in shards):
        how = "each its rank's part of the stream (split_dataset_by_node)"
        return ShardPlan(streamed=f"{_count(len(shards), 'shard')}, {how}")
    return ShardPlan(tuple(FrozenDict(shard["files"]) for shard in shards))


def _imported_line(imported: dict) -> str:
    tokens = "tokens not recorded" if imported["tokens"] is None else _count(imported["tokens"], "token")
    return (
        f"imports the Levanter cache at {imported['location']}: {imported['layout']} layout, "
        f"{_count(imported['parts'], 'part')}, {_count(imported['documents'], 'document')}, "
        f"{tokens} (its shard_ledger.json)"
    )


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _three(values: list[int]) -> tuple[int, int, int]:
    return min(values), statistics.median_low(values), max(values)


def _spread(values: list[int]) -> str:
    return "/".join(f"{n:,}" for n in _three(values))


def _size(n: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def rules():
    return collect_rules()
