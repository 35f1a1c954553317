"""The user's Hugging Face settings (HF_TOKEN, HF_HOME, the endpoint and offline switches) for
tokenize processes, kept out of their cache keys.

Pants puts a Process's env into its cache key, so a token there would enter the local (and any
remote) cache's keys. Instead the values go to a file, mode 0600, in a Pants named cache (one
per Pants process, `hub_settings_file(PID)`: a tokenize process reads its parent's): a
process mounts the cache (`append_only_caches`), whose name is in the key but whose contents are
not, and `kiln.data.tokenize` reads the file before importing huggingface_hub. The file is
rewritten whenever the variables change (the rule depends on them), so an unset token is gone.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from pants.engine.env_vars import EnvironmentVars, EnvironmentVarsRequest
from pants.engine.rules import Get, collect_rules, rule
from pants.option.global_options import NamedCachesDirOption
from pants.util.frozendict import FrozenDict

from kiln_contract.processes import is_running
from kiln_contract.tokenize import (
    HUB_SETTINGS_CACHE,
    HUB_SETTINGS_DIR,
    HUB_SETTINGS_PREFIX,
    HUB_VARIABLES,
    hub_settings_file,
)


@dataclass(frozen=True)
class HubSettingsCache:
    """The named cache to mount (`append_only_caches`) in a process that reads the hub."""

    append_only_caches: FrozenDict[str, str]


def write_hub_settings(folder: Path, values: Mapping[str, str], pants_pid: int) -> Path:
    """Atomically (re)writes the settings file of the Pants process `pants_pid`, readable by its
    owner only, and deletes those of Pants processes that have ended."""
    folder.mkdir(parents=True, exist_ok=True)
    _remove_ended(folder)
    path = folder / hub_settings_file(pants_pid)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(dict(sorted(values.items())), f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _remove_ended(folder: Path) -> None:
    for path in folder.glob(f"{HUB_SETTINGS_PREFIX}*.json"):
        pid = path.stem.removeprefix(HUB_SETTINGS_PREFIX)
        if pid.isdigit() and not is_running(int(pid)):
            path.unlink(missing_ok=True)


@rule
async def hub_settings_cache(named_caches: NamedCachesDirOption) -> HubSettingsCache:
    env = await Get(EnvironmentVars, EnvironmentVarsRequest(HUB_VARIABLES))
    values = {name: value for name, value in env.items() if value}
    # The processes this Pants process starts read its file: one of its own, so that another
    # `./pants` with other settings (another terminal, a concurrent test) cannot replace it.
    write_hub_settings(Path(named_caches.val) / HUB_SETTINGS_CACHE, values, os.getpid())
    return HubSettingsCache(FrozenDict({HUB_SETTINGS_CACHE: HUB_SETTINGS_DIR}))


def rules():
    return collect_rules()
