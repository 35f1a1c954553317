"""Build a token cache from a step spec: the CLI the Pants backend runs, and `build_cache` for tests.

    python -m kiln.data.tokenize shard SPEC.json --index I --out DIR
    python -m kiln.data.tokenize merge SPEC.json --shards DIR0 DIR1 ... --out CACHE_DIR
    python -m kiln.data.tokenize build SPEC.json --out CACHE_DIR
    python -m kiln.data.tokenize import SPEC.json --out CACHE_DIR
    python -m kiln.data.tokenize many MANIFEST.json
    python -m kiln.data.tokenize plan SPEC.json... [--json]

`import` is for a `levanter_cache` source (kiln.data.levanter_cache): it checks the cache and
writes the Kiln cache that reads it in place; `build` of such a spec imports too. `shard`
tokenizes shard I of config.num_shards into one shard folder; `merge` moves complete shard
folders into CACHE_DIR and writes the ledger, stats, tokenizer metadata and, last, STATUS SUCCESS;
`build` does both in one process (resuming: complete shards of an interrupted build are kept).
`many` runs several small caches' command lines in this one process, each cache's in order (the
Pants backend batches one-shard store caches so: a process per cache would cost more than its
tokenizing); MANIFEST.json is a list with, per cache, `{"name": WHAT, "commands": [["shard",
...], ["merge", ...]]}`. A cache that fails is reported (its error, then `error: WHAT failed`),
and the others are still built.
`plan` prints the files (pieces, units) and bytes each shard of each spec reads, or for an
import the Levanter cache's layout, parts, documents and tokens from its ledger, and writes
nothing; `--json` prints one line per spec, as `pants plan` reads them: a JSON list with an
object per shard (an import's: one `{"imported": ...}`), `{"error": WHY}` for a spec that cannot
be planned (its hub unreachable, say), or `{"refused": WHY}` for an import Kiln cannot make (its
ledger's layout or counts); neither stops the others.

Every folder may be a bucket URL as well (`s3://…` or `gs://…`: storage="store" with a bucket
prefix): the commands take the same steps through the object store. A bucket has no rename, so
a shard in a bucket is built at its place in the cache, `--out CACHE/shards/shard-NNNNN` with
`--unless-built CACHE`, tokenized in a local staging folder and uploaded, STATUS last; `merge`
(with those shard URLs) leaves the shards where they are (kiln.data.cache_writer). `build`
writes a local folder only.

One builder per folder: `shard` holds its shard folder's lease, `merge` the cache's lease and
then each shard's, `build` the cache's (kiln.artifacts.lease). A second builder waits for the
lease, then finds the work done and uses it. Each `shard` of a store-mode cache also leaves a
build hold on the cache (kiln.artifacts.holds) that the merge ends: housekeeping keeps the
cache from its first shard to its merge, between shard processes too.

Exit status (`many`: the worst of its caches'): 0 done (or already done); 2 bad input or damaged content (one paragraph); 4
(EXIT_STORAGE) a storage error, as one line `error: PATH: CAUSE` (rerun once it is fixed: the
build resumes). See docs/token-cache.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kiln import lifetime  # before the slow imports: it notes the parent process
from kiln.artifacts import RECORD_FILE, RUNNING, holds
from kiln.artifacts.atomic import atomic_write_bytes
from kiln.artifacts.folder import ArtifactFolder
from kiln.artifacts.lease import Lease, LeaseHeld
from kiln.artifacts.locations import open_store
from kiln.artifacts.storage_errors import (
    EXIT_STORAGE,
    StorageError,
    as_storage_error,
    refused_store_write,
)
from kiln.artifacts.store import ObjectStore
from kiln.containment import OutsideRoot, within
from kiln.data import sources
from kiln.data.cache_build import (  # noqa: F401 - ENCODE_BATCH_DOCUMENTS: for benchmarks
    ENCODE_BATCH_DOCUMENTS,
    already_built,
    build_cache,
    check_placeable,
    merge_cache,
    merge_shards,
    ref,
    served,
    tokenize_shard,
    write_shard_unless_done,
)
from kiln.data.cache_writer import remove_dead_temporaries
from kiln.data.errors import KilnDataError, SpecError
from kiln.data.hub_settings import apply_hub_settings
from kiln.data.levanter_cache import import_levanter_cache, plan_import
from kiln.data.spec import parse_cache_spec
from kiln.data.tokenizer import LoadedTokenizer, load_tokenizer
from kiln_contract.location import location_argument
from kiln_contract.tokenize import CacheSpec, LevanterCacheSource, TokenizerSpec

__all__ = ["already_built", "build_cache", "main", "merge_cache", "tokenize_shard"]

# A tokenize process whose Pants process died ends at SIGTERM; SIGKILL follows if it does not.
ORPHAN_GRACE_SECONDS = 5.0

# --- the command line ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    # transformers warns on import that PyTorch is absent: true, and irrelevant for tokenizing.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    # A cache's shards run as parallel processes, up to one per core (Pants' process limit, 1-CPU
    # Ray tasks): each encodes on one thread, as `plan`'s CPU-hours and the benchmark count them,
    # instead of every process's Rust encoder spreading over all the cores.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    apply_hub_settings()  # before huggingface_hub is imported: it reads HF_HOME etc. once
    args = _parser().parse_args(argv)
    lifetime.stop_when_orphaned(ORPHAN_GRACE_SECONDS)
    if args.command == "many":
        return _many_command(args.manifest)
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    """One command; its exit status (the module's docstring). A store-mode cache whose build
    fails records why (`_record_failure`)."""
    finished: str | Path | None = None
    try:
        _check_locations(args)
        _check_contained(args)
        if args.command == "plan":
            _plan_command(args.spec, args.json)
            return 0
        raw_spec = _read_spec_file(args.spec)
        spec = parse_cache_spec(raw_spec)
        # Every folder the command names, opened once, where its location enters the process.
        opened = {where: open_store(where) for where in _named_folders(args)}
        # The finished cache: a shard's --unless-built, else --out.
        finished = args.out if args.command != "shard" else args.unless_built
        cache = None if finished is None else opened[finished]
        if cache is not None and served(spec, cache):  # no lease needed to see it
            return 0
        _check_command_fits_source(spec, args.command)
        if args.command == "shard":
            _shard_command(spec, args, opened[args.out], cache)
        elif args.command == "build":
            build_cache(raw_spec, args.out)
            print(f"{ref(spec)}: cache ready at {args.out}", file=sys.stderr)
        elif args.command == "merge":
            assert cache is not None  # merge and import name the cache as --out
            _merge_command(spec, args, cache, [opened[shard] for shard in args.shards])
        else:
            assert cache is not None
            _import_command(spec, args, cache)
    except Exception as e:
        reason = _failure_line(e, args)
        if reason is None:
            raise
        print(f"error: {reason}", file=sys.stderr)
        _record_failure(args.command, finished, reason)
        return 2 if isinstance(e, KilnDataError) else EXIT_STORAGE
    return 0


def _failure_line(error: Exception, args: argparse.Namespace) -> str | None:
    """The one line an expected failure of the command prints and records: bad input or damaged
    content in Kiln's words; a storage error as `PATH: CAUSE` (the command's folder when the
    error names no path), and a store (--root) that refuses writes with what to do. None for
    any other error, a bug, whose traceback is the report."""
    if isinstance(error, KilnDataError):
        return str(error)
    root = getattr(args, "root", None)
    refused = None if root is None else refused_store_write(error, root)
    failure = refused or as_storage_error(error, getattr(args, "out", None) or args.spec)
    return None if failure is None else str(failure)


def _record_failure(command: str, cache: str | os.PathLike[str] | None, reason: str) -> None:
    """A shard or merge of a store-mode cache failed: STATUS FAILED and the reason in the cache's
    folder, for `plan` and the next build, under the cache's lease (another builder holding it
    speaks for itself). A finished cache stays as it is. A merge has recorded its failure under
    its own lease already; on a full disk this second record may find the room for the reason
    that its released leases gave back."""
    if command not in ("shard", "merge", "import") or cache is None:
        return
    folder = ArtifactFolder.at(cache)
    # A store that refused the build (no bucket, no permission) refuses the record too.
    with contextlib.suppress(LeaseHeld, OSError, StorageError):
        with Lease.beside(cache, what=f"record a failed {command}").acquire(wait=False):
            if not folder.is_built():
                folder.mark_failed(reason)


def _many_command(manifest: Path) -> int:
    """Each cache's commands in order, until one fails; then the next cache."""
    try:
        caches = _read_json(manifest, what="manifest")
    except KilnDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    worst = 0
    for cache in caches:
        for argv in cache["commands"]:
            status = _run(_parser().parse_args(argv))
            worst = max(worst, status)
            if status != 0:
                print(f"error: {cache['name']} failed", file=sys.stderr)
                break
    return worst


