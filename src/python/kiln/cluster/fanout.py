"""A store-mode token cache tokenized on a Ray cluster: one Ray task per shard, then the merge.

    python -m kiln.cluster.fanout SPEC.json --cluster ADDRESS --prefix STORE
        --shards FOLDER... --out CACHE [--record artifact.json]

The Pants backend runs this one process instead of one shard process per shard when `[kiln]
cluster` names a cluster (docs/clusters.md, "Token caches on the cluster"). It serves a built
cache without contacting the cluster; otherwise it connects, ships Kiln's runtime to the nodes
(kiln.cluster.runtime_shipping), puts the files the spec reads from the working folder (the spec, the
artifact record, repository data files, a repository tokenizer) into Ray's object store once, and
runs `python -m kiln.data.tokenize shard` for every shard as a 1-CPU Ray task, in parallel,
then `merge` as one more task. Every folder (or, with a bucket prefix, every object) is written
by those commands, exactly as a store-mode build here writes it: a finished shard is skipped,
STATUS comes last, and the cache is byte-identical to one built here.

Exit status: 0 built (or already built); 1 one line about the cluster (unreachable, another Ray
version, no CPU, a task lost with its node); a failed task's own status (2 bad input, 4 storage:
docs/token-cache.md), its message naming the cache and the shard; 130 interrupted (the tasks
are cancelled).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.artifacts.locations import open_store
from kiln.artifacts.storage_errors import EXIT_STORAGE, as_storage_error
from kiln.cluster import node_runtime, tokenize_task
from kiln.cluster.connection import connect, resolve_address
from kiln.cluster.dispatch import host_environment
from kiln.cluster.errors import ClusterError
from kiln.cluster.placement import fits
from kiln.cluster.runtime_shipping import ship_runtime
from kiln.data.errors import KilnDataError, SpecError
from kiln.data.hub_settings import apply_hub_settings
from kiln.data.sources import expand_paths
from kiln.data.spec import parse_cache_spec
from kiln.data.tokenize import already_built
from kiln_contract.location import in_bucket
from kiln_contract.tokenize import HUB_VARIABLES, CacheSpec, FilesSource, LevanterCacheSource
from kiln_contract.train import Resources

TASK_SPEC = "tokenize_spec.json"  # the names the spec and the record have in a task's folder
TASK_RECORD = "artifact_record.json"
TASK_CPUS = 1
# Folders of the submitting machine: a node keeps its own Hugging Face cache.
MACHINE_LOCAL_HUB_VARIABLES = ("HF_HOME", "HF_HUB_CACHE")


class TaskFailed(ClusterError):
    """A shard's or the merge's tokenize process failed: its exit status is this command's."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class FanOut:
    """One cache's tasks: the tokenize command lines each runs, and where they write."""

    spec: CacheSpec
    shards: tuple[str, ...]  # local folders, or bucket URLs
    out: str
    prefix: str
    address: str
    record: bool

    @property
    def ref(self) -> str:
        return f"{self.spec.name}@{self.spec.version}"

    @property
    def _root(self) -> list[str]:
        """Local folders are confined to the store; a bucket's keys are its own."""
        return [] if in_bucket(self.prefix) else ["--root", self.prefix]

    def shard_argv(self, index: int) -> list[str]:
        return ["shard", TASK_SPEC, "--index", str(index), "--out", self.shards[index],
                "--unless-built", self.out, *self._root]  # fmt: skip

    def merge_argv(self) -> list[str]:
        record = ["--record", TASK_RECORD] if self.record else []
        return ["merge", TASK_SPEC, "--shards", *self.shards, "--out", self.out, *record,
                *self._root]  # fmt: skip


def task_files(spec: CacheSpec, spec_bytes: bytes, record: Path | None) -> dict[str, bytes]:
    """What a task's folder holds: the spec, the record, and the files the spec names relative
    to the working folder (data files, a local tokenizer). Absolute paths are read where they
    are: on the cluster they must be on a filesystem every node shares."""
    files = {TASK_SPEC: spec_bytes}
    if record is not None:
        files[TASK_RECORD] = record.read_bytes()
    relative: list[Path] = []
    if isinstance(spec.source, FilesSource):
        relative += [p for p in expand_paths(spec.source.paths) if not p.is_absolute()]
    if spec.tokenizer.kind == "local" and not os.path.isabs(spec.tokenizer.path or ""):
        folder = Path(spec.tokenizer.path or "")
        relative += [p for p in sorted(folder.rglob("*")) if p.is_file()]
    for path in relative:
        if ".." in path.parts:
            raise SpecError(
                f"{path}: a cache tokenized on a cluster ships the files it reads from below "
                "the working folder; give this one as an absolute path on a filesystem every "
                "node mounts."
            )
        files[str(path)] = path.read_bytes()
    return files


