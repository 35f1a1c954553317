"""Pants goals on graphs of a hundred to thousands of artifacts: list, plan, build, no-op build.

    ./pants run benchmarks/graph_scale.py -- --repo "$PWD" [--caches 100 1000 5000]
        [--storage store|inline] [--work DIR]

For each size N a copy of this workspace gets, in a temporary folder (nothing is committed),
`scale/caches/BUILD`: N `tokenized_cache` targets (`storage="store"`, or the default `inline`),
each of one local jsonl file of one document (about 130 tokens) in the repository, and
`scale/BUILD`: one `lm_checkpoint` mixing all of them. The documents carry a token of the run,
so no earlier run's results in Pants' cache serve them. Then, timed as a user waits for each command (wall seconds, the client's start
included):
- `list scale::` and `plan scale:big` in a fresh Pants (`--no-pantsd`: nothing memoized, and no
  wait for a daemon to start, which a loaded machine can stretch past the client's 60 s);
- `list scale::` with pantsd up, then `plan scale:big` with the plan not yet computed ("cold"),
  then again ("warm");
- `build scale/caches:` from nothing (every cache tokenized into the store), then `build
  scale:big` (the checkpoint trained on all of them), then `build scale/caches:` again: the
  no-op of a built graph;
- with store caches, the same caches built in a bucket (`--kiln-prefix=s3://...` on moto, `gs://...` on
  fake-gcs-server, both on loopback: kiln_testing.buckets): `plan scale:big`, once warm; and the
  same record reads made in this process, without Pants or a process to start: the server's
  floor (moto is Python and answers a few hundred requests a second).
Each row also gives seconds per 1,000 targets and the ratio to `list` of the same graph in the
same daemon state (fresh or warm: Pants' floor for a goal on that graph). Goals: plan <= 5 ms
per cache (5 s at 1,000) cold with pantsd up and for built caches in a bucket, <= 30 s fresh;
1,000 caches and the checkpoint built in <= 5 min, 5,000 in <= 20 min.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from report_table import markdown_table

if TYPE_CHECKING:
    from kiln.artifacts.store import ObjectStore

WORKSPACE = ("pants", "pants.toml", "ruff.toml", "mypy.ini", "3rdparty", "src", "experiments")
VERSION = "2026.12.02"
CACHE = """tokenized_cache(
    name="c{i}",
    artifact_name="scale/c{i}",
    sources=["texts/c{i}.jsonl"],
    tokenizer="//experiments/tokenizers:kiln-stdlib-8k",
    version="{version}",{storage}
)
"""
CHECKPOINT = """lm_checkpoint(
    name="big",
    artifact_name="checkpoints/scale",
    version="{version}",
    model=llama(max_seq_len=64, hidden_dim=32, intermediate_dim=64, num_heads=2,
                num_kv_heads=1, num_layers=1),
    optimizer=adam(learning_rate=1e-2, warmup=2),
    datasets={datasets},
    validation=["//scale/caches:c0"],
    batch_size=4,
    seq_len=64,
    num_train_steps=20,
    z_loss_weight=None,
    evals=None,
    resources=cpu(),
)
"""
HEADER = ["caches", "command", "s", "s per 1,000 targets", "vs list (same daemon state)"]
PLANNED = re.compile(r"^\s+\S.*?\s([0-9a-f]{16})\s+tokenized_cache\s+(\S+)@(\S+)\s", re.MULTILINE)


def workspace(repo: Path, root: Path, caches: int, storage: str) -> Path:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for name in WORKSPACE:
        source = repo / name
        if source.is_dir():
            shutil.copytree(source, root / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, root / name)
    texts = root / "scale/caches/texts"
    texts.mkdir(parents=True)
    run = os.urandom(4).hex()
    for i in range(caches):
        text = f"Cache {i} of run {run}. " + "The quick brown fox jumps over the lazy dog. " * 12
        (texts / f"c{i}.jsonl").write_text(json.dumps({"text": text}) + "\n")  # one document
    field = '\n    storage="store",' if storage == "store" else ""
    build = "\n".join(CACHE.format(i=i, version=VERSION, storage=field) for i in range(caches))
    (root / "scale/caches/BUILD").write_text(build)
    datasets = "{" + ", ".join(f'"//scale/caches:c{i}": 1.0' for i in range(caches)) + "}"
    (root / "scale/BUILD").write_text(CHECKPOINT.format(version=VERSION, datasets=datasets))
    return root


def pants(root: Path, *args: str, env: dict[str, str] | None = None) -> tuple[float, str]:
    """Wall seconds of one `./pants` command, and its stdout; it must succeed."""
    started = time.perf_counter()
    result = subprocess.run(["./pants", *args], cwd=root, capture_output=True, text=True,
                            env=env or clean_environment())  # fmt: skip
    seconds = time.perf_counter() - started
    print(f"./pants {' '.join(args)}: {seconds:.2f} s", file=sys.stderr, flush=True)  # as it goes
    if result.returncode != 0:
        raise RuntimeError(f"./pants {' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return seconds, result.stdout


def clean_environment() -> dict[str, str]:
    """This process's environment without what `./pants run` set for it (the runtime PEX's)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("PEX_", "PANTS_"))}


