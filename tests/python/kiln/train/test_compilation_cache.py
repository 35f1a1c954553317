from __future__ import annotations

from pathlib import Path

import jax
import pytest

from kiln.train import compilation_cache
from kiln.train.compilation_cache import Compilations, cache_folder


def test_a_local_store_keeps_the_cache_and_a_bucket_run_keeps_it_on_this_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cache_folder(tmp_path / "store") == tmp_path / "store/.kiln/jax-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_folder(None) == tmp_path / "xdg/kiln/jax-cache"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_folder(None) == tmp_path / "home/.cache/kiln/jax-cache"


def test_jax_own_variable_names_the_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    chosen = tmp_path / "chosen"
    monkeypatch.setenv(compilation_cache.DIRECTORY_VARIABLE, str(chosen))
    before = jax.config.jax_compilation_cache_dir
    try:
        assert compilation_cache.use(tmp_path / "store/.kiln/jax-cache") == str(chosen)
        assert compilation_cache.active_folder() == str(chosen)
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0  # every program
        monkeypatch.delenv(compilation_cache.DIRECTORY_VARIABLE)
        assert compilation_cache.use(None) is None  # a run without a store: no folder of its own
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


@pytest.mark.parametrize(
    ("looked_up", "from_cache", "source"),
    [(0, 0, "no cache"), (3, 0, "compiled"), (3, 3, "cache"), (3, 1, "partly cached")],
)
def test_where_the_programs_came_from(looked_up: int, from_cache: int, source: str) -> None:
    assert Compilations(looked_up, from_cache).source == source


def test_a_run_without_a_cache_folder_counts_no_lookups() -> None:
    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        with compilation_cache.watching() as compilations:
            jax.jit(lambda x: x * 3.25 + 1.5)(jax.numpy.ones(7)).block_until_ready()
        assert compilations.source == "no cache"
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