def _check_command_fits_source(spec: CacheSpec, command: str) -> None:
    imported = isinstance(spec.source, LevanterCacheSource)
    if imported and command in ("shard", "merge"):
        raise SpecError(
            f"{ref(spec)}: a {spec.source.kind} source is imported, not tokenized: run "
            "`python -m kiln.data.tokenize import` (or `build`)."
        )
    if not imported and command == "import":
        raise SpecError(
            f"{ref(spec)}: only a levanter_cache source is imported; a {spec.source.kind} "
            "source is tokenized with `shard` and `merge` (or `build`)."
        )


def _plan_command(spec_files: list[Path], as_json: bool) -> None:
    for spec_file in spec_files:
        if as_json:
            print(json.dumps(_plan_json(spec_file)), flush=True)
        else:
            _print_plan(parse_cache_spec(_read_spec_file(spec_file)))


def _plan_json(spec_file: Path) -> Any:
    """For `pants plan`: one object per shard, in index order; or why there is no plan."""
    try:
        spec = parse_cache_spec(_read_spec_file(spec_file))
        if isinstance(spec.source, LevanterCacheSource):
            return _import_plan_json(spec)
        return [_shard_plan_json(spec, index) for index in range(spec.num_shards)]
    except KilnDataError as e:
        return {"error": str(e)}
    except Exception as e:
        failure = as_storage_error(e, spec_file)
        if failure is None:
            raise
        return {"error": str(failure)}


