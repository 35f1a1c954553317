"""The Kiln runtime as Pants builds it: one venv PEX of the third-party closure of every entry
point (from the runtime lockfile, CPython 3.12) plus the first-party sources of the entry point a
process runs (its module: `PEX_MODULE`).

Each entry point gets only its own transitive sources, so a process's cache key covers exactly the
code it runs: editing the trainer does not invalidate tokenization processes. The requirements are
shared: a first run builds and installs one PEX, not one per entry point, and pex's cold build
is a `pip download` process per distribution (benchmarks/RESULTS.md), so PEXes of overlapping
subsets only add to it.

The runtime lockfile pins jax[cpu]. A step that trains on gpu(...) also gets jax's CUDA plugin and
NVIDIA's libraries from the `cuda` resolve (tpu(...): libtpu from the `tpu` resolve), as a second
PEX on the runtime's PEX_PATH: CPU runs and CI never download them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Optional

from pants.backend.python.util_rules.pex import (
    Pex,
    PexLayout,
    PexRequest,
    VenvPex,
    VenvPexProcess,
)
from pants.backend.python.util_rules.pex_from_targets import PexFromTargetsRequest
from pants.backend.python.util_rules.python_sources import (
    PythonSourceFiles,
    PythonSourceFilesRequest,
)
from pants.engine.addresses import Address
from pants.engine.fs import Digest, MergeDigests
from pants.engine.process import Process, ProcessCacheScope
from pants.engine.rules import Get, MultiGet, collect_rules, rule
from pants.engine.target import TransitiveTargets, TransitiveTargetsRequest
from pants.util.frozendict import FrozenDict
from pants.util.logging import LogLevel

from kiln_contract.shipping import PLUGIN_LOCK_VARIABLE, RUNTIME_PEX_VARIABLE


@dataclass(frozen=True)
class EntryPoint:
    """A runtime entry point: the module its processes run and the file that owns it."""

    module: str
    address: Address

    @classmethod
    def of(cls, module: str, path: str) -> EntryPoint:
        """`path`: the owning file, relative to the repository root."""
        directory, file = os.path.split(path)
        return cls(module, Address(directory, relative_file_path=file))


TOKENIZE = EntryPoint.of("kiln.data.tokenize", "src/python/kiln/data/tokenize.py")
RUN_STEP = EntryPoint.of("kiln.runner", "src/python/kiln/runner/__main__.py")
EXPORT = EntryPoint.of("kiln.interop", "src/python/kiln/interop/__main__.py")
PEEK = EntryPoint.of("kiln.artifacts.peek", "src/python/kiln/artifacts/peek.py")
INVENTORY = EntryPoint.of("kiln.artifacts.inventory", "src/python/kiln/artifacts/inventory.py")
DEP_FAILED_MARKS = EntryPoint.of(
    "kiln.artifacts.dep_failed", "src/python/kiln/artifacts/dep_failed.py"
)
REPORT = EntryPoint.of("kiln.report", "src/python/kiln/report/__main__.py")
FAN_OUT = EntryPoint.of("kiln.cluster.fanout", "src/python/kiln/cluster/fanout.py")
# Compiles a step for a TPU slice on libtpu's mock devices (`plan --fit`): run with the `tpu`
# plugins layered on, on any machine.
FIT = EntryPoint.of("kiln.fit", "src/python/kiln/fit/__main__.py")
ENTRY_POINTS = (
    TOKENIZE, RUN_STEP, EXPORT, PEEK, INVENTORY, DEP_FAILED_MARKS, REPORT, FAN_OUT, FIT
)
RUNTIME_PEX = "kiln-runtime.pex"


@dataclass(frozen=True)
class AcceleratorPlugins:
    """What jax needs for one accelerator kind, from its own resolve (3rdparty/python/BUILD)."""

    resolve: str  # also the python_requirements target's name
    requirements: tuple[str, ...]

    @property
    def addresses(self) -> tuple[Address, ...]:
        return tuple(
            Address("3rdparty/python", target_name=self.resolve, generated_name=name)
            for name in self.requirements
        )


ACCELERATOR_PLUGINS = {
    "gpu": AcceleratorPlugins("cuda", ("jax-cuda13-plugin", "jax-cuda13-pjrt")),
    "tpu": AcceleratorPlugins("tpu", ("libtpu", "requests")),
}


@dataclass(frozen=True)
class RuntimeRequest:
    entry: EntryPoint  # one of ENTRY_POINTS
    accelerator: str = "cpu"  # A resources kind; gpu and tpu layer their ACCELERATOR_PLUGINS on.


@dataclass(frozen=True)
class AcceleratorPluginsRequest:
    accelerator: str


def _exact_subset(addresses: Iterable[Address], **fields: Any) -> PexFromTargetsRequest:
    """A PEX of exactly the requirements the closure of `addresses` needs.

    `[python] run_against_entire_lockfile` (pants.toml) gives every internal-only PEX the whole
    lockfile, test servers and all, so that the tests share one requirements PEX per resolve.
    The runtime is shipped to cluster nodes and unpacked on every host: it keeps its subset,
    asked for as a deployable PEX; `_as_internal` then builds it as the internal, packed PEX it
    always was."""
    return PexFromTargetsRequest(addresses, internal_only=False, layout=PexLayout.PACKED, **fields)


def _as_internal(pex_request: PexRequest) -> PexRequest:
    return dataclasses.replace(pex_request, internal_only=True)


@dataclass(frozen=True)
class AcceleratorPluginsPex:
    """A `PexRequest`, in a result type of its own (docs/architecture.md)."""

    pex_request: PexRequest


@rule(desc="Resolving accelerator plugins for the Kiln runtime")
async def accelerator_plugins(request: AcceleratorPluginsRequest) -> AcceleratorPluginsPex:
    addresses = ACCELERATOR_PLUGINS[request.accelerator].addresses
    name = f"kiln-{request.accelerator}-plugins.pex"
    pex_request = await Get(
        PexRequest, PexFromTargetsRequest, _exact_subset(addresses, output_filename=name)
    )
    return AcceleratorPluginsPex(_as_internal(pex_request))


@dataclass(frozen=True)
class EntryPointSourcesRequest:
    entry: EntryPoint  # one of ENTRY_POINTS


@dataclass(frozen=True)
class EntryPointSources:
    """An entry point's first-party closure: what its processes run of Kiln's code (its digest is
    the code digest of what they build)."""

    digest: Digest
    source_roots: tuple[str, ...]


@dataclass(frozen=True)
class Runtime:
    module: str  # the entry point its processes run
    pex_request: PexRequest
    pex: VenvPex
    sources: EntryPointSources

    def process_env(self, root: str = ".") -> dict[str, str]:
        """What a process running the entry point from the runtime PEX in `root` needs: its
        module, and its sources on the PEX's path."""
        sys_path = os.pathsep.join(os.path.join(root, r) for r in self.sources.source_roots)
        return {"PEX_MODULE": self.module, "PEX_EXTRA_SYS_PATH": sys_path}


