"""jax's persistent compilation cache for training runs, and whether a step's program came from it.

A run compiles its train step (and its initialisation, validation and sampling programs) at
every start; the same program compiled once is read back from the cache in a fraction of the
time. Where the cache lives (`cache_folder`): `{prefix}/.kiln/jax-cache` for a local store,
shared by every run of the store (and by every host of a multi-host run, which see the store at
one path; jax writes entries from process 0 only); `$XDG_CACHE_HOME/kiln/jax-cache` (default
`~/.cache/kiln/jax-cache`) for a bucket store, whose runs compile on this machine. jax's own
variables win: `JAX_COMPILATION_CACHE_DIR` names another folder,
`JAX_ENABLE_COMPILATION_CACHE=false` turns the cache off. The folder is a run-time choice: it enters no fingerprint, record or Pants
cache key. Entries are keyed by jax on the program, the devices and jax's version, so a changed
model, mesh or jax compiles afresh and never reads a stale program.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

STORE_FOLDER = ".kiln/jax-cache"  # under a local store's prefix
DIRECTORY_VARIABLE = "JAX_COMPILATION_CACHE_DIR"  # jax's own: an explicit folder wins
_REQUESTS = "/jax/compilation_cache/compile_requests_use_cache"
_HITS = "/jax/compilation_cache/cache_hits"


def cache_folder(local_prefix: Path | None) -> Path:
    """The cache folder of runs whose store is the local directory `local_prefix`, or (None) a
    bucket's runs on this machine."""
    if local_prefix is not None:
        return local_prefix / STORE_FOLDER
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kiln" / "jax-cache"


def use(folder: Path | None) -> str | None:
    """Turns the persistent cache on in `folder` (unless $JAX_COMPILATION_CACHE_DIR names
    another, or the cache is turned off; None: only that variable's folder, if any) for every
    program, however small or quick to compile: the quickstart's step compiles in seconds, which
    is what a warm start saves. Returns the folder in use, or None when the cache is off. Call
    before the first compilation."""
    chosen = os.environ.get(DIRECTORY_VARIABLE) or (str(folder) if folder else None)
    if chosen is None or not jax.config.jax_enable_compilation_cache:
        return None
    if jax.config.jax_compilation_cache_dir != chosen:
        from jax.experimental.compilation_cache import compilation_cache

        jax.config.update("jax_compilation_cache_dir", chosen)
        compilation_cache.reset_cache()  # jax opens its cache once: reopen it at the new folder
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # 0 means jax's default
    return chosen


def active_folder() -> str | None:
    """The folder jax caches compiled programs in, or None when the cache is off."""
    if not jax.config.jax_enable_compilation_cache:
        return None
    return jax.config.jax_compilation_cache_dir or None


@dataclass
class Compilations:
    """What happened to the programs compiled while `watching()`: how many were looked up in the
    persistent cache and how many of those it held."""

    looked_up: int = 0
    from_cache: int = 0

    @property
    def source(self) -> str:
        """"cache" (every program read back), "compiled" (none), "partly cached", or "no cache"
        (the cache is off, or nothing was compiled)."""
        if self.looked_up == 0:
            return "no cache"
        if self.from_cache == self.looked_up:
            return "cache"
        return "compiled" if self.from_cache == 0 else "partly cached"

    def _count(self, event: str, **_: Any) -> None:
        if event == _REQUESTS:
            self.looked_up += 1
        elif event == _HITS:
            self.from_cache += 1


@contextmanager
def watching() -> Iterator[Compilations]:
    """Counts, in the block, the compilations that consulted the persistent cache and its hits
    (jax's monitoring events; in this process, from any thread). Nothing is counted while no
    cache folder is set: jax reports lookups then too, though nothing is kept."""
    from jax import monitoring

    compilations = Compilations()
    if active_folder() is None:
        yield compilations
        return
    monitoring.register_event_listener(compilations._count)
    try:
        yield compilations
    finally:
        monitoring.unregister_event_listener(compilations._count)