def _import_plan_json(spec: CacheSpec) -> Any:
    """An import's plan is its ledger: a list of one {"imported": ...}; a ledger Kiln cannot
    import is {"refused": why}, which fails `pants plan`."""
    try:
        return [{"imported": plan_import(spec)}]
    except KilnDataError as e:
        return {"refused": str(e)}


def _print_plan(spec: CacheSpec) -> None:
    if isinstance(spec.source, LevanterCacheSource):
        imported = plan_import(spec)
        tokens = "an unrecorded number of" if imported["tokens"] is None else f"{imported['tokens']:,}"
        print(
            f"imports the Levanter cache at {imported['location']}: {imported['layout']} layout, "
            f"{imported['parts']} part(s), {imported['documents']:,} documents, {tokens} tokens"
        )
        return
    for index in range(spec.num_shards):
        sizes = sources.shard_sizes(spec.source, spec.num_shards, index)
        if sizes is None:
            streamed = sources.shard_plan(spec.source, spec.num_shards, index)[0]
            print(f"shard {index}/{spec.num_shards}: {streamed}")
            continue
        print(f"shard {index}/{spec.num_shards}: {len(sizes)} files, {sum(sizes.values()):,} bytes")
        for key, size in sizes.items():
            print(f"  {key} ({size:,} bytes)")


def _shard_plan_json(spec: CacheSpec, index: int) -> dict[str, Any]:
    """{"files": {key: bytes}} in read order, or {"streamed": how} for a streamed source."""
    sizes = sources.shard_sizes(spec.source, spec.num_shards, index)
    if sizes is None:
        return {"streamed": sources.shard_plan(spec.source, spec.num_shards, index)[0]}
    return {"files": sizes}