@rule(desc="Collecting an entry point's sources")
async def entry_point_sources(request: EntryPointSourcesRequest) -> EntryPointSources:
    closure = await Get(TransitiveTargets, TransitiveTargetsRequest([request.entry.address]))
    sources = await Get(
        PythonSourceFiles, PythonSourceFilesRequest(closure.closure, include_files=True)
    )
    return EntryPointSources(sources.source_files.snapshot.digest, tuple(sources.source_roots))


@rule(desc="Building a Kiln runtime PEX")
async def kiln_runtime(request: RuntimeRequest) -> Runtime:
    pex_request, sources = await MultiGet(
        Get(
            PexRequest,
            PexFromTargetsRequest,
            _exact_subset(
                [entry.address for entry in ENTRY_POINTS],  # the same PEX for every entry point
                output_filename=RUNTIME_PEX,
                include_source_files=False,
                # The module (PEX_MODULE) and the sources (PEX_EXTRA_SYS_PATH) come with each
                # process: keep them. The wheels go in as downloaded and are installed once,
                # when the venv is made: packing installed wheels into the PEX costs more than
                # installing them.
                additional_args=("--no-strip-pex-env", "--no-pre-install-wheels"),
            ),
        ),
        Get(EntryPointSources, EntryPointSourcesRequest(request.entry)),
    )
    pex_request = _as_internal(pex_request)
    if request.accelerator in ACCELERATOR_PLUGINS:
        wanted = await Get(AcceleratorPluginsPex, AcceleratorPluginsRequest(request.accelerator))
        plugins = await Get(Pex, PexRequest, wanted.pex_request)
        pex_request = dataclasses.replace(pex_request, pex_path=(*pex_request.pex_path, plugins))
    pex = await Get(VenvPex, PexRequest, pex_request)
    return Runtime(request.entry.module, pex_request, pex, sources)


def shipped_to_nodes(
    runtime: Runtime, plugin_lock: Optional[str] = None, root: str = ""
) -> dict[str, str]:
    """What a process that submits to a Ray cluster ships to its nodes
    (kiln.cluster.runtime_shipping): its runtime PEX and an accelerator plugin's lockfile, as
    paths under `root` (its sandbox), in the variables the runtime reads."""
    shipped = {RUNTIME_PEX_VARIABLE: os.path.join(root, runtime.pex.pex_filename)}
    if plugin_lock:
        shipped[PLUGIN_LOCK_VARIABLE] = os.path.join(root, plugin_lock)
    return shipped


@dataclass(frozen=True)
class RuntimeProcess:
    """A cached (or per-session) process running a runtime entry point in a sandbox."""

    runtime: Runtime
    argv: tuple[str, ...]
    description: str
    input_digest: Digest
    output_directories: tuple[str, ...]
    cache_scope: ProcessCacheScope = ProcessCacheScope.SUCCESSFUL
    timeout_seconds: int | None = None
    # Variables of the caller's environment (credentials): only for PER_SESSION processes, whose
    # keys are never persisted.
    env: FrozenDict[str, str] = FrozenDict()
    # Fixed variables of the process (no secrets): they enter its cache key.
    settings: FrozenDict[str, str] = FrozenDict()
    # Named caches to mount: their names enter the cache key, their contents do not.
    append_only_caches: FrozenDict[str, str] = FrozenDict()

    def __post_init__(self) -> None:
        if self.env and self.cache_scope != ProcessCacheScope.PER_SESSION:
            raise ValueError("a runtime process given the caller's environment is PER_SESSION")


@dataclass(frozen=True)
class KilnProcess:
    """A runtime process, in a result type of its own (docs/architecture.md)."""

    process: Process


@rule
async def runtime_process(request: RuntimeProcess) -> KilnProcess:
    input_digest = await Get(
        Digest, MergeDigests([request.input_digest, request.runtime.sources.digest])
    )
    process = await Get(
        Process,
        VenvPexProcess(
            request.runtime.pex,
            argv=request.argv,
            description=request.description,
            level=LogLevel.INFO,
            input_digest=input_digest,
            extra_env={**request.settings, **request.env, **request.runtime.process_env()},
            output_directories=request.output_directories,
            cache_scope=request.cache_scope,
            timeout_seconds=request.timeout_seconds,
            append_only_caches=request.append_only_caches,
        ),
    )
    return KilnProcess(process)


def rules():
    return collect_rules()