def start_pantsd(root: Path, attempts: int = 5) -> None:
    """`list scale::` until pantsd answers: on a loaded machine the daemon can take longer to
    start than the client waits (60 s), and it goes on starting after the client gives up."""
    for attempt in range(attempts):
        try:
            pants(root, "list", "scale::")
            return
        except RuntimeError:
            if attempt == attempts - 1:
                raise


def stop_pantsd(root: Path) -> None:
    title = f"pantsd [{root}]".encode()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes().startswith(title):
                os.kill(int(entry.name), signal.SIGKILL)
        except OSError:
            continue
    time.sleep(1)


def mark_built(plan_output: str, store: ObjectStore) -> int:
    """Writes each planned cache's record and STATUS SUCCESS into a bucket's store, as a build
    leaves them."""
    marked = 0
    for fingerprint, name, version in PLANNED.findall(plan_output):
        record = json.dumps({"kind": "tokenized_cache", "name": name, "version": version,
                             "fingerprint": fingerprint}).encode()  # fmt: skip
        store.write(f"{name}/{version}/artifact.json", record)
        store.write(f"{name}/{version}/STATUS", b"SUCCESS\n")
        marked += 1
    return marked


def measure(root: Path, caches: int, storage: str) -> dict[str, float]:
    times: dict[str, float] = {}
    stop_pantsd(root)
    times["list, fresh (no daemon)"], _ = pants(root, "--no-pantsd", "list", "scale::")
    times["plan, fresh (no daemon)"], _ = pants(root, "--no-pantsd", "plan", "scale:big")
    start_pantsd(root)  # the BUILD files parsed, nothing planned
    times["list, warm"], _ = pants(root, "list", "scale::")
    times["plan, pantsd up, cold"], planned = pants(root, "plan", "scale:big")
    times["plan, warm"], _ = pants(root, "plan", "scale:big")
    times["build of the caches, from nothing"], _ = pants(root, "build", "scale/caches:")
    times["build of the checkpoint, caches built"], _ = pants(root, "build", "scale:big")
    times["build of built caches, no-op"], _ = pants(root, "build", "scale/caches:")
    if storage == "store":
        times.update(bucket_plans(root, planned, caches))
    stop_pantsd(root)
    return times


def bucket_plans(root: Path, planned: str, caches: int) -> dict[str, float]:
    """`plan` of the graph with every cache built in a bucket, warm, on each loopback server;
    and, as the server's floor, the same record reads in this process without Pants."""
    from kiln_testing.buckets import BUCKET, gcs_endpoint, s3_endpoint

    from kiln.artifacts.locations import open_store
    from kiln.artifacts.store import read_texts

    times: dict[str, float] = {}
    for scheme, server, endpoint in (("s3", "moto", s3_endpoint), ("gs", "fake-gcs-server", gcs_endpoint)):  # fmt: skip
        with tempfile.TemporaryDirectory() as scratch, endpoint(Path(scratch)):
            prefix = f"{scheme}://{BUCKET}/graph-scale"
            store = open_store(prefix)
            assert mark_built(planned, store) == caches
            option = f"--kiln-prefix={prefix}"
            pants(root, option, "plan", "scale:big")
            seconds, output = pants(root, option, "plan", "scale:big")
            assert f"{caches} built" in output, output[-2000:]
            times[f"plan, built in {scheme}:// ({server})"] = seconds
            keys = [f"{name}/{version}/{file}" for _, name, version in PLANNED.findall(planned)
                    for file in ("STATUS", "artifact.json")]  # fmt: skip
            started = time.perf_counter()
            assert all(read_texts(store, keys).values())
            times[f"its {len(keys):,} reads alone, in-process ({server})"] = (
                time.perf_counter() - started
            )
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", type=Path, required=True, help="this workspace (`pants run` "
                        "runs the benchmark in a sandbox)")  # fmt: skip
    parser.add_argument("--caches", type=int, nargs="+", default=[100, 1000, 5000])
    parser.add_argument("--storage", choices=["store", "inline"], default="store")
    parser.add_argument("--work", type=Path, default=Path("/tmp/kiln-graphs"))
    args = parser.parse_args(argv)
    rows = []
    for caches in args.caches:
        root = workspace(args.repo, args.work / f"graph-{caches}", caches, args.storage)
        times = measure(root, caches, args.storage)
        targets = caches + 1
        for command, seconds in times.items():
            floor = times["list, fresh (no daemon)" if "fresh" in command else "list, warm"]
            per_thousand = seconds / targets * 1000
            rows.append([f"{caches:,} {args.storage}", command, f"{seconds:.2f}", f"{per_thousand:.2f}",
                         f"{seconds / floor:.2f}x"])  # fmt: skip
        print(markdown_table(HEADER, rows[-len(times):]), file=sys.stderr, flush=True)
        shutil.rmtree(root)
    print(f"{platform.node()}, {os.cpu_count()} CPUs")
    print(markdown_table(HEADER, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