def _shard_command(
    spec: CacheSpec, args: argparse.Namespace, shard: ObjectStore, cache: ObjectStore | None
) -> None:
    """Tokenizes shard --index into --out unless it is done: that folder complete, or (store
    mode) the cache built or holding the shard already. The stores are checked first (a missing
    bucket or an unreachable endpoint fails here), then the lease is taken (a denied write fails
    here): either way one line naming the URL, before anything is tokenized."""
    if not 0 <= args.index < spec.num_shards:
        raise SpecError(
            f"--index {args.index} is out of range: config.num_shards is {spec.num_shards}."
        )
    if cache is None and shard.root_location.in_bucket:
        raise SpecError(
            f"shard --out {args.out}: a shard in a bucket is built at its place in the cache; "
            "give the cache as --unless-built CACHE_URL."
        )
    if cache is not None:
        check_placeable(spec, args.index, shard, cache)
        cache.check()
    what = f"tokenize {ref(spec)} shard {args.index}"
    with contextlib.ExitStack() as held:
        if cache is not None:  # store mode: the cache is held from its first shard to its merge
            held.enter_context(holds.building(args.unless_built, what))
        held.enter_context(Lease.beside(args.out, what=what).acquire(wait=True))
        if cache is None or not served(spec, cache):
            tokenizer = _tokenizer(spec)
            write_shard_unless_done(spec, args.index, shard, cache, tokenizer)
    staging = shard.root_location.folder
    if cache is not None and staging is not None and ArtifactFolder(cache, "").is_built():
        _remove_if_empty(staging.parent)  # merged while this waited



def _merge_command(
    spec: CacheSpec, args: argparse.Namespace, cache: ObjectStore, shards: list[ObjectStore]
) -> None:
    """Merges under the cache's lease and each shard's (none is being written meanwhile); a
    cache another builder finished while this one waited is served."""
    cache.check()
    with contextlib.ExitStack() as leases:
        leases.enter_context(Lease.beside(args.out, what=f"merge {ref(spec)}").acquire(wait=True))
        if served(spec, cache):
            return
        folder = ArtifactFolder(cache, "")
        with _failure_recorded(folder, args):
            folder.clear_stop_reason()  # an earlier build's failure
            # First: a disk that fills up later still has this file to overwrite with FAILED.
            folder.write_status(RUNNING)
            for shard in args.shards:
                what = f"merge {ref(spec)} (shard {os.fspath(shard).rpartition('/')[2]})"
                leases.enter_context(Lease.beside(shard, what=what).acquire(wait=True))
            record = None if args.record is None else args.record.read_bytes()
            merge_shards(spec, shards, cache, _tokenizer(spec), artifact_record=record)
            holds.end_build_holds(args.out)
        print(f"{ref(spec)}: cache ready at {args.out}", file=sys.stderr)
    for staging in {shard.parent for shard in args.shards if isinstance(shard, Path)}:
        remove_dead_temporaries(staging)  # what killed builds left in .{version}.shards/
        _remove_if_empty(staging)


@contextlib.contextmanager
def _failure_recorded(folder: ArtifactFolder, args: argparse.Namespace) -> Iterator[None]:
    """Under the cache's lease: an expected failure of the body leaves STATUS FAILED and its
    line in the cache before the leases are let go. Recorded afterwards, under a new lease, it
    would find no room for that lease on a full disk."""
    try:
        yield
    except Exception as e:
        reason = _failure_line(e, args)
        if reason is not None:
            with contextlib.suppress(OSError, StorageError):  # as far as the store allows
                folder.mark_failed(reason)
        raise


def _remove_if_empty(folder: Path) -> None:
    """Removes a shard staging folder once nothing is left in it (no shard, no lease)."""
    with contextlib.suppress(OSError):
        folder.rmdir()


def _import_command(spec: CacheSpec, args: argparse.Namespace, cache: ObjectStore) -> None:
    """Imports under the cache's lease, the artifact record placed before STATUS (the imported
    arrays stay where they are)."""
    cache.check()
    with Lease.beside(args.out, what=f"import {ref(spec)}").acquire(wait=True):
        if served(spec, cache):
            return
        tokenizer = _tokenizer(spec)
        with ArtifactFolder(cache, "").local_output() as folder:
            if args.record is not None:
                atomic_write_bytes(folder / RECORD_FILE, args.record.read_bytes())
            import_levanter_cache(spec, folder, tokenizer)
        print(f"{ref(spec)}: imported at {args.out}", file=sys.stderr)


