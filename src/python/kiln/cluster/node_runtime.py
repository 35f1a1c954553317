"""Kiln's runtime on a Ray node that has nothing but CPython and Ray (docs/clusters.md, "What a
node needs").

The submitting machine ships two bundles through Ray itself, each once per digest:

- Kiln's sources (`kiln`, `kiln_contract`: about 1 MB), for every command;
- the runtime PEX Pants built for the run (its third-party packages from the lockfile), when the
  run comes from `pants run`: a packed PEX folder, run by the node's own CPython 3.12.

A bundle is held by a detached actor (`Depot`, named `kiln-depot-DIGEST` in a namespace of its
own, `kiln-runtime`: the `kiln` namespace holds jobs' drivers only, which `list` shows),
which keeps it on its node's disk in chunks; a node fetches it once into
`~/.cache/kiln/bundles/DIGEST/` (under a file lock: the hosts and tasks of one node share it) and
reuses it for every later job. The PEX builds its virtual environment on the node on first use
(PEX_ROOT `~/.cache/kiln/pex_root`). A gpu(...) or tpu(...) run also needs jax's accelerator
plugin, which the submitting machine neither builds nor downloads: the node installs it from the
plugin lockfile's pinned, hashed wheels (`pip install --require-hashes --target
~/.cache/kiln/plugins/DIGEST`) and puts it on the trainer's path.

Standard library only at import (and Ray, present on every node): the submitter ships this module
by value, as it does the actors that call it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tarfile
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

# The depots' Ray namespace, apart from the jobs' drivers' (kiln.cluster.driver.JOB_NAMESPACE).
RUNTIME_NAMESPACE = "kiln-runtime"
CHUNK_BYTES = 32 << 20  # one call carries this much of a bundle
# A sliver of the resource Ray gives the head node alone: what must outlive a lost worker node
# (a job's driver, a depot) lives there.
ON_HEAD = {"node:__internal_head__": 0.001}
# Ray's GCS client connect timeouts and their defaults. A Ray Client session's runtime_env goes
# to every worker of its job, and Kiln's session shortens these for its own server's sake
# (kiln.cluster.connection): what Kiln starts from the session gets them back (worker_env).
GCS_CONNECT_TIMEOUTS = {"RAY_py_gcs_connect_timeout_s": "30",
                        "RAY_gcs_rpc_server_connect_timeout_s": "5"}  # fmt: skip


@dataclass(frozen=True)
class Bundle:
    """Files shipped to the nodes: `kind` ("code", "runtime"), their digest, and the actor that
    holds them."""

    kind: str
    digest: str

    @property
    def depot(self) -> str:
        return f"kiln-depot-{self.kind}-{self.digest}"


@dataclass(frozen=True)
class NodeRuntime:
    """What a node runs Kiln with. `runtime` None: the node's own Python holds the packages."""

    code: Bundle
    runtime: Bundle | None = None
    pex: str = ""  # the PEX folder's name inside the runtime bundle
    plugins: str = ""  # pinned, hashed requirements of the accelerator plugin ("": none)

    def to_json(self) -> dict[str, Any]:
        return {
            "code": self.code.__dict__,
            "runtime": None if self.runtime is None else self.runtime.__dict__,
            "pex": self.pex,
            "plugins": self.plugins,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> NodeRuntime:
        runtime = None if obj["runtime"] is None else Bundle(**obj["runtime"])
        return cls(Bundle(**obj["code"]), runtime, obj["pex"], obj["plugins"])


class Depot:
    """A detached actor holding one bundle on its node's disk, chunk by chunk."""

    def __init__(self, name: str) -> None:
        self._folder = Path(tempfile.gettempdir()) / "kiln-depots" / name
        shutil.rmtree(self._folder, ignore_errors=True)  # a depot restarted under the same name
        self._folder.mkdir(parents=True)
        self._chunks = -1  # sealed: the number of chunks

    def put(self, index: int, data: bytes) -> None:
        """Two submitters of the same bundle at once may both fill it: each chunk is replaced
        whole (the same bytes), never read half-written."""
        staging = self._folder / f".{index:06d}.{secrets.token_hex(4)}"
        staging.write_bytes(data)
        os.replace(staging, self._folder / f"{index:06d}")

    def seal(self, chunks: int) -> None:
        self._chunks = chunks

    def chunks(self) -> int:
        """The number of chunks once the bundle is complete; -1 while it is being filled."""
        return self._chunks

    def chunk(self, index: int) -> bytes:
        return (self._folder / f"{index:06d}").read_bytes()


# --- on the submitting machine ----------------------------------------------------------------


def worker_env() -> dict[str, Any]:
    """The runtime_env of an actor or task Kiln starts from its Ray Client session: the GCS
    connect timeouts this machine sets, else Ray's defaults."""
    timeouts = {name: os.environ.get(name, ray_default)
                for name, ray_default in GCS_CONNECT_TIMEOUTS.items()}  # fmt: skip
    return {"env_vars": timeouts}


def ship(ray: Any, kind: str, digest: str, files: list[tuple[str, Path]]) -> Bundle:
    """The bundle of `files` (name in the bundle, local path), in a depot on the cluster: made
    and filled unless a depot of the same digest has it already."""
    bundle = Bundle(kind, digest)
    depot, chunks = _depot(ray, bundle)
    if chunks >= 0:
        return bundle
    with _tar_stream(files) as stream, warnings.catch_warnings():
        # Ray Client warns once more than 10 MB of calls went out: the bundle is meant to.
        warnings.filterwarnings("ignore", message="More than 10MB of messages")
        count = 0
        while data := stream.read(CHUNK_BYTES):
            ray.get(depot.put.remote(count, data))
            count += 1
    ray.get(depot.seal.remote(count))
    return bundle


def _depot(ray: Any, bundle: Bundle) -> tuple[Any, int]:
    """The bundle's depot, made unless it exists, and its sealed chunk count (-1: not filled).
    Two submissions at once (a sweep's runs) may both make it: Ray's get_if_exists still lets
    the second creation fail (at once, or at its first call through Ray Client), which then
    takes the first's."""
    try:
        depot = (
            ray.remote(Depot)
            .options(name=bundle.depot, namespace=RUNTIME_NAMESPACE, lifetime="detached",
                     num_cpus=0, resources=ON_HEAD, get_if_exists=True,
                     runtime_env=worker_env())  # fmt: skip
            .remote(bundle.depot)
        )
        return depot, ray.get(depot.chunks.remote())
    except ValueError:  # ActorAlreadyExistsError: another submission made it meanwhile
        depot = ray.get_actor(bundle.depot, namespace=RUNTIME_NAMESPACE)
        return depot, ray.get(depot.chunks.remote())


@contextlib.contextmanager
def _tar_stream(files: list[tuple[str, Path]]) -> Iterator[BinaryIO]:
    """An uncompressed tar of `files` (the PEX's wheels are compressed already), in a temp file."""
    with tempfile.TemporaryFile() as f:
        with tarfile.open(fileobj=f, mode="w") as tar:
            for name, path in files:
                tar.add(path, arcname=name)
        f.seek(0)
        yield f


def folder_files(root: Path, name: str) -> list[tuple[str, Path]]:
    """Every file under `root` (no caches of compiled Python), named under `name/`."""
    return [
        (f"{name}/{path.relative_to(root).as_posix()}", path)
        for path in sorted(root.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    ]


def digest_of(files: list[tuple[str, Path]]) -> str:
    digest = hashlib.sha256()
    for name, path in files:
        digest.update(f"{name}\0{path.stat().st_size}\0".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def pex_digest(pex: Path) -> str:
    """A packed PEX's digest: the hash pex recorded of its contents (PEX-INFO's pex_hash)."""
    info = json.loads((pex / "PEX-INFO").read_text())
    return hashlib.sha256(f"{pex.name}\0{info['pex_hash']}".encode()).hexdigest()[:16]


# --- on a node --------------------------------------------------------------------------------


def cache_root() -> Path:
    return Path(os.environ.get("KILN_NODE_CACHE") or Path.home() / ".cache" / "kiln")


def fetch(ray: Any, bundle: Bundle) -> Path:
    """The bundle's folder on this node, fetched from its depot on first use."""
    folder = cache_root() / "bundles" / bundle.digest
    if (folder / ".complete").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _locked(folder.parent / f".{bundle.digest}.lock"):
        if (folder / ".complete").exists():
            return folder  # another worker of this node fetched it meanwhile
        depot = ray.get_actor(bundle.depot, namespace=RUNTIME_NAMESPACE)
        staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{bundle.digest}."))
        with tempfile.TemporaryFile(dir=folder.parent) as f:
            for index in range(ray.get(depot.chunks.remote())):
                f.write(ray.get(depot.chunk.remote(index)))
            f.seek(0)
            with tarfile.open(fileobj=f, mode="r") as tar:
                tar.extractall(staging, filter="data")
        shutil.rmtree(folder, ignore_errors=True)
        os.rename(staging, folder)
        (folder / ".complete").write_text("")
    return folder


def python_command(ray: Any, runtime: NodeRuntime, module: str) -> tuple[list[str], dict[str, str]]:
    """The command line that runs `python -m MODULE` with Kiln's runtime on this node, and the
    environment it needs (added to the node's own)."""
    code = str(fetch(ray, runtime.code))
    paths = [code, *_plugins(runtime.plugins)]
    if runtime.runtime is None:
        existing = os.environ.get("PYTHONPATH", "")
        env = {"PYTHONPATH": os.pathsep.join(p for p in [*paths, existing] if p)}
        return [sys.executable, "-m", module], env
    pex = fetch(ray, runtime.runtime) / runtime.pex
    env = {
        "PEX_ROOT": str(cache_root() / "pex_root"),
        "PEX_MODULE": module,
        "PEX_EXTRA_SYS_PATH": os.pathsep.join(paths),
    }
    return [sys.executable, str(pex)], env


def _plugins(requirements: str) -> list[str]:
    """The accelerator plugin's folder (installed on first use), or none."""
    if not requirements:
        return []
    digest = hashlib.sha256(requirements.encode()).hexdigest()[:16]
    folder = cache_root() / "plugins" / digest
    if (folder / ".complete").exists():
        return [str(folder)]
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _locked(folder.parent / f".{digest}.lock"):
        if not (folder / ".complete").exists():
            shutil.rmtree(folder, ignore_errors=True)
            with tempfile.NamedTemporaryFile("w", suffix=".txt") as listed:
                listed.write(requirements)
                listed.flush()
                subprocess.run(
                    [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                     "--require-hashes", "--target", str(folder), "-r", listed.name],
                    check=True,
                )  # fmt: skip
            (folder / ".complete").write_text("")
    return [str(folder)]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