def hub_environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The hub settings the tasks need (a token, an endpoint, offline switches): task arguments,
    never command lines or logs."""
    wanted = set(HUB_VARIABLES) - set(MACHINE_LOCAL_HUB_VARIABLES)
    return {name: environ[name] for name in sorted(wanted) if environ.get(name)}


def check_cpus(nodes: list[Mapping[str, Any]], address: str) -> None:
    """Ray waits forever for a task no node can run: refuse a cluster without a CPU at once."""
    if not any(n.get("Alive") and fits(n.get("Resources", {}), {"CPU": TASK_CPUS}) for n in nodes):
        raise ClusterError(
            f"the Ray cluster at {address} has no alive node with {TASK_CPUS} CPU to tokenize on"
        )


def build(ray: Any, fan_out: FanOut, files: dict[str, bytes]) -> None:
    """On the cluster `ray` is connected to: ships Kiln's code, runs every shard's task at once,
    then the merge's. On a failure, cancels the rest (the shards finished so far stay for the
    next build) and raises."""
    check_cpus(ray.nodes(), fan_out.address)
    runtime = ship_runtime(ray, Resources(kind="cpu")).to_json()
    ray.cloudpickle.register_pickle_by_value(tokenize_task)  # nodes need no Kiln to run it
    task = ray.remote(tokenize_task.run_tokenize).options(
        num_cpus=TASK_CPUS, runtime_env=node_runtime.worker_env()
    )
    inputs = ray.put(files)  # sent once; each node fetches it once
    secrets = {**hub_environment(), **host_environment()}  # the Hub's, a bucket's
    pending = {
        task.remote(inputs, fan_out.shard_argv(i), runtime, secrets): i
        for i in range(fan_out.spec.num_shards)
    }
    try:
        while pending:
            [done], _ = ray.wait(list(pending), num_returns=1)
            index = pending.pop(done)
            _finished(ray, done, fan_out, f"shard {index} of {fan_out.spec.num_shards}")
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)  # its tokenize process stops with its worker
    _finished(ray, task.remote(inputs, fan_out.merge_argv(), runtime, secrets), fan_out, "merge")


def _finished(ray: Any, ref: Any, fan_out: FanOut, what: str) -> None:
    """Prints a finished task's output; raises if its process failed or its node was lost."""
    try:
        exit_code, lines = ray.get(ref)
    except ray.exceptions.RayError as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ClusterError(
            f"{fan_out.ref}: the task of {what} was lost on the Ray cluster at "
            f"{fan_out.address} ({reason}); rerun: finished shards are kept"
        ) from None
    for line in lines:
        print(f"({what}) {line}", file=sys.stderr, flush=True)
    if exit_code != 0:
        errors = [line for line in lines if line.startswith("error: ")] or lines or ["no output"]
        raise TaskFailed(
            f"{fan_out.ref}: {what} failed on the Ray cluster at {fan_out.address} "
            f"(exit {exit_code}): {errors[-1].removeprefix('error: ')}",
            exit_code,
        )


def main(argv: list[str] | None = None) -> int:
    apply_hub_settings()  # the Pants backend's hub settings file, as for a local build
    args = _parser().parse_args(argv)
    try:
        return _command(args)
    except KeyboardInterrupt:  # the tasks were cancelled on the way out
        print("kiln: interrupted; the shards finished so far are kept", file=sys.stderr)
        return 130
    except TaskFailed as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return e.exit_code
    except ClusterError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 1
    except KilnDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        failure = as_storage_error(e, args.prefix)
        if failure is None:
            raise
        print(f"error: {failure}", file=sys.stderr)
        return EXIT_STORAGE


def _command(args: argparse.Namespace) -> int:
    spec_bytes, spec = _read_spec(args.spec)
    if isinstance(spec.source, LevanterCacheSource):
        raise SpecError(f"{spec.name}: a levanter_cache source is imported, not tokenized.")
    if len(args.shards) != spec.num_shards:
        raise SpecError(f"--shards names {len(args.shards)} folders for {spec.num_shards} shards.")
    if already_built(spec, open_store(args.out)):  # no cluster needed to see it
        print(f"{spec.name}@{spec.version}: already built at {args.out}", file=sys.stderr)
        return 0
    files = task_files(spec, spec_bytes, args.record)
    address = resolve_address(args.cluster)
    if address is None:
        raise ClusterError(f"--cluster {args.cluster!r} names no cluster; tokenize here instead")
    fan_out = FanOut(spec, tuple(args.shards), args.out, args.prefix, address, bool(args.record))
    ray = connect(address)
    try:
        build(ray, fan_out, files)
    finally:
        ray.shutdown()
    print(f"{fan_out.ref}: cache ready at {fan_out.out}", file=sys.stderr)
    return 0


def _read_spec(path: Path) -> tuple[bytes, CacheSpec]:
    try:
        content = path.read_bytes()
        return content, parse_cache_spec(json.loads(content))
    except FileNotFoundError:
        raise SpecError(f"{path}: no such spec file.") from None
    except json.JSONDecodeError as e:
        raise SpecError(f"{path}: not valid JSON ({e}).") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kiln.cluster.fanout", description=__doc__.split("\n")[0]
    )
    parser.add_argument("spec", type=Path)
    parser.add_argument("--cluster", required=True, help="ray://HOST:PORT, HOST:PORT or auto")
    parser.add_argument("--prefix", required=True, help="the artifact store: a folder or a URL")
    parser.add_argument("--shards", nargs="+", required=True, help="one folder (or URL) each")
    parser.add_argument("--out", required=True, help="the cache's folder (or URL)")
    parser.add_argument("--record", type=Path, help="an artifact.json to place in the cache")
    return parser


if __name__ == "__main__":
    sys.exit(main())