def _check_locations(args: argparse.Namespace) -> None:
    """A command's folders are all local paths (Path) or all bucket URLs (str), as the arguments
    were parsed: a cache in a bucket is built in that bucket."""
    urls = [isinstance(location, str) for location in _named_folders(args)]
    if any(urls) and not all(urls):
        raise SpecError(
            f"{args.command}: --out and the shard folders must all be local paths or all be "
            "bucket URLs; a cache in a bucket is built in that bucket."
        )
    if args.command == "build" and isinstance(args.out, str):
        raise SpecError(
            f"build --out {args.out}: a cache in a bucket is built with `shard` and `merge` "
            "(storage=\"store\"), or built locally and uploaded."
        )
    if any(urls) and args.root is not None:
        raise SpecError("--root confines local folders; a bucket cache's keys are its own.")


def _named_folders(args: argparse.Namespace) -> list[str | Path]:
    """The folders a command names: --out, a shard's --unless-built, a merge's --shards."""
    named = [
        getattr(args, "out", None),  # `plan` writes nothing
        getattr(args, "unless_built", None),
        *(getattr(args, "shards", None) or []),
    ]
    return [location for location in named if location is not None]


def _check_contained(args: argparse.Namespace) -> None:
    """With --root (the artifact store, for store-mode caches), every folder this command writes
    or moves must resolve inside it, before anything is written."""
    if args.root is None:
        return
    written = [args.out, *(args.shards if args.command == "merge" else [])]
    try:
        for path in written:
            within(path, args.root, "the folder")
    except OutsideRoot as e:
        raise SpecError(str(e)) from None


_tokenizers: dict[TokenizerSpec, LoadedTokenizer] = {}


def _tokenizer(spec: CacheSpec) -> LoadedTokenizer:
    """Loaded once per process: `many` builds caches that mostly share one tokenizer."""
    if spec.tokenizer not in _tokenizers:
        _tokenizers[spec.tokenizer] = load_tokenizer(spec.tokenizer)
    return _tokenizers[spec.tokenizer]


def _read_spec_file(path: Path) -> Any:
    return _read_json(path, what="spec")


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SpecError(f"{path}: no such {what} file.") from None
    except json.JSONDecodeError as e:
        raise SpecError(f"{path}: not valid JSON ({e}).") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kiln.data.tokenize", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    shard = commands.add_parser("shard", help="tokenize one shard into a shard folder")
    shard.add_argument("spec", type=Path)
    shard.add_argument("--index", type=int, required=True)
    shard.add_argument("--out", type=location_argument, required=True)
    shard.add_argument(
        "--unless-built",
        type=location_argument,
        help="do nothing if this cache is already built (store mode)",
    )
    merge = commands.add_parser("merge", help="assemble shard folders into a cache")
    merge.add_argument("spec", type=Path)
    merge.add_argument("--shards", type=location_argument, nargs="+", required=True)
    merge.add_argument("--out", type=location_argument, required=True)
    merge.add_argument("--record", type=Path, help="an artifact.json to place in the cache")
    build = commands.add_parser("build", help="all shards in this process, then merge")
    build.add_argument("spec", type=Path)
    build.add_argument("--out", type=location_argument, required=True)
    imported = commands.add_parser("import", help="import a levanter_cache source")
    imported.add_argument("spec", type=Path)
    imported.add_argument("--out", type=location_argument, required=True)
    imported.add_argument("--record", type=Path, help="an artifact.json to place in the cache")
    many = commands.add_parser("many", help="several caches' command lines in one process")
    many.add_argument("manifest", type=Path)
    plan = commands.add_parser("plan", help="print the files and bytes each shard reads")
    plan.add_argument("spec", type=Path, nargs="+")
    plan.add_argument("--json", action="store_true", help="a JSON line per spec: its shards")
    plan.set_defaults(root=None)  # it writes nothing
    for command in (shard, merge, build, imported):
        command.add_argument(
            "--root", type=Path, help="every folder written must resolve inside this one"
        )
    return parser


if __name__ == "__main__":
    sys.exit(main())
